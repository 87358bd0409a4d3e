"""The GPU matmul kernel over 8-bit weights (pallas_kernels/quantized/gpu.py): int8 per-column and
FP8 block-scaled weights against a NumPy dequantize-then-multiply oracle (the Pallas interpreter),
and models.layers.linear lowering to it on CUDA (few rows, off a mesh) but not on CPU."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dflash_jax.quantize import Fp8BlockWeight, Int8Weight
from pallas_kernels._common import Unsupported
from pallas_kernels.quantized import gpu as qgpu

TRITON = "__gpu$xla.gpu.triton"


def _int8(rng, K, N):
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    s = (rng.random(N) * 0.02 + 1e-3).astype(np.float32)
    return q, s, q.astype(np.float64) * s[None]


def _fp8(rng, K, N, block):
    q = jnp.asarray(rng.standard_normal((K, N)) * 50, jnp.float32).astype(jnp.float8_e4m3fn)
    s = (rng.random((-(-K // block[0]), -(-N // block[1]))) * 0.02 + 1e-3).astype(np.float32)
    full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:K, :N]
    return q, s, np.asarray(q.astype(jnp.float32), np.float64) * full


@pytest.mark.parametrize("M,K,N,block,dtype,splits", [
    (1, 256, 128, None, jnp.float32, 1),            # a decode row
    (16, 256, 192, None, jnp.bfloat16, 2),          # a verify block, split K
    (33, 128, 64, None, jnp.float32, 1),            # rows padded to 64
    (5, 384, 256, (128, 128), jnp.float32, 1),      # an FP8 checkpoint's 128 x 128 blocks
    (16, 256, 96, (128, 1), jnp.bfloat16, 2),       # a fused matrix's per-column block scales
])
def test_quantized_matmul_matches_numpy_dequantize_oracle(M, K, N, block, dtype, splits):
    rng = np.random.default_rng(M * 7 + N)
    q, s, w = _int8(rng, K, N) if block is None else _fp8(rng, K, N, block)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xd = jnp.asarray(x, dtype)
    want = np.asarray(xd.astype(jnp.float32), np.float64) @ w
    got = qgpu.matmul(xd, jnp.asarray(q), jnp.asarray(s), block=block, splits=splits, bk=64 if splits > 1 else None,
                      interpret=True)
    assert got.shape == (M, N) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


def test_quantized_matmul_refuses_what_it_cannot_tile():
    x = jnp.ones((4, 100), jnp.float32)
    assert not qgpu.supported(4, 100, 64, jnp.float32)                  # K: no power-of-two tile
    assert not qgpu.supported(129, 128, 64, jnp.float32)                # more rows than MAX_ROWS
    assert not qgpu.supported(4, 128, 64, jnp.float32, block=(100, 128))  # no K tile divides bk_s = 100
    assert qgpu.supported(4, 128, 64, jnp.float32, block=(96, 96))        # 32-wide tiles inside 96-blocks
    with pytest.raises(Unsupported):
        qgpu.matmul(x, jnp.ones((100, 64), jnp.int8), jnp.ones((64,)), interpret=True)


def _lowered(f, *args):
    from jax import export
    return export.export(jax.jit(f), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args).mlir_module()


def test_linear_runs_the_kernel_where_it_wins_on_cuda_only():
    """models.layers.linear on CUDA: an Fp8BlockWeight times few rows is the Triton kernel; an
    Int8Weight only at one row of a large matrix (elsewhere XLA's converted dot measured as fast);
    many rows (a prefill) keep XLA's dot; on CPU the value equals the XLA path's."""
    from dflash_jax.models.layers import linear
    rng = np.random.default_rng(0)
    qf, sf, _ = _fp8(rng, 256, 128, (128, 128))
    wf = Fp8BlockWeight(qf, jnp.asarray(sf), (128, 128))
    S = jax.ShapeDtypeStruct
    assert TRITON in _lowered(linear, S((1, 16, 256), jnp.bfloat16), wf)
    assert TRITON not in _lowered(linear, S((1, 512, 256), jnp.bfloat16), wf)
    big = Int8Weight(S((4096, 6144), jnp.int8), S((6144,), jnp.float32))
    assert TRITON in _lowered(linear, S((1, 1, 4096), jnp.bfloat16), big)
    assert TRITON not in _lowered(linear, S((1, 16, 4096), jnp.bfloat16), big)
    q, s, _ = _int8(rng, 256, 128)
    w8 = Int8Weight(jnp.asarray(q), jnp.asarray(s))
    for w in (w8, wf):
        x = jnp.asarray(rng.standard_normal((1, 16, 256)), jnp.float32)
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, w)), np.asarray(w.matmul(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("variant", ["xla kn", "xla nk", "dequant kn", "dequant nk", "pallas kn", "pallas nk fused",
                                     "pallas nk bm64", "pallas kn s2"])
def test_experimental_fp8_w8a8_matmul_matches_numpy_oracle(M, variant):
    """pallas_kernels/quantized/gpu_w8a8.py (the W8A8 path of an FP8 checkpoint, --w8a8): x quantized to
    e4m3 per row and 128-column K group (scale amax * float32(1/448), 1 for an all-zero group), fp8 x
    fp8 products scaled per K block, against NumPy (ml_dtypes' e4m3 rounding, float64 products)."""
    import ml_dtypes
    from pallas_kernels.quantized import gpu_w8a8 as w8

    K, N, block, rng = 256, 384, (128, 128), np.random.default_rng(M)
    q, s, wd = _fp8(rng, K, N, block)
    x = rng.standard_normal((M, K)).astype(np.float32) * 2.0
    x[0, :128] = 0.0                                                   # an all-zero group
    xg = x.reshape(M, K // 128, 128)
    sx = np.abs(xg).max(-1) * np.float32(1.0 / 448.0)
    sx = np.where(sx > 0, sx, np.float32(1.0)).astype(np.float32)
    xq = (xg / sx[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx[..., None]
    want = xq.reshape(M, K) @ wd
    qj, sj = jnp.asarray(q), jnp.asarray(s)
    xj = jnp.asarray(x)
    got = {"xla kn": lambda: w8.matmul_xla(xj, qj, sj, block, "kn"),
           "xla nk": lambda: w8.matmul_xla(xj, qj.T, sj.T, block, "nk"),
           "dequant kn": lambda: w8.matmul_dequant(xj, qj, sj, block, "kn"),
           "dequant nk": lambda: w8.matmul_dequant(xj, qj.T, sj.T, block, "nk"),
           "pallas kn": lambda: w8.matmul_pallas(xj, qj, sj, block, "kn", interpret=True),
           "pallas nk fused": lambda: w8.matmul_pallas(xj, qj.T, sj.T, block, "nk", fuse_quant=True, interpret=True),
           # the model path beyond 16 rows (models.layers._w8a8_gpu): x quantized by XLA, rows padded to 64
           "pallas nk bm64": lambda: w8.matmul_pallas(xj, qj.T, sj.T, block, "nk", bm=64, interpret=True),
           "pallas kn s2": lambda: w8.matmul_pallas(xj, qj, sj, block, "kn", bn=128, bk=64, splits=2,
                                                    interpret=True)}[variant]()
    assert got.shape == (M, N)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_fp8_channel_requantized_matmul_matches_numpy_oracle():
    """gpu_w8a8.requantize_channels + matmul_channel (the many-row experiment): the block weight
    requantized to one e4m3 scale per output channel stays within e4m3's rounding of the dequantized
    weight, and the per-row x per-channel W8A8 product equals NumPy's (ml_dtypes' e4m3 rounding of x with
    one scale per row, float64 products)."""
    import ml_dtypes
    from pallas_kernels.quantized import gpu_w8a8 as w8

    M, K, N, block, rng = 5, 256, 320, (128, 128), np.random.default_rng(4)
    q, s, wd = _fp8(rng, K, N, block)                           # wd [K, N]
    q_ch, s_ch = w8.requantize_channels(jnp.asarray(q).T, jnp.asarray(s).T, block)
    w_ch = np.asarray(q_ch.astype(jnp.float32), np.float64) * np.asarray(s_ch, np.float64)[:, None]   # [N, K]
    np.testing.assert_allclose(w_ch, wd.T, rtol=2 ** -3, atol=float(np.asarray(s_ch).max()) * 2 ** -9)
    x = rng.standard_normal((M, K)).astype(np.float32)
    sx = (np.abs(x).max(-1) * np.float32(1.0 / 448.0)).astype(np.float32)
    xq = (x / sx[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx[:, None]
    want = xq @ w_ch.T
    got = w8.matmul_channel(jnp.asarray(x), q_ch, s_ch)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-6 * np.abs(want).max())
