"""FP8 W8A8 matmuls of few rows against FP8 block-scaled weights (issue 57): the path of an FP8
checkpoint loaded with `w8a8=True` (`--w8a8`; dflash_jax.quantize.Fp8W8A8Weight, which
dflash_jax.models.layers.linear sends here: XLA at one row, the fused Pallas kernel at 2-128 rows on CUDA).

The scheme Qwen's FP8 checkpoints declare (`activation_scheme: dynamic`): x is quantized at run time
to float8_e4m3fn per row and per `group` (= the weight's K block, 128) columns of K, scale = amax / 448
(computed as amax * float32(1/448); 1 where the group is all zeros), and the matmul runs fp8 x fp8
with float32 accumulation: each K block's partial product times x's (row, kb) scale and the weight's
(kb, nb) block scale, summed over K blocks. The weight tile is never converted (gpu.py converts it to
bf16 in registers), so it can go global -> shared -> MMA as it is.

Checked on CPU (interpret mode, `--check`; tests/test_quantized_kernel.py, tests/test_w8a8.py) and
lowered to Triton IR for CUDA (`--lower`: the dot is a tt.dot of f8E4M3FN x f8E4M3FN -> f32; "nk" adds
a tt.trans of the weight tile); timed per matmul on a GPU by scripts/bench_fp8_w8a8.py.

    y[m, n] = sum_kb  sx[m, kb] * ws[kb, n // bn_s] * sum_{k in kb} xq[m, k] * q[k, n]

Weights come in two layouts: "kn" q [K, N] with scale [Kb, Nb] (ours, dflash_jax.quantize.Fp8BlockWeight)
and "nk" q [N, K] with scale [Nb, Kb] (the HF checkpoint's weight / weight_scale_inv as stored: both
operands K-major, what an fp8 MMA wants). `block` is (bk_s, bn_s) = (K block, N block) in both.

- quantize_rows(x, group): the activation quantization, plain jnp.
- matmul_xla: XLA only; one batched fp8 dot over the K blocks ([Kb, M, N] float32 partials), scaled, summed.
- matmul_dequant: the many-row form (a prefill, a wide verify): the same quantized operands, each
  dequantized to x's dtype (x per row and group, the weight per block), then one dot with float32
  accumulation. The same sum as the fp8 dots', rounded to x's dtype once per operand; it costs one
  GEMM where matmul_xla writes and reads a [Kb, M, N] float32 partial (at 512 rows of a Qwen3-8B
  gate_up, 1.6 GB).
- requantize_channels / matmul_channel: W8A8 per channel (quantize.Fp8ChannelWeight, `--w8a8 channel`): the
  weight requantized to one scale per output channel, x to one per row, one fp8 dot (cuBLASLt's fp8 GEMM
  shape), scaled after it.
- matmul_pallas: a Triton-lowered Pallas kernel modelled on gpu.py's `_kernel` (grid (N // bn, splits),
  rows padded to bm = max(16, next_pow2(M)), bk divides bk_s); `fuse_quant=True` quantizes x inside the
  kernel (bk == bk_s) instead of in XLA before it.

    python pallas_kernels/quantized/gpu_w8a8.py --check          # CPU: both paths against a NumPy oracle
    python pallas_kernels/quantized/gpu_w8a8.py --lower          # CPU: lower the kernel for CUDA (to Triton IR)
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, next_pow2, pltriton, quiet_triton

__all__ = ["quantize_rows", "matmul_xla", "matmul_dequant", "matmul_pallas", "matmul_channel", "requantize_channels",
           "tiles", "FP8_MAX", "MAX_ROWS"]

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
MAX_ROWS = 128
_INV_MAX = float(__import__("numpy").float32(1.0 / FP8_MAX))


def _scale_of(amax):
    # amax times the float32 reciprocal (not amax / 448: XLA rewrites a division by a constant into
    # that product, so this is what every backend computes alike)
    s = amax * _INV_MAX
    return jnp.where(s > 0, s, 1.0)


def quantize_rows(x, group: int = 128):
    """x [M, K] -> (x_fp8 [M, K] float8_e4m3fn, sx [M, K // group] float32): x ~ x_fp8 * sx per (row, group)."""
    M, K = x.shape
    if K % group:
        raise Unsupported(f"quantize_rows: K={K} is not a multiple of group={group}")
    xf = x.astype(jnp.float32).reshape(M, K // group, group)
    s = _scale_of(jnp.max(jnp.abs(xf), axis=-1))                                         # [M, Kb]
    xq = jnp.clip(xf / s[..., None], -FP8_MAX, FP8_MAX).astype(FP8).reshape(M, K)
    return xq, s


def _rows(x):
    lead, K = x.shape[:-1], x.shape[-1]
    M = 1
    for d in lead:
        M *= d
    return lead, M, K


def _check(K, N, q, scale, block, layout):
    bks, bns = block
    if layout not in ("kn", "nk"):
        raise ValueError(f"layout must be 'kn' or 'nk', got {layout!r}")
    want_q = (K, N) if layout == "kn" else (N, K)
    if q.shape != want_q:
        raise Unsupported(f"w8a8: q {q.shape} is not {want_q} for x with K={K} in layout {layout}")
    kb, nb = -(-K // bks), -(-N // bns)
    want_s = (kb, nb) if layout == "kn" else (nb, kb)
    if scale.shape != want_s:
        raise Unsupported(f"w8a8: scale {scale.shape} is not {want_s} (block {block}, layout {layout})")
    if K % bks:
        raise Unsupported(f"w8a8: K={K} is not a multiple of the K block {bks}")


@functools.partial(jax.jit, static_argnames=("block", "layout"))
def matmul_xla(x, q, scale, block=(128, 128), layout: str = "kn"):
    """x [..., K] @ the FP8 block weight -> [..., N] in x's dtype, W8A8 through XLA's fp8 dot."""
    lead, M, K = _rows(x)
    N = q.shape[1] if layout == "kn" else q.shape[0]
    _check(K, N, q, scale, block, layout)
    bks, bns = block
    Kb = K // bks
    xq, sx = quantize_rows(x.reshape(M, K), bks)
    xr = xq.reshape(M, Kb, bks)
    if layout == "kn":
        qr = q.reshape(Kb, bks, N)
        p = lax.dot_general(xr, qr, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)
        ws = scale                                                                          # [Kb, Nb]
    else:
        qr = q.reshape(N, Kb, bks)
        p = lax.dot_general(xr, qr, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32)
        ws = scale.T
    # p [Kb, M, N]
    wcol = jnp.repeat(ws.astype(jnp.float32), bns, axis=1)[:, :N] if bns > 1 else ws.astype(jnp.float32)
    y = jnp.sum(p * sx.T[:, :, None] * wcol[:, None, :], axis=0)
    return y.astype(x.dtype).reshape(*lead, N)


def _dequantized(q, scale, block, layout: str):
    """The FP8 block weight q * its block's scale in float32, in q's own layout ("kn" or "nk")."""
    bks, bns = block
    rep = (bks, bns) if layout == "kn" else (bns, bks)                                  # q's axes' blocks
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), rep[0], axis=0), rep[1], axis=1)
    return q.astype(jnp.float32) * full[:q.shape[0], :q.shape[1]]


@functools.partial(jax.jit, static_argnames=("block", "layout"))
def matmul_dequant(x, q, scale, block=(128, 128), layout: str = "kn"):
    """x [..., K] @ the FP8 block weight -> [..., N] in x's dtype, W8A8 numerics for many rows: x
    quantized as matmul_xla quantizes it, both operands dequantized to x's dtype, one dot (float32
    accumulation). In float32 it equals matmul_xla up to float32 rounding; in bf16 each dequantized
    operand is rounded to bf16 once."""
    lead, M, K = _rows(x)
    N = q.shape[1] if layout == "kn" else q.shape[0]
    _check(K, N, q, scale, block, layout)
    bks, bns = block
    xq, sx = quantize_rows(x.reshape(M, K), bks)
    xd = (xq.astype(jnp.float32).reshape(M, K // bks, bks) * sx[..., None]).reshape(M, K).astype(x.dtype)
    wd = _dequantized(q, scale, block, layout).astype(x.dtype)                             # q's layout
    k_axis = 0 if layout == "kn" else 1
    y = lax.dot_general(xd, wd, (((1,), (k_axis,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*lead, N)


@functools.partial(jax.jit, static_argnames=("block",))
def requantize_channels(q, scale, block=(128, 128)):
    """An FP8 block weight in the checkpoint's layout (q [N, K], scale [Nb, Kb]) requantized to one scale
    per output channel: (q_ch [N, K] float8_e4m3fn, s_ch [N] float32), q_ch * s_ch[:, None] ~ the
    dequantized weight (e4m3's exponent keeps each block's relative precision while the blocks' scales
    within a row span less than ~2^8). For matmul_channel (quantize.Fp8ChannelWeight)."""
    w = _dequantized(q, scale, block, "nk")
    s = _scale_of(jnp.max(jnp.abs(w), axis=1))
    # w / s as IEEE division: XLA rewrites a division by a broadcast into a product with the reciprocal,
    # one ulp off, and the checkpoint's values (fp8 times block scales) often sit on e4m3 rounding ties
    # after the division, where that ulp picks the other neighbour
    s_full = lax.optimization_barrier(jnp.broadcast_to(s[:, None], w.shape))
    return jnp.clip(w / s_full, -FP8_MAX, FP8_MAX).astype(FP8), s


@jax.jit
def matmul_channel(x, q_ch, s_ch):
    """x [..., K] @ a per-channel FP8 weight (requantize_channels: q_ch [N, K], s_ch [N]) -> [..., N] in
    x's dtype, W8A8 with one scale per row of x and per output channel (vLLM's dynamic per-token x
    per-channel FP8): one fp8 x fp8 dot with float32 output, scaled after it -- the shape cuBLASLt's fp8
    GEMM takes, where the checkpoint's K blocks need a scale inside the K loop: on an H100 it beats the
    block form beyond 16 rows (scripts/bench_w8a8_chain.py "w8a8 channel"). A different quantization of
    the target than the checkpoint's (its own numerics): quantize.Fp8ChannelWeight, `--w8a8 channel`."""
    lead, M, K = _rows(x)
    N = q_ch.shape[0]
    xq, sx = quantize_rows(x.reshape(M, K), K)                                           # sx [M, 1]
    y = lax.dot_general(xq, q_ch, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * sx * s_ch[None, :]).astype(x.dtype).reshape(*lead, N)


def _kernel(x_ref, sx_ref, q_ref, s_ref, o_ref, *, bn: int, bk: int, steps: int, block, layout: str,
            fuse_quant: bool):
    # x_ref [bm, K] fp8 (fuse_quant: x's dtype), sx_ref [bm, Kb] f32 (fuse_quant: unused),
    # q_ref [K, N] or [N, K] fp8, s_ref [Kb, Nb] or [Nb, Kb], o_ref [splits, bm, N]: whole arrays
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    bks, bns = block
    nb = lax.div(n0, bns)
    base = s * steps * bk

    def k_step(kk, acc):
        k0 = pl.multiple_of(base + kk * bk, bk)
        kb = lax.div(k0, bks)
        if fuse_quant:
            xf = x_ref[:, pl.ds(k0, bk)].astype(jnp.float32)                               # [bm, bk = bks]
            sx = _scale_of(jnp.max(jnp.abs(xf), axis=1, keepdims=True))                     # [bm, 1]
            x = jnp.clip(xf / sx, -FP8_MAX, FP8_MAX).astype(FP8)
        else:
            x = x_ref[:, pl.ds(k0, bk)]                                                     # [bm, bk] fp8
            sx = sx_ref[:, pl.ds(kb, 1)]                                                    # [bm, 1]
        if layout == "kn":
            w = q_ref[pl.ds(k0, bk), pl.ds(n0, bn)]                                         # [bk, bn] fp8
            d = jnp.dot(x, w, preferred_element_type=jnp.float32)
            ws = s_ref[pl.ds(kb, 1), pl.ds(nb, 1)]                                          # [1, 1]
        else:
            w = q_ref[pl.ds(n0, bn), pl.ds(k0, bk)]                                         # [bn, bk] fp8
            d = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            ws = s_ref[pl.ds(nb, 1), pl.ds(kb, 1)]                                          # [1, 1]
        return acc + d * sx * ws

    acc = lax.fori_loop(0, steps, k_step, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    o_ref[s, :, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)


def tiles(M: int, K: int, N: int, block=(128, 128)) -> tuple[int, int, int] | None:
    """Default (bn, bk, splits): 128-column tiles when N >= 16384 else 64, bk = the K block (128), K
    split until ~384 programs run (at most 8), as gpu.tiles does. None when it cannot tile."""
    if not 1 <= M <= MAX_ROWS:
        return None
    bks, bns = block
    bk = bks if bks in (32, 64, 128) else None
    bn = next((b for b in ((128, 64, 32, 16) if N >= 16384 else (64, 32, 16)) if N % b == 0 and bns % b == 0), None)
    if bn is None or bk is None or K % bk:
        return None
    splits = 1
    while splits < 8 and (N // bn) * splits < 384 and K % (bk * splits * 2) == 0:
        splits *= 2
    return bn, bk, splits


@functools.partial(jax.jit, static_argnames=("block", "layout", "bn", "bk", "splits", "num_warps", "num_stages",
                                             "fuse_quant", "bm", "interpret"))
def matmul_pallas(x, q, scale, block=(128, 128), layout: str = "kn", *, bn: int | None = None,
                  bk: int | None = None, splits: int | None = None, num_warps: int = 4, num_stages: int = 4,
                  fuse_quant: bool = False, bm: int = 16, interpret: bool = False):
    """x [..., K] (at most MAX_ROWS rows) @ the FP8 block weight -> [..., N] in x's dtype, W8A8 in a
    Triton-lowered Pallas kernel: the x quantization in XLA first (fuse_quant False) or in the kernel.
    Rows are padded to max(bm, next_pow2(M)) (bm 16: Triton's smallest dot; 64: Hopper's wgmma M)."""
    lead, M, K = _rows(x)
    N = q.shape[1] if layout == "kn" else q.shape[0]
    _check(K, N, q, scale, block, layout)
    bks, bns = block
    t = tiles(M, K, N, block)
    if t is None and None in (bn, bk, splits):
        raise Unsupported(f"w8a8 pallas: M={M}, K={K}, N={N}, block {block} has no default tiling")
    dbn, dbk, dsplits = t or (None, None, None)
    bn, bk = bn or dbn, bk or dbk
    splits = splits or (dsplits if bk == dbk else 1)
    if N % bn or K % (bk * splits) or bks % bk or bns % bn or bk < 32:
        raise Unsupported(f"w8a8 pallas: K={K}, N={N}, block {block} do not tile by bn={bn}, bk={bk}, splits={splits}")
    if fuse_quant and bk != bks:
        raise Unsupported(f"w8a8 pallas: fuse_quant needs bk == the K block {bks}, got {bk}")
    bm = max(bm, next_pow2(M))
    x2 = x.reshape(M, K)
    if fuse_quant:
        xin, sx = x2, jnp.ones((bm, K // bks), jnp.float32)   # sx unused
    else:
        xin, sx = quantize_rows(x2, bks)
    if bm != M:
        xin = jnp.pad(xin, ((0, bm - M), (0, 0)))
        if not fuse_quant:
            sx = jnp.pad(sx, ((0, bm - M), (0, 0)), constant_values=1.0)
    out_dt = jnp.float32 if splits > 1 else x.dtype
    kernel = functools.partial(_kernel, bn=bn, bk=bk, steps=K // bk // splits, block=block, layout=layout,
                               fuse_quant=fuse_quant)
    whole2 = lambda a: pl.BlockSpec(a.shape, lambda j, s: (0, 0))  # noqa: E731
    s2 = scale.astype(jnp.float32)
    with quiet_triton():
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((splits, bm, N), out_dt),
            grid=(N // bn, splits),
            in_specs=[whole2(xin), whole2(sx), whole2(q), whole2(s2)],
            out_specs=pl.BlockSpec((splits, bm, N), lambda j, s: (0, 0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="dflash_w8a8_matmul_gpu",
        )(xin, sx, q, s2)
    y = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return y[:M].reshape(*lead, N)


# ---------------------------------------------------------------------------------------------- checks

def make_weight(key, K: int, N: int, block=(128, 128)):
    """A random FP8 block weight: (q_kn [K, N] fp8, scale_kn [Kb, Nb] f32), q * scale ~ N(0, 1/K)."""
    bks, bns = block
    w = jax.random.normal(key, (K, N), jnp.float32) * K ** -0.5
    # vary the block magnitudes so a wrong scale index shows
    mag = jnp.exp(jax.random.uniform(jax.random.fold_in(key, 1), (K // bks, N // bns), minval=-1.0, maxval=1.0))
    wf = w.reshape(K // bks, bks, N // bns, bns) * mag[:, None, :, None]
    s = jnp.max(jnp.abs(wf), axis=(1, 3)) / FP8_MAX
    q = (wf / s[:, None, :, None]).reshape(K, N).astype(FP8)
    return q, s


def _oracle(x, q, s, block, quantize_x=True):
    """float64 NumPy: quantize x per (row, K block) as quantize_rows defines it (the scale and the
    division in float32, the rounding to e4m3fn by ml_dtypes), dequantize both, multiply."""
    import ml_dtypes
    import numpy as np
    bks, bns = block
    x = np.asarray(x.astype(jnp.float32), np.float32)
    M, K = x.shape
    wd = np.asarray(q.astype(jnp.float32), np.float64) * np.repeat(np.repeat(np.asarray(s, np.float64), bks, 0),
                                                                   bns, 1)[:K, :q.shape[1]]
    if not quantize_x:
        return x.astype(np.float64) @ wd
    xg = x.reshape(M, K // bks, bks)
    amax = np.abs(xg).max(-1)
    sx = amax * np.float32(_INV_MAX)
    sx = np.where(sx > 0, sx, np.float32(1.0)).astype(np.float32)
    xq = np.clip(xg / sx[..., None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    xd = xq.astype(np.float64) * sx[..., None].astype(np.float64)
    return xd.reshape(M, K) @ wd


def check(verbose: bool = True) -> dict:
    """Both paths (the Pallas one interpreted) against the oracle; returns the worst errors."""
    import numpy as np
    block = (128, 128)
    worst = {}

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    def maxrel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    for K, N in ((256, 384), (512, 384)):
        q, s = make_weight(jax.random.key(K), K, N, block)
        qnk, snk = q.T, s.T
        for M in (1, 3, 16):
            x32 = jax.random.normal(jax.random.key(M), (M, K), jnp.float32) * 2.0
            x32 = x32.at[0, :128].set(0.0)    # an all-zero group: the guarded scale
            for dt in (jnp.float32, jnp.bfloat16):
                x = x32.astype(dt)
                ref = _oracle(x, q, s, block)
                wo = _oracle(x, q, s, block, quantize_x=False)
                outs = {
                    "xla kn": matmul_xla(x, q, s, block, "kn"),
                    "xla nk": matmul_xla(x, qnk, snk, block, "nk"),
                    "dequant kn": matmul_dequant(x, q, s, block, "kn"),
                    "dequant nk": matmul_dequant(x, qnk, snk, block, "nk"),
                    "pallas kn": matmul_pallas(x, q, s, block, "kn", interpret=True),
                    "pallas nk": matmul_pallas(x, qnk, snk, block, "nk", interpret=True),
                    "pallas kn bk64 s2": matmul_pallas(x, q, s, block, "kn", bn=128, bk=64, splits=2, interpret=True),
                    "pallas nk fused": matmul_pallas(x, qnk, snk, block, "nk", fuse_quant=True, interpret=True),
                    "pallas nk bm64": matmul_pallas(x, qnk, snk, block, "nk", bm=64, interpret=True),
                    "pallas kn fused s2": matmul_pallas(x, q, s, block, "kn", bn=64, bk=128, splits=2,
                                                        fuse_quant=True, interpret=True),
                }
                dname = jnp.dtype(dt).name
                for name, y in outs.items():
                    e = maxrel(y, ref)
                    k = f"{name} {dname}"
                    worst[k] = max(worst.get(k, 0.0), e)
                    if verbose:
                        print(f"K={K} N={N} M={M:2d} {dname:8s} {name:20s} max|y-oracle|/max|oracle| {e:.2e}")
                wk = f"w8a8 vs weight-only {dname}"
                worst[wk] = max(worst.get(wk, 0.0), rel(ref, wo))
                if verbose:
                    print(f"K={K} N={N} M={M:2d} {dname:8s} oracle W8A8 vs weight-only (x unquantized): "
                          f"rel L2 {rel(ref, wo):.2e}, max {maxrel(ref, wo):.2e}")
    return worst


def lower_for_cuda(layout: str = "kn", fuse_quant: bool = False, M: int = 1, K: int = 512, N: int = 384):
    """Lower matmul_pallas for the CUDA platform on this (GPU-less) host; return the Triton IR lines
    that hold the dot and the fp8 types (the Triton -> PTX compile itself only runs on a GPU)."""
    q, s = make_weight(jax.random.key(0), K, N)
    if layout == "nk":
        q, s = q.T, s.T
    x = jnp.zeros((M, K), jnp.bfloat16)
    f = functools.partial(matmul_pallas, block=(128, 128), layout=layout, fuse_quant=fuse_quant)
    lowered = jax.jit(f).trace(x, q, s).lower(lowering_platforms=("cuda",))
    return lowered


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--lower", action="store_true")
    a = ap.parse_args(argv)
    rc = 0
    if a.check:
        worst = check()
        print("worst:")
        for k, v in worst.items():
            print(f"  {k:32s} {v:.2e}")
        for k, v in worst.items():
            tol = 1e-6 if "float32" in k else 4e-3   # bf16: half an ulp of the output
            if not k.startswith("w8a8 vs") and v > tol:
                print(f"FAIL {k}: {v:.2e} > {tol}")
                rc = 1
        print("check:", "FAIL" if rc else "ok")
    if a.lower:
        for layout in ("kn", "nk"):
            for fq in (False, True):
                try:
                    lowered = lower_for_cuda(layout, fq)
                    print(f"lowered for cuda: layout {layout}, fuse_quant {fq}: ok")
                except Exception as e:  # noqa: BLE001
                    print(f"lowered for cuda: layout {layout}, fuse_quant {fq}: {type(e).__name__}: {e}")
                    rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(_main())
