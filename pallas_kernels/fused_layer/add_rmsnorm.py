"""The residual add and the RMSNorm after it as one Pallas Triton kernel (GPU path, short blocks)."""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, pltriton

# Residual add + RMSNorm in one kernel (GPU path, short blocks). XLA:GPU runs `x + attn_out` and the
# post-attention RMSNorm as two launch-bound kernels at decode sizes; this is one program per row.

def _add_rmsnorm_kernel(x_ref, y_ref, w_ref, s_ref, n_ref, *, eps: float):
    f32 = jnp.float32
    dt = x_ref.dtype
    s = (x_ref[...].astype(f32) + y_ref[...].astype(f32)).astype(dt)          # [H], as x + y in dt
    sf = s.astype(f32)
    r = lax.rsqrt(jnp.mean(sf * sf) + eps)
    s_ref[...] = s
    n_ref[...] = (w_ref[...].astype(f32) * (sf * r).astype(dt).astype(f32)).astype(n_ref.dtype)


def add_rmsnorm_supported(H: int) -> bool:
    return 16 <= H <= 16384 and not (H & (H - 1))


def add_rmsnorm(x, y, weight, eps: float, *, interpret=False):
    """(x + y, RMSNorm(x + y) * weight) for x, y [..., H] of one dtype, as models.layers computes
    them (the sum rounded to the input dtype, the norm in float32, cast back, times the weight)."""
    H = x.shape[-1]
    if x.shape != y.shape or x.dtype != y.dtype or not add_rmsnorm_supported(H):
        raise Unsupported(f"add_rmsnorm: {x.shape} {x.dtype} + {y.shape} {y.dtype}")
    lead = x.shape[:-1]
    N = math.prod(lead)
    row = pl.BlockSpec((None, H), lambda i: (i, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        s, n = pl.pallas_call(
            functools.partial(_add_rmsnorm_kernel, eps=float(eps)),
            out_shape=[jax.ShapeDtypeStruct((N, H), x.dtype), jax.ShapeDtypeStruct((N, H), x.dtype)],
            grid=(N,),
            in_specs=[row, row, pl.BlockSpec((H,), lambda i: (0,))],
            out_specs=[row, row],
            compiler_params=pltriton.CompilerParams(num_warps=4 if H <= 4096 else 8, num_stages=1),
            interpret=interpret,
            name="dflash_add_rmsnorm",
        )(x.reshape(N, H), y.reshape(N, H), weight.astype(x.dtype))
    return s.reshape(x.shape), n.reshape(x.shape)
