"""The KV cache contract: every model, draft and loop program reads and writes K/V through the
methods below, never through a layout of its own.

Two storages behind one interface:
- `KVCache` (dense rows): one [B, Hkv, C, D] buffer per layer for K and for V, fixed capacity C per
  row. The one-shot `generate` and the fixed-slot engine use it (no gather per layer: fastest).
- `PagedKVCache` (pages): one pool [N, Hkv, page, D] per layer shared by every row, and a page
  table [B, P] of page ids per row (row b's position t lives in page table[b, t // page] at
  offset t % page; page 0 is the dummy page that padding points at). The paged slot engine uses it
  for the target and the draft's context with ONE table, so a prefix hit on the target's pages is a
  hit on the draft's (dflash_jax.serving.pages owns the host-side allocation and prefix index). A
  sliding-window draft layer may instead live in a pool of its own read through a SECOND table
  (`window_table`, the same logical page index; `windowed` names those layers): the host
  (`pages.WindowPages`) holds window pages only for the logical pages the layer's window and the
  step's reach can touch, and points the entries behind at the dummy page, which the window mask
  (`k_start`) hides. Without a window table a sliding layer keeps every row in the main pages (its
  window a mask, not a ring).

Interface (both): `layer_kv(i)` the layer's K/V as dense [B, Hkv, C, D] views (a paged layer's is a
gather of its rows' pages, what the XLA path and meshes attend over; on the Pallas TPU and GPU paths
off a mesh the layers instead write their rows with `write_rows` and the attention kernel reads the
pools through the table: dflash_jax.attention.reads_pages), `set_layer(i, k, v, lo, rows)` the layer after a forward
wrote rows [lo, lo + rows) of each row into those views (a paged layer scatters back only the
pages those rows touch), `write_rows(i, k, v, start)` new rows written directly, `lens`,
`capacity` (positions per row).

Entries at or past a row's length are stale: attention never reads them (k_end masks them) and the
next write overwrites them. Inside the compiled loop the cache is loop state, so XLA updates it in
place; outside, functions that take a cache donate it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.kernel_config import GPU_PATHS


@struct.dataclass
class KVCache:
    k: tuple        # per layer [B, Hkv, C, D]
    v: tuple        # per layer [B, Hkv, C, D]
    lens: jax.Array  # [B] int32: valid entries per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def layer_kv(self, i: int):
        """Layer i's (k, v) [B, Hkv, C, D]."""
        return self.k[i], self.v[i]

    def set_layer(self, i: int, k, v, lo=None, rows: int = 0) -> "KVCache":
        """The cache with layer i's buffers replaced (lo, rows: see PagedKVCache.set_layer)."""
        return self.replace(k=_put(self.k, i, k), v=_put(self.v, i, v))

    def write_rows(self, i: int, k, v, start, kernels=None) -> "KVCache":
        """Layer i with k, v [B, T, Hkv, D] written at rows [start[b], start[b] + T) (kernels: as
        PagedKVCache.write_rows'; the dense layers write through write_kv_rows themselves)."""
        return self.set_layer(i, write_rows(self.k[i], k, start), write_rows(self.v[i], v, start))

    @classmethod
    def zeros(cls, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype):
        shape = (batch, num_kv_heads, capacity, head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lens=jnp.zeros((batch,), jnp.int32))


def _put(xs: tuple, i: int, x) -> tuple:
    return xs[:i] + (x,) + xs[i + 1:]


@struct.dataclass
class PagedKVCache:
    k: tuple         # per layer: a pool [N, Hkv, page, D]
    v: tuple
    lens: jax.Array  # [B] int32
    table: jax.Array  # [B, P] int32 page ids (0: the dummy page)
    page_size: int = struct.field(pytree_node=False, default=16)
    window_table: jax.Array | None = None   # [B, P]: the windowed layers' pages (pages.WindowPages), or None
    windowed: tuple = struct.field(pytree_node=False, default=())   # per layer: read through window_table

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.page_size

    @classmethod
    def zeros(cls, num_pages: int, page_size: int, batch: int, pages_per_row: int, layers, dtype,
              window_pages: int | None = None, windowed=()):
        """layers: per layer (Hkv, D). windowed (with window_pages): per layer, whether its pools
        are window pools of window_pages pages read through a second table."""
        windowed = tuple(bool(w) for w in windowed) if window_pages is not None and any(windowed) else ()

        def pool(i, h, d):
            n = window_pages if windowed and windowed[i] else num_pages
            return jnp.zeros((n, h, page_size, d), dtype)
        table = jnp.zeros((batch, pages_per_row), jnp.int32)
        return cls(k=tuple(pool(i, *x) for i, x in enumerate(layers)), v=tuple(pool(i, *x) for i, x in enumerate(layers)),
                   lens=jnp.zeros((batch,), jnp.int32), table=table, page_size=int(page_size),
                   window_table=table if windowed else None, windowed=windowed)

    def with_tables(self, tables) -> "PagedKVCache":
        """The cache with its page table(s): an array [B, P] (the main table), a pair (main, window
        table: a cache without window layers ignores the second; one with them needs it), or None
        (the per-row state without tables: the slot state keeps none)."""
        if tables is None:
            return self.replace(table=None, window_table=None)
        main, window = tables if isinstance(tables, (tuple, list)) else (tables, None)
        if self.windowed and window is None:
            raise ValueError("this cache has window layers: give (main table, window table)")
        return self.replace(table=main, window_table=window if self.windowed else None)

    def layer_table(self, i: int):
        """The page table layer i reads through."""
        return self.window_table if self.windowed and self.windowed[i] else self.table

    def specs(self, mesh) -> "PagedKVCache":
        """PartitionSpecs on `mesh`: pools by kv head on 'model' (every page on every data shard:
        any row may own any page), lens and table rows on 'data'."""
        from jax.sharding import PartitionSpec as P

        from dflash_jax import sharding
        kv, lens = sharding.cache_specs(self.k[0].shape[1], mesh)
        pool = P(None, *kv[1:])
        return self.replace(k=tuple(pool for _ in self.k), v=tuple(pool for _ in self.v), lens=lens,
                            table=None if self.table is None else P("data", None),
                            window_table=None if self.window_table is None else P("data", None))

    def pools(self) -> tuple:
        """(k, v): the part every row shares, which row gathers and scatters leave alone."""
        return self.k, self.v

    def rows_part(self) -> "PagedKVCache":
        """The cache without its pools (the per-row part: lens, table)."""
        return self.replace(k=None, v=None)

    def with_pools(self, pools) -> "PagedKVCache":
        """A rows_part() with its pools (from pools()) back."""
        return self.replace(k=pools[0], v=pools[1])

    def _view(self, pool, table):
        from dflash_jax import sharding
        B, P = table.shape
        g = pool[table]                                                          # [B, P, Hkv, page, D]
        view = jnp.swapaxes(g, 1, 2).reshape(B, pool.shape[1], P * self.page_size, pool.shape[3])
        mesh = sharding.current_mesh()
        if mesh is None:
            return view
        kv, _ = sharding.cache_specs(pool.shape[1], mesh)     # laid out as a dense cache's rows
        return jax.lax.with_sharding_constraint(view, jax.sharding.NamedSharding(mesh, kv))

    def layer_kv(self, i: int):
        """Layer i's (k, v) as [B, Hkv, C, D]: each row's pages gathered (C = P * page)."""
        return self._view(self.k[i], self.layer_table(i)), self._view(self.v[i], self.layer_table(i))

    def _pages_back(self, pool, view, lo, rows: int, table):
        """pool with the pages holding view rows [lo[b], lo[b] + rows) written back from view."""
        B, P = table.shape
        ps, N = self.page_size, pool.shape[0]
        n = min(P, -(-rows // ps) + 1)
        idx = lo[:, None] // ps + jnp.arange(n, dtype=jnp.int32)                   # [B, n] pages of the row
        ok = idx < P
        idx = jnp.minimum(idx, P - 1)
        ids = jnp.where(ok, jnp.take_along_axis(table, idx, axis=1), N)          # N: dropped
        pages = view.reshape(B, view.shape[1], P, ps, view.shape[3])
        pages = jnp.take_along_axis(pages, idx[:, None, :, None, None], axis=2)   # [B, Hkv, n, ps, D]
        pages = jnp.swapaxes(pages, 1, 2).reshape(B * n, view.shape[1], ps, view.shape[3])
        return pool.at[ids.reshape(-1)].set(pages.astype(pool.dtype), mode="drop")

    def set_layer(self, i: int, k, v, lo=None, rows: int = 0) -> "PagedKVCache":
        """Layer i after a forward wrote rows [lo[b], lo[b] + rows) of each row into the views
        layer_kv(i) gave (k, v [B, Hkv, C, D]): the pages those rows touch go back to the pool
        (a page a row shares is full and lies before its writes, so it is never among them)."""
        t = self.layer_table(i)
        return self.replace(k=_put(self.k, i, self._pages_back(self.k[i], k, lo, rows, t)),
                            v=_put(self.v, i, self._pages_back(self.v[i], v, lo, rows, t)))

    def _scatter(self, pool, new, start, table):
        """pool ← new [B, T, Hkv, D] at positions [start[b], + T) of each row (past the capacity:
        dropped). Whole pages: the n pages the rows touch are gathered, the rows written into them
        (a dynamic_update_slice) and the pages scattered back along the pool's page axis. A scatter
        of single positions (pool.at[page, :, offset]) made the TPU compiler copy the whole pool into
        another layout and back at every write (scripts/tpu_paged_step.py measures it)."""
        B, T, H, D = new.shape
        ps, N, P = self.page_size, pool.shape[0], table.shape[1]
        n = -(-T // ps) + 1             # pages a write can touch (those past the table are dropped)
        first = start // ps                                                       # [B]
        idx = first[:, None] + jnp.arange(n, dtype=jnp.int32)                     # [B, n]
        ids = jnp.where(idx < P, jnp.take_along_axis(table, jnp.minimum(idx, P - 1), axis=1), N)
        pages = pool[jnp.minimum(ids, N - 1)]                                     # [B, n, H, ps, D]
        block = jnp.swapaxes(pages, 1, 2).reshape(B, H, n * ps, D)
        upd = jnp.swapaxes(new, 1, 2).astype(pool.dtype)                          # [B, H, T, D]
        off = start - first * ps                                                  # < ps: the write fits
        block = jax.vmap(lambda b, u, o: jax.lax.dynamic_update_slice(b, u, (0, o, 0)))(block, upd, off)
        pages = jnp.swapaxes(block.reshape(B, H, n, ps, D), 1, 2).reshape(B * n, H, ps, D)
        return pool.at[ids.reshape(-1)].set(pages, mode="drop")

    def write_rows(self, i: int, k, v, start, kernels=None) -> "PagedKVCache":
        """Layer i with k, v [B, T, Hkv, D] written at positions [start[b], start[b] + T). kernels
        (the program's resolved KernelConfig): on the TPU attention paths, off a mesh, the rows go
        into their pages through the Pallas page-write kernel (the pools aliased in/out, only the
        touched pages moved: tpu_cache_write.write_kv_pages); on the GPU paths, off a mesh, through the
        Triton page-write kernel (one kernel for K and V storing only the new rows, positions past the
        table into the dummy page 0: gpu_cache_write.write_kv_pages); otherwise XLA's page-wise write
        (_scatter)."""
        from dflash_jax import sharding
        if kernels is not None and kernels.attention in TPU_WRITE_PATHS + GPU_PATHS and sharding.current_mesh() is None:
            from pallas_kernels import Unsupported
            if kernels.attention in GPU_PATHS:
                from pallas_kernels.attention import gpu_cache_write as writer
                interpret = kernels.interpret
            else:
                from jax.experimental.pallas import tpu as pltpu

                from pallas_kernels.attention import tpu_cache_write as writer
                interpret = pltpu.InterpretParams() if kernels.interpret else False
            try:
                kp, vp = writer.write_kv_pages(self.k[i], self.v[i], k, v, start, self.layer_table(i), interpret=interpret)
                return self.replace(k=_put(self.k, i, kp), v=_put(self.v, i, vp))
            except Unsupported:
                pass
        t = self.layer_table(i)
        return self.replace(k=_put(self.k, i, self._scatter(self.k[i], k, start, t)),
                            v=_put(self.v, i, self._scatter(self.v[i], v, start, t)))


def is_paged(cache) -> bool:
    return isinstance(cache, PagedKVCache)


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
