"""Matmuls of few rows (a verify block, a small batch) as a Triton-lowered Pallas GPU kernel: x [M,
K] @ w [K, N] with M <= 64, a weight stream.

At 16 rows (a B = 1 DFlash verify) XLA's GEMMs took 1.19x the bytes of the Qwen3.5-9B's weights on
the H200 (session 31's trace), the single largest share of the hybrid iteration's distance from its
floor. This kernel is the experiment: one program per `bn` output columns walks K in `bk` steps,
acc [bm, bn] += x [bm, bk] @ w [bk, bn] in f32 (Triton pipelines the loads, `num_stages`), the rows
padded to bm = 16 (Triton's smallest dot). `splits` > 1 splits K over that many programs per column
tile (partial sums in f32, added by XLA) for matrices with too few column tiles to fill the SMs.

`swiglu=True` fuses the MLP's first projection: w [K, 2I] holds gate columns [0, I) and up columns
[I, 2I), a program loads both column tiles and writes silu(x @ gate) * (x @ up) [M, I], each product
rounded to x's dtype first as the unfused path rounds them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, precision, pltriton, quiet_triton, round_up

__all__ = ["matmul", "supported", "MAX_ROWS"]

MAX_ROWS = 64


def _pick(n: int, options) -> int | None:
    return next((b for b in options if n % b == 0), None)


def _kernel(x_ref, w_ref, o_ref, *, bm: int, bn: int, bk: int, steps: int, half: int, swiglu: bool):
    # x_ref [bm, K], w_ref [K, N], o_ref [splits, bm, N or N / 2]: whole arrays, sliced here
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    prec = precision(x_ref.dtype)
    base = s * steps * bk

    def k_step(kk, accs):
        k0 = pl.multiple_of(base + kk * bk, bk)
        x = x_ref[:, pl.ds(k0, bk)]                                                    # [bm, bk]
        out = []
        for acc, c0 in zip(accs, (n0, half + n0) if swiglu else (n0,)):
            w = w_ref[pl.ds(k0, bk), pl.ds(c0, bn)]                                     # [bk, bn]
            out.append(acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=prec))
        return tuple(out)

    zero = jnp.zeros((bm, bn), jnp.float32)
    accs = lax.fori_loop(0, steps, k_step, (zero, zero) if swiglu else (zero,))
    if swiglu:
        gate = accs[0].astype(x_ref.dtype).astype(jnp.float32)
        up = accs[1].astype(x_ref.dtype).astype(jnp.float32)
        y = (gate / (1.0 + jnp.exp(-gate))).astype(x_ref.dtype).astype(jnp.float32) * up
    else:
        y = accs[0]
    o_ref[s, :, pl.ds(n0, bn)] = y.astype(o_ref.dtype)


def supported(M: int, K: int, N: int, dtype, swiglu: bool = False) -> bool:
    half = N // 2 if swiglu else N
    return (1 <= M <= MAX_ROWS and jnp.dtype(dtype).itemsize in (2, 4) and (not swiglu or N % 2 == 0)
            and _pick(half, (64, 32, 16)) is not None and _pick(K, (256, 128, 64, 32, 16)) is not None)


@functools.partial(jax.jit, static_argnames=("swiglu", "out_dtype", "bn", "bk", "splits", "num_warps",
                                             "num_stages", "interpret"))
def matmul(x, w, *, swiglu: bool = False, out_dtype=None, bn: int | None = None, bk: int | None = None,
           splits: int = 1, num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """x [..., K] (at most MAX_ROWS rows) @ w [K, N] -> [..., N] in out_dtype (default x's; f32
    accumulation), or with swiglu [..., N / 2] = silu(x @ w[:, :N/2]) * (x @ w[:, N/2:])."""
    lead, K = x.shape[:-1], x.shape[-1]
    M = 1
    for d in lead:
        M *= d
    K2, N = w.shape
    if K2 != K or x.dtype != w.dtype:
        raise Unsupported(f"skinny matmul: x {x.shape} {x.dtype}, w {w.shape} {w.dtype} do not agree")
    if not supported(M, K, N, x.dtype, swiglu):
        raise Unsupported(f"skinny matmul: M={M}, K={K}, N={N}, {x.dtype} (swiglu={swiglu}) has no tiling")
    half = N // 2 if swiglu else N
    bm = max(16, round_up(M, 16))
    bn = bn or _pick(half, (64, 32, 16))
    bk = bk or _pick(K, (256, 128, 64, 32, 16))
    if half % bn or K % bk or (K // bk) % splits:
        raise Unsupported(f"skinny matmul: K={K}, N={half} do not tile by bn={bn}, bk={bk}, splits={splits}")
    x2 = x.reshape(M, K)
    if bm != M:
        x2 = jnp.pad(x2, ((0, bm - M), (0, 0)))
    final = jnp.dtype(out_dtype or x.dtype)
    buf = jnp.float32 if splits > 1 else final
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, steps=K // bk // splits, half=half, swiglu=swiglu)
    with quiet_triton():
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((splits, bm, half), buf),
            grid=(half // bn, splits),
            in_specs=[pl.BlockSpec((bm, K), lambda j, s: (0, 0)), pl.BlockSpec((K, N), lambda j, s: (0, 0))],
            out_specs=pl.BlockSpec((splits, bm, half), lambda j, s: (0, 0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="dflash_skinny_gpu",
        )(x2, w)
    y = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(final)
    return y[:M].reshape(*lead, half)
