"""DFlash2 drafts and sliding-window / causal draft layers against the reference `dflash` package
(PyPI 0.1.0: DFlash2DraftModel, GroupedDynamicCausalConv, CandidateSelector, the draft's per-layer
masks and dflash_generate's DFlash2 path), float32, random weights, windows shorter than the prompts.
Issue 35."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.checkpoints import _draft_config, _noisy_norms, _seeded, load_torch_pair, random_prompts, \
    reference_generate, write_target
from tests.pairs import assert_width_result, widths

from dflash_jax import ConfigError, DraftConfig, generate, load_draft, load_target
from dflash_jax.drafts.dflash2 import DFlash2Draft, walk

WINDOW = 5          # shorter than every prompt below: the window decides which context keys a row sees
S = 8


def _write_reference_draft(path, target_path, *, dflash2: bool, layer_types, is_causal=None, seed=0,
                           window=WINDOW, num_layers=None, rank=16, top_k=8, multiplier=None, softcap=None,
                           init_from=None, scale=1.0):
    """A random reference draft saved in z-lab format: DFlash2DraftModel (conv 2 taps x 16-channel
    groups, selector rank/top_k; the codebooks stored without `.weight`, as z-lab does) or
    DFlashDraftModel, with per-layer types, a window and an optional explicit is_causal.
    init_from: a trained DFlash-1 draft whose weights it starts from (conv and selector random,
    their departures from identity / zero times `scale`)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config
    n = num_layers or len(layer_types)
    if init_from is None:
        cfg = _draft_config(target_path, num_layers=n, block_size=S, mask_token_id=None, target_layer_ids=[0, 2])
    else:
        cfg = Qwen3Config.from_pretrained(init_from)
    cfg.use_sliding_window, cfg.sliding_window, cfg.layer_types = True, window, list(layer_types)
    if is_causal is not None:
        cfg.is_causal = is_causal
    if dflash2:
        cfg.architectures = ["DFlash2DraftModel"]
        cfg.dflash_config = dict(cfg.dflash_config, conv_kernel_size=2, conv_group_size=16,
                                 selector_rank=rank, selector_top_k=top_k)
        if multiplier is not None:
            cfg.dflash_config["output_multiplier"] = multiplier
        if softcap is not None:
            cfg.dflash_config["final_logit_softcapping"] = softcap
    torch.manual_seed(seed)
    draft = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(cfg).eval()
    gen = _seeded(seed + 1)
    if init_from is None:
        _noisy_norms(draft, gen)
    else:
        trained = DFlashDraftModel.from_pretrained(init_from, dtype=torch.float32)
        missing = draft.load_state_dict(trained.state_dict(), strict=False).missing_keys
        assert all("conv" in k or "selector" in k for k in missing), missing
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("base_kernel"):      # tap 0 near 1, tap 1 clearly non-zero
                p.copy_(0.5 * scale * torch.randn(p.shape, generator=gen))
                p[:, 0] += 1.0
            elif "kernel_projection" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 * scale / p.shape[1] ** 0.5)
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale ** 0.5)
            elif "hidden_projection" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    draft.save_pretrained(path, safe_serialization=True)
    tensors = {}
    for f in [f for f in os.listdir(path) if f.endswith(".safetensors")]:
        with safe_open(os.path.join(path, f), "pt") as st:
            for k in st.keys():
                if "rotary" not in k:
                    tensors[k.removesuffix(".weight") if "codebook" in k else k] = st.get_tensor(k)
        os.remove(os.path.join(path, f))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    cls = DFlash2DraftModel if dflash2 else DFlashDraftModel
    return path, cls.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    tp = write_target(str(root / "target"), num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    hf, _ = load_torch_pair(tp)
    target = load_target(tp, dtype="float32")
    out = dict(hf=hf, target=target, target_path=tp)
    specs = {
        # the published DFlash2 layout: every layer sliding, explicit non-causal
        "dflash2": dict(dflash2=True, layer_types=["sliding_attention"] * 2, is_causal=False),
        # v1 mixed sliding/full layers, is_causal absent: sliding layers causal, full ones not
        "v1_mixed": dict(dflash2=False, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    }
    for name, kw in specs.items():
        path, ref = _write_reference_draft(str(root / name), tp, seed=7, **kw)
        out[name] = dict(path=path, ref=ref, draft=load_draft(path, target=target, dtype="float32"))
    return out


def test_configs_load_with_their_fields(pairs):
    d2 = pairs["dflash2"]["draft"]
    assert isinstance(d2, DFlash2Draft)
    c = d2.config
    assert c.is_dflash2 and (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 16, 8)
    assert c.layer_types == ("sliding_attention",) * 2 and c.sliding_window == WINDOW and c.is_causal is False
    assert [c.layer_causal(i) for i in range(2)] == [False, False]
    v1 = pairs["v1_mixed"]["draft"].config
    assert not v1.is_dflash2 and [v1.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert [v1.layer_causal(i) for i in range(3)] == [True, False, True]


def _ref_forward(ref, hf, ctx, block):
    with torch.no_grad():
        T = ctx.shape[1]
        return ref(target_hidden=torch.tensor(ctx), noise_embedding=hf.model.embed_tokens(torch.tensor(block)),
                   position_ids=torch.arange(T + block.shape[1])[None]).numpy()


@pytest.mark.parametrize("name", ["dflash2", "v1_mixed"])
def test_draft_hidden_states_match_the_reference(pairs, name, kernels=None):
    """The block's hidden states through conv + windowed layers = the reference's, with the
    context written at prefill or arriving as pending rows (12 context rows, window 5; the
    sliding layers' rings of 16 slots wrap)."""
    draft, ref, target = pairs[name]["draft"], pairs[name]["ref"], pairs["target"]
    nH, T = 2 * 64, 12
    ctx = np.random.RandomState(0).randn(1, T, nH).astype(np.float32)
    block = np.array([[5] + [draft.config.mask_token_id] * (S - 1)])
    want = _ref_forward(ref, pairs["hf"], ctx, block)
    pos = jnp.arange(T, T + S, dtype=jnp.int32)[None]
    emb = target.embed_tokens(jnp.asarray(block))
    cache = draft.write_context(jnp.asarray(ctx[:, :8]), jnp.arange(8, dtype=jnp.int32)[None], draft.new_cache(1, 64))
    pending = np.zeros((1, S, nH), np.float32)
    pending[:, :4] = ctx[:, 8:]
    got, _ = jax.jit(lambda *a: draft(*a, kernels=kernels))(emb, pos, jnp.asarray(pending),
                                                            jnp.arange(8, 8 + S, dtype=jnp.int32)[None], cache,
                                                            jnp.array([T + S], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_gpu_fused_draft_pass_matches_xla(pairs):
    """A DFlash2 draft of head_dim 64 (one sliding layer, one full layer) on the GPU path in the
    interpreter = its XLA path: the Triton attention over the sliding layer's wrapped ring, the
    full layer's fused prologue with its context rows, the residual adds and norms as the add +
    RMSNorm kernel (XLA path = the reference: test_draft_hidden_states_match_the_reference)."""
    import dataclasses
    from dflash_jax import KernelConfig, init_draft
    from dflash_jax.attention import fused_add_norm, fused_prologue
    cfg = dataclasses.replace(pairs["dflash2"]["draft"].config, head_dim=64,
                              layer_types=("sliding_attention", "full_attention"))
    draft = init_draft(cfg, seed=5, dtype="float32")
    kernels = KernelConfig(attention="pallas_gpu_interpret", fused_layer=True).resolve()
    assert fused_add_norm(kernels, S, 64) and fused_prologue(kernels, S, 64)
    assert [k.shape[2] for k in draft.new_cache(2, 64).k] == [16, 64]
    rs = np.random.RandomState(9)
    nH = 2 * 64
    ctx = jnp.asarray(rs.randn(2, 16, nH).astype(np.float32))
    cache = draft.write_context(ctx, jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16)), draft.new_cache(2, 64),
                                valid=jnp.array([12, 16], jnp.int32))
    lens = jnp.array([15, 19], jnp.int32)                     # pending rows [12, 15) / [16, 19)
    pos = lens[:, None] + jnp.arange(S, dtype=jnp.int32)
    pend = (lens - 3)[:, None] + jnp.arange(S, dtype=jnp.int32)
    emb = jnp.asarray(rs.randn(2, S, 64).astype(np.float32))
    feats = jnp.asarray(rs.randn(2, S, nH).astype(np.float32))
    outs = [jax.jit(lambda *a, k=k: draft(*a, kernels=k))(emb, pos, feats, pend, cache, lens + S)
            for k in ("xla", kernels)]
    (h0, c0), (h1, c1) = outs
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-4, rtol=1e-4)
    for a, b in zip(c1.k + c1.v, c0.k + c0.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_conv_matches_the_reference_module(pairs):
    ours = pairs["dflash2"]["draft"].layers[1].mlp_conv
    ref = pairs["dflash2"]["ref"].layers[1].mlp_conv
    x = np.random.RandomState(1).randn(2, S, 64).astype(np.float32)
    with torch.no_grad():
        want, want_dyn = ref.prepare(torch.tensor(x))
        want_fin = ref.finish(torch.tensor(x[:, ::-1].copy()), want_dyn)
    got, dyn = ours.prepare(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ours.finish(jnp.asarray(x[:, ::-1].copy()), dyn)), want_fin.numpy(),
                               atol=1e-5, rtol=0)


def test_selector_candidates_and_path_match_the_reference(pairs):
    draft, ref, target = pairs["dflash2"]["draft"], pairs["dflash2"]["ref"], pairs["target"]
    rs = np.random.RandomState(2)
    hidden = rs.randn(3, S - 1, 64).astype(np.float32)
    anchors = np.array([3, 50, 101])
    with torch.no_grad():
        want_path, want_cand, _ = ref.propose(torch.tensor(hidden), torch.tensor(anchors), pairs["hf"].lm_head, 0.0)
    logits = draft.unary_logits(target, jnp.asarray(hidden))
    scores, cand = draft.candidate_selector.lattice(jnp.asarray(hidden), logits, jnp.asarray(anchors))
    path, q = walk(scores, cand)
    assert q is None
    np.testing.assert_array_equal(np.sort(np.asarray(cand), -1), np.sort(want_cand.numpy(), -1))
    np.testing.assert_array_equal(np.asarray(path), want_path.numpy())
    # the path differs from plain argmax somewhere (the selector matters in this test)
    assert (np.asarray(path) != np.asarray(logits).argmax(-1)).any()


def test_softcap_and_multiplier_enter_the_unary_logits(pairs, tmp_path):
    path, ref = _write_reference_draft(str(tmp_path / "cap"), pairs["target_path"], dflash2=True,
                                       layer_types=["full_attention"], seed=9, multiplier=0.7, softcap=3.0)
    draft = load_draft(path, target=pairs["target"], dtype="float32")
    hidden = np.random.RandomState(3).randn(2, S - 1, 64).astype(np.float32)
    with torch.no_grad():
        want = ref.compute_logits(torch.tensor(hidden), pairs["hf"].lm_head).numpy()
        want_path, _, _ = ref.propose(torch.tensor(hidden), torch.tensor([4, 9]), pairs["hf"].lm_head, 0.0)
    got = draft.unary_logits(pairs["target"], jnp.asarray(hidden))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
    scores, cand = draft.candidate_selector.lattice(jnp.asarray(hidden), got, jnp.array([4, 9]))
    np.testing.assert_array_equal(np.asarray(walk(scores, cand)[0]), want_path.numpy())


@pytest.mark.slow
@pytest.mark.parametrize("verify_width", widths(3))
@pytest.mark.parametrize("name", ["dflash2", "v1_mixed"])
def test_generate_is_identical_to_the_reference(pairs, name, verify_width):
    """Tokens and acceptance lengths = dflash_generate's (whose greedy tokens are the target's own),
    over prompts longer than the window, a partial last block and two batch rows. The sliding
    layers keep rings of 16 slots (window 5 + block 8, rounded) that wrap 3 times over these
    lengths, the prompt bucket of 32 wider than the ring; full layers keep the whole capacity.
    At "auto" and at W = 3 (the DFlash2 selector's path cut to its first 3 drafts): the same
    tokens, at most W + 1 an iteration."""
    from dflash_jax import decode
    prompts = random_prompts(2, 127, min_len=9, max_len=20, seed=11)
    assert max(map(len, prompts)) > 16
    draft = pairs[name]["draft"]
    res, state = decode._generate(pairs["target"], draft, prompts, max_new_tokens=30, verify_width=verify_width)
    if "reference_runs" not in pairs[name]:       # once for the widths
        pairs[name]["reference_runs"] = [reference_generate(pairs[name]["ref"], pairs["hf"], p, 30) for p in prompts]
    runs = pairs[name]["reference_runs"]
    assert_width_result(res, [r.output_ids[0, len(p):].tolist() for r, p in zip(runs, prompts)],
                        [list(r.acceptance_lengths) for r in runs], verify_width, S)
    if verify_width != "block":
        return
    C = state.target_cache.k[0].shape[2]
    rows = [16 if draft.config.layer_window(i) else C for i in range(draft.config.num_layers)]
    assert [k.shape[2] for k in state.draft_cache.k] == [k.shape[2] for k in state.draft_cache.v] == rows
    assert C >= 1024 and 16 in rows
    if name == "dflash2":   # the slot engine (continuous batching, one slot) runs the same iterations
        eng = generate(pairs["target"], draft, prompts, max_new_tokens=30, slots=1, verify_width="block")
        assert eng.tokens == res.tokens and eng.acceptance_lengths == res.acceptance_lengths


def test_draft_cache_of_a_window_layer_is_a_ring_of_window_plus_block_rows(pairs):
    """O(W) bytes per sliding layer whatever the capacity: W + S rounded to 16 (to 128 past 128),
    never more than the capacity; full layers keep the capacity."""
    from dflash_jax.drafts.dflash2 import ring_rows
    v1 = pairs["v1_mixed"]["draft"]
    for cap in (64, 4096, 32768):
        c = v1.new_cache(2, cap)
        assert [k.shape for k in c.k] == [(2, 2, 16, 16), (2, 2, cap, 16), (2, 2, 16, 16)]
    assert [k.shape[2] for k in v1.new_cache(1, 8).k] == [8, 8, 8]
    assert (ring_rows(5, 8), ring_rows(120, 8), ring_rows(2048, 8), ring_rows(4096, 16)) == (16, 128, 2176, 4224)


def test_bad_dflash2_configs_are_one_line_errors(pairs, tmp_path):
    cfg = json.load(open(os.path.join(pairs["dflash2"]["path"], "config.json")))

    def with_(**kw):
        c = json.loads(json.dumps(cfg))
        for k, v in kw.items():
            (c["dflash_config"] if k.startswith(("conv_", "selector_")) else c)[k] = v
        return c

    for changes, word in [(dict(selector_top_k=1000), "selector_top_k"),
                          (dict(conv_group_size=24), "conv_group_size"),
                          (dict(selector_rank=0), "selector_rank"),
                          (dict(layer_types=["sliding_attention"]), "layer_types"),
                          (dict(sliding_window=0), "sliding_window")]:
        with pytest.raises(ConfigError, match=word) as e:
            DraftConfig.from_dict(with_(**changes))
        assert "\n" not in str(e.value)
    c = dict(cfg, dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != "selector_top_k"})
    with pytest.raises(ConfigError, match="selector_top_k"):
        DraftConfig.from_dict(c)
    # a draft whose head / width does not fit the target
    small = DraftConfig.from_dict(with_(vocab_size=64, selector_top_k=8))
    with pytest.raises(ConfigError, match="vocab_size"):
        small.check_fits(pairs["target"].config)
    wide = DraftConfig.from_dict(with_(hidden_size=128))
    with pytest.raises(ConfigError, match="hidden_size"):
        wide.check_fits(pairs["target"].config)


def test_walk_draws_from_q_with_gumbel_max():
    """At T > 0 each slot's pick is a draw from q = softmax(row / T) of the row its predecessor
    picks; T = 0 rows take the argmax."""
    rs = np.random.RandomState(4)
    K, L, n = 4, 2, 4000
    scores = jnp.asarray(np.broadcast_to(rs.randn(1, L, K, K).astype(np.float32), (n, L, K, K)))
    cand = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (n, L, K))
    keys = jax.random.split(jax.random.key(0), n)
    T = jnp.full((n,), 0.7, jnp.float32)
    path, q = walk(scores, cand, T, keys)
    want0 = jax.nn.softmax(scores[0, 0, 0] / 0.7)
    np.testing.assert_allclose(np.asarray(q[:, 0]), np.broadcast_to(want0, (n, K)), atol=1e-6)
    freq = np.bincount(np.asarray(path[:, 0]), minlength=K) / n
    np.testing.assert_allclose(freq, np.asarray(want0), atol=0.03)
    # slot 1's q is the row of slot 0's pick
    np.testing.assert_allclose(np.asarray(q[:, 1]), np.asarray(jax.nn.softmax(scores[0, 1][path[:, 0]] / 0.7)),
                               atol=1e-6)
    greedy, _ = walk(scores[:2], cand[:2], jnp.zeros((2,), jnp.float32), keys[:2])
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(walk(scores[:2], cand[:2])[0]))


def test_staged_top_k_equals_lax_top_k():
    """The GPU's staged top k (each chunk's top k, in stages, then the rest's) = lax.top_k: values,
    ids and order, ties to the lowest id across chunk edges, -inf entries before the padding,
    ragged last chunks."""
    from dflash_jax import sharding
    rs = np.random.RandomState(6)
    L = sharding.TOP_K_STAGES[0]
    V = 9 * L + 37
    x = rs.randn(3, 2, V).astype(np.float32)
    x[0, 0, L - 5:3 * L + 30] = 9.0                                         # ties over chunk edges
    x[1, 1] = -np.inf
    x[1, 1, [7, V - 1]] = 1.0                                               # two finite, the rest -inf
    x[2, 0] = np.round(x[2, 0])                                             # many ties
    for k, stages in [(1, sharding.TOP_K_STAGES), (16, sharding.TOP_K_STAGES), (40, sharding.TOP_K_STAGES),
                      (16, (1024,)), (16, (256, 64, 32))]:
        want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
        got_v, got_i = jax.jit(lambda a, k=k, s=stages: sharding._staged_top_k(a, k, s))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_walk_equals_a_sequential_walk_and_runs_no_device_loop():
    """The parallel lattice argmax + unrolled gathers = the walk slot by slot (a NumPy oracle with
    the same per-slot Gumbel noise, ties included), and the greedy walk compiles without a while
    loop (a device loop is one host round trip per slot on XLA:GPU)."""
    rs = np.random.RandomState(5)
    B, L, K = 4, 7, 8
    scores = np.round(rs.randn(B, L, K, K).astype(np.float32) * 2) / 2          # ties on purpose
    cand = rs.randint(0, 500, (B, L, K)).astype(np.int32)
    T = np.array([0.0, 0.6, 1.0, 1.7], np.float32)
    keys = jax.random.split(jax.random.key(3), B)
    noise = np.asarray(jax.vmap(lambda k: jax.vmap(lambda t: jax.random.gumbel(jax.random.fold_in(k, t), (K,)))(
        jnp.arange(L, dtype=jnp.uint32)))(keys))
    for temp in (None, T):
        path, q = walk(jnp.asarray(scores), jnp.asarray(cand), None if temp is None else jnp.asarray(temp), keys)
        for b in range(B):
            prev = 0
            for t in range(L):
                row = scores[b, t, prev]
                sampled = temp is not None and temp[b] > 0
                pick = int(np.argmax(row / temp[b] + noise[b, t] if sampled else row))
                assert path[b, t] == cand[b, t, pick]
                if temp is not None:
                    z = row / (temp[b] if temp[b] > 0 else 1.0)
                    np.testing.assert_allclose(q[b, t], np.exp(z - z.max()) / np.exp(z - z.max()).sum(), atol=1e-6)
                prev = pick
    assert "while" not in jax.jit(walk).lower(jnp.asarray(scores), jnp.asarray(cand)).as_text()


@pytest.fixture(scope="module")
def selector_sampling(tmp_path_factory):
    """A vocab-32 target, a DFlash2 draft with a selector (rank 8, top-K 8) and one prompt's exact
    T = 1 joint of the first three generated tokens (tests/test_sampling.py's enumeration)."""
    from tests.test_sampling import _exact_joint
    root = tmp_path_factory.mktemp("selector_sampling")
    tp = write_target(str(root / "target"), vocab_size=32, num_layers=4, seed=5, init_std=0.2)
    path, _ = _write_reference_draft(str(root / "draft"), tp, dflash2=True, layer_types=["sliding_attention"] * 2,
                                     is_causal=False, seed=6, rank=8, top_k=8, window=4)
    hf, _ = load_torch_pair(tp)
    target = load_target(tp, dtype="float32")
    prompt = random_prompts(1, 31, min_len=9, max_len=9, seed=12)[0]
    return dict(target=target, draft=load_draft(path, target=target, dtype="float32"), prompt=prompt,
                expected=_exact_joint(hf, prompt, 1.0, 1.0, 0))


def _selector_samples(d, verify_width="block"):
    counts, n, acc = {}, 0, []
    for seed in range(4):
        res = generate(d["target"], d["draft"], [d["prompt"]] * 512, max_new_tokens=3, temperature=1.0, seed=seed,
                       capacity=64, verify_width=verify_width)
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
            n += 1
        acc += [a for r in res.acceptance_lengths for a in r]
    return counts, n, acc


@pytest.mark.slow
@pytest.mark.parametrize("verify_width", ["block", pytest.param(1, id="W1")])
def test_sampling_with_the_selector_is_in_distribution(selector_sampling, verify_width):
    """T = 1: the joint of the first three generated tokens (prefill token + one verify chain with
    drafts drawn by the selector) matches the target's exact plain-sampling distribution (chi-square,
    tests/test_sampling.py's method), and drafts do get accepted; also at the prefix width W = 1
    (the selector's sampled path verified at its first draft only, the acceptance dividing by that
    slot's q)."""
    from tests.test_sampling import _chi_square_p
    counts, n, acc = _selector_samples(selector_sampling, verify_width)
    assert max(acc) == 2 if verify_width == 1 else max(acc) >= 2, acc[:20]
    assert _chi_square_p(counts, selector_sampling["expected"], n) > 1e-4


@pytest.mark.slow
def test_a_selector_drafting_its_argmax_would_be_caught(selector_sampling, monkeypatch):
    """Power of the check above: a plausible bug planted (the selector's path taken by argmax, no
    Gumbel draw, while the acceptance still divides by q, the sampled path's distribution) moves the
    joint off the exact one at p < 1e-4."""
    import dflash_jax.drafts.dflash2 as d2
    from dflash_jax import decode
    from tests.test_sampling import _chi_square_p

    def argmax_walk(scores, cand, temperature=None, keys=None):
        if temperature is None:
            return walk(scores, cand)
        B, L = scores.shape[:2]
        z = scores / jnp.where(temperature > 0, temperature, 1.0)[:, None, None, None]
        follow = jnp.argmax(scores, axis=-1).astype(jnp.int32)                     # no noise
        picks, prev = [], jnp.zeros((B,), jnp.int32)
        for t in range(L):
            prev = follow[jnp.arange(B), t, prev]
            picks.append(prev)
        idx = jnp.stack(picks, axis=1)
        before = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), idx[:, :-1]], axis=1)
        q = jax.nn.softmax(jnp.take_along_axis(z, before[:, :, None, None], axis=2)[:, :, 0], axis=-1)
        return jnp.take_along_axis(cand, idx[..., None], axis=-1)[..., 0], q

    monkeypatch.setattr(d2, "walk", argmax_walk)
    decode.clear_compiled()                 # programs and traces built with the bug, dropped after
    jax.clear_caches()
    try:
        counts, n, acc = _selector_samples(selector_sampling)
    finally:
        monkeypatch.undo()
        decode.clear_compiled()
        jax.clear_caches()
    assert max(acc) >= 2                    # drafts accepted: the bug had something to act on
    assert _chi_square_p(counts, selector_sampling["expected"], n) < 1e-4


def test_key_start_on_the_xla_paths_matches_a_dense_mask():
    """attend(k_start=): rows see keys [k_start, k_end) on the chunked XLA path (chunks skipped
    before the first row's start) and the dense one, as a numpy softmax over that range does."""
    import pallas_kernels
    rs = np.random.RandomState(5)
    B, T, Hq, Hkv, D, C = 2, 4, 4, 2, 8, 40
    q = rs.randn(B, T, Hq, D).astype(np.float32)
    k, v = rs.randn(B, Hkv, C, D).astype(np.float32), rs.randn(B, Hkv, C, D).astype(np.float32)
    end = np.array([[20, 21, 22, 23], [35, 35, 35, 35]], np.int32)
    start = np.array([[17, 18, 19, 20], [9, 10, 11, 12]], np.int32)
    want = np.zeros((B, T, Hq, D), np.float32)
    for b in range(B):
        for t in range(T):
            for h in range(Hq):
                kk, vv = k[b, h // 2, start[b, t]:end[b, t]], v[b, h // 2, start[b, t]:end[b, t]]
                s = kk @ q[b, t, h] / np.sqrt(D)
                p = np.exp(s - s.max())
                want[b, t, h] = p @ vv / p.sum()
    for chunk in (8, 0):
        got = pallas_kernels.xla_block_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(end),
                                                 kv_chunk=chunk, k_start=jnp.asarray(start))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def trained_dflash2(trained_pair, tmp_path_factory):
    """The trained pair's draft with a (perturbed) conv, a selector and window-6 sliding layers, its
    target, 4 eval prompts and dflash_generate's runs on them (shared by the widths)."""
    tp = trained_pair["target_path"]
    path, ref = _write_reference_draft(str(tmp_path_factory.mktemp("d2") / "d2"), tp, dflash2=True,
                                       layer_types=["sliding_attention"] * 2, is_causal=False, window=6, seed=13,
                                       init_from=trained_pair["draft_path"], scale=0.1)
    hf, _ = load_torch_pair(tp)
    target = load_target(tp, dtype="float32")
    prompts = trained_pair["eval_prompts"][:4]
    runs = [reference_generate(ref, hf, p, 30) for p in prompts]
    return dict(target=target, draft=load_draft(path, target=target, dtype="float32"), prompts=prompts,
                tokens=[r.output_ids[0, len(p):].tolist() for r, p in zip(runs, prompts)],
                acceptance=[list(r.acceptance_lengths) for r in runs])


@pytest.mark.slow
@pytest.mark.parametrize("verify_width", ["block", pytest.param(3, id="W3")])
def test_trained_draft_as_dflash2_accepts_and_matches_the_reference(trained_dflash2, verify_width):
    """Blocks get accepted, and tokens and acceptance lengths = dflash_generate's; at the prefix
    width W = 3 (the selector's path cut to its first 3 drafts) the same tokens, iterations
    accepting up to W + 1 = 4 and no more."""
    d = trained_dflash2
    res = generate(d["target"], d["draft"], d["prompts"], max_new_tokens=30, verify_width=verify_width)
    assert_width_result(res, d["tokens"], d["acceptance"], verify_width, S)
    assert max(a for row in res.acceptance_lengths for a in row) >= 3, res.acceptance_lengths
    if verify_width != "block":
        assert max(a for row in res.acceptance_lengths for a in row) == verify_width + 1, res.acceptance_lengths


def _ring(cache, top, size):
    """The ring of `size` slots a windowed layer keeps of a plain cache [B, Hkv, C, D] whose rows
    were written up to top [B] (exclusive): slot s holds the last position < top that is s mod
    size; slots no position reached hold noise (a real ring's stale or zero rows)."""
    B = cache.shape[0]
    s = np.arange(size)
    pos = top[:, None] - 1 - np.mod(top[:, None] - 1 - s, size)                   # [B, size]
    rows = np.take_along_axis(np.asarray(cache), np.maximum(pos, 0)[:, None, :, None], axis=2)
    noise = np.random.RandomState(99).randn(*rows.shape).astype(rows.dtype) * 100
    return jnp.asarray(np.where((pos >= 0)[:, None, :, None], rows, noise)), B


def _window_case(seed, B, T, Hq, Hkv, D, C, pos0, window, tops):
    """q, k, v over a plain cache of C rows, and rows at positions pos0[b] + t seeing
    [p - window + 1, min(p + 5, top)): a non-causal window (one row empty)."""
    rs = np.random.RandomState(seed)
    q = jnp.asarray(rs.randn(B, T, Hq, D).astype(np.float32))
    k, v = (jnp.asarray(rs.randn(B, Hkv, C, D).astype(np.float32)) for _ in range(2))
    pos = np.array(pos0)[:, None] + np.arange(T)
    end = np.minimum(pos + 5, np.array(tops)[:, None]).astype(np.int32)
    end[1, 7] = 0
    start = np.maximum(pos - window + 1, 0).astype(np.int32)
    return q, k, v, end, start


@pytest.mark.parametrize("kv_splits,ring", [pytest.param(1, False, marks=pytest.mark.slow),
                                             pytest.param(3, False, marks=pytest.mark.slow), (3, True)])
def test_key_start_in_the_gpu_kernel_interpret(kv_splits, ring):
    """The Triton kernel (interpreter) with a per-row first key: a window's rows, ragged, one with
    no key, split KV = the reference over the plain cache; ring: the same rows over a ring of 128
    slots that has wrapped twice (keys by absolute position, tiles read mod 128)."""
    import pallas_kernels
    from pallas_kernels.attention import gpu
    tops = np.array([308, 48])
    q, k, v, end, start = _window_case(6, 2, 8, 4, 2, 64, 512, [300, 40], 70, tops)
    want = pallas_kernels.reference_block_attention(q, k, v, jnp.asarray(end), k_start=jnp.asarray(start))
    if ring:
        k, _ = _ring(k, tops, 128)
        v, _ = _ring(v, tops, 128)
    got = gpu.block_attention(q, k, v, jnp.asarray(end), interpret=True, kv_splits=kv_splits, block_k=32,
                              min_chunk=32, k_start=jnp.asarray(start), ring=ring)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    if ring:   # the XLA paths (chunked: 64-key chunks, dense) and the reference take the same ring
        for chunk in (64, 0):
            got = pallas_kernels.xla_block_attention(q, k, v, jnp.asarray(end), kv_chunk=chunk,
                                                     k_start=jnp.asarray(start), ring=True)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_key_start_gpu_kernel_lowers_for_cuda():
    """The Triton kernel with k_start lowers for CUDA, over a flat cache and over a ring of 2176
    slots (window 2048 + block 8, rounded: a multiple of the kernel's 64-key tiles)."""
    from dflash_jax.attention import attend
    from dflash_jax.kernel_config import resolved
    S_ = jax.ShapeDtypeStruct
    B, T, Hq, Hkv, D = 1, 8, 32, 8, 128
    for C, ring in ((4096, False), (2176, True)):
        fn = lambda q, k, v, e, s: attend(q, k, v, e, resolved("pallas_gpu"), k_start=s, ring=ring)   # noqa: E731
        args = (S_((B, T, Hq, D), jnp.bfloat16), S_((B, Hkv, C, D), jnp.bfloat16), S_((B, Hkv, C, D), jnp.bfloat16),
                S_((B, T), jnp.int32), S_((B, T), jnp.int32))
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_export_round_trip_through_the_reference(pairs, tmp_path):
    """Our DFlash2 draft exported in z-lab format: load_draft gives the same tensors back, and the
    reference DFlash2DraftModel loads it and computes the same block hidden states and path."""
    from dflash.model import DFlash2DraftModel
    from dflash_jax.train.export import export_draft
    draft, target = pairs["dflash2"]["draft"], pairs["target"]
    out = export_draft(draft, str(tmp_path / "exported"), dtype="float32")
    again = load_draft(out, target=target, dtype="float32")
    assert again.config == draft.config
    ref = DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    nH, T = 2 * 64, 12
    ctx = np.random.RandomState(7).randn(1, T, nH).astype(np.float32)
    block = np.array([[9] + [draft.config.mask_token_id] * (S - 1)])
    np.testing.assert_allclose(_ref_forward(ref, pairs["hf"], ctx, block),
                               _ref_forward(pairs["dflash2"]["ref"], pairs["hf"], ctx, block), atol=1e-5, rtol=0)
    assert ref.config.sliding_window == WINDOW and ref.layers[0].self_attn.is_causal is False


@pytest.mark.parametrize("D,Hq,block_k,ring", [pytest.param(128, 4, 128, False, marks=pytest.mark.slow),
                                               pytest.param(128, 4, 256, False, marks=pytest.mark.slow),
                                               pytest.param(64, 2, 128, False, marks=pytest.mark.slow),
                                               (128, 4, 128, True),
                                               pytest.param(64, 2, 128, True, marks=pytest.mark.slow)])
def test_key_start_in_the_tpu_kernel_interpret(D, Hq, block_k, ring):
    """The TPU kernel (TPU interpreter; token-major tiles, and the folded layout at G·D 64) with a
    per-row first key: blocks before the tile's first key skipped, ragged rows, an empty row = the
    reference; ring: over a ring of 256 slots, wrapped, the tile's keys [101, 308) starting
    mid-tile (3 absolute tiles of a 2-tile ring)."""
    import pallas_kernels
    from jax.experimental.pallas import tpu as pltpu
    from pallas_kernels.attention import tpu
    tops = np.array([308, 48])
    q, k, v, end, start = _window_case(8, 2, 8, Hq, 2, D, 512, [300, 40], 200, tops)
    want = pallas_kernels.reference_block_attention(q, k, v, jnp.asarray(end), k_start=jnp.asarray(start))
    if ring:
        k, _ = _ring(k, tops, 256)
        v, _ = _ring(v, tops, 256)
    got = tpu.block_attention(q, k, v, jnp.asarray(end), interpret=pltpu.InterpretParams(), block_k=block_k,
                              k_start=jnp.asarray(start), ring=ring)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


_MESH_CHILD = """
import json, sys
import jax
from dflash_jax import generate, load_draft, load_target, sharding
tp, dp, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = []
for mesh in (None, sharding.make_mesh("1x2", devices=jax.devices()[:2])):
    t = load_target(tp, dtype="float32", mesh=mesh)
    d = load_draft(dp, target=t, dtype="float32", mesh=mesh)
    r = generate(t, d, prompts, max_new_tokens=16, attention_impl="xla", verify_width="block")
    # sampled: the selector's q over candidates from per-shard top-K, accepted per vocab shard
    s = generate(t, d, prompts, max_new_tokens=16, attention_impl="xla", temperature=1.0, seed=5, verify_width="block")
    out.append([r.tokens, r.acceptance_lengths, [k.shape[2] for k in d.new_cache(1, 1024).k], d.layers[0].qkv_groups,
                s.tokens, s.acceptance_lengths])
# the selector's top-K over vocab shards = lax.top_k, ties (to the lowest id) across shards included
import jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
x = jnp.asarray(np.random.RandomState(0).randint(0, 6, (2, 3, 128)).astype(np.float32))
with sharding.active(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(None, None, "model")))
    got = jax.jit(lambda v: sharding.top_k(v, 8))(xs)
want = jax.lax.top_k(x, 8)
out.append([np.array_equal(got[0], want[0]), np.array_equal(got[1], want[1])])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_dflash2_on_a_mesh_matches_one_device(pairs):
    """The DFlash2 draft (conv, selector, sliding layers with ring caches) loaded onto a 2-device
    TP mesh (8 virtual CPU devices in a child process, as tests/test_sharding.py): its layers in
    the fused layout, the selector's top-K over the vocab-sharded head per shard; tokens and
    acceptance lengths = one device's, greedy and sampled (the selector's q accepted per shard)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    prompts = random_prompts(2, 127, min_len=9, max_len=20, seed=11)
    r = subprocess.run([sys.executable, "-c", _MESH_CHILD, pairs["target_path"], pairs["dflash2"]["path"],
                        json.dumps(prompts)], cwd=root, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    one, two, top = json.loads(r.stdout.strip().splitlines()[-1])
    assert one[:3] == two[:3] and one[2] == [16, 16] and (one[3], two[3]) == (1, 2)
    assert one[4:] == two[4:] and one[4] != one[0]      # sampled DFlash2 over the sharded head = one device
    assert top == [True, True]
