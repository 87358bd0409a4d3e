"""The fused GPU kernels of short blocks, against the layer's XLA ops, on CPU in the Pallas
interpreter, and their lowering for CUDA:
- the attention prologue (q/k RMSNorm, RoPE, in-place cache writes in one Pallas Triton kernel);
- the residual add + post-attention RMSNorm;
- the sampling search's count and gather kernels.
The whole-path, search and fast-path checks run the interpreter over many grid steps (minutes on a
CPU): they are `slow` (.ci/run runs them); the single-kernel checks stay in the default run."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import DecoderLayer, rope, rope_tables
from dflash_jax.cache import write_rows
from dflash_jax.kernel_config import KernelConfig
from pallas_kernels import Unsupported, fused_layer
from pallas_kernels import sampling as search


def _layer(D, Hq, Hkv, dtype):
    cfg = TargetConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=Hq,
                       num_kv_heads=Hkv, head_dim=D, rope_theta=1e6)
    layer = DecoderLayer(cfg, dtype, nnx.Rngs(0))
    # non-unit norm weights, so a weight applied to the wrong half or head would show
    rng = np.random.default_rng(0)
    layer.q_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    layer.k_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    return layer


def _xla(layer, qkv, positions, k_cache, v_cache, start):
    q, k, v = layer._split_heads(qkv)
    q = rope(layer.q_norm(q), positions, layer.rope_theta)
    k = rope(layer.k_norm(k), positions, layer.rope_theta)
    return q, write_rows(k_cache, k, start), write_rows(v_cache, v, start)


# The interpreter takes seconds a case: a plain `pytest` runs the verify block, `.ci/run` all three.
@pytest.mark.parametrize("B,T,Hq,Hkv,D,C,dtype", [
    pytest.param(1, 1, 8, 2, 128, 64, jnp.float32, marks=pytest.mark.slow),     # plain decode, GQA 4
    (2, 16, 4, 4, 64, 96, jnp.float32),                                        # verify block, MHA
    pytest.param(2, 16, 8, 1, 256, 48, jnp.bfloat16, marks=pytest.mark.slow),  # GQA 8, head_dim 256, bf16
])
@pytest.mark.slow
def test_prologue_matches_the_layer(B, T, Hq, Hkv, D, C, dtype):
    layer = _layer(D, Hq, Hkv, dtype)
    ks = jax.random.split(jax.random.key(1), 3)
    qkv = (jax.random.normal(ks[0], (B, T, (Hq + 2 * Hkv) * D)) * 3).astype(dtype)
    k_cache = jax.random.normal(ks[1], (B, Hkv, C, D)).astype(dtype)
    v_cache = jax.random.normal(ks[2], (B, Hkv, C, D)).astype(dtype)
    # row 1 starts past C - T: both paths clamp it (a finished row still runs the iteration)
    start = jnp.asarray([5, C - T + 7][:B], jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    want = _xla(layer, qkv, positions, k_cache, v_cache, start)
    cos, sin = rope_tables(positions, D, layer.rope_theta)
    got = fused_layer.qk_norm_rope_write(qkv, cos, sin, layer.q_norm.weight[...], layer.k_norm.weight[...],
                                 layer.q_norm.eps, k_cache, v_cache, start, num_heads=Hq, interpret=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, g, w in zip(("q", "k_cache", "v_cache"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol)
    # rows outside the block are untouched
    np.testing.assert_array_equal(np.asarray(got[2][0, :, :5], np.float32), np.asarray(v_cache[0, :, :5], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_prologue_with_context_rows_matches_the_draft_layer(dtype):
    """The draft's form (ctx_rows): Tc context rows' K/V written at ctx_start, then the block's at
    start, which wins where they overlap (row 0: context rows past the pending count run into the
    block, as in DFlashDraft); q from the block rows only. Against the draft layer's XLA ops."""
    B, Tc, T, Hq, Hkv, D, C = 2, 16, 16, 8, 2, 64, 96
    layer = _layer(D, Hq, Hkv, dtype)
    ks = jax.random.split(jax.random.key(2), 3)
    qkv = (jax.random.normal(ks[0], (B, Tc + T, (Hq + 2 * Hkv) * D)) * 3).astype(dtype)
    k_cache = jax.random.normal(ks[1], (B, Hkv, C, D)).astype(dtype)
    v_cache = jax.random.normal(ks[2], (B, Hkv, C, D)).astype(dtype)
    # row 0: context rows 5.. overlap the block; row 1: both starts past C - 16, clamped to 80 as
    # dynamic_update_slice clamps them (a finished row still runs the fixed-shape iteration)
    ctx_start = jnp.asarray([20, 85], jnp.int32)
    start = jnp.asarray([25, 90], jnp.int32)
    ctx_pos = ctx_start[:, None] + jnp.arange(Tc, dtype=jnp.int32)
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    all_pos = jnp.concatenate([ctx_pos, pos], axis=1)
    q, k, v = layer._split_heads(qkv)
    want_q = rope(layer.q_norm(q[:, Tc:]), pos, layer.rope_theta)
    k = rope(layer.k_norm(k), all_pos, layer.rope_theta)
    want_k = write_rows(write_rows(k_cache, k[:, :Tc], ctx_start), k[:, Tc:], start)
    want_v = write_rows(write_rows(v_cache, v[:, :Tc], ctx_start), v[:, Tc:], start)
    cos, sin = rope_tables(all_pos, D, layer.rope_theta)
    got = fused_layer.qk_norm_rope_write(qkv, cos, sin, layer.q_norm.weight[...], layer.k_norm.weight[...],
                                 layer.q_norm.eps, k_cache, v_cache, start, num_heads=Hq,
                                 ctx_rows=Tc, ctx_start=ctx_start, interpret=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, g, w in zip(("q", "k_cache", "v_cache"), got, (want_q, want_k, want_v)):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol)
    with pytest.raises(Unsupported, match="context rows"):
        fused_layer.qk_norm_rope_write(qkv, cos, sin, layer.q_norm.weight[...], layer.k_norm.weight[...],
                               layer.q_norm.eps, k_cache, v_cache, start, num_heads=Hq, ctx_rows=Tc)


def test_prologue_lowers_for_cuda():
    from jax import export
    B, T, Hq, Hkv, D, C = 2, 16, 32, 8, 128, 4096
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    f = lambda qkv, c, s, qw, kw, kc, vc, st: fused_layer.qk_norm_rope_write(qkv, c, s, qw, kw, 1e-6, kc, vc, st,
                                                                       num_heads=Hq)
    exp = export.export(jax.jit(f, donate_argnums=(5, 6)), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        S((B, T, (Hq + 2 * Hkv) * D), bf), S((B, T, D // 2), jnp.float32), S((B, T, D // 2), jnp.float32),
        S((D,), bf), S((D,), bf), S((B, Hkv, C, D), bf), S((B, Hkv, C, D), bf), S((B,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("shape,dtype", [pytest.param((1, 1, 256), jnp.float32, marks=pytest.mark.slow),
                                         ((2, 16, 512), jnp.bfloat16)])
@pytest.mark.slow
def test_add_rmsnorm_matches_the_layer(shape, dtype):
    from dflash_jax.models.layers import RMSNorm
    norm = RMSNorm(shape[-1], 1e-6, dtype)
    norm.weight[...] = jnp.linspace(0.5, 1.5, shape[-1]).astype(dtype)
    kx, ky = jax.random.split(jax.random.key(3))
    x = (jax.random.normal(kx, shape) * 4).astype(dtype)
    y = jax.random.normal(ky, shape).astype(dtype)
    s, n = fused_layer.add_rmsnorm(x, y, norm.weight[...], norm.eps, interpret=True)
    want_s = x + y
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want_s, np.float32))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(n, np.float32), np.asarray(norm(want_s), np.float32), **tol)


def test_add_rmsnorm_lowers_for_cuda():
    from jax import export
    S = jax.ShapeDtypeStruct
    exp = export.export(jax.jit(lambda x, y, w: fused_layer.add_rmsnorm(x, y, w, 1e-6)), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        S((1, 16, 4096), jnp.bfloat16), S((1, 16, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16))
    assert "dflash_add_rmsnorm" in exp.mlir_module()


GPU = KernelConfig(attention="pallas_gpu").resolve()
GPU_INTERPRET = KernelConfig(attention="pallas_gpu_interpret").resolve()


def test_fused_dispatch():
    from dflash_jax.attention import fused_add_norm, fused_prologue
    xla, tpu = KernelConfig("xla").resolve(), KernelConfig("pallas_tpu").resolve()
    assert not fused_prologue(xla, 16, 128) and not fused_prologue(tpu, 16, 128)
    assert fused_prologue(GPU, 16, 128) and fused_prologue(GPU, 1, 128)
    assert not fused_prologue(GPU, 512, 128) and not fused_prologue(GPU, 16, 96)
    assert fused_add_norm(GPU, 16, 4096) and not fused_add_norm(GPU, 16, 2560)
    assert not fused_add_norm(xla, 1, 4096) and not fused_add_norm(GPU, 512, 4096)
    off = KernelConfig("pallas_gpu", fused_layer=False).resolve()
    assert not fused_prologue(off, 16, 128) and not fused_add_norm(off, 16, 4096)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_path_forward_and_loop_match_xla(fused, caplog):
    """The whole GPU layer path in the interpreter (attention kernel; with `fused` the fused
    prologue, add + norm and residuals deferred across layers into the next norm, without it the
    layers' XLA ops around the attention kernel) against the XLA path: the target's verify and decode forwards (hidden
    states, taps, caches), the draft's pass (its prologue with the context rows, deferred
    residuals: hidden states, caches) and a speculative generation's tokens (greedy without `fused`,
    sampled with top-k and top-p with it)."""
    from dflash_jax import DraftConfig, generate, init_draft, init_target
    kernels = KernelConfig(attention="pallas_gpu_interpret", fused_layer=fused)
    cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=64)   # every GPU kernel supports these shapes
    target = init_target(cfg, seed=3, dtype="float32")
    B, C = 2, 64
    prompt = jax.random.randint(jax.random.key(0), (B, 16), 0, 128)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16))
    _, _, cache = target(prompt, pos, target.new_cache(B, C), pos + 1, taps=(0, 1))
    for T in (16, 1):
        toks = jax.random.randint(jax.random.key(T), (B, T), 0, 128)
        p = jnp.asarray([[16], [20]], jnp.int32) + jnp.arange(T, dtype=jnp.int32)
        outs = [jax.jit(lambda t, q, c, k=k: target(t, q, c, q + 1, taps=(0, 1), kernels=k))(toks, p, cache)
                for k in ("xla", kernels)]          # jitted: the interpreter's kernels in one program
        (h0, f0, c0), (h1, f1, c1) = outs
        np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(f1), np.asarray(f0), atol=1e-4, rtol=1e-4)
        for a, b in zip(c1.k + c1.v, c0.k + c0.v):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    draft = init_draft(DraftConfig.for_target(cfg, num_layers=2, block_size=8), seed=4, dtype="float32")
    # the draft's pass (fused prologue with its context rows, residuals deferred across its layers)
    S, n_taps = 8, len(draft.config.target_layer_ids)
    emb = jax.random.normal(jax.random.key(6), (B, S, cfg.hidden_size))
    feats = jax.random.normal(jax.random.key(7), (B, S, n_taps * cfg.hidden_size))
    blk = jnp.asarray([[30], [24]], jnp.int32) + jnp.arange(S, dtype=jnp.int32)
    pend = jnp.asarray([[26], [22]], jnp.int32) + jnp.arange(S, dtype=jnp.int32)  # overlaps the block
    dcache, d_end = draft.new_cache(B, C), jnp.broadcast_to(blk[:, -1:] + 1, (B, S))
    outs = [jax.jit(lambda *xs, k=k: draft(*xs, kernels=k))(emb, blk, feats, pend, dcache, d_end)
            for k in ("xla", kernels)]
    (h0, c0), (h1, c1) = outs
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-4, rtol=1e-4)
    for a, b in zip(c1.k + c1.v, c0.k + c0.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    if not fused:   # the sampling kernels do not depend on fused_layer: one run of them is enough
        # greedy, the XLA path's tokens (a 12-token run at the default capacity before this one
        # proved nothing more: this one runs to the capacity, through the same kernels)
        # a capacity that is no multiple of the kernel's key tile (100: 16 rows at most per tile)
        # still takes the kernels (the cache is allocated to 112 rows), and stops where 100 says
        import logging
        caplog.set_level(logging.WARNING, logger="pallas_kernels.attention")
        got = generate(target, draft, prompts, max_new_tokens=200, kernels=kernels, capacity=100, verify_width="block")
        want = generate(target, draft, prompts, max_new_tokens=200, attention_impl="xla", capacity=100, verify_width="block")
        assert got.tokens == want.tokens and set(got.finish_reasons) == {"capacity"}
        assert "using the XLA path" not in caplog.text
        return
    # sampling with top-k and top-p: the search's passes in the count kernel, same seed, same tokens.
    # (Greedy speculative and plain generation through the fused path against the XLA path's tokens:
    # the one-device runs of test_sharding.py::test_fused_gpu_kernels_on_mesh_match_one_device (fused
    # prologue and add + RMSNorm, head_dim 64); a greedy loop here cost two more loop compiles.)
    kw = dict(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    want = generate(target, draft, prompts, attention_impl="xla", **kw, verify_width="block").tokens
    got = generate(target, draft, prompts, kernels=kernels, **kw, verify_width="block").tokens
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("N,V,bits,shared,weighted", [(3, 300, 32, False, False), (2, 5000, 32, False, True),
                                                      (4, 1100, 20, True, True)])
def test_sampling_search_kernel_matches_xla(N, V, bits, shared, weighted):
    """The threshold search with each pass one count kernel (the previous digit decided inside it)
    finds the same key as the XLA search: counts, weights, an offset, one key row shared by all
    rows (the index phase), budgets at the extremes. Weights are multiples of 1/1024, so both
    paths' sums are exact and the comparison is exact."""
    from dflash_jax import sampling
    rng = np.random.default_rng(N * V)
    hi = 2 ** bits
    keys = jnp.asarray(rng.integers(0, hi, size=(1 if shared else N, V), dtype=np.uint64), jnp.uint32)
    keys = keys.at[..., :7].set(keys[..., 7:8])                   # ties
    weight = jnp.asarray(rng.integers(0, 64, (N, V)) / 1024, jnp.float32) if weighted else None
    total = float(V) if weight is None else float(jnp.max(jnp.sum(weight, axis=1)))
    budget = jnp.asarray(rng.uniform(0.01, 1.0, N) * total, jnp.float32).at[0].set(0.5)
    offset = jnp.asarray(rng.integers(0, 4, N) / 1024, jnp.float32) if shared else jnp.zeros((N,), jnp.float32)
    want = sampling._min_passing(lambda c: offset[:, None] + sampling._masked_sums(keys, c, weight) < budget[:, None],
                                 N, bits)
    got = sampling._kernel_min_passing(keys, weight, offset, budget, bits, GPU_INTERPRET)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("first", [True, False])
def test_sampling_count_pass_lowers_for_cuda(first):
    from jax import export
    S = jax.ShapeDtypeStruct
    V = 151936
    P, chunk = search.count_layout(16, V)
    assert P == 64 and P * chunk >= V
    prev = None if first else (S((16, P, 16), jnp.float32), S((16, P, 16), jnp.int32))

    def f(k, w, off, bud, prev):
        return search.count_pass(k, w, prev, off, bud, P=P, chunk=chunk, shift=24, width=4, prev_shift=28)
    exp = export.export(jax.jit(f), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        S((16, V), jnp.int32), S((16, V), jnp.float32), S((16,), jnp.float32), S((16,), jnp.float32), prev)
    assert "dflash_sampling_count" in exp.mlir_module()


@pytest.mark.slow
def test_sampling_search_kernel_matches_the_reference():
    """top-k, top-p and both, with the search's passes in the count kernel (interpreter), against the
    reference's sort-based `_sampling_probs`, ties at the cut included."""
    import torch
    from dflash.model import _sampling_probs
    from dflash_jax import sampling
    rng = np.random.RandomState(1)
    logits = (rng.randn(2, 3, 700) * 2).astype(np.float32)
    logits[0, 0, 10:20] = logits[0, 0, 5]                          # a tie across the top-k cut
    log_probs = jax.jit(sampling.log_probs, static_argnums=(4, 5))   # one interpret program per mode
    for top_k, top_p in ((7, 1.0), (0, 0.9), (20, 0.5), (1000, 0.3)):
        mode = sampling.mode_for(0.8, top_p, top_k)
        ours = np.exp(np.asarray(log_probs(jnp.asarray(logits), jnp.float32(0.8), jnp.int32(top_k),
                                           jnp.float32(top_p), mode, GPU_INTERPRET)))
        ref = _sampling_probs(torch.tensor(logits), 0.8, top_p, top_k).numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-6, err_msg=f"top_k={top_k} top_p={top_p}")


@pytest.mark.parametrize("N,V,ranks", [(3, 5000, (10, 300, 0)), pytest.param(2, 700, (699, 255), marks=pytest.mark.slow)])
def test_sampling_gather_kernel_collects_the_keys_above(N, V, ranks):
    """gather_above (interpreter) against numpy: the count of keys >= h, and up to GATHER_MAX of
    them with their indices, exact; ties at h, a row past the buffer (count > GATHER_MAX), a row
    of one, the whole vocabulary, and a vocabulary that ends inside a block."""
    rng = np.random.default_rng(V)
    keys = rng.integers(-2**31, 2**31, size=(N, V)).astype(np.int32)
    h = -np.sort(-keys, axis=1)[np.arange(N), list(ranks)]
    keys[0, 5:9] = h[0]                                                      # ties at the cut
    cnt, gk, gi = map(np.asarray, search.gather_above(jnp.asarray(keys), jnp.asarray(h), interpret=True))
    G = search.GATHER_MAX
    assert gk.shape == gi.shape == (N, G)
    for n in range(N):
        above = np.nonzero(keys[n] >= h[n])[0]
        assert cnt[n] == len(above)
        m = min(len(above), G)
        assert len(set(gi[n, :m])) == m and set(gi[n, :m]) <= set(above)
        np.testing.assert_array_equal(gk[n, :m], keys[n, gi[n, :m]])
        assert (gi[n, m:] == V).all()


def test_sampling_gather_kernel_lowers_for_cuda():
    from jax import export
    S = jax.ShapeDtypeStruct
    exp = export.export(jax.jit(search.gather_above), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        S((16, 151936), jnp.int32), S((16,), jnp.int32))
    assert "dflash_sampling_gather" in exp.mlir_module()


@pytest.mark.slow
def test_sampling_fast_path_matches_the_full_searches():
    """The GPU path's shortcut (top-k candidates gathered, then the tie and top-p cuts on them)
    keeps exactly the tokens the full searches keep: top-k
    alone and with top-p, ties inside and across the cut, a row whose tie overflows the gather
    buffer (the whole batch takes the full searches then), -inf scores. The gathered cut does not
    depend on the order the kernel's atomics put the candidates in."""
    from dflash_jax import sampling
    rng = np.random.RandomState(3)
    V = 1200
    logits = (rng.randn(4, V) * 2).astype(np.float32)
    logits[0, 10:20] = logits[0, 5]                                 # tie across the top-k cut
    logits[1, ::7] = -np.inf
    wide = logits.copy()
    wide[2, :300] = 9.0                                             # 300 tied at the top: overflow
    # jitted (top_k, top_p traced): one interpret-mode program per (mode, path), not eager kernels
    keep = jax.jit(sampling._keep_mask, static_argnums=(3, 4), static_argnames=("fast",))
    for lg, settings in ((logits, ((7, 1.0), (20, 0.97), (256, 0.9), (2, 0.3))), (wide, ((20, 0.5),))):
        for top_k, top_p in settings:
            mode = sampling.mode_for(1.0, top_p, top_k)
            args = (jnp.asarray(lg), jnp.int32(top_k), jnp.float32(top_p), mode)
            want = np.asarray(keep(*args, GPU_INTERPRET, fast=False))
            got = np.asarray(keep(*args, GPU_INTERPRET))
            np.testing.assert_array_equal(got, want, err_msg=f"top_k={top_k} top_p={top_p}")
            np.testing.assert_array_equal(want, np.asarray(keep(*args)))
            assert (got.sum(1) <= top_k).all() if lg is logits else True
    # order independence of the gathered cut
    scores = jnp.asarray(logits[:2, :40])
    gk = sampling._score_key(scores)
    gi = jnp.broadcast_to(jnp.arange(40), (2, 40))
    perm = rng.permutation(40)
    n = jnp.asarray([40, 40])
    for top_k, top_p in ((5, 0.9), (30, 0.6), (40, 0.999)):
        a = sampling._gathered_cut(gk, gi, n, jnp.int32(top_k), jnp.float32(top_p), "filtered")
        b = sampling._gathered_cut(gk[:, perm], gi[:, perm], n, jnp.int32(top_k), jnp.float32(top_p), "filtered")
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_search_kernel_dispatch():
    from dflash_jax import sampling
    assert sampling.search_kernel(GPU) and sampling.search_kernel(GPU_INTERPRET)
    assert not sampling.search_kernel(KernelConfig("xla").resolve()) and not sampling.search_kernel(None)
    assert not sampling.search_kernel(KernelConfig("pallas_tpu").resolve())
    assert not sampling.search_kernel(KernelConfig("pallas_gpu", sampling_kernels=False).resolve())


@pytest.mark.slow
def test_two_kernel_configs_in_one_process_are_two_programs():
    """KernelConfig is part of the compile key: the fused layer kernels on and off in one process
    compile two programs, each with its own kernels (the fused ones appear only in the first),
    and both give the XLA path's tokens."""
    from dflash_jax import DraftConfig, decode, generate, init_draft, init_target
    cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64)
    target = init_target(cfg, seed=3, dtype="float32")
    draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=4), seed=4, dtype="float32")
    prompts, kw = [[5, 6, 7, 8, 9]], dict(max_new_tokens=6, capacity=64)
    on = KernelConfig(attention="pallas_gpu_interpret")
    off = KernelConfig(attention="pallas_gpu_interpret", fused_layer=False)
    before = decode.compile_count()
    texts = [decode.compiled_program(target, draft, prompts, kernels=k, **kw, verify_width="block")[0].as_text() for k in (on, off)]
    assert decode.compile_count() == before + 2
    assert "dflash_add_rmsnorm" in texts[0] and "dflash_add_rmsnorm" not in texts[1]
    assert "dflash_qk_norm_rope_write" in texts[0] and "dflash_qk_norm_rope_write" not in texts[1]
    assert "dflash_block_attention_gpu" in texts[1]          # the attention kernel stays in both
    want = generate(target, draft, prompts, kernels=KernelConfig(attention="xla"), **kw, verify_width="block").tokens
    for k in (on, off):
        res = generate(target, draft, prompts, kernels=k, **kw, verify_width="block")
        assert res.tokens == want and res.compile_time_s == 0.0
    assert decode.compile_count() == before + 3              # the XLA program; no recompiles
    with pytest.raises(ValueError, match="disagrees"):
        generate(target, draft, prompts, kernels=on, attention_impl="xla", **kw, verify_width="block")


def test_one_row_small_projections_lower_to_a_two_row_dot_on_cuda():
    """layers.linear: one row times a matrix under SMALL_DOT elements is a [2, K] dot on CUDA (XLA:GPU
    would rewrite the [K] x [K, N] dot as a multiply writing a [K, N] product and a reduce), of the
    same value; more rows, a larger matrix or another platform keep the plain dot."""
    from jax import export

    from dflash_jax.models.layers import SMALL_DOT, _two_rows, linear
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 256), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (256, 96), jnp.float32)
    # the same value, not the same bits: XLA:CPU may sum a [2, K] dot in another order than a [1, K]
    # one (it does under the tests' cheap codegen flags)
    np.testing.assert_allclose(np.asarray(_two_rows(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-5)

    def dots(f, *shapes, platform="cuda"):
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
        text = export.export(jax.jit(f), platforms=[platform])(*args).mlir_module()
        return re.findall(r"stablehlo.dot_general[^\n]*\(tensor<([\dx]+)xbf16>", text)

    assert dots(linear, (1, 1, 4096), (4096, 2048)) == ["2x4096"]                 # o-projection, 8.4M
    assert dots(linear, (1, 4096), (4096, 2048), platform="cpu") == ["1x4096"]
    assert dots(linear, (2, 1, 4096), (4096, 2048)) == ["2x1x4096"]               # two rows: as written
    assert 4096 * 4096 >= SMALL_DOT and dots(linear, (1, 1, 4096), (4096, 4096)) == ["1x1x4096"]
