"""The paged KV cache's layout as the block-attention family reads it (the shape contract and the
gather); the paged kernels are in tpu.py and gpu.py, the dispatch and its XLA reference
(`block_attention_paged`, `xla_block_attention_paged`) beside block_attention in __init__.py.

`block_attention_paged(q[B,T,Hq,D], k_pool[N,Hkv,page,D], v_pool[N,Hkv,page,D], table[B,P], k_end[B,T])
-> [B,T,Hq,D]`: row b's key position t lives in pool page table[b, t // page] at row t % page, so
the result is `block_attention(q, view_k, view_v, k_end)` on the gathered view [B, Hkv, P*page, D]
(`gather_pages`; dflash_jax.cache.PagedKVCache's layout, page 0 its dummy page). Table entries past a
row's pages may name any page: their keys are past k_end.

impl:
  "tpu"  tpu.block_attention_paged: each KV tile is whole pages, DMA'd from the pools by page id
         (the scalar-prefetched table in the K/V index_maps); pages of 8k rows (f32) / 16k (bf16),
         tiles of up to 1024 keys. (tpu.block_attention_qkv_paged: the same with the TPU layer's
         q prologue, q read out of the projection.)
  "gpu"  gpu.block_attention_paged: each KV tile loads its page id(s) from the table; any page
         (a tile inside one page is a slice of it, a tile over several pages a gather load).
  "xla"  xla_block_attention_paged: the gather, then xla_block_attention (the reference).
  "auto" as block_attention picks.
A shape a kernel cannot take raises Unsupported inside it; the dispatch then falls back to "xla"
(said once per reason), as block_attention does.
"""

from __future__ import annotations

import jax.numpy as jnp


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
