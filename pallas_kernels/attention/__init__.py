"""Block attention for DFlash: one signature, several backends.

`block_attention(q[B,T,Hq,D], k_cache[B,Hkv,C,D], v_cache[B,Hkv,C,D], k_end[B,T]) -> [B,T,Hq,D]`,
row t of batch b attending keys [0, k_end[b, t]). `attention.reference.block_attention` is the oracle.

impl:
  "auto"  the kernel of the default backend (TPU -> "tpu", GPU -> "gpu"); on CPU "xla", or the TPU
          kernel in interpret mode when `interpret` is set.
  "tpu"   Pallas Mosaic TPU kernel (attention/tpu.py). Also what an ahead-of-time TPU compile
          from a CPU host must ask for, since the default backend there is "cpu".
  "gpu"   Pallas Triton kernel (attention/gpu.py); likewise for a CUDA export from a CPU host.
  "xla"   the reference in plain jnp, with the queries chunked when T*C is large (prefill).
A shape a kernel cannot tile (head_dim 96, capacity not a multiple of 128, ...) falls back to "xla".
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import Unsupported, check_shapes
from pallas_kernels.attention.reference import block_attention as reference_block_attention

__all__ = ["block_attention", "reference_block_attention", "xla_block_attention", "IMPLS",
           "Unsupported"]

IMPLS = ("auto", "tpu", "gpu", "xla")
_log = logging.getLogger(__name__)

# Score elements (f32) one query chunk of the XLA path may materialise: 2**26 = 256 MiB.
_XLA_SCORE_BUDGET = 1 << 26


def _xla_dense(q, k_cache, v_cache, k_end, scale):
    """The oracle's own math (its P.V einsum is batch-major, so bf16 batches also run on XLA:CPU)."""
    return reference_block_attention(q, k_cache, v_cache, k_end, scale=scale)


def xla_block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None,
                        q_tile: int | None = None):
    """The reference in XLA ops, with queries processed in tiles (lax.map) so B*tile*Hq*C scores stay bounded.

    A 32k prompt over a 32k cache would otherwise build a [B, Hq, 32k, 32k] f32 score tensor.
    """
    check_shapes(q, k_cache, v_cache, k_end)
    B, T, Hq, D = q.shape
    C = k_cache.shape[2]
    if q_tile is None:
        if B * T * Hq * C <= _XLA_SCORE_BUDGET:
            return _xla_dense(q, k_cache, v_cache, k_end, scale)
        q_tile = 512
        while q_tile > 16 and B * q_tile * Hq * C > _XLA_SCORE_BUDGET:
            q_tile //= 2
    if q_tile >= T:
        return _xla_dense(q, k_cache, v_cache, k_end, scale)
    n = -(-T // q_tile)
    pad = n * q_tile - T
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))                      # [B, n*tile, Hq, D]
    ep = jnp.pad(k_end, ((0, 0), (0, pad)))                                   # [B, n*tile]
    qt = qp.reshape(B, n, q_tile, Hq, D).swapaxes(0, 1)                       # [n, B, tile, Hq, D]
    et = ep.reshape(B, n, q_tile).swapaxes(0, 1)                              # [n, B, tile]
    out = lax.map(lambda a: _xla_dense(a[0], k_cache, v_cache, a[1], scale), (qt, et))                                                   # [n, B, tile, Hq, D]
    return out.swapaxes(0, 1).reshape(B, n * q_tile, Hq, D)[:, :T]


def default_impl(interpret=False) -> str:
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "tpu" if interpret else "xla"


def block_attention(q, k_cache, v_cache, k_end, *, impl: str = "auto", scale: float | None = None,
                    interpret=False, **tuning):
    """Dispatch to a kernel. interpret: False, True, or a pltpu.InterpretParams for the TPU kernel.

    tuning: block sizes etc. forwarded to the chosen kernel (benchmarks); ignored by "xla".
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    check_shapes(q, k_cache, v_cache, k_end)
    if impl == "auto":
        impl = default_impl(interpret)
    try:
        if impl == "tpu":
            from pallas_kernels.attention import tpu
            if interpret is True:
                from jax.experimental.pallas import tpu as pltpu
                interpret = pltpu.InterpretParams()
            return tpu.block_attention(q, k_cache, v_cache, k_end, scale=scale,
                                       interpret=interpret, **tuning)
        if impl == "gpu":
            from pallas_kernels.attention import gpu
            return gpu.block_attention(q, k_cache, v_cache, k_end, scale=scale,
                                       interpret=bool(interpret), **tuning)
    except Unsupported as e:
        _log.warning("pallas %s kernel cannot take q%s cache%s (%s): using the XLA path",
                     impl, q.shape, k_cache.shape, e)
    return xla_block_attention(q, k_cache, v_cache, k_end, scale=scale)
