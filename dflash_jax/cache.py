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


# The attention backends whose programs write cache rows with the TPU row-write kernel.
TPU_WRITE_PATHS = ("pallas_tpu", "pallas_interpret")


def write_kv_rows(k_cache, v_cache, k, v, start, kernels=None):
    """write_rows for a layer's K and V caches together: k, v [B, T, Hkv, D] at rows
    [start[b], start[b] + T). kernels: the resolved KernelConfig of the program (None: XLA).

    On the TPU attention paths the rows go in through the Pallas row-write kernel, the caches
    aliased in/out and kept in HBM (XLA would stage a cache that fits VMEM through it and write
    the whole buffer back, pallas_kernels.attention.tpu_cache_write); a shape it cannot tile, and
    every other path, uses dynamic_update_slice."""
    if kernels is not None and kernels.attention in TPU_WRITE_PATHS:
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels import Unsupported
        from pallas_kernels.attention import tpu_cache_write
        from dflash_jax import sharding
        interpret = pltpu.InterpretParams() if kernels.interpret else False
        try:   # a custom call XLA cannot partition: under a mesh it runs per shard
            return sharding.per_shard_rows(
                lambda kc, vc, k_, v_, s: tpu_cache_write.write_kv_rows(kc, vc, k_, v_, s, interpret=interpret),
                k_cache, v_cache, k, v, start)
        except Unsupported:
            pass
    return write_rows(k_cache, k, start), write_rows(v_cache, v, start)


def write_ring_rows(cache, new, start, valid=None):
    """A ring cache [B, Hkv, R, D] (a windowed draft layer's: position p in slot p mod R) ←
    new [B, T, Hkv, D], the rows at positions [start[b], start[b] + T) of each batch row.

    valid [B] (or None: every row): rows at positions >= valid are a prompt bucket's padding and
    are left out. T <= R with no padding: a scatter of T distinct slots (in place in the loop).
    Otherwise (a prefill of more rows than the ring) each slot takes the last row written to it:
    the position e - 1 - ((e - 1 - s) mod R), e = min(valid, start + T), when that is >= start;
    slots no row reaches keep their old entry."""
    B, T = new.shape[:2]
    R = cache.shape[2]
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)                        # [B, Hkv, T, D]
    if T <= R and valid is None:
        slots = jnp.mod(start[:, None] + jnp.arange(T, dtype=start.dtype), R)   # [B, T] distinct
        return jax.vmap(lambda c, u, s: c.at[:, s].set(u, unique_indices=True))(cache, new, slots)
    end = start + T if valid is None else jnp.minimum(valid, start + T)       # [B]
    s = jnp.arange(R, dtype=start.dtype)
    pos = end[:, None] - 1 - jnp.mod(end[:, None] - 1 - s, R)                  # [B, R]
    ok = (pos >= start[:, None])[:, None, :, None]                             # [B, 1, R, 1]
    rows = jnp.take_along_axis(new, jnp.clip(pos - start[:, None], 0, T - 1)[:, None, :, None], axis=2)
    return jnp.where(ok, rows, cache)


def write_ring_kv_rows(k_cache, v_cache, k, v, start, valid=None):
    """write_ring_rows for a layer's K and V rings together (XLA ops on every path: the TPU row
    writer writes one contiguous range, and a ring's write may wrap)."""
    return write_ring_rows(k_cache, k, start, valid), write_ring_rows(v_cache, v, start, valid)
