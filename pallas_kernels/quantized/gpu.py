"""Matmuls of few rows against 8-bit weights as a Triton-lowered Pallas GPU kernel: x [M, K] (bf16 or
f32, M <= MAX_ROWS) @ w [K, N] where w is int8 with one float32 scale per output column
(dflash_jax.quantize.Int8Weight) or float8_e4m3fn with block scales (Fp8BlockWeight: an FP8
checkpoint's `weight_scale_inv`, one per (bk_s, bn_s) block).

Why: at a B = 1 decode step or DFlash verify (1 or 16 rows) a matmul streams its weight once, so
its bytes are its time. XLA:GPU's weight-only int8 dot ran at 1.5-1.8x the int8 bytes on an H100
(XLA converts the weight first), and an FP8 block-scaled weight dequantized to bf16 ran at 2.6x the
bf16 time. This kernel reads the 8-bit weight once: one program per `bn` output columns (and per
K split) walks K in `bk` steps, converts the [bk, bn] tile to x's dtype in registers and
accumulates acc [bm, bn] += x [bm, bk] @ tile in float32 (Triton pipelines the loads,
`num_stages`). int8: the accumulator times the column scales at the end. FP8: each K step's
product times its block's scale (the scales vary along K), so `bk` divides bk_s.

The rows are padded to bm = 16 (Triton's smallest dot) or the next power of two. `splits` > 1 splits
K over that many programs per column tile (float32 partial sums added by XLA) for matrices with too
few column tiles to fill the SMs. Shapes it cannot tile raise Unsupported (callers keep XLA's path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, next_pow2, precision, pltriton, quiet_triton

__all__ = ["matmul", "supported", "worthwhile", "tiles", "MAX_ROWS"]

MAX_ROWS = 128
_BN = (64, 32, 16)


def _pick(n: int, options) -> int | None:
    return next((b for b in options if n % b == 0), None)


def _kernel(x_ref, q_ref, s_ref, o_ref, *, bn: int, bk: int, steps: int, block):
    # x_ref [bm, K], q_ref [K, N] 8-bit, s_ref: [1, N] (int8) or [Kb, Nb] (fp8 block scales),
    # o_ref [splits, bm, N]: whole arrays, sliced here
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    dt = x_ref.dtype
    prec = precision(dt)
    base = s * steps * bk

    def k_step(kk, acc):
        k0 = pl.multiple_of(base + kk * bk, bk)
        x = x_ref[:, pl.ds(k0, bk)]                                                    # [bm, bk]
        w = q_ref[pl.ds(k0, bk), pl.ds(n0, bn)].astype(jnp.float32).astype(dt)         # [bk, bn]
        d = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=prec)
        if block is not None:
            bks, bns = block
            kb = lax.div(k0, bks)
            if bns == 1:
                sc = s_ref[pl.ds(kb, 1), pl.ds(n0, bn)]                                # [1, bn]
            else:
                sc = s_ref[pl.ds(kb, 1), pl.ds(lax.div(n0, bns), 1)]                   # [1, 1]
            d = d * sc
        return acc + d

    acc = lax.fori_loop(0, steps, k_step, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    if block is None:
        acc = acc * s_ref[pl.ds(0, 1), pl.ds(n0, bn)]
    o_ref[s, :, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)


def tiles(M: int, K: int, N: int, block=None) -> tuple[int, int, int] | None:
    """The default (bn, bk, splits) for this shape, or None when it cannot be tiled: bn divides N
    (and the FP8 block's bn_s when the scales are per block), bk * splits divides K (bk divides
    the FP8 block's bk_s). From the H100 sweep (docs/perf-log.md, "a GPU matmul that reads 8-bit
    weights"): 128-column tiles for wide matrices, 64 x 64 tiles elsewhere, K split until ~384
    programs run (at most 8). A one-row GEMV without the dot and a swapped-operand dot measured no
    better (perf-log, "a one-row GEMV and a swapped dot")."""
    if not 1 <= M <= MAX_ROWS:
        return None
    wide = N >= 16384
    bn_opts, bk_opts = ((128,) if wide else ()) + _BN, (128, 64, 32, 16) if wide and M <= 64 else (64, 32, 16)
    if block is not None:
        bks, bns = block
        if bns != 1:
            bn_opts = tuple(b for b in bn_opts if bns % b == 0)
        bk_opts = tuple(b for b in bk_opts if bks % b == 0)
    bn, bk = _pick(N, bn_opts), _pick(K, bk_opts)
    if bn is None or bk is None:
        return None
    splits = 1
    while splits < 8 and (N // bn) * splits < 384 and K % (bk * splits * 2) == 0:
        splits *= 2
    return bn, bk, splits


def supported(M: int, K: int, N: int, dtype, block=None) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) and tiles(M, K, N, block) is not None


def worthwhile(M: int, K: int, N: int, dtype, block=None) -> bool:
    """Whether the kernel beats XLA here (H100, Qwen3-8B shapes, scripts/bench_quantized_matmul.py;
    docs/perf-log.md): FP8 block weights always (XLA dequantizes the whole weight first: 2.6-2.9x
    bf16's time at 1-16 rows, the kernel 0.6-1.0x); int8 only at one row of a matrix 6,144 to
    65,535 columns wide (qkv 17.2 against XLA's 22.1 us, gate_up 46.8 against 55.3; at 16 rows,
    for o, down and the LM head XLA's converted dot is as fast or faster)."""
    if not supported(M, K, N, dtype, block):
        return False
    return block is not None or (M == 1 and 6144 <= N < 65536)


@functools.partial(jax.jit, static_argnames=("block", "bn", "bk", "splits", "num_warps", "num_stages", "interpret"))
def matmul(x, q, scale, *, block=None, bn: int | None = None, bk: int | None = None, splits: int | None = None,
           num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """x [..., K] (at most MAX_ROWS rows) @ (q [K, N] 8-bit, scale) -> [..., N] in x's dtype, float32
    accumulation. block None: q int8, scale [N] per column; block (bk_s, bn_s): q float8, scale
    [ceil(K / bk_s), ceil(N / bn_s)] (bn_s = 1: per column within each K block)."""
    lead, K = x.shape[:-1], x.shape[-1]
    M = 1
    for d in lead:
        M *= d
    K2, N = q.shape
    if K2 != K:
        raise Unsupported(f"quantized matmul: x {x.shape} and q {q.shape} do not agree")
    if not supported(M, K, N, x.dtype, block):
        raise Unsupported(f"quantized matmul: M={M}, K={K}, N={N}, {x.dtype}, block {block} has no tiling")
    dbn, dbk, dsplits = tiles(M, K, N, block)
    bn, bk, splits = bn or dbn, bk or dbk, splits or (dsplits if bk is None else 1)
    if N % bn or K % (bk * splits) or (block is not None and (block[0] % bk or (block[1] != 1 and block[1] % bn))):
        raise Unsupported(f"quantized matmul: K={K}, N={N} do not tile by bn={bn}, bk={bk}, splits={splits}")
    s2 = scale.reshape(1, N) if block is None else scale
    if s2.shape != ((1, N) if block is None else (-(-K // block[0]), -(-N // block[1]))):
        raise Unsupported(f"quantized matmul: scale {scale.shape} does not match q {q.shape}, block {block}")
    bm = max(16, next_pow2(M))
    x2 = x.reshape(M, K)
    if bm != M:
        x2 = jnp.pad(x2, ((0, bm - M), (0, 0)))
    out_dt = jnp.float32 if splits > 1 else x.dtype
    kernel = functools.partial(_kernel, bn=bn, bk=bk, steps=K // bk // splits, block=block)
    with quiet_triton():
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((splits, bm, N), out_dt),
            grid=(N // bn, splits),
            in_specs=[pl.BlockSpec(x2.shape, lambda j, s: (0, 0)), pl.BlockSpec(q.shape, lambda j, s: (0, 0)),
                      pl.BlockSpec(s2.shape, lambda j, s: (0, 0))],
            out_specs=pl.BlockSpec((splits, bm, N), lambda j, s: (0, 0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="dflash_quantized_matmul_gpu",
        )(x2, q, s2.astype(jnp.float32))
    y = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return y[:M].reshape(*lead, N)
