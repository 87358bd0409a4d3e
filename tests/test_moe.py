"""Qwen3-MoE targets (issue 36): the grouped matmul against its oracle, the router and the whole
model against transformers' Qwen3MoeForCausalLM, the per-expert checkpoint loader, and the DFlash
loop with an MoE target against the reference `dflash_generate`."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
from tests.checkpoints import random_prompts, reference_generate, write_draft, write_moe_target
from tests.doubles import truth_proposer
from tests.pairs import assert_width_result, widths

from dflash_jax import KernelConfig, generate, load_draft, load_target
from dflash_jax.config import PRESETS, Qwen3MoeConfig
from dflash_jax.models import read_config
from dflash_jax.models.moe import route
from pallas_kernels.moe import gmm, gmm_reference
from pallas_kernels.moe.tpu import group_metadata


# ------------------------------------------------------------------------------- grouped matmul

@pytest.mark.parametrize("sizes", [[3, 0, 7, 0, 10], [0, 0, 0, 0, 0], [0, 20, 0, 0, 0], [2, 2, 2, 2, 2]])
@pytest.mark.parametrize("impl", ["xla", "pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_gmm_matches_reference(sizes, impl):
    """Groups of uneven size, empty groups, rows past the last group (zero), M not a tile multiple."""
    rng = np.random.RandomState(len(sizes) + sum(sizes))
    x = jnp.asarray(rng.randn(22, 32), jnp.float32)
    w = jnp.asarray(rng.randn(5, 32, 64), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(gmm(x, w, gs, impl))
    want = np.asarray(gmm_reference(x, w, gs))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not got[sum(sizes):].any()


def test_gmm_pallas_bf16_many_tiles():
    """bf16, several row tiles (groups straddling tile edges) and column tiles: = the XLA path."""
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(300, 64), jnp.bfloat16)
    w = jnp.asarray(rng.randn(6, 64, 256) * 0.1, jnp.bfloat16)
    gs = jnp.asarray([100, 0, 50, 0, 0, 130], jnp.int32)
    from pallas_kernels.moe import tpu
    got = tpu.gmm(x, w, gs, tm=32, tn=128, interpret=True)
    want = gmm(x, w, gs, "xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def _int8_oracle(x, q, scale, sizes):
    """NumPy: each group's rows times its dequantized matrix q[g] * scale[g], float64; rows past the
    groups zero."""
    x = np.asarray(x, np.float64)
    w = np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None, :]
    out = np.zeros((x.shape[0], w.shape[2]))
    r = 0
    for g, n in enumerate(sizes):
        out[r:r + n] = x[r:r + n] @ w[g]
        r += n
    return out


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [[3, 0, 7, 0, 10], [0, 0, 0, 0, 0], [0, 20, 0, 0, 0]])
def test_gmm_kernels_read_int8_experts_like_the_dequantize_oracle(sizes, dtype, impl):
    """int8 experts (q [G, K, N], float32 scale [G, N]) read by the TPU and GPU kernels themselves
    (interpreted): the groups' rows times q[g] * scale[g]; several row and column tiles (and K
    steps on the GPU), empty groups, rows past the groups zero. bf16 rows: within one bf16
    rounding of the float64 product."""
    from dflash_jax.quantize import quantize_int8
    from pallas_kernels.moe import gpu, tpu
    rng = np.random.RandomState(sum(sizes) + 7)
    w = quantize_int8(jnp.asarray(rng.randn(5, 64, 256) * rng.uniform(0.1, 3, size=(5, 1, 256)), jnp.float32))
    x = jnp.asarray(rng.randn(22, 64), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    if impl == "gpu":
        got = gpu.gmm(x, w.q, gs, scale=w.scale, bn=64, bk=32, interpret=True)
        sw = np.asarray(gpu.gmm(x, w.q, gs, scale=w.scale, swiglu=True, bn=64, bk=32, interpret=True), np.float64)
        h = _int8_oracle(x, w.q, w.scale, sizes)
        want_sw = h[:, :128] / (1 + np.exp(-h[:, :128])) * h[:, 128:]
        tol = 1e-4 * max(1.0, np.abs(want_sw).max()) if dtype == jnp.float32 else 2 ** -6 * np.abs(want_sw).max()
        assert np.abs(sw - want_sw).max() <= tol, np.abs(sw - want_sw).max()
    else:
        got = tpu.gmm(x, w.q, gs, scale=w.scale, tm=16, tn=128, interpret=True)
    assert got.dtype == dtype and got.shape == (22, 256)
    got = np.asarray(got, np.float64)
    want = _int8_oracle(x, w.q, w.scale, sizes)
    tol = 1e-5 * max(1.0, np.abs(want).max()) if dtype == jnp.float32 else 2 ** -8 * np.abs(want).max() + 1e-6
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    assert not got[sum(sizes):].any()
    # through the dispatcher; an impl that does not read int8 says so
    from pallas_kernels._common import Unsupported
    kernel = gpu.gmm if impl == "gpu" else tpu.gmm
    np.testing.assert_array_equal(
        np.asarray(gmm(x, w.q, gs, f"pallas_{impl}_interpret", scale=w.scale), np.float64),
        np.asarray(kernel(x, w.q, gs, scale=w.scale, interpret=True), np.float64))
    with pytest.raises(Unsupported, match="int8"):
        gmm(x, w.q, gs, "xla", scale=w.scale)


@pytest.mark.parametrize("impl,N", [("pallas_tpu_interpret", 5), ("pallas_gpu_interpret", 5),
                                    ("pallas_gpu_interpret", 1)])
@pytest.mark.parametrize("first_expert", [None, 4])
def test_int8_experts_run_in_the_kernels(first_expert, impl, N):
    """models.moe.experts with Int8Weight experts and moe_gmm on a Pallas kernel (interpreted; the
    GPU's one-token path, gmm_rows, at N = 1): the int8 kernel is in the program (not XLA's
    ragged_dot) and the outputs are the NumPy oracle's on the dequantized experts; an expert-parallel
    shard (first_expert 4: experts 4..7 of 8) adds only its own experts' outputs."""
    from dflash_jax.models.moe import experts
    from dflash_jax.quantize import quantize_int8
    rng = np.random.default_rng(3)
    E, H, I, k = 8, 128, 128, 2
    gu = quantize_int8(jnp.asarray(rng.normal(size=(E, H, 2 * I)) * H ** -0.5, jnp.float32))
    down = quantize_int8(jnp.asarray(rng.normal(size=(E, I, H)) * I ** -0.5, jnp.float32))
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), axis=1), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, size=(N, k)), jnp.float32)
    gu_w, down_w = np.asarray(gu.dequantize(), np.float64), np.asarray(down.dequantize(), np.float64)
    keep = np.ones(E, bool) if first_expert is None else (np.arange(E) >= first_expert)
    want = np.zeros((N, H))
    for n in range(N):
        for wt, e in zip(np.asarray(weights[n], np.float64), np.asarray(idx[n])):
            if keep[e]:
                h = np.asarray(x[n], np.float64) @ gu_w[e]
                want[n] += wt * ((h[:I] / (1 + np.exp(-h[:I])) * h[I:]) @ down_w[e])
    if first_expert is not None:      # the shard holds experts [4, 8) only
        gu = type(gu)(gu.q[first_expert:], gu.scale[first_expert:])
        down = type(down)(down.q[first_expert:], down.scale[first_expert:])

    def f(x, w, i, gu, down):
        return experts(x, w, i, gu, down, gmm_impl=impl, first_expert=first_expert, ascending=True)

    name = "dflash_gmm_gpu_int8" if "gpu" in impl else "dflash_gmm_tpu_int8"
    assert str(jax.make_jaxpr(f)(x, weights, idx, gu, down)).count(name) == 2
    got = np.asarray(f(x, weights, idx, gu, down), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _fp8_experts(rng, G: int, K: int, N: int, block, std: float = 1.0):
    """Random FP8 experts as an FP8 checkpoint loads them (quantize.Fp8BlockWeight): float8_e4m3fn q
    [G, K, N] and block scales [G, ceil(K / bk), ceil(N / bn)] spread over 2^-8..2^-2 (times std),
    so neighbouring blocks differ."""
    import ml_dtypes

    from dflash_jax.quantize import Fp8BlockWeight
    q = (rng.normal(size=(G, K, N)) * 40).astype(ml_dtypes.float8_e4m3fn)
    s = np.exp2(rng.uniform(-8, -2, size=(G, -(-K // block[0]), -(-N // block[1])))) * std
    return Fp8BlockWeight(jnp.asarray(q), jnp.asarray(s, jnp.float32), block)


def _fp8_dequantized(w):
    """NumPy float64: q * each weight's block scale."""
    (bk, bn), (K, N) = w.block, w.shape[1:]
    s = np.repeat(np.repeat(np.asarray(w.scale, np.float64), bk, axis=1)[:, :K], bn, axis=2)[:, :, :N]
    return np.asarray(w.q, np.float64) * s


def _grouped_oracle(x, w, sizes):
    x, out, r = np.asarray(x, np.float64), np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(sizes):
        out[r:r + n] = x[r:r + n] @ w[g]
        r += n
    return out


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_gmm_kernels_read_fp8_experts_like_the_dequantize_oracle(impl):
    """FP8 experts (float8 q [G, K, N], block scales [G, K / bk, N / bn]; Qwen's 128 x 128 blocks and
    a fused gate | up's per-column bn = 1) read by the TPU and GPU kernels themselves (interpreted),
    float32 and bf16 rows, two K blocks whose scales differ: the groups' rows times the NumPy
    dequantized matrices; empty groups, rows past the groups zero. TPU: column tiles inside one
    block and spanning two; GPU: K steps of a quarter block, the fused SwiGLU, the one-token
    gmm_rows. Tiles that straddle a block are refused."""
    from pallas_kernels._common import Unsupported
    from pallas_kernels.moe import gpu, tpu
    rng = np.random.default_rng(11)
    sizes = [3, 0, 7, 0, 10]
    gs = jnp.asarray(sizes, jnp.int32)
    for block, dtype, tn in (((128, 1), jnp.bfloat16, 128), ((128, 128), jnp.bfloat16, 256),
                             ((128, 128), jnp.float32, 128)):
        w = _fp8_experts(rng, 5, 256, 256, block)
        wd = _fp8_dequantized(w)
        x = jnp.asarray(rng.normal(size=(22, 256)), dtype)
        want = _grouped_oracle(x, wd, sizes)
        if impl == "gpu":
            got = gpu.gmm(x, w.q, gs, scale=w.scale, block=block, bn=64, bk=32, interpret=True)
        else:
            got = tpu.gmm(x, w.q, gs, scale=w.scale, block=block, tm=16, tn=tn, interpret=True)
        assert got.dtype == dtype and got.shape == (22, 256)
        got = np.asarray(got, np.float64)
        # float32: the float64 product up to float32 sums; bf16: one rounding of the output
        tol = 1e-5 * np.abs(want).max() if dtype == jnp.float32 else 2 ** -8 * np.abs(want).max()
        assert np.abs(got - want).max() <= tol, (dtype, np.abs(got - want).max())
        assert not got[sum(sizes):].any()
    if impl == "gpu":       # the last case's float32 rows and 128 x 128 blocks
        h = want
        sw = np.asarray(gpu.gmm(x, w.q, gs, scale=w.scale, block=block, swiglu=True, bn=32, bk=64, interpret=True))
        want_sw = h[:, :128] / (1 + np.exp(-h[:, :128])) * h[:, 128:]
        np.testing.assert_allclose(sw, want_sw, rtol=1e-4, atol=1e-5 * np.abs(want_sw).max())
        g = jnp.asarray([2, -1, 4], jnp.int32)
        rows = np.asarray(gpu.gmm_rows(x[:1], w.q, g, shared=True, scale=w.scale, block=block, interpret=True))
        want_rows = np.stack([np.asarray(x[0], np.float64) @ wd[e] * (e >= 0) for e in (2, -1, 4)])
        np.testing.assert_allclose(rows, want_rows, rtol=1e-4, atol=1e-5 * np.abs(want_rows).max())
        with pytest.raises(Unsupported, match="straddle"):
            gpu.gmm(x, w.q, gs, scale=w.scale, block=block, bn=64, bk=256, interpret=True)
    else:
        with pytest.raises(Unsupported, match="FP8 block"):
            tpu.gmm(x, w.q, gs, scale=jnp.ones((5, 2, 3)), block=(128, 96), tn=128, interpret=True)
    # XLA's gmm does not read 8-bit weights (the dispatcher to the kernels: the experts test below)
    with pytest.raises(Unsupported, match="8-bit"):
        gmm(x, w.q, gs, "xla", scale=w.scale, block=block)


@pytest.mark.parametrize("impl,N,first_expert", [("pallas_tpu_interpret", 5, 4), ("pallas_gpu_interpret", 5, None),
                                                 ("pallas_gpu_interpret", 1, 4)])
def test_fp8_experts_run_in_the_kernels_like_the_xla_path(impl, N, first_expert):
    """models.moe.experts with an FP8 checkpoint's experts (gate | up per column, bn = 1; down in 128 x
    128 blocks; two K blocks each) and moe_gmm on a Pallas kernel (interpreted; the GPU's one-token
    gmm_rows at N = 1): the FP8 kernel is in the program twice, and the outputs equal the XLA path
    (moe_gmm="xla": the experts dequantized, then ragged_dot) and the NumPy oracle; an
    expert-parallel shard (first_expert 4: experts 4..7 of 8) adds only its own experts' outputs."""
    from dflash_jax.models.moe import experts
    from dflash_jax.quantize import Fp8BlockWeight
    rng = np.random.default_rng(5)
    E, H, I, k = 8, 256, 256, 2
    gu = _fp8_experts(rng, E, H, 2 * I, (128, 1), std=H ** -0.5 * 4)
    down = _fp8_experts(rng, E, I, H, (128, 128), std=I ** -0.5 * 4)
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), axis=1), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, size=(N, k)), jnp.float32)
    gu_w, down_w = _fp8_dequantized(gu), _fp8_dequantized(down)
    keep = np.ones(E, bool) if first_expert is None else (np.arange(E) >= first_expert)
    want = np.zeros((N, H))
    for n in range(N):
        for wt, e in zip(np.asarray(weights[n], np.float64), np.asarray(idx[n])):
            if keep[e]:
                h = np.asarray(x[n], np.float64) @ gu_w[e]
                want[n] += wt * ((h[:I] / (1 + np.exp(-h[:I])) * h[I:]) @ down_w[e])
    if first_expert is not None:      # the shard holds experts [4, 8) only
        gu, down = (Fp8BlockWeight(w.q[first_expert:], w.scale[first_expert:], w.block) for w in (gu, down))

    def f(x, w, i, gu, down, impl=impl):
        return experts(x, w, i, gu, down, gmm_impl=impl, first_expert=first_expert, ascending=True)

    name = "dflash_gmm_gpu_fp8" if "gpu" in impl else "dflash_gmm_tpu_fp8"
    assert str(jax.make_jaxpr(f)(x, weights, idx, gu, down)).count(name) == 2
    got = np.asarray(jax.jit(f)(x, weights, idx, gu, down), np.float64)
    xla = np.asarray(jax.jit(functools.partial(f, impl="xla"))(x, weights, idx, gu, down), np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, xla, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [[0, 9, 0, 0, 3, 0, 0, 20], [0, 0, 0, 0, 0, 0, 32, 0], [4] * 8])
def test_gmm_gpu_kernel_matches_ragged_dot(sizes, dtype):
    """The Triton kernel interpreted on CPU = XLA's ragged_dot: empty groups, all rows in one group,
    a group over several 16-row tiles (bm), several K steps and column tiles, rows past the groups
    (zero); and the fused gate|up + SwiGLU = ragged_dot then SwiGLU."""
    from pallas_kernels.moe import gpu, gmm_swiglu
    rng = np.random.RandomState(sum(sizes))
    x = jnp.asarray(rng.randn(36, 64), dtype)
    w = jnp.asarray(rng.randn(8, 64, 128) * 0.2, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=3e-2, rtol=3e-2)
    got = gpu.gmm(x, w, gs, bn=32, bk=16, interpret=True)
    want = gmm(x, w, gs, "xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    assert not np.asarray(got, np.float32)[sum(sizes):].any()
    got = gmm_swiglu(x, w, gs, "pallas_gpu_interpret")
    want = gmm_swiglu(x, w, gs, "xla")
    assert got.shape == (36, 64) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_rows_gpu_kernel_matches_each_rows_matrix(dtype):
    """gmm_rows (every row its own group: the one-token decode path) through the Triton kernel,
    interpreted, and through the gather fallback = each row times its own group's matrix: a group
    chosen twice, a skipped row (-1: zero), plain and fused gate|up + SwiGLU."""
    from pallas_kernels.moe import gmm_rows, gmm_swiglu
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(8, 64), dtype)
    w = jnp.asarray(rng.randn(8, 64, 128) * 0.2, dtype)
    group = jnp.asarray([5, 0, -1, 7, 5, 2, 3, 1], jnp.int32)
    want = np.stack([np.zeros(128, np.float32) if g < 0 else
                     np.asarray(x[r].astype(jnp.float32) @ w[g].astype(jnp.float32))
                     for r, g in enumerate(group.tolist())])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == jnp.float32 else dict(atol=5e-2, rtol=5e-2)
    for impl in ("pallas_gpu_interpret", "xla"):
        got = gmm_rows(x, w, group, impl)
        assert got.shape == (8, 128) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)
        assert not np.asarray(got, np.float32)[2].any()
        # fused SwiGLU = the grouped path's, row by row (one row per group)
        sw = np.asarray(gmm_rows(x, w, group, impl, swiglu=True), np.float32)
        for r, g in enumerate(group.tolist()):
            if g >= 0:
                ref = gmm_swiglu(x[r:r + 1], w[g:g + 1], jnp.asarray([1], jnp.int32), "xla")
                np.testing.assert_allclose(sw[r], np.asarray(ref, np.float32)[0], **tol)
        assert not sw[2].any()
        # the one-token chain: one shared row, each projection's raw buffer into the next
        raw = gmm_rows(x[3:4], w, group, impl, swiglu=True, shared=True, raw=True)
        y = np.asarray(gmm_rows(raw, w[:, :64, :], group, impl, raw=True), np.float32)
        a1 = gmm_rows(jnp.broadcast_to(x[3:4], (8, 64)), w, group, impl, swiglu=True)
        y1 = np.asarray(gmm_rows(a1, w[:, :64, :], group, impl), np.float32)
        live = np.asarray(group) >= 0
        np.testing.assert_allclose(y[:8][live], y1[live], **tol)


@pytest.mark.parametrize("first_expert", [0, 4])
def test_one_token_experts_equal_the_grouped_path(first_expert):
    """One token (a B = 1 decode step) on the GPU kernel takes the no-sort path (a row per choice);
    its output = the grouped path's (ragged_dot), also on an expert-parallel shard holding experts
    [first_expert, first_expert + 8) of 16, where some choices belong to another shard (zero)."""
    from dflash_jax.models.moe import experts
    rng = np.random.RandomState(first_expert)
    x = jnp.asarray(rng.randn(1, 32), jnp.float32)
    gate_up = jnp.asarray(rng.randn(8, 32, 96) * 0.2, jnp.float32)
    down = jnp.asarray(rng.randn(8, 48, 32) * 0.2, jnp.float32)
    idx = jnp.asarray([[9, 2, 5, 14]], jnp.int32)
    w = jnp.asarray([[0.4, 0.3, 0.2, 0.1]], jnp.float32)
    got = experts(x, w, idx, gate_up, down, gmm_impl="pallas_gpu_interpret", first_expert=first_expert)
    want = experts(x, w, idx, gate_up, down, gmm_impl="xla", first_expert=first_expert)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(want)).sum() > 0


def test_gmm_gpu_grid_is_touched_experts_only():
    """The slots walk only the non-empty groups: their ids, first rows and sizes, and the count
    the kernel stops at (the grid has min(G, M) slots)."""
    from pallas_kernels.moe.gpu import group_list
    meta = np.asarray(group_list(jnp.asarray([0, 4, 0, 0, 2, 0, 1, 0], jnp.int32), slots=7))
    assert meta[3, 0] == 3
    assert meta[:3, :3].T.tolist() == [[1, 0, 4], [4, 4, 2], [6, 6, 1]]



@pytest.mark.parametrize("R,G", [(64, 128), (128, 8), (1024, 128), (7, 4), (2048, 128)])
def test_grouping_by_comparison_equals_a_stable_sort(R, G):
    """models.moe.group_rows (ranks by an [R, R] compare-and-count up to GROUP_BY_COMPARE rows,
    the sort past it) = numpy's stable argsort, its inverse and bincount, with the 'not here' id G;
    group_list's compare-and-count = the non-empty groups in id order, at 128 and 256 groups."""
    from dflash_jax.models.moe import GROUP_BY_COMPARE, group_rows
    from pallas_kernels.moe.gpu import group_list
    r = np.random.RandomState(R)
    flat = r.randint(0, G + 1, R).astype(np.int32)
    rows, back, sizes = map(np.asarray, jax.jit(group_rows, static_argnums=1)(jnp.asarray(flat), G))
    assert (R <= GROUP_BY_COMPARE) == (R < 2048)
    np.testing.assert_array_equal(rows, np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(rows[back], np.arange(R))
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=G + 1)[:G])
    for groups, slots in ((G, min(G, R)), (256, 128)):
        sz = (r.randint(1, 4, groups) * (r.rand(groups) < 0.3)).astype(np.int32)
        meta = np.asarray(group_list(jnp.asarray(sz), slots))
        live = np.nonzero(sz)[0][:slots]
        assert (meta[3] == np.count_nonzero(sz)).all() and (meta[0] < groups).all()
        np.testing.assert_array_equal(meta[0, :len(live)], live)
        np.testing.assert_array_equal(meta[1, :len(live)], (np.cumsum(sz) - sz)[live])
        np.testing.assert_array_equal(meta[2, :len(live)], sz[live])

def test_gmm_gpu_kernel_lowers_for_cuda():
    """Qwen3-Coder-30B-A3B shapes (128 experts, H 2048, I 768) through the Triton lowering: the
    fused gate|up and the down projection, at decode (16 tokens) and prefill (512 tokens x top-8:
    64-row tiles) rows. The pipeline's shared memory stays under the H200's 227 KiB: prefill's
    first tiles asked 288 KiB and did not launch (session 26's H200 call)."""
    from jax import export
    from pallas_kernels.moe import gpu
    S = jax.ShapeDtypeStruct
    for M in (128, 4096):
        for K, N, sw in ((2048, 1536, True), (768, 2048, False)):
            for dt in (jnp.bfloat16, jnp.float32):
                bm, bn, bk = gpu.plan_tiles(M, K, N // 2 if sw else N, jnp.dtype(dt).itemsize, sw, 3,
                                            slots=min(128, M))
                assert gpu.smem_bytes(bm, bn, bk, jnp.dtype(dt).itemsize, sw, 3) <= 227 * 1024 - 32 * 1024
            exp = export.export(jax.jit(lambda x, w, g: gpu.gmm(x, w, g, swiglu=sw)), platforms=["cuda"],
                                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
                S((M, K), jnp.bfloat16), S((128, K, N), jnp.bfloat16), S((128,), jnp.int32))
            assert "dflash_gmm_gpu" in exp.mlir_module()
    cuda = dict(platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    for K, N, sw in ((2048, 1536, True), (768, 2048, False)):     # the one-token path: 8 rows, 8 groups
        exp = export.export(jax.jit(lambda x, w, g: gpu.gmm_rows(x, w, g, swiglu=sw)), **cuda)(
            S((8, K), jnp.bfloat16), S((128, K, N), jnp.bfloat16), S((8,), jnp.int32))
        assert "dflash_gmm_gpu" in exp.mlir_module()
    # as the one-token layer runs it: routing kernel, a shared row, raw buffers chained
    def layer(logits, x, gu, dn):
        w, i = gpu.route(logits, k=8, norm=True)
        a = gpu.gmm_rows(x, gu, i[0], swiglu=True, shared=True, raw=True)
        return gpu.gmm_rows(a, dn, i[0], raw=True)[:8] * w[0][:, None]
    for E in (128, 256):
        mod = export.export(jax.jit(layer), **cuda)(S((1, E), jnp.bfloat16), S((1, 2048), jnp.bfloat16),
                                                    S((E, 2048, 1536), jnp.bfloat16), S((E, 768, 2048), jnp.bfloat16)
                                                    ).mlir_module()
        assert mod.count("dflash_gmm_gpu") >= 2 and "dflash_moe_route" in mod


def test_gmm_gpu_int8_kernel_lowers_for_cuda():
    """int8 experts at Qwen3-Coder-30B-A3B shapes through the Triton lowering: the grouped kernel
    (a 16-token verify's 128 rows, fused gate|up and down) and the one-token gmm_rows chain."""
    from jax import export
    from pallas_kernels.moe import gpu
    S = jax.ShapeDtypeStruct
    cuda = dict(platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    for K, N, sw in ((2048, 1536, True), (768, 2048, False)):
        mod = export.export(jax.jit(lambda x, w, g, s: gpu.gmm(x, w, g, swiglu=sw, scale=s)), **cuda)(
            S((128, K), jnp.bfloat16), S((128, K, N), jnp.int8), S((128,), jnp.int32), S((128, N), jnp.float32)
        ).mlir_module()
        assert "dflash_gmm_gpu_int8" in mod

    def layer(x, gu, gs, dn, ds, i):
        a = gpu.gmm_rows(x, gu, i, swiglu=True, shared=True, raw=True, scale=gs)
        return gpu.gmm_rows(a, dn, i, raw=True, scale=ds)[:8]
    mod = export.export(jax.jit(layer), **cuda)(S((1, 2048), jnp.bfloat16), S((128, 2048, 1536), jnp.int8),
                                                S((128, 1536), jnp.float32), S((128, 768, 2048), jnp.int8),
                                                S((128, 2048), jnp.float32), S((8,), jnp.int32)).mlir_module()
    assert mod.count("dflash_gmm_gpu_int8") >= 2 and "dflash_gmm_gpu\"" not in mod


def test_gmm_gpu_fp8_kernel_lowers_for_cuda():
    """FP8 experts at Qwen3-Coder-30B-A3B-FP8's shapes (128 x 128 blocks) through the Triton lowering:
    the grouped kernel (a 16-token verify's 128 rows, fused gate|up and down) and the one-token
    gmm_rows chain (with per-column scales, bn = 1, on gate|up)."""
    from jax import export
    from pallas_kernels.moe import gpu
    S, f8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn
    cuda = dict(platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    for K, N, sw in ((2048, 1536, True), (768, 2048, False)):
        mod = export.export(jax.jit(lambda x, w, g, s: gpu.gmm(x, w, g, swiglu=sw, scale=s, block=(128, 128))),
                            **cuda)(S((128, K), jnp.bfloat16), S((128, K, N), f8), S((128,), jnp.int32),
                                    S((128, K // 128, N // 128), jnp.float32)).mlir_module()
        assert "dflash_gmm_gpu_fp8" in mod

    def layer(x, gu, gs, dn, ds, i):
        a = gpu.gmm_rows(x, gu, i, swiglu=True, shared=True, raw=True, scale=gs, block=(128, 1))
        return gpu.gmm_rows(a, dn, i, raw=True, scale=ds, block=(128, 128))[:8]
    mod = export.export(jax.jit(layer), **cuda)(S((1, 2048), jnp.bfloat16), S((128, 2048, 1536), f8),
                                                S((128, 16, 1536), jnp.float32), S((128, 768, 2048), f8),
                                                S((128, 6, 16), jnp.float32), S((8,), jnp.int32)).mlir_module()
    assert mod.count("dflash_gmm_gpu_fp8") >= 2 and "dflash_gmm_gpu\"" not in mod


def test_group_metadata_schedules_only_non_empty_groups():
    """The TPU kernel's weight tiles follow the schedule: an expert no row chose is never visited."""
    sizes = jnp.asarray([5, 0, 0, 20, 0, 3, 0, 0], jnp.int32)       # rows [0,5) [5,25) [25,28)
    starts, ends, group, tile, active = group_metadata(sizes, m_tiles=4, tm=8)
    n = int(active[0])
    steps = list(zip(np.asarray(group)[:n].tolist(), np.asarray(tile)[:n].tolist()))
    assert steps == [(0, 0), (3, 0), (3, 1), (3, 2), (3, 3), (5, 3)]
    # the padding steps repeat the last one (same blocks: no copy)
    assert set(np.asarray(group)[n:].tolist()) <= {5} and set(np.asarray(tile)[n:].tolist()) <= {3}


# --------------------------------------------------------------------------------------- router

@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers(norm):
    """XLA's routing (descending, as HF returns it) and the GPU routing kernel, interpreted
    (ascending ids: the order the experts are added in) = transformers' Qwen3MoeTopKRouter, on 50
    rows (the kernel's 16-row blocks, the last one partial) and on one row (a B = 1 decode)."""
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    torch.manual_seed(0)
    r = Qwen3MoeTopKRouter(HFConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm))
    with torch.no_grad():
        r.weight.normal_()
        x = torch.randn(50, 32)
        _, w_ref, i_ref = r(x)
    xs, rw = jnp.asarray(x.numpy()), jnp.asarray(r.weight.detach().numpy().T)
    w, i = route(xs, rw, 4, norm)
    np.testing.assert_array_equal(np.asarray(i), i_ref.numpy())
    np.testing.assert_allclose(np.asarray(w), w_ref.numpy(), atol=1e-6, rtol=1e-6)
    order = np.argsort(i_ref.numpy(), axis=-1)
    i_asc, w_asc = np.take_along_axis(i_ref.numpy(), order, -1), np.take_along_axis(w_ref.numpy(), order, -1)
    for rows in (slice(None), slice(7, 8)):
        w, i = route(xs[rows], rw, 4, norm, ascending=True, kernel="pallas_gpu_interpret")
        np.testing.assert_array_equal(np.asarray(i), i_asc[rows])
        np.testing.assert_allclose(np.asarray(w), w_asc[rows], atol=1e-6, rtol=1e-6)


def test_routing_kernels_sorting_networks_sort_every_permutation():
    """The routing kernel puts its k picks in ascending id order with a fixed compare-exchange
    network: each one sorts every permutation of its k keys."""
    import itertools
    from pallas_kernels.moe.gpu import _SORT_NETWORKS
    for k, net in _SORT_NETWORKS.items():
        for perm in itertools.permutations(range(k)):
            a = list(perm)
            for i, j in net:
                if a[i] > a[j]:
                    a[i], a[j] = a[j], a[i]
            assert a == list(range(k)), (k, perm)


@pytest.mark.parametrize("E,k,dtype", [(128, 8, jnp.bfloat16), (256, 8, jnp.bfloat16), (32, 4, jnp.float32)])
def test_routing_kernel_equals_xla_routing(E, k, dtype):
    """The GPU routing kernel (interpreted) = XLA's route then a sort by id, at the MoE targets'
    expert counts (Coder-30B-A3B 128, Qwen3.5-35B-A3B 256), with tied probabilities (equal logits:
    the lower ids win, as jax.lax.top_k) and rows past a 16-row block; a shape it does not take (a
    non-power-of-two expert count) falls back to XLA's ops."""
    from pallas_kernels.moe import route_ascending
    rng = np.random.RandomState(E)
    x = jnp.asarray(rng.randn(21, 64), dtype)
    router = jnp.asarray(rng.randn(64, E), dtype).at[:, 3].set(0).at[:, 11].set(0)
    x = x.at[0].set(0)                                            # row 0: every logit 0, all tied
    for norm in (True, False):
        want_w, want_i = route(x, router, k, norm, ascending=True)
        got_w, got_i = route(x, router, k, norm, ascending=True, kernel="pallas_gpu_interpret")
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        assert np.asarray(got_i)[0].tolist() == list(range(k))
        assert (np.diff(np.asarray(got_i), axis=-1) > 0).all()
        np.testing.assert_allclose(np.asarray(got_w, np.float32), np.asarray(want_w, np.float32),
                                   rtol=1e-6 if dtype == jnp.float32 else 8e-3, atol=1e-7)
    assert route_ascending(jnp.zeros((2, 6), jnp.float32), 3, True, "pallas_gpu_interpret") is None
    assert route_ascending(jnp.zeros((2, 8), jnp.float32), 2, True, "xla") is None


# ------------------------------------------------------------------------------- the whole model

MOE_VARIANTS = {
    "renorm-dense1": dict(norm_topk_prob=True, mlp_only_layers=(1,)),
    "plain-step2": dict(norm_topk_prob=False, decoder_sparse_step=2, num_experts=6, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def moe_target(request, tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM
    path = write_moe_target(str(tmp_path_factory.mktemp(request.param)), seed=7, **MOE_VARIANTS[request.param])
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    return path, hf, load_target(path, "float32")


def test_logits_and_routing_match_transformers(moe_target):
    """Prefill logits = HF's, the dense layers (mlp_only_layers / decoder_sparse_step) are dense, and
    the tokens really spread over the experts."""
    path, hf, target = moe_target
    cfg = target.config
    assert [type(l.mlp).__name__ for l in target.layers] == \
        ["MoE" if cfg.is_sparse(i) else "MLP" for i in range(cfg.num_layers)]
    assert "MLP" in [type(l.mlp).__name__ for l in target.layers]
    ids = np.random.RandomState(0).randint(0, 128, (2, 13))
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_router_logits=True)
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    h, _, _ = target(jnp.asarray(ids), pos, target.new_cache(2, 32), pos + 1)
    np.testing.assert_allclose(np.asarray(target.logits(h)), out.logits.numpy(), atol=1e-4, rtol=0)
    if cfg.norm_topk_prob:     # (one variant: the interpreter is slow) the GPU grouped matmul, fused
        gpu = KernelConfig(attention="xla", moe_gmm="pallas_gpu_interpret").resolve("cpu")   # gate|up + SwiGLU
        h, _, _ = target(jnp.asarray(ids), pos, target.new_cache(2, 32), pos + 1, kernels=gpu)
        np.testing.assert_allclose(np.asarray(target.logits(h)), out.logits.numpy(), atol=1e-4, rtol=0)
    for logits in out.router_logits:
        used = set(torch.topk(logits, cfg.num_experts_per_tok).indices.flatten().tolist())
        assert len(used) > cfg.num_experts // 2


@pytest.mark.slow
def test_decode_step_through_gpu_kernels_matches_transformers(moe_target):
    """A decode step (2 rows x 1 token: the GPU grouped-matmul kernels, interpreted; then 1 row: the
    one-token path) after a 12-token prefill = transformers' logits at the 13th position. Both
    variants: k = 3 of 6 experts routes in XLA (the routing kernel takes powers of two), k = 2 of 8
    through the routing kernel (`KernelConfig.moe_route`), interpreted."""
    path, hf, target = moe_target
    ids = np.random.RandomState(1).randint(0, 128, (2, 13))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()[:, 12:]
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    _, _, cache = target(jnp.asarray(ids[:, :12]), pos[:, :12], target.new_cache(2, 32), pos[:, :12] + 1)
    gpu = KernelConfig(attention="xla", moe_gmm="pallas_gpu_interpret").resolve("cpu")
    h, _, _ = target(jnp.asarray(ids[:, 12:]), pos[:, 12:], cache, pos[:, 12:] + 1, kernels=gpu)
    np.testing.assert_allclose(np.asarray(target.logits(h)), want, atol=1e-4, rtol=0)
    # one row (B = 1: one token, the no-sort path)
    one = jax.tree.map(lambda a: a[:1] if getattr(a, "ndim", 0) and a.shape[0] == 2 else a, cache)
    h, _, _ = target(jnp.asarray(ids[:1, 12:]), pos[:1, 12:], one, pos[:1, 12:] + 1, kernels=gpu)
    np.testing.assert_allclose(np.asarray(target.logits(h)), want[:1], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_greedy_equals_transformers_generate(moe_target):
    path, hf, target = moe_target
    prompts = random_prompts(2, 128, min_len=3, max_len=12, seed=2)
    res = generate(target, None, prompts, max_new_tokens=12)
    for p, got in zip(prompts, res.tokens):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert got == want


@pytest.fixture(scope="module")
def moe_dflash(tmp_path_factory):
    """A Qwen3-MoE target + reference draft (block 8), their torch twins, and the reference runs."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3MoeForCausalLM
    root = tmp_path_factory.mktemp("moe_dflash")
    tp = write_moe_target(str(root / "t"), norm_topk_prob=True, mlp_only_layers=(1,), num_layers=4, seed=3)
    dp = write_draft(str(root / "d"), tp, num_layers=2, block_size=8, target_layer_ids=[0, 2], seed=4)
    hf = Qwen3MoeForCausalLM.from_pretrained(tp, dtype=torch.float32).eval().requires_grad_(False)
    ref_draft = DFlashDraftModel.from_pretrained(dp, dtype=torch.float32).eval().requires_grad_(False)
    target = load_target(tp, "float32")
    prompts = random_prompts(2, 127, min_len=3, max_len=12, seed=1)
    ref = [reference_generate(ref_draft, hf, p, 20, block_size=8) for p in prompts]
    return dict(target=target, draft=load_draft(dp, target=target, dtype="float32"), prompts=prompts,
                tokens=[r.output_ids[0, len(p):].tolist() for r, p in zip(ref, prompts)],
                acceptance=[list(r.acceptance_lengths) for r in ref])


@pytest.mark.slow
@pytest.mark.parametrize("verify_width", widths(3))
def test_dflash_with_moe_target_equals_reference(moe_dflash, verify_width):
    """Tokens = the reference dflash_generate's with Qwen3MoeForCausalLM as the target, and = plain
    greedy decoding, at every width (the block, "auto", W = 3); acceptance lengths = the
    reference's at the block, at most W + 1 otherwise."""
    target, draft, prompts = moe_dflash["target"], moe_dflash["draft"], moe_dflash["prompts"]
    res = generate(target, draft, prompts, max_new_tokens=20, block_size=8, verify_width=verify_width)
    assert res.tokens == generate(target, None, prompts, max_new_tokens=20).tokens
    assert_width_result(res, moe_dflash["tokens"], moe_dflash["acceptance"], verify_width, 8)


@pytest.mark.slow
def test_moe_blocks_cut_mid_way_keep_the_greedy_tokens(moe_dflash):
    """The random draft above has its blocks rejected early: here the truth proposer (the
    target's greedy continuation, = transformers' by the reference comparison) cut after its 3rd
    draft, so every iteration accepts 4 tokens of the block of 8 and commits mid-block."""
    target, draft, prompts = moe_dflash["target"], moe_dflash["draft"], moe_dflash["prompts"]
    n = 20
    truth = np.zeros((len(prompts), 64), np.int32)
    for i, (p, e) in enumerate(zip(prompts, moe_dflash["tokens"])):
        truth[i, :len(p) + n] = p + e
    res = generate(target, truth_proposer(draft, truth, 3, 128), prompts, max_new_tokens=n, block_size=8,
                   verify_width="block")
    assert res.tokens == moe_dflash["tokens"]
    assert all(a == 4 for row in res.acceptance_lengths for a in row[:-1]), res.acceptance_lengths


# ------------------------------------------------------------------------------------ the loader

@pytest.fixture(scope="module")
def small_moe(tmp_path_factory):
    return write_moe_target(str(tmp_path_factory.mktemp("small")), num_layers=2, num_experts=4, seed=1)


def _rewrite(src, dst, edit):
    """A copy of checkpoint src at dst with its tensors passed through edit(dict) (in place)."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    t = load_file(os.path.join(src, "model.safetensors"))
    edit(t)
    save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_missing_or_misshaped_experts_are_named_in_one_line(small_moe, tmp_path):
    gone = _rewrite(small_moe, str(tmp_path / "a"), lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"^[^\n]*layer 1 lacks 1 expert tensor\(s\): "
                                         r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight$"):
        load_target(gone, "float32")

    def bad(t):
        t["model.layers.0.mlp.experts.3.down_proj.weight"] = t["model.layers.0.mlp.experts.3.down_proj.weight"][:, :5].contiguous()
    with pytest.raises(ValueError, match=r"^[^\n]*experts\.3\.down_proj\.weight has shape \(64, 5\), "
                                         r"the config implies \(64, 32\)$"):
        load_target(_rewrite(small_moe, str(tmp_path / "b"), bad), "float32")
    router = _rewrite(small_moe, str(tmp_path / "c"), lambda t: t.pop("model.layers.0.mlp.gate.weight"))
    with pytest.raises(ValueError, match=r"^[^\n]*lacks 1 tensor\(s\): model\.layers\.0\.mlp\.gate\.weight$"):
        load_target(router, "float32")


def test_config_reader_and_preset():
    d = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
         "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True}
    cfg = read_config(d)
    assert isinstance(cfg, Qwen3MoeConfig) and cfg.model_type == "qwen3_moe"
    assert [cfg.is_sparse(i) for i in range(4)] == [False, True, False, False]
    from dflash_jax import ConfigError
    with pytest.raises(ConfigError, match="num_experts_per_tok=5 > num_experts=4"):
        read_config({**d, "num_experts_per_tok": 5})
    p = PRESETS["qwen3-coder-30b-a3b"]
    assert (p.num_layers, p.hidden_size, p.num_heads, p.num_kv_heads, p.head_dim, p.num_experts,
            p.num_experts_per_tok, p.moe_intermediate_size, p.rope_theta, p.vocab_size, p.norm_topk_prob) == \
        (48, 2048, 32, 4, 128, 128, 8, 768, 1e7, 151936, True)


# z-lab/Qwen3-Coder-30B-A3B-DFlash's config.json, reconstructed (docs/moe.md): a dense Qwen3 draft of
# the target's width, 8 layers reading 5 target layers, block 16, Qwen3's MASK id
CODER_DRAFT_CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "rope_theta": 10000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "layer_types": ["full_attention"] * 8, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 48, "num_target_layers": 48, "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]},
}


def test_zlab_coder_draft_config_fits_the_preset_and_builds():
    """The Coder-30B-A3B draft's config reads, fits the qwen3-coder-30b-a3b target (48 layers, taps
    inside them, its vocab) and builds (abstractly: 8 layers + the fc over 5 taps)."""
    from flax import nnx
    from dflash_jax import drafts
    from dflash_jax.weights import init_draft
    cfg = drafts.read_config(CODER_DRAFT_CONFIG)
    cfg.check_fits(PRESETS["qwen3-coder-30b-a3b"])
    assert (cfg.num_layers, cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == \
        (8, 16, (1, 12, 23, 34, 45), 151669)
    draft = nnx.eval_shape(lambda: init_draft(cfg, dtype="bfloat16"))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(draft, nnx.Param)))
    # 8 x (attention 2048 x (4096 + 2 x 512) + 4096 x 2048, MLP 3 x 2048 x 6144) + fc 5 x 2048 x 2048 + norms
    per_layer = 2048 * (4096 + 1024) + 4096 * 2048 + 3 * 2048 * 6144
    assert abs(n - (8 * per_layer + 5 * 2048 * 2048)) < 0.001 * n, n


def test_kernel_config_moe_gmm_resolves():
    assert KernelConfig().resolve("cpu").moe_gmm == "xla"
    assert KernelConfig().resolve("tpu").moe_gmm == "pallas_tpu"
    assert KernelConfig(moe_gmm="pallas").resolve("cpu").moe_gmm == "pallas_tpu_interpret"
    assert KernelConfig(moe_gmm="pallas_tpu").resolve("cpu").moe_gmm == "pallas_tpu"
    with pytest.raises(ValueError, match="moe_gmm='bogus'"):
        KernelConfig(moe_gmm="bogus")
    # the GPU kernel is chosen, not defaulted, until the H200 A/B shows it faster
    assert KernelConfig().resolve("gpu", device=None).moe_gmm == "pallas_gpu"
    assert KernelConfig(moe_gmm="pallas").resolve("gpu", device=None).moe_gmm == "pallas_gpu"
    assert KernelConfig(moe_gmm="pallas_gpu").resolve("cpu").moe_gmm == "pallas_gpu"
    # the routing kernel goes with the GPU gmm only
    assert KernelConfig().resolve("gpu", device=None).moe_route
    assert not KernelConfig(moe_route=False).resolve("gpu", device=None).moe_route
    assert not KernelConfig().resolve("cpu").moe_route and not KernelConfig().resolve("tpu").moe_route
    assert KernelConfig(moe_gmm="pallas_gpu_interpret").resolve("cpu").moe_route
    # the one-token launches' A/B overrides: kept for the GPU gmm, dropped elsewhere, names checked
    tuned = KernelConfig(moe_tuning=(("down_bn", 64), ("gate_up_num_stages", 4))).resolve("gpu", device=None)
    assert tuned.gmm_rows_tiles("gate_up") == {"num_stages": 4} and tuned.gmm_rows_tiles("down") == {"bn": 64}
    assert KernelConfig(moe_tuning=(("down_bn", 64),)).resolve("cpu").moe_tuning == ()
    with pytest.raises(ValueError, match="moe_tuning: unknown settings"):
        KernelConfig(moe_tuning=(("up_bn", 64),))


@tpu_aot.requires_libtpu
@pytest.mark.parametrize("topology", tpu_aot.TOPOLOGIES)
@pytest.mark.parametrize("rows,weights", [(8, "bf16"), (128, "bf16"), (128, "int8"), (128, "fp8")])
def test_gmm_kernel_compiles_for_tpu(topology, rows, weights):
    """The TPU kernel at Qwen3-Coder-30B-A3B's expert shapes (128 experts, H 2048, I 768, bf16 rows)
    through Mosaic for v5e and v6e: a decode step's 8 rows at B = 1 and a 16-token verify's 128;
    int8 experts (their float32 column scales beside them) read as int8, FP8 experts (float8 with
    Qwen's 128 x 128 block scales in SMEM; down with per-column scales, bn = 1) as float8: nothing
    dequantized in HBM."""
    from pallas_kernels.moe import tpu
    dev = tpu_aot.tpu_device(topology)
    q8 = weights in ("int8", "fp8")
    for K, N in ((2048, 2 * 768), (768, 2048)):
        block = ((128, 128) if K == 2048 else (128, 1)) if weights == "fp8" else None
        sshape = (128, N) if block is None else (128, K // 128, N // block[1])
        args = (tpu_aot.abstract((rows, K), jnp.bfloat16, dev),
                tpu_aot.abstract((128, K, N), {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(weights, jnp.bfloat16),
                                 dev),
                tpu_aot.abstract((128,), jnp.int32, dev))
        if q8:
            args += (tpu_aot.abstract(sshape, jnp.float32, dev),)
        compiled = tpu_aot.compile_for_tpu(
            lambda x, w, g, *s: tpu.gmm(x, w, g, scale=s[0] if s else None, block=block), *args)
        # the Pallas kernel itself (not an XLA fallback), its operands whole in HBM: x, w and the group sizes
        assert {"int8": "dflash_gmm_tpu_int8", "fp8": "dflash_gmm_tpu_fp8"}.get(weights, "dflash_gmm_tpu") \
            in compiled.as_text()
        ma = compiled.memory_analysis()
        assert ma.argument_size_in_bytes == rows * K * 2 + 128 * K * N * (1 if q8 else 2) + 128 * 4 + \
            (4 * int(np.prod(sshape)) if q8 else 0)
        assert ma.temp_size_in_bytes < 1 << 20          # no converted copy of the experts


@pytest.mark.slow
@tpu_aot.requires_libtpu
@pytest.mark.parametrize("chip,quantize", [("v5e-8", None), ("v5e-4", "int8")])   # (v6e-4 bf16: CI time)
def test_coder_iteration_compiles_for_tpu_meshes_and_fits(chip, quantize):
    """scripts/tpu_moe_aot.py reduced: Qwen3-Coder-30B-A3B at 1 and 2 layers (+ a 1-layer draft),
    the DFlash iteration on a 1 x chips mesh (experts over 'model') through the TPU compiler. Two
    grouped matmuls per MoE layer, each reading its chip's E / chips experts in the static grid
    (the per-layer difference), the 48-layer extrapolation fits the chip's HBM, and with the
    touched experts swapped in the iteration sits within 1.3x its floor. int8 (v5e-4): the target
    placed on the mesh as load_target(quantize="int8") would (scales with their columns), its
    experts read as int8 by the kernel (half the bytes, no converted copy in temporaries)."""
    import argparse
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "tpu_moe_aot", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                                    "tpu_moe_aot.py"))
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    tb = aot._tpu_bytes()
    args = argparse.Namespace(preset="qwen3-coder-30b-a3b", draft_layers=1, batch=1, capacity=1024)
    a, b = (aot.compile_one(chip, "dflash", L, args, tb, quantize) for L in (1, 2))
    tp = int(chip.split("-")[1])
    expert = 3 * 2048 * 768 * (1 if quantize else 2)
    assert b["gmm_calls"] - a["gmm_calls"] == 2
    local = 128 // tp * expert
    assert abs((b["gmm_hbm"] - a["gmm_hbm"]) - local) < 0.05 * local
    assert b["temp"] < 0.05e9                     # no layer's experts converted to bf16 in HBM
    full = aot.extrapolate(a, b, 48)
    f = aot.floors(chip, "dflash", args, tb, full, quantize)
    assert f["fits"], full["memory"]
    assert 0.9 < f["expected_x_floor"] < 1.3, f
