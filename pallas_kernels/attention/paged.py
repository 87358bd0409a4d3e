"""Block attention over a paged KV cache: one signature, the same backends as `block_attention`.

`block_attention_paged(q[B,T,Hq,D], k_pool[N,Hkv,page,D], v_pool[N,Hkv,page,D], table[B,P], k_end[B,T])
-> [B,T,Hq,D]`: row b's key position t lives in pool page table[b, t // page] at row t % page, so
the result is `block_attention(q, view_k, view_v, k_end)` on the gathered view [B, Hkv, P*page, D]
(`gather_pages`; dflash_jax.cache.PagedKVCache's layout, page 0 its dummy page). Table entries past a
row's pages may name any page: their keys are past k_end.

impl:
  "tpu"  tpu.block_attention_paged: each KV tile is whole pages, DMA'd from the pools by page id
         (the scalar-prefetched table in the K/V index_maps); pages of 8k rows (f32) / 16k (bf16).
  "gpu"  gpu.block_attention_paged: each KV tile loads its page id from the table; pages of a power
         of two >= 16 rows.
  "xla"  xla_block_attention_paged: the gather, then xla_block_attention (the reference).
  "auto" as block_attention picks.
A shape a kernel cannot take raises Unsupported inside it; this dispatch then falls back to "xla"
(said once per reason), as block_attention does.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from pallas_kernels._common import Unsupported, warn_once

_log = logging.getLogger(__name__)


def check_paged_shapes(q, k_pool, v_pool, table, k_end):
    """Shape errors that no backend can handle (as opposed to Unsupported tilings)."""
    if q.ndim != 4 or k_pool.ndim != 4 or table.ndim != 2:
        raise ValueError(f"q must be [B,T,Hq,D], pools [N,Hkv,page,D], table [B,P]; got {q.shape}, "
                         f"{k_pool.shape}, {table.shape}")
    B, T, Hq, D = q.shape
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ")
    if k_pool.shape[3] != D or Hq % k_pool.shape[1]:
        raise ValueError(f"pool {k_pool.shape} does not match q {q.shape} (head_dim, Hq % Hkv)")
    if table.shape[0] != B:
        raise ValueError(f"table {table.shape} does not match batch {B}")
    if k_end.shape != (B, T):
        raise ValueError(f"k_end must be [B,T]={(B, T)}; got {k_end.shape}")


def gather_pages(pool, table):
    """The dense view of a paged layer: pool [N, Hkv, page, D], table [B, P] -> [B, Hkv, P*page, D]."""
    B, P = table.shape
    g = pool[table]                                                           # [B, P, Hkv, page, D]
    return jnp.swapaxes(g, 1, 2).reshape(B, pool.shape[1], P * pool.shape[2], pool.shape[3])


def xla_block_attention_paged(q, k_pool, v_pool, table, k_end, *, scale: float | None = None,
                              k_start=None, kv_chunk: int | None = None):
    """The reference: gather each row's pages into the dense view, then `xla_block_attention`."""
    from pallas_kernels.attention import xla_block_attention
    check_paged_shapes(q, k_pool, v_pool, table, k_end)
    return xla_block_attention(q, gather_pages(k_pool, table), gather_pages(v_pool, table), k_end,
                               scale=scale, k_start=k_start, kv_chunk=kv_chunk)


def block_attention_paged(q, k_pool, v_pool, table, k_end, *, impl: str = "auto", interpret=False,
                          scale: float | None = None, k_start=None, **tuning):
    """Dispatch to a paged kernel (module docstring). interpret: False, True, or a
    pltpu.InterpretParams for the TPU kernel. k_start [B, T] or None: each row's first key
    (sliding-window layers). tuning: forwarded to the chosen kernel (TPU: block_q,
    pages_per_block; GPU: gpu.block_attention's); ignored by "xla"."""
    from pallas_kernels.attention import IMPLS, default_impl
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    check_paged_shapes(q, k_pool, v_pool, table, k_end)
    if impl == "auto":
        impl = default_impl(interpret)
    try:
        if impl == "tpu":
            from pallas_kernels.attention import tpu
            if interpret is True:
                from jax.experimental.pallas import tpu as pltpu
                interpret = pltpu.InterpretParams()
            return tpu.block_attention_paged(q, k_pool, v_pool, table, k_end, scale=scale,
                                             interpret=interpret, k_start=k_start, **tuning)
        if impl == "gpu":
            from pallas_kernels.attention import gpu
            return gpu.block_attention_paged(q, k_pool, v_pool, table, k_end, scale=scale,
                                             interpret=bool(interpret), k_start=k_start, **tuning)
    except Unsupported as e:
        warn_once(_log, f"paged {impl}: {e}", "pallas %s paged kernel cannot take q%s pool%s (%s): using "
                  "the XLA gather (said once per reason)", impl, q.shape, k_pool.shape, e)
    return xla_block_attention_paged(q, k_pool, v_pool, table, k_end, scale=scale, k_start=k_start)
