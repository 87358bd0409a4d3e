"""The GPU path's paged KV write as a Pallas Triton kernel: a block's new K/V rows stored straight
into their pages, the pools aliased in/out.

    k_pool, v_pool = write_kv_pages(k_pool, v_pool, k, v, start, table)
    # pools [N, Hkv, page, D]; k, v [B, T, Hkv, D]; position p = start[b] + t of row b goes to
    # pool[table[b, p // page], :, p % page]

The same pools as `dflash_jax.cache.PagedKVCache`'s XLA write (`_scatter`), except where that write
drops a position past the table (p // page >= P): here it lands in page 0, the dummy page that the
allocator never hands out and no row reads (`dflash_jax.serving.pages`), so every store is
unconditional. Why a kernel: XLA's page-wise write is a gather of the pages the block touches, a
row update and a scatter back, for K and for V of every layer; this is one kernel per layer that
moves only the new rows.

Grid (B, Hkv, T / bt): a program stores bt rows of one kv head of one batch row, each row to its own
page and offset (a scatter store of [bt, D]; bt the largest power of two <= 16 dividing T, since
Triton tensors are powers of two). Pages a row writes are its own (shared prefix pages are full and
lie before every write), so no two programs store the same row of a live page.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import Unsupported

__all__ = ["write_kv_pages", "DUMMY_PAGE"]

DUMMY_PAGE = 0      # where positions past the table go (dflash_jax.serving.pages: never handed out)
_MAX_ROWS = 16


def _rows_tile(T: int) -> int:
    """The largest power of two <= _MAX_ROWS dividing T."""
    return min(T & -T, _MAX_ROWS)


def _kernel(start_ref, table_ref, nk_ref, nv_ref, kp_in, vp_in, kp_ref, vp_ref, *, bt: int, ps: int, P: int):
    # start_ref [B] (whole); table_ref [P] (row b); nk_ref / nv_ref [bt, D] (rows i*bt.. of row b,
    # kv head h); kp_ref / vp_ref [N, ps, D] (kv head h of the pools, aliased to kp_in / vp_in)
    del kp_in, vp_in
    b, i = pl.program_id(0), pl.program_id(2)
    pos = start_ref[b] + i * bt + lax.broadcasted_iota(jnp.int32, (bt,), 0)      # [bt]
    at = lax.div(pos, ps)
    ids = jnp.where(at < P, table_ref[jnp.minimum(at, P - 1)], DUMMY_PAGE)
    off = lax.rem(pos, ps)
    kp_ref[ids, off, :] = nk_ref[...].astype(kp_ref.dtype)
    vp_ref[ids, off, :] = nv_ref[...].astype(vp_ref.dtype)


def write_kv_pages(k_pool, v_pool, k, v, start, table, *, interpret=False):
    """k_pool, v_pool [N, Hkv, page, D] ← k, v [B, T, Hkv, D] at positions [start[b], start[b] + T)
    of row b (start >= 0), position p in page table[b, p // page] at row p % page; positions past the
    table go to the dummy page 0. Returns the new pools (the inputs' buffers, aliased). Raises
    Unsupported for a shape Triton cannot tile (head_dim not a power of two)."""
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"pools {k_pool.shape} / {v_pool.shape} must be equal [N, Hkv, page, D] buffers")
    N, Hkv, ps, D = k_pool.shape
    B, T = k.shape[:2]
    if k.shape != v.shape or k.shape[2:] != (Hkv, D) or start.shape != (B,) or table.ndim != 2 \
            or table.shape[0] != B:
        raise ValueError(f"new rows {k.shape}, start {start.shape}, table {table.shape} do not fit pools {k_pool.shape}")
    if D & (D - 1):
        raise Unsupported(f"head_dim {D} is not a power of two (Triton tensors)")
    if T == 0:
        return k_pool, v_pool
    bt = _rows_tile(T)
    P = table.shape[1]
    new_spec = pl.BlockSpec((None, bt, None, D), lambda b, h, i: (b, i, h, 0))
    pool_spec = pl.BlockSpec((N, None, ps, D), lambda b, h, i: (0, h, 0, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        return pl.pallas_call(
            functools.partial(_kernel, bt=bt, ps=ps, P=P),
            out_shape=(jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                       jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)),
            grid=(B, Hkv, T // bt),
            in_specs=[pl.BlockSpec((B,), lambda b, h, i: (0,)),
                      pl.BlockSpec((None, P), lambda b, h, i: (b, 0)),
                      new_spec, new_spec, pool_spec, pool_spec],
            out_specs=(pool_spec, pool_spec),
            input_output_aliases={4: 0, 5: 1},
            compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
            interpret=interpret,
            name="dflash_write_kv_pages_gpu",
        )(start.astype(jnp.int32), table.astype(jnp.int32), k, v, k_pool, v_pool)
