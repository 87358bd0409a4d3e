"""The KV cache: one [B, Hkv, C, D] buffer per layer for K and for V, fixed capacity C, per-row lengths.

Entries at or past a row's length are stale: attention never reads them (k_end masks them) and the
next write overwrites them. Inside the compiled loop the cache is loop state, so XLA updates it in
place; outside, functions that take a cache donate it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple        # per layer [B, Hkv, C, D]
    v: tuple        # per layer [B, Hkv, C, D]
    lens: jax.Array  # [B] int32: valid entries per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype):
        shape = (batch, num_kv_heads, capacity, head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lens=jnp.zeros((batch,), jnp.int32))


def write_rows(cache, new, start):
    """cache [B, Hkv, C, D] ← new [B, T, Hkv, D] at rows [start[b], start[b] + T) of each batch row.
    Callers guarantee start + T <= C (dynamic_update_slice would otherwise clamp and misplace)."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)                        # [B, Hkv, T, D]
    if cache.shape[0] == 1:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, start[0], 0))
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (0, s, 0)))(cache, new, start)
