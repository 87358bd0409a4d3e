"""The Qwen3.5 hybrid target (Gated DeltaNet + gated attention) against transformers' qwen3_5
classes (the independent oracle), float32 on random tiny configs with both layer types: each
layer, the chunked rule against transformers' recurrent one, the rollback fold, prefill and
decode through the cache, greedy, and DFlash greedy with rejected and fully accepted blocks.
Issue 38."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
from tests.checkpoints import hf_greedy, random_prompts
from tests.doubles import truth_proposer

from dflash_jax import DraftConfig, generate, init_draft, init_target, load_target
from dflash_jax.config import ConfigError
from dflash_jax.kernel_config import resolved
from dflash_jax.models import gated_delta as gd
from dflash_jax.models.qwen3_5 import Qwen35Config, load_qwen3_5, with_verify_form

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hfm  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            max_position_embeddings=4096, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))


def write_qwen3_5(path: str, seed: int = 0, prefix: str = "", **kw) -> str:
    """A random transformers Qwen3_5ForCausalLM (float32, non-zero norms and dt_bias) saved as a
    HF directory; prefix renames `model.` keys as a multimodal checkpoint stores them."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5TextConfig(**{**TINY, **kw})
    m = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or n.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    m.save_pretrained(path, safe_serialization=True)
    if prefix:
        f = os.path.join(path, "model.safetensors")
        t = load_file(f)
        save_file({(prefix + k[len("model."):] if k.startswith("model.") else k): v for k, v in t.items()}, f)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, our model): 4 layers, GDN / full / GDN / full."""
    path = write_qwen3_5(str(tmp_path_factory.mktemp("q35")), full_attention_interval=2)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    return hf, load_target(path, dtype="float32")     # through the family registry


def _positions(B, T, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + T, dtype=jnp.int32), (B, T))


def _hf(hf, ids):
    ids = torch.as_tensor(np.asarray(ids))
    with torch.no_grad():
        return hf(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)


# ------------------------------------------------------------------------------------ config reader

def test_config_reader_layer_types_and_text_config():
    base = {k: v for k, v in TINY.items() if k != "rope_parameters"}
    d = {"model_type": "qwen3_5", "tie_word_embeddings": True,
         "text_config": {**base, "model_type": "qwen3_5_text", "num_hidden_layers": 8,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                             "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
    c = Qwen35Config.from_dict(d)
    assert c.full_layers == (3, 7) and c.linear_layers == (0, 1, 2, 4, 5, 6)   # interval 4 by default
    assert c.tie_word_embeddings and c.rotary_dim == 4 and c.rope_theta == 1e7
    d["text_config"]["full_attention_interval"] = 2
    assert Qwen35Config.from_dict(d).full_layers == (1, 3, 5, 7)
    with pytest.raises(ConfigError, match="model_type='qwen3'"):
        Qwen35Config.from_dict({**base, "model_type": "qwen3"})
    with pytest.raises(ConfigError, match="lacks linear_num_key_heads"):
        Qwen35Config.from_dict({k: v for k, v in {**base, "model_type": "qwen3_5_text"}.items()
                                if k != "linear_num_key_heads"})


def test_language_model_prefix_loads_the_same_weights(tmp_path, pair):
    hf, ours = pair
    assert type(ours).__name__ == "Qwen35" and ours.config.model_type == "qwen3_5"
    path = write_qwen3_5(str(tmp_path), prefix="model.language_model.", full_attention_interval=2)
    other = load_qwen3_5(path, "float32")
    assert type(init_target(other.config, dtype="float32")) is type(other)
    for a, b in zip(jax.tree.leaves(nnx_state(ours)), jax.tree.leaves(nnx_state(other))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def nnx_state(m):
    from flax import nnx
    return nnx.state(m, nnx.Param)


# ------------------------------------------------------------------------------------------- layers

def test_zero_centred_norm_matches_transformers(pair):
    hf, ours = pair
    x = np.random.RandomState(0).randn(2, 5, 64).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.layers[0].input_layernorm(torch.tensor(x)).numpy()
    np.testing.assert_allclose(np.asarray(ours.layers[0].input_layernorm(jnp.asarray(x))), ref, atol=1e-6)


def test_gated_attention_matches_transformers(pair):
    """Gate from q_proj, q/k norm, RoPE on a quarter of the head dims, sigmoid gate before o_proj."""
    hf, ours = pair
    B, T = 2, 9
    x = np.random.RandomState(1).randn(B, T, 64).astype(np.float32)
    pos = torch.arange(T)[None].expand(B, T)
    cos, sin = hf.model.rotary_emb(torch.tensor(x), pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        ref, _ = hf.model.layers[1].self_attn(torch.tensor(x), (cos, sin), mask)
    layer = ours.layers[1].mixer
    kc = jnp.zeros((B, 2, 16, 16))
    out, _, _ = layer(jnp.asarray(x), _positions(B, T), kc, kc, _positions(B, T, 1), resolved(None), False)
    np.testing.assert_allclose(np.asarray(out), ref.numpy(), atol=1e-5)


def test_gated_deltanet_matches_transformers(pair):
    """Projections, causal conv, gates, l2-normalised q/k, grouped v-heads, the rule, the gated norm."""
    hf, ours = pair
    x = np.random.RandomState(2).randn(2, 11, 64).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.layers[0].linear_attn(torch.tensor(x)).numpy()
    m = ours.layers[0].mixer
    state = jnp.zeros((2, 4, 16, 8))
    window = jnp.zeros((2, 3, m.conv_dim))
    for prefill in (True, False):     # chunked (prefill) and the block path
        out, _ = m(jnp.asarray(x), state, window, prefill)
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def _rule_inputs(B=2, T=37, HK=2, HV=4, dk=16, dv=8, seed=3):
    r = np.random.RandomState(seed)
    q = gd.l2norm(jnp.asarray(r.randn(B, T, HK, dk), jnp.float32)) * dk ** -0.5
    k = gd.l2norm(jnp.asarray(r.randn(B, T, HK, dk), jnp.float32))
    q, k = jnp.repeat(q, HV // HK, axis=2), jnp.repeat(k, HV // HK, axis=2)
    v = jnp.asarray(r.randn(B, T, HV, dv), jnp.float32)
    g = jnp.asarray(-np.abs(r.randn(B, T, HV)) * 0.5, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-r.randn(B, T, HV))), jnp.float32)
    s0 = jnp.asarray(r.randn(B, HV, dk, dv) * 0.3, jnp.float32)
    return q, k, v, g, beta, s0


def test_chunked_rule_equals_transformers_recurrent_rule():
    """Our chunked form (several chunks, a padded last one) and recurrent form from a non-zero
    state = transformers' torch_recurrent_gated_delta_rule (outputs and final state)."""
    q, k, v, g, beta, s0 = _rule_inputs()
    t = [torch.tensor(np.asarray(a)) for a in (q, k, v, g, beta, s0)]
    # the torch function normalises and scales itself: give it the raw directions, scaled back
    with torch.no_grad():
        ref_o, ref_s = hfm.torch_recurrent_gated_delta_rule(t[0] * 16 ** 0.5, t[1], t[2], t[3], t[4],
                                                            initial_state=t[5], output_final_state=True)
    for o, s in (gd.chunked(q, k, v, g, beta, s0, chunk=8), gd.recurrent(q, k, v, g, beta, s0)):
        np.testing.assert_allclose(np.asarray(o), ref_o.numpy(), atol=2e-5)
        np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), atol=2e-5)


def test_fold_stops_each_row_at_its_count():
    q, k, v, g, beta, s0 = _rule_inputs(T=16)
    n = jnp.asarray([5, 16], jnp.int32)
    got = gd.fold(k, v, g, beta, s0, n, chunk=16)
    for b in range(2):
        want = gd.recurrent(q[b:b + 1, :int(n[b])], k[b:b + 1, :int(n[b])], v[b:b + 1, :int(n[b])],
                            g[b:b + 1, :int(n[b])], beta[b:b + 1, :int(n[b])], s0[b:b + 1])[1]
        np.testing.assert_allclose(np.asarray(got[b:b + 1]), np.asarray(want), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(gd.fold(k, v, g, beta, s0, jnp.zeros(2, jnp.int32))), np.asarray(s0))


# ---------------------------------------------------------------------------------- whole model

@pytest.mark.slow
def test_prefill_logits_and_taps_match_transformers(pair):
    hf, ours = pair
    ids = np.random.RandomState(0).randint(0, 128, (2, 13))
    out = _hf(hf, ids)
    pos = _positions(2, 13)
    taps = (0, 1, 3)
    h, feats, cache = ours(jnp.asarray(ids), pos, ours.new_cache(2, 32), pos + 1, taps=taps, prefill=True)
    np.testing.assert_allclose(np.asarray(ours.logits(h)), out.logits.numpy(), atol=1e-4)
    for n, layer in enumerate(taps):   # taps are HF hidden_states[id + 1] whatever the layer type
        np.testing.assert_allclose(np.asarray(feats[..., n * 64:(n + 1) * 64]),
                                   out.hidden_states[layer + 1].numpy(), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_padded_prefill_then_blocks_with_rollback_match_transformers(pair, form):
    """A padded prompt bucket (row 0: 6 of 10 tokens), prefill committed at the prompt length,
    then 4-token blocks of which only n[b] tokens are committed (the rest rejected): every
    committed position's logits = the HF full-sequence forward."""
    hf, ours = pair
    ours = with_verify_form(ours, form)
    seqs = np.random.RandomState(4).randint(0, 128, (2, 24))
    ref = [_hf(hf, seqs[b:b + 1]).logits.numpy()[0] for b in range(2)]
    lens = np.array([6, 10])
    prompt = np.where(np.arange(10)[None] < lens[:, None], seqs[:, :10], 0)
    @jax.jit
    def fwd(tok, pos, cache, n):
        h, _, cache = ours(tok, pos, cache, pos + 1)
        return ours.logits(h), ours.commit(cache, n)

    pos = _positions(2, 10)
    h, _, cache = ours(jnp.asarray(prompt), pos, ours.new_cache(2, 48), pos + 1, prefill=True)
    cache = ours.commit(cache, jnp.asarray(lens, jnp.int32))
    logits = np.asarray(ours.logits(h))
    for b in range(2):
        np.testing.assert_allclose(logits[b, :lens[b]], ref[b][:lens[b]], atol=1e-4)
    for n in ([1, 3], [4, 0], [2, 4]):
        block = np.stack([seqs[b, lens[b]:lens[b] + 4] for b in range(2)])
        block[0, n[0]:] = (block[0, n[0]:] + 7) % 128          # rejected tail: other tokens
        logits, cache = fwd(jnp.asarray(block), jnp.asarray(lens[:, None] + np.arange(4), jnp.int32), cache,
                            jnp.asarray(n, jnp.int32))
        for b in range(2):
            ok = n[b] if b == 0 else 4                          # row 1's block is the true sequence
            np.testing.assert_allclose(np.asarray(logits)[b, :ok], ref[b][lens[b]:lens[b] + ok], atol=1e-4)
        lens = lens + np.asarray(n)


def test_one_row_steps_that_commit_in_the_forward_match_transformers(pair):
    """A plain step's forward with commit_rows (the loop passes its running rows): the committing
    rows' states advance in the forward, a held row (False: a finished one) keeps its state and
    window whatever token it was given, and every committed position's logits = the HF
    full-sequence forward; the commit with n = commit_rows only hands the states over."""
    hf, ours = pair
    seqs = np.random.RandomState(5).randint(0, 128, (2, 20))
    ref = [_hf(hf, seqs[b:b + 1]).logits.numpy()[0] for b in range(2)]

    @jax.jit
    def step(tok, pos, cache, rows):
        h, _, cache = ours(tok, pos, cache, pos + 1, commit_rows=rows)
        assert all(r.kind == "committed" for r in cache.records)     # nothing is left to fold
        return ours.logits(h), ours.commit(cache, rows.astype(jnp.int32))

    pos = _positions(2, 8)
    _, _, cache = ours(jnp.asarray(seqs[:, :8]), pos, ours.new_cache(2, 32), pos + 1, prefill=True)
    cache = ours.commit(cache, jnp.full((2,), 8, jnp.int32))
    lens = np.array([8, 8])
    for t in range(6):
        rows = np.array([True, t % 2 == 0])                        # row 1 held every other step
        tok = np.array([seqs[b, lens[b]] if rows[b] else (seqs[b, lens[b]] + 11) % 128 for b in range(2)])
        logits, cache = step(jnp.asarray(tok[:, None]), jnp.asarray(lens[:, None], jnp.int32), cache,
                             jnp.asarray(rows))
        for b in range(2):
            if rows[b]:
                np.testing.assert_allclose(np.asarray(logits)[b, 0], ref[b][lens[b]], atol=1e-4)
        lens = lens + rows


@pytest.mark.slow
def test_greedy_matches_transformers(pair):
    hf, ours = pair
    prompts = random_prompts(3, 128, min_len=3, max_len=12, seed=7)
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    res = generate(ours, None, prompts, max_new_tokens=20)
    assert res.tokens == expected


def _dflash_case(pair, n=24):
    hf, ours = pair
    prompts = random_prompts(2, 128, min_len=4, max_len=12, seed=9)
    expected = [hf_greedy(hf, p, n) for p in prompts]
    draft = init_draft(DraftConfig.for_target(ours.config, num_layers=1, block_size=4, target_layer_ids=(1, 2)),
                       seed=1, dtype="float32")
    truth = np.zeros((len(prompts), 64), np.int32)
    for i, (p, e) in enumerate(zip(prompts, expected)):
        truth[i, :len(p) + n] = p + e
    return ours, prompts, expected, draft, truth, n


@pytest.mark.slow
def test_dflash_greedy_random_draft_matches_transformers(pair):
    """A random draft: nearly every block is rejected at its first draft."""
    ours, prompts, expected, draft, _, n = _dflash_case(pair)
    assert generate(ours, draft, prompts, max_new_tokens=n, verify_width="block").tokens == expected


@pytest.mark.slow
@pytest.mark.parametrize("corrupt,verify_width", [(None, "block"), (2, "block"), (2, "auto"), (2, 1)],
                         ids=["whole-block", "cut2-block", "cut2-auto", "cut2-W1"])
def test_dflash_greedy_full_and_cut_blocks_match_transformers(pair, corrupt, verify_width):
    """The truth proposer: every block accepted whole (None), or cut after its second draft (2),
    so the state is rolled back to the middle of every block: the target's greedy tokens each time.
    At "auto" and at the prefix width W = 1 (block 4: widths 0, 1, 3; one compiled program, the
    truth proposer's corrupt slot being part of its key) the same tokens; at W = 1 every iteration
    accepts its one draft, at "auto" at most the block's."""
    ours, prompts, expected, draft, truth, n = _dflash_case(pair)
    res = generate(ours, truth_proposer(draft, truth, corrupt, 128), prompts, max_new_tokens=n,
                   verify_width=verify_width)
    assert res.tokens == expected
    accepted = 3 if corrupt is None else corrupt       # drafts a full-width iteration accepts
    if verify_width == "auto":
        assert all(1 <= a <= accepted + 1 for row in res.acceptance_lengths for a in row)
        assert max(a for row in res.acceptance_lengths for a in row) >= 2
        return
    want = 1 + min(accepted, 3 if verify_width == "block" else verify_width)
    assert all(a == want for row in res.acceptance_lengths for a in row[:-1]), res.acceptance_lengths


@pytest.mark.slow
def test_slot_engine_serves_a_hybrid_target_as_one_shot_generate(pair):
    """Requests through 2 slots (inserts into busy slot state, steps over ragged rows): each
    request's tokens and acceptance lengths = its one-shot generate."""
    from dflash_jax.serving.engine import RowRequest, Slots
    ours, prompts, _, draft, _, _ = _dflash_case(pair)
    ps = prompts + random_prompts(1, 128, min_len=3, max_len=9, seed=10)
    ns = [9, 17, 5]
    out = Slots(ours, draft, slots=2, capacity=64, steps=2).run(
        [RowRequest(prompt=tuple(p), max_new=n, rng_row=0) for p, n in zip(ps, ns)])
    for p, n, r in zip(ps, ns, out):
        want = generate(ours, draft, [p], max_new_tokens=n, capacity=64, verify_width="block")
        assert r.tokens == want.tokens[0] and r.acceptance_lengths == want.acceptance_lengths[0]


@pytest.mark.slow
@pytest.mark.parametrize("verify_width", [None, "auto"], ids=["block", "auto"])
def test_slot_engine_rolls_a_hybrid_target_back_mid_block(pair, verify_width):
    """The truth proposer cut after its second draft (every full-width iteration accepts 2 of 3
    drafts: the GDN states and conv windows are rolled back to the middle of the verified block)
    in the slot engine: 3 requests of one prompt (the proposer's truth rows are per slot) through 2
    slots, so a refill inserts into a slot whose states were rolled back; each request's tokens =
    transformers' greedy, its acceptance lengths = one-shot generate's with the same proposer
    (3 an iteration at full width); at "auto" (the server's slot-engine default) the same tokens."""
    from dflash_jax.serving.engine import RowRequest, Slots
    ours, prompts, expected, draft, truth, n = _dflash_case(pair)
    proposer = truth_proposer(draft, np.tile(truth[:1], (2, 1)), 2, 128)
    ns = [9, 24, 5]
    # step_buckets=None: every step runs over both slots (the proposer double's truth is [slots, L])
    out = Slots(ours, proposer, slots=2, capacity=64, steps=2, verify_width=verify_width, step_buckets=None).run(
        [RowRequest(prompt=tuple(prompts[0]), max_new=m, rng_row=0) for m in ns])
    for m, r in zip(ns, out):
        assert r.tokens == expected[0][:m]
        if verify_width is None:
            want = generate(ours, truth_proposer(draft, truth[:1], 2, 128), [prompts[0]], max_new_tokens=m,
                            capacity=64, verify_width="block")
            assert r.acceptance_lengths == want.acceptance_lengths[0]
            assert r.acceptance_lengths[:-1] == [3] * (len(r.acceptance_lengths) - 1), r.acceptance_lengths
        else:
            assert max(r.acceptance_lengths) <= 3 and max(a for q in out for a in q.acceptance_lengths) >= 2


def test_block_terms_fold_to_every_prefix():
    """The verify path: a block as one chunk gives the recurrent outputs, and its kept terms
    (k, G, v_new) fold to the recurrent state after any prefix n (0 .. T), per row."""
    q, k, v, g, beta, s0 = _rule_inputs(T=8)
    o, terms = gd.block(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(o), np.asarray(gd.recurrent(q, k, v, g, beta, s0)[0]), atol=2e-5)
    for n in ([0, 8], [3, 1], [7, 5]):
        got = gd.fold_deltas(*terms, s0, jnp.asarray(n, jnp.int32))
        for b in range(2):
            m = n[b]
            want = gd.recurrent(q[b:b + 1, :m], k[b:b + 1, :m], v[b:b + 1, :m], g[b:b + 1, :m],
                                beta[b:b + 1, :m], s0[b:b + 1])[1] if m else s0[b:b + 1]
            np.testing.assert_allclose(np.asarray(got[b:b + 1]), np.asarray(want), atol=2e-5)


# ------------------------------------------------------------- the GPU block kernel (interpreted)

def _kernel_config(block_v=0):
    from dflash_jax.kernel_config import KernelConfig
    return KernelConfig(attention="xla", gdn="pallas", gdn_block_v=block_v).resolve("cpu")


@pytest.mark.slow      # the Triton interpreter's compile: ~8 s of CPU
def test_gdn_kernel_interpreted_equals_the_xla_block_and_its_fold(pair):
    """pallas_kernels.gated_delta (the Triton kernel, interpreted on CPU) on the transformers
    checkpoint's GDN layer, from a non-zero state and conv window: its outputs = the XLA block
    path's (float32), and its records fold to the XLA fold's state and window for every row's
    count (through the fold kernel, interpreted; counts 0 and 3 of 4); the value dims split over two
    programs (the gated norm then in XLA)."""
    _, ours = pair
    m = ours.layers[0].mixer
    r = np.random.RandomState(4)
    h = jnp.asarray(r.randn(2, 4, 64), jnp.float32)
    state = jnp.asarray(r.randn(2, 4, 16, 8) * 0.3, jnp.float32)
    window = jnp.asarray(r.randn(2, 3, m.conv_dim), jnp.float32)
    n = jnp.asarray([0, 3], jnp.int32)
    ref, rec = m(h, state, window, False)
    ref_state, ref_window = m.advance(state, rec, n)
    for bv in (4,):     # value dims split over 2 programs (the whole head: the DFlash test below)
        kc = _kernel_config(bv)
        assert kc.gdn == "pallas_gpu_interpret" and m.use_kernel(4, kc, False)
        out, krec = jax.jit(lambda h, s, w: m(h, s, w, False, kc))(h, state, window)
        assert krec.kind == "deltas"
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
        got_state, got_window = m.advance(state, krec, n)
        np.testing.assert_allclose(np.asarray(got_state), np.asarray(ref_state), atol=2e-5)
        np.testing.assert_array_equal(np.asarray(got_window), np.asarray(ref_window))
    assert not m.use_kernel(4, _kernel_config(), True)           # prefill keeps the chunked form
    assert not m.use_kernel(3, _kernel_config(), False)          # T not a power of two: XLA


def test_kernel_config_gdn_resolves():
    """The default "auto": the Triton block kernel with 32 value dims per program on GPU (the H200 A/B), the XLA
    forms on CPU and TPU; a block_v at or past dv is the whole head (the norm fused)."""
    from dflash_jax import KernelConfig
    from pallas_kernels.gated_delta import block_supported
    gpu = KernelConfig().resolve("gpu", device=None)
    assert (gpu.gdn, gpu.gdn_block_v) == ("pallas_gpu", 32)
    for backend in ("cpu", "tpu"):
        assert KernelConfig().resolve(backend).gdn == "xla"
    assert KernelConfig(gdn="pallas").resolve("cpu").gdn == "pallas_gpu_interpret"
    assert block_supported(16, 2, 4, 8, 8, 4, 32) and block_supported(16, 2, 4, 8, 64, 4, 32)
    assert not block_supported(16, 2, 4, 8, 64, 4, 24)


def test_gdn_kernel_lowers_for_cuda_at_qwen3_5_9b_shapes():
    """The kernel at Qwen3.5-9B's GDN shapes (HK 16, HV 32, dk = dv = 128, conv 8192), a verify
    block (16) and a decode step (1), whole and split value dims, and the fold kernel: lowered
    to Triton and exported for CUDA from this CPU host (no GPU here), one kernel call each."""
    from jax import export
    from pallas_kernels.gated_delta import fold_deltas, gdn_block
    HK, HV, d, bf = 16, 32, 128, jnp.bfloat16
    C = 2 * HK * d + HV * d
    for T, bv in ((16, 0), (1, 32)):
        args = [jax.ShapeDtypeStruct(s, t) for s, t in (((1, T, C + HV * d + 2 * HV), bf), ((1, 3, C), bf),
                                                        ((C, 4), bf), ((HV,), bf), ((HV,), bf), ((d,), bf),
                                                        ((1, HV, d, d), jnp.float32))]
        fn = jax.jit(lambda *a: gdn_block(*a, num_k_heads=HK, key_dim=d, value_dim=d, norm_eps=1e-6, block_v=bv))
        exp = export.export(fn, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1
        o = exp.out_avals[0]
        assert o.shape == ((1, T, HV * d) if bv == 0 else (1, T, HV, d))
    # the fold kernel (the commit of the kernel's records) at the same shapes, a verify block
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(s, f32) for s in ((1, HV, 16, d), (1, HV, 16), (1, HV, 16, d), (1, HV, d, d))]
    exp = export.export(jax.jit(lambda *a: fold_deltas(*a)), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args, jax.ShapeDtypeStruct((1,), jnp.int32))
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1 and exp.out_avals[0].shape == (1, HV, d, d)


@pytest.mark.slow
def test_dflash_greedy_through_the_gdn_kernel_matches_transformers(pair):
    """The whole loop with every decode step and verify block of the GDN layers in the kernel
    (interpreted), blocks cut after their second draft (the state rolled back from the kernel's
    records every iteration; each head whole in one program, the gated norm in the kernel):
    transformers' greedy tokens."""
    ours, prompts, expected, draft, truth, n = _dflash_case(pair)
    from dflash_jax.kernel_config import KernelConfig
    res = generate(ours, truth_proposer(draft, truth, 2, 128), prompts, max_new_tokens=n,
                   kernels=KernelConfig(attention="xla", gdn="pallas"), verify_width="block")
    assert res.tokens == expected
    assert all(a == 3 for row in res.acceptance_lengths for a in row[:-1])
