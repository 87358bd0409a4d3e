"""The DFlash draft and the speculative loop against the reference `dflash` package (PyPI 0.1.0):
draft parity, lossless greedy output identical to `dflash_generate` (tokens and acceptance lengths),
acceptance coverage (zero, partial, full) and compile-once. Issue: the speculative loop."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import tpu_aot
from tests.doubles import truth_proposer
from tests.pairs import assert_width_result, cap
from tests.checkpoints import load_torch_pair, random_prompts, reference_generate, write_draft, write_target

from dflash_jax import ConfigError, DraftConfig, generate, load_draft, load_target
from dflash_jax import decode


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tp = write_target(str(root / "target"), num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    dp = write_draft(str(root / "draft"), tp, num_layers=2, block_size=16, target_layer_ids=[0, 2], seed=4)
    hf, ref_draft = load_torch_pair(tp, dp)
    target = load_target(tp, dtype="float32")
    return dict(hf=hf, ref_draft=ref_draft, target=target, draft=load_draft(dp, target=target, dtype="float32"),
                target_path=tp, draft_path=dp)


@pytest.fixture(scope="module")
def trained(trained_pair):
    hf, ref_draft = load_torch_pair(trained_pair["target_path"], trained_pair["draft_path"])
    target = load_target(trained_pair["target_path"], dtype="float32")
    draft = load_draft(trained_pair["draft_path"], target=target, dtype="float32")
    return dict(trained_pair, hf=hf, ref_draft=ref_draft, target=target, draft=draft)


@pytest.mark.slow
def test_draft_hidden_states_match_the_reference(random_pair):
    """Our draft (context written at prefill, or arriving as pending context in the loop) gives the
    reference DFlashDraftModel's hidden states for the block, in float32."""
    draft, ref, target = random_pair["draft"], random_pair["ref_draft"], random_pair["target"]
    S, nH = 16, 2 * 64
    rng = np.random.RandomState(0)
    ctx = rng.randn(1, 10, nH).astype(np.float32)
    block = np.array([[5] + [draft.config.mask_token_id] * (S - 1)])
    with torch.no_grad():
        want = ref(target_hidden=torch.tensor(ctx), noise_embedding=random_pair["hf"].model.embed_tokens(torch.tensor(block)),
                   position_ids=torch.arange(10 + S)[None]).numpy()
    pos = jnp.arange(10, 10 + S, dtype=jnp.int32)[None]
    emb = target.embed_tokens(jnp.asarray(block))
    k_end = jnp.full((1, S), 10 + S, jnp.int32)
    # (a) the whole context written by prefill, nothing pending
    cache = draft.write_context(jnp.asarray(ctx), jnp.arange(10, dtype=jnp.int32)[None], draft.new_cache(1, 64))
    got, _ = draft(emb, pos, jnp.zeros((1, S, nH)), pos, cache, k_end)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    # (b) 6 context tokens from prefill, the last 4 pending from the previous iteration
    cache = draft.write_context(jnp.asarray(ctx[:, :6]), jnp.arange(6, dtype=jnp.int32)[None], draft.new_cache(1, 64))
    pending = np.zeros((1, S, nH), np.float32)
    pending[:, :4] = ctx[:, 6:]
    got, cache = draft(emb, pos, jnp.asarray(pending), jnp.arange(6, 6 + S, dtype=jnp.int32)[None], cache, k_end)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def _reference_run(pair, prompts, n, S, stop=None):
    out = []
    for p in prompts:
        r = reference_generate(pair["ref_draft"], pair["hf"], p, n, block_size=S, stop_token_ids=stop)
        out.append((r.output_ids[0, len(p):].tolist(), list(r.acceptance_lengths)))
    return out


@pytest.mark.parametrize("S", [pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow), 16])
def test_random_pair_is_lossless_and_identical_to_reference(random_pair, S):
    prompts = random_prompts(3, 127, min_len=3, max_len=21, seed=S)
    res = generate(random_pair["target"], random_pair["draft"], prompts, max_new_tokens=23, block_size=S, verify_width="block")
    plain = generate(random_pair["target"], None, prompts, max_new_tokens=23)
    assert res.tokens == plain.tokens
    ref = _reference_run(random_pair, prompts, 23, S)
    assert res.tokens == [t for t, _ in ref]
    assert res.acceptance_lengths == [a for _, a in ref]


_REFERENCE_RUNS: dict = {}


@pytest.mark.parametrize("S,verify_width", [pytest.param(4, "block", marks=pytest.mark.slow), (8, "block"),
                                            (8, "auto"), pytest.param(8, 3, id="8-W3")])
@pytest.mark.slow
def test_trained_pair_is_lossless_identical_to_reference_and_accepts(trained, S, verify_width):
    """At the full block: tokens and acceptance lengths = dflash_generate's. At "auto" (generate's
    default) and at the prefix width W = 3: the same tokens, each iteration at most W + 1 of them,
    and the prefix width reaching its cap (a trained draft: blocks accepted past 3 at full width)."""
    prompts = trained["eval_prompts"]  # all 8: a partial block somewhere must not hinge on one seed
    stop = None
    res = generate(trained["target"], trained["draft"], prompts, max_new_tokens=40, block_size=S,
                   verify_width=verify_width)
    plain = generate(trained["target"], None, prompts, max_new_tokens=40)
    assert res.tokens == plain.tokens
    if S not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[S] = _reference_run(trained, prompts, 40, S, stop)
    ref = _REFERENCE_RUNS[S]
    assert_width_result(res, [t for t, _ in ref], [a for _, a in ref], verify_width, S)
    seen = set(n for row in res.acceptance_lengths for n in row[:-1])  # the last one may be cut by the limit
    assert max(seen) >= 3 and (verify_width == "auto" or max(seen) == cap(verify_width, S)), (verify_width, res.tau_histogram)
    if verify_width != "block":
        return
    assert S in seen and any(1 < n < S for n in seen), (S, res.tau_histogram)
    assert res.mean_tau > 2.0
    print(f"\ntrained pair S={S}: tau={res.mean_tau:.2f} histogram(1..S)={res.tau_histogram}")


@pytest.mark.slow
def test_trained_pair_with_stop_tokens_matches_reference(trained):
    prompts = trained["eval_prompts"][4:7]
    first = generate(trained["target"], None, prompts[:1], max_new_tokens=30).tokens[0]
    stop = [first[9]]
    res = generate(trained["target"], trained["draft"], prompts, max_new_tokens=30, stop_token_ids=stop, verify_width="block")
    ref = _reference_run(trained, prompts, 30, trained["block_size"], stop)
    assert res.tokens == [t for t, _ in ref]
    assert res.acceptance_lengths == [a for _, a in ref]
    assert res.tokens[0][-1] == stop[0] and len(res.tokens[0]) <= 10


@pytest.mark.parametrize("corrupt", [pytest.param(None, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow), 3])
@pytest.mark.slow
def test_full_partial_zero_acceptance_with_a_proposer_double(random_pair, corrupt):
    target, draft = random_pair["target"], random_pair["draft"]
    S, n = 8, 40
    prompts = random_prompts(2, 127, min_len=4, max_len=12, seed=11)
    plain = generate(target, None, prompts, max_new_tokens=n + S)
    truth = np.zeros((2, 64 + n + 2 * S), np.int32)
    for i, (p, t) in enumerate(zip(prompts, plain.tokens)):
        truth[i, :len(p) + len(t)] = p + t
    res, st = decode._generate(target, truth_proposer(draft, truth, corrupt, 128), prompts,
                               **decode._generate_defaults(dict(max_new_tokens=n, block_size=S, verify_width="block")),
                               on_commit=None)
    assert res.tokens == [t[:n] for t in plain.tokens]
    expect = S if corrupt is None else corrupt + 1
    for row in res.acceptance_lengths:
        assert row[:-1] == [expect] * (len(row) - 1) and 1 <= row[-1] <= expect
    # The draft's context cache after partial acceptance: rows [0, len - pending) hold exactly the K/V
    # of the target taps of the committed tokens, as if written from scratch (the last iteration's
    # tokens are still pending: the loop ended before a draft step wrote them).
    for b, (p, t) in enumerate(zip(prompts, res.tokens)):
        seq = np.array([p + t[:-1]])
        assert int(st.lens[b]) == seq.shape[1]
        L = seq.shape[1] - res.acceptance_lengths[b][-1]
        pos = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
        _, feats, _ = target(jnp.asarray(seq), pos, target.new_cache(1, 128), pos + 1, taps=draft.config.target_layer_ids)
        fresh = draft.write_context(feats, pos, draft.new_cache(1, 128))
        for layer in range(draft.config.num_layers):
            np.testing.assert_allclose(np.asarray(st.draft_cache.k[layer][b, :, :L]),
                                       np.asarray(fresh.k[layer][0, :, :L]), atol=1e-4)
            np.testing.assert_allclose(np.asarray(st.draft_cache.v[layer][b, :, :L]),
                                       np.asarray(fresh.v[layer][0, :, :L]), atol=1e-4)



@pytest.mark.parametrize("kv_chunk,capacity", [(16, 1000), (512, 8192)], ids=["chunk16-cap1000", "cap8192"])
@pytest.mark.slow
def test_kv_chunks_and_a_generous_capacity_keep_the_tokens(trained, kv_chunk, capacity):
    """The XLA path's KV-chunk attention inside the loop: tiny chunks (rows cross many chunk
    boundaries, a capacity that is no multiple of the chunk) and a capacity far above what the rows
    use give the reference's tokens and acceptance lengths, speculative and plain."""
    from dflash_jax import KernelConfig

    prompts, S = trained["eval_prompts"][:4], 8
    kernels = KernelConfig(attention="xla", xla_kv_chunk=kv_chunk)
    res = generate(trained["target"], trained["draft"], prompts, max_new_tokens=40, block_size=S,
                   capacity=capacity, kernels=kernels, verify_width="block")
    plain = generate(trained["target"], None, prompts, max_new_tokens=40, capacity=capacity, kernels=kernels)
    ref = _reference_run(trained, prompts, 40, S)
    assert res.tokens == plain.tokens == [t for t, _ in ref]
    assert res.acceptance_lengths == [a for _, a in ref]
    assert res.mean_tau > 2.0


def test_speculative_loop_compiles_once_and_is_one_dispatch(random_pair, monkeypatch):
    target, draft = random_pair["target"], random_pair["draft"]
    generate(target, draft, [[1, 2, 3]], max_new_tokens=20, block_size=8, verify_width="block")
    before = decode.compile_count()
    calls = []
    real_call = jax.stages.Compiled.__call__
    monkeypatch.setattr(jax.stages.Compiled, "__call__", lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    for prompt, n, stop in (([4, 5, 6, 7, 8, 9], 17, None), ([9] * 16, 33, [1, 2]), ([3], 9, [7])):
        generate(target, draft, [prompt], max_new_tokens=n, block_size=8, stop_token_ids=stop, verify_width="block")
    assert decode.compile_count() == before
    assert len(calls) == 3  # one device dispatch per generation


@pytest.mark.parametrize("verify_width", ["block", "auto"])
def test_a_call_hashes_each_graph_definition_once(random_pair, monkeypatch, verify_width):
    """One generate() call hashes the target's and the draft's graph definitions once each (a
    36-layer target's hash walks every node, ~7 ms of host time; the call looks its compile key up
    in several caches) and its tokens are unchanged."""
    from flax.nnx import graphlib
    target, draft = random_pair["target"], random_pair["draft"]
    want = generate(target, draft, [[4, 5, 6]], max_new_tokens=12, block_size=8, verify_width=verify_width)
    hashes = []
    real = graphlib.GraphDef.__hash__
    monkeypatch.setattr(graphlib.GraphDef, "__hash__", lambda self: hashes.append(1) or real(self))
    got = generate(target, draft, [[4, 5, 6]], max_new_tokens=12, block_size=8, verify_width=verify_width)
    assert got.tokens == want.tokens
    assert len(hashes) <= 2, f"{len(hashes)} graph-definition hashes in one call"


def test_block_size_one_is_plain_decoding(random_pair):
    prompts = random_prompts(2, 127, seed=5)
    a = generate(random_pair["target"], random_pair["draft"], prompts, max_new_tokens=12, block_size=1, verify_width="block")
    b = generate(random_pair["target"], None, prompts, max_new_tokens=12)
    assert a.tokens == b.tokens and a.block_size == 1


def test_mismatched_drafts_are_refused(random_pair, tmp_path):
    target = random_pair["target"]
    cfg = json.load(open(os.path.join(random_pair["draft_path"], "config.json")))

    def variant(name, **changes):
        d = tmp_path / name
        d.mkdir()
        c = json.loads(json.dumps(cfg))
        for k, v in changes.items():
            if k in ("mask_token_id", "target_layer_ids"):
                c["dflash_config"][k] = v
            else:
                c[k] = v
        json.dump(c, open(d / "config.json", "w"))
        os.symlink(os.path.join(random_pair["draft_path"], "model.safetensors"), d / "model.safetensors")
        return str(d)

    for name, changes, word in [("width", dict(hidden_size=32), "hidden_size"),
                                ("vocab", dict(vocab_size=256), "vocab_size"),
                                ("taps", dict(target_layer_ids=[0, 4]), "target_layer_ids"),
                                ("mask", dict(mask_token_id=128), "mask_token_id"),
                                ("layers", dict(num_target_layers=36), "num_target_layers")]:
        with pytest.raises(ConfigError, match=word):
            load_draft(variant(name, **changes), target=target)
    # a head layout that disagrees with the tensors
    with pytest.raises(ValueError, match="shape"):
        load_draft(variant("heads", num_key_value_heads=4), target=target)
    with pytest.raises(ValueError, match="block_size"):
        generate(target, random_pair["draft"], [[1, 2]], block_size=17, verify_width="block")
    # per-layer attention the reference cannot run either (tests/test_dflash2.py runs the good ones)
    with pytest.raises(ConfigError, match="is_causal"):
        DraftConfig.from_dict({**cfg, "is_causal": "yes"})
    with pytest.raises(ConfigError, match="layer_types"):
        DraftConfig.from_dict({**cfg, "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="sliding_window"):
        DraftConfig.from_dict({**cfg, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": None})
    # block_size is read as the reference reads it: dflash_config first
    assert DraftConfig.from_dict({**cfg, "block_size": 4, "dflash_config": {**cfg["dflash_config"], "block_size": 12}}).block_size == 12
    with pytest.raises(ConfigError, match="dflash_config.mask_token_id"):
        DraftConfig.from_dict({k: v for k, v in cfg.items() if k != "dflash_config"} | {"num_target_layers": 4})


def test_default_taps_formula():
    from dflash_jax.config import default_target_layer_ids
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(28, 1) == (14,)


def test_speculative_loop_exports_for_cuda():
    from dflash_jax import TargetConfig
    cfg = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)
    dcfg = DraftConfig.for_target(cfg, num_layers=1, block_size=8)
    lowered = decode.lower_generate(cfg, dcfg, batch=1, prompt_len=32, max_new_tokens=32, attention_impl="xla")
    # jax.export of the same traced program for the CUDA platform (no GPU needed to lower)
    exported = decode.export_generate(cfg, dcfg, batch=1, prompt_len=32, max_new_tokens=32, attention_impl="xla",
                                      platforms=("cuda",))
    assert exported.platforms == ("cuda",)
    assert "while" in exported.mlir_module() and "stablehlo.while" in lowered.as_text()
    # the program lowered for this host and the one exported for CUDA take and give the same arrays
    shapes = lambda avals: [(a.shape, a.dtype) for a in avals]  # noqa: E731
    assert shapes(jax.tree.leaves(lowered.in_avals)) == shapes(exported.in_avals)
    assert shapes(jax.tree.leaves(lowered.out_info)) == shapes(exported.out_avals)
    assert shapes(exported.out_avals)[0] == ((1, 1024 + 8), jnp.int32)     # the token buffer: capacity + a block


@pytest.mark.slow
def test_on_commit_true_stops_the_loop_with_partial_tokens(random_pair):
    """on_commit returning True stops every running row at that iteration (device side): generate
    returns what was committed (a prefix of the full run), finish reason "stopped"."""
    target, draft = random_pair["target"], random_pair["draft"]
    prompts = random_prompts(2, 127, min_len=4, max_len=12, seed=21)
    full = generate(target, draft, prompts, max_new_tokens=40, block_size=4, verify_width="block")
    seen, calls = [[], []], []

    def on_commit(rows):
        calls.append(1)
        for s, r in zip(seen, rows):
            s.extend(r)
        return len(calls) == 3            # the prefill, then two loop iterations
    res = generate(target, draft, prompts, max_new_tokens=40, block_size=4, on_commit=on_commit, verify_width="block")
    assert len(calls) == 3 and res.tokens == seen
    assert res.finish_reasons == ["stopped", "stopped"]
    for got, want in zip(res.tokens, full.tokens):
        assert 3 <= len(got) < len(want) and got == want[:len(got)]


@pytest.mark.slow
def test_on_commit_exception_reaches_the_caller(random_pair):
    target, draft = random_pair["target"], random_pair["draft"]

    class Halt(Exception):
        pass
    calls = []

    def on_commit(rows):
        calls.append(1)
        if len(calls) == 2:
            raise Halt("user stop")
    with pytest.raises(Halt, match="user stop"):
        generate(target, draft, [[3, 4, 5]], max_new_tokens=30, block_size=4, on_commit=on_commit, verify_width="block")
    assert len(calls) == 2                 # the loop stopped at the iteration that raised


@pytest.mark.slow
def test_streaming_calls_run_in_threads_with_one_program(random_pair):
    """Two streaming generations at once, each with its own on_commit: each callback sees exactly its
    own call's tokens, and the streaming program is compiled once."""
    import threading
    target, draft = random_pair["target"], random_pair["draft"]
    prompts = [[[7, 8, 9]], [[1, 2, 3, 4, 5]]]
    generate(target, draft, prompts[0], max_new_tokens=12, block_size=4, on_commit=lambda rows: None, verify_width="block")
    before = decode.compile_count()
    seen, results = [[], []], [None, None]

    def run(i):
        results[i] = generate(target, draft, prompts[i], max_new_tokens=12, block_size=4,
                              on_commit=lambda rows: seen[i].extend(rows[0]), verify_width="block")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert decode.compile_count() == before
    for i in range(2):
        assert seen[i] == results[i].tokens[0]
        assert results[i].tokens == generate(target, draft, prompts[i], max_new_tokens=12, block_size=4, verify_width="block").tokens
