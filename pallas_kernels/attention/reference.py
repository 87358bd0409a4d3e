"""The jnp oracle of the block-attention family. Every kernel is tested against this function.

`block_attention(q, k_cache, v_cache, k_end)`: row t of batch b attends keys `[0, k_end[b, t])`.
  q        [B, T, Hq, D]
  k_cache  [B, Hkv, C, D]   (Hq is a multiple of Hkv: grouped-query attention)
  v_cache  [B, Hkv, C, D]
  k_end    [B, T] int32     (1 <= k_end <= C for rows whose output is used)
  k_start  [B, T] int32 or None: a per-row first key (sliding-window draft layers); rows attend
           [k_start, k_end). None: 0.
  ring     (with k_start) the cache is a ring of C slots: key position p sits in slot p mod C, and
           k_start / k_end are absolute positions with k_end - k_start <= C (a windowed draft
           layer's cache of window + block rows; the caller keeps each row's range in the ring).
  returns  [B, T, Hq, D] in q.dtype, accumulated in float32.
"""

from __future__ import annotations

import jax.numpy as jnp


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None, k_start=None, ring: bool = False):
    B, T, Hq, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("btkgd,bkcd->bkgtc", qg, k_cache, preferred_element_type=jnp.float32) * scale
    slot = jnp.arange(C)[None, None, :]
    if ring and k_start is None:
        raise ValueError("ring=True needs k_start (absolute first keys)")
    if ring:   # slot s holds position k_start + ((s - k_start) mod C) for the row
        visible = jnp.mod(slot - k_start[:, :, None], C) < (k_end - k_start)[:, :, None]   # [B, T, C]
    else:
        visible = slot < k_end[:, :, None]                                  # [B, T, C]
        if k_start is not None:
            visible &= slot >= k_start[:, :, None]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)                                 # rows with no key: output 0
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    # batch-major output, then transpose: XLA:CPU has no bf16 x bf16 -> f32 dot with "->btkgd"
    o = jnp.einsum("bkgtc,bkcd->bkgtd", p.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    o = o / jnp.where(l > 0, l, 1.0)                                       # [B, Hkv, G, T, D]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)
