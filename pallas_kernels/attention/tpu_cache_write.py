"""The TPU path's KV-cache row write as a Pallas Mosaic kernel: the block's new K/V rows into the
caches, the caches aliased in/out and left in HBM.

    k_cache, v_cache = write_kv_rows(k_cache, v_cache, k, v, start)
    # caches [B, Hkv, C, D]; k, v [B, T, Hkv, D]; rows [start[b], start[b] + T) of batch row b

Same result as `dflash_jax.cache.write_rows` (dynamic_update_slice per row; callers guarantee
start + T <= C). Why a kernel: XLA writes a batched row update as a scatter loop, and where a
cache fits VMEM it stages the whole buffer there for that loop and evicts the whole buffer back to
HBM afterwards, so every iteration writes each cache whole instead of T rows. Here the caches are
operands in HBM (memory_space HBM, aliased to the outputs): XLA cannot stage them, and the kernel
moves only a window of rows around each write.

The window. A DMA into HBM must start and end on the layout's row tiles (8 rows of the [C, D]
plane), and `start` is arbitrary, so for each batch row the kernel reads the tile-aligned window of
W = round_up(T + 7, 8) rows that covers [start, start + T) (moved down to end at C where it would
pass the end), puts the new rows in it (a sublane rotate by the offset and a select), and writes the
window back. Traffic per call: 2 · B · Hkv · W · D elements of each cache, plus the new rows.

The caches are pinned to HBM for XLA with pltpu.with_memory_space_constraint (the BlockSpec's
memory space binds only the kernel's own view). Known limit of the TPU compiler: a program whose
donated input cache is written only by this kernel and returned unread fails XLA's alias check
(RET_CHECK "Different aliasing shapes"); the generation program and its iteration, where the
attention kernel reads every written cache, compile.

Batch rows are processed in chunks of `rows` (a grid axis): all reads of a chunk are started, then
waited on, merged, and all its writes started and waited on, so the DMAs of a chunk overlap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import Unsupported, round_up

# HBM row tile of a [C, D] cache plane (f32 (8, 128); bf16 (8, 128)(2, 1)): a DMA's row offset
# must be a multiple of it.
ROW_TILE = 8
# VMEM for one chunk's buffers (the new rows and the window, for K and for V): well inside the
# default scoped VMEM of every TPU generation.
_CHUNK_BUDGET = 4 << 20
_DTYPES = (jnp.float32, jnp.bfloat16)

__all__ = ["write_kv_rows", "write_kv_rows_qkv", "write_kv_pages", "qkv_supported", "window_rows", "ROW_TILE"]


def window_rows(T: int) -> int:
    """Rows W of the aligned window that covers any T rows."""
    return round_up(T + ROW_TILE - 1, ROW_TILE)


def _window_ops(start_ref, kc_ref, vc_ref, kbuf, vbuf, sems, b0, *, W: int, C: int, rows: int):
    """The two row writers' shared pieces: window(j) → (start, tile-aligned window start w0) of batch
    row b0 + j; dma(j, read) → its K and V window copies (HBM → VMEM if read, else back); each(fn)
    runs fn(j) for the block's rows."""
    def window(j):
        s = start_ref[b0 + j]
        w0 = pl.multiple_of(jnp.minimum(jnp.bitwise_and(s, -ROW_TILE), C - W), ROW_TILE)
        return s, w0

    def dma(j, read: bool):
        _, w0 = window(j)
        b = b0 + j
        pairs = ((kc_ref, kbuf, 0), (vc_ref, vbuf, 1))
        return [pltpu.make_async_copy(c.at[b, :, pl.ds(w0, W), :], buf.at[j], sems.at[i, j]) if read
                else pltpu.make_async_copy(buf.at[j], c.at[b, :, pl.ds(w0, W), :], sems.at[i, j])
                for c, buf, i in pairs]

    def each(fn):
        lax.fori_loop(0, rows, lambda j, c: (fn(j), c)[1], 0)

    return window, dma, each


def _kernel(start_ref, nk_ref, nv_ref, kc_in, vc_in, kc_ref, vc_ref, kbuf, vbuf, sems, *,
            T: int, W: int, C: int, rows: int):
    # start_ref [B] int32 (SMEM); nk_ref/nv_ref [rows, Hkv, W, D] (VMEM, new rows at the top);
    # kc_ref/vc_ref [B, Hkv, C, D] (HBM, aliased to kc_in/vc_in); kbuf/vbuf [rows, Hkv, W, D] VMEM
    del kc_in, vc_in
    b0 = pl.program_id(0) * rows

    window, dma, each = _window_ops(start_ref, kc_ref, vc_ref, kbuf, vbuf, sems, b0, W=W, C=C, rows=rows)

    each(lambda j: [d.start() for d in dma(j, True)])
    each(lambda j: [d.wait() for d in dma(j, True)])

    def merge(j):
        s, w0 = window(j)
        r = s - w0                                   # the new rows go to window rows [r, r + T)
        for new_ref, buf in ((nk_ref, kbuf), (nv_ref, vbuf)):
            # f32 for the rotate (exact for bf16); the new rows come padded to W at the top
            new = new_ref[j].astype(jnp.float32)                                 # [Hkv, W, D]
            row = lax.broadcasted_iota(jnp.int32, new.shape, 1)
            put = jnp.logical_and(row >= r, row < r + T)
            buf[j] = jnp.where(put, pltpu.roll(new, r, 1), buf[j].astype(jnp.float32)).astype(buf.dtype)

    each(merge)
    each(lambda j: [d.start() for d in dma(j, False)])
    each(lambda j: [d.wait() for d in dma(j, False)])


def _chunk_rows(B: int, row_bytes: int) -> int:
    """The largest divisor of B whose chunk of buffers fits the budget."""
    fits = [r for r in range(1, B + 1) if B % r == 0 and r * row_bytes <= _CHUNK_BUDGET]
    if not fits:
        raise Unsupported(f"one batch row's window buffers ({row_bytes} bytes) exceed the "
                          f"{_CHUNK_BUDGET}-byte VMEM budget")
    return fits[-1]


def write_kv_rows(k_cache, v_cache, k, v, start, *, interpret=False):
    """k_cache, v_cache [B, Hkv, C, D] ← k, v [B, T, Hkv, D] at rows [start[b], start[b] + T).
    start [B] int32, start + T <= C (the caller's guarantee, as for dynamic_update_slice).
    interpret: False, or pltpu.InterpretParams() to run on CPU. Raises Unsupported for a shape
    it cannot tile (callers write with XLA instead)."""
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} "
                         f"{v_cache.dtype} must be equal [B, Hkv, C, D] buffers")
    B, Hkv, C, D = k_cache.shape
    if k.shape != v.shape or k.ndim != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (B, Hkv, D):
        raise ValueError(f"new rows k {k.shape}, v {v.shape} must be [B, T, Hkv, D] of the cache {k_cache.shape}")
    if start.shape != (B,):
        raise ValueError(f"start must be [B]={(B,)}; got {start.shape}")
    T = k.shape[1]
    W = window_rows(T)
    dtype = jnp.dtype(k_cache.dtype)
    if dtype not in map(jnp.dtype, _DTYPES):
        raise Unsupported(f"cache dtype {dtype} not supported")
    if C % ROW_TILE or W > C:
        raise Unsupported(f"capacity C={C} must be a multiple of {ROW_TILE} and hold {W} rows")
    rows = _chunk_rows(B, 4 * Hkv * W * D * dtype.itemsize)

    return _call(k_cache, v_cache, k, v, start.astype(jnp.int32), T=T, W=W, rows=rows, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("T", "W", "rows", "interpret"))
def _call(k_cache, v_cache, k, v, start, *, T: int, W: int, rows: int, interpret):
    # jitted: the memory-space constraint below only exists inside a traced program
    B, Hkv, C, D = k_cache.shape
    dtype = jnp.dtype(k_cache.dtype)
    if not interpret:
        # HBM at the XLA level too: a BlockSpec's memory space alone binds only the kernel's view,
        # and XLA would still place a cache that fits in VMEM and evict it whole afterwards.
        k_cache = pltpu.with_memory_space_constraint(k_cache, pltpu.HBM)
        v_cache = pltpu.with_memory_space_constraint(v_cache, pltpu.HBM)

    def pad(x):   # [B, T, Hkv, D] -> [B, Hkv, W, D], the new rows at the top
        x = jnp.swapaxes(x, 1, 2).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, W - T), (0, 0)))

    new_spec = pl.BlockSpec((rows, Hkv, W, D), lambda i, *_: (i, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    kernel = functools.partial(_kernel, T=T, W=W, C=C, rows=rows)
    window_bytes = B * Hkv * W * D * dtype.itemsize
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, dtype), jax.ShapeDtypeStruct(v_cache.shape, dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B // rows,),
            in_specs=[new_spec, new_spec, hbm, hbm],
            out_specs=(hbm, hbm),
            scratch_shapes=[pltpu.VMEM((rows, Hkv, W, D), dtype), pltpu.VMEM((rows, Hkv, W, D), dtype),
                            pltpu.SemaphoreType.DMA((2, rows))],
        ),
        # operands count the scalar-prefetch start: (start, new k, new v, k cache, v cache)
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        # what moves: each cache's windows read and written, the new rows read
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=6 * window_bytes),
        interpret=interpret,
        name="dflash_kv_write_tpu",
    )(start, pad(k), pad(v), k_cache, v_cache)


# ------------------------------------------------------------------ k/v straight out of the qkv output

def _qkv_kernel(*refs, T: int, W: int, C: int, rows: int, r0: int, Hkv: int, D: int, eps: float, Tc: int):
    # start_ref [B] int32 (SMEM) (and with Tc > 0, ctx_ref [B]: where the Tc context rows go; the
    # window then starts from it); k_ref/v_ref [rows, Tb, Hkv*D] (VMEM): the k / v column block of
    # the qkv output, the written rows at [r0, r0 + Tc + T); cos_ref/sin_ref [rows, Tc + T, D] f32
    # (sin signed); w_ref [1, D] the k_norm weight; kc_ref/vc_ref [B, Hkv, C, D] (HBM, aliased to
    # kc_in/vc_in); kbuf/vbuf [rows, Hkv, W, D] VMEM windows; nbuf [W, D] f32 (one head's new rows,
    # at the top)
    from pallas_kernels.attention.tpu import norm_rope
    if Tc:
        start_ref, ctx_ref, *refs = refs
    else:
        start_ref, *refs = refs
        ctx_ref = None
    (k_ref, v_ref, cos_ref, sin_ref, w_ref, kc_in, vc_in, kc_ref, vc_ref, kbuf, vbuf, nbuf, sems) = refs
    del kc_in, vc_in
    b0 = pl.program_id(0) * rows
    n = Tc + T

    window, dma, each = _window_ops(ctx_ref if Tc else start_ref, kc_ref, vc_ref, kbuf, vbuf, sems, b0,
                                    W=W, C=C, rows=rows)

    each(lambda j: [d.start() for d in dma(j, True)])

    def merge(j):
        s0, w0 = window(j)
        row = lax.broadcasted_iota(jnp.int32, (W, D), 0)
        # the block's rows go to window rows [rb, rb + T); the context's (first, the block wins
        # where they overlap) to [s0 - w0, + Tc)
        rb = (start_ref[b0 + j] if Tc else s0) - w0
        put_b = jnp.logical_and(row >= rb, row < rb + T)
        if Tc:
            rc = s0 - w0
            put_c = jnp.logical_and(row >= rc, row < rc + Tc)
        for h in range(Hkv):
            for new_ref, buf, is_k in ((k_ref, kbuf, True), (v_ref, vbuf, False)):
                x = new_ref[j, r0:r0 + n, h * D:(h + 1) * D]                     # [Tc + T, D]
                if is_k:
                    x = norm_rope(x, cos_ref[j], sin_ref[j], w_ref[...], eps)
                # f32 for the rotate (exact for bf16); rows [Tc + T, W) of nbuf are never selected
                nbuf[0:n, :] = x.astype(buf.dtype).astype(jnp.float32)
                old = buf[j, h].astype(jnp.float32)
                if Tc:   # nbuf row Tc + i -> window row rb + i; row i -> rc + i
                    old = jnp.where(put_c, pltpu.roll(nbuf[...], rc, 0), old)
                    sb = rb - Tc
                    blk = pltpu.roll(nbuf[...], jnp.where(sb < 0, sb + W, sb), 0)
                else:
                    blk = pltpu.roll(nbuf[...], rb, 0)
                buf[j, h] = jnp.where(put_b, blk, old).astype(buf.dtype)

    def wait_merge(j):
        for d in dma(j, True):
            d.wait()
        merge(j)

    each(wait_merge)
    each(lambda j: [d.start() for d in dma(j, False)])
    each(lambda j: [d.wait() for d in dma(j, False)])


def qkv_supported(Tall: int, t0: int, T: int, Hq: int, Hkv: int, D: int, C: int, dtype, N: int) -> bool:
    """Whether `write_kv_rows_qkv` takes this shape: plain [q | k | v] columns whose k and v blocks
    are whole lanes and start on a block boundary, a cache dtype it writes, a window that fits C."""
    if jnp.dtype(dtype) not in map(jnp.dtype, _DTYPES) or D % 128 or Hq % Hkv or N != (Hq + 2 * Hkv) * D:
        return False
    if T <= 0 or t0 + T > Tall:
        return False
    return C % ROW_TILE == 0 and window_rows(T) <= C


def write_kv_rows_qkv(k_cache, v_cache, qkv, cos, sin, k_norm_weight, eps: float, start, *,
                      num_heads: int, t0: int = 0, T: int | None = None, ctx_rows: int = 0,
                      ctx_start=None, interpret=False):
    """write_kv_rows for K/V taken straight out of the fused projection's output: rows [t0, t0 + T)
    of qkv [B, Tall, (Hq + 2 Hkv) D] (the plain [q | k | v] layout), k normed (k_norm_weight [D],
    eps) and rotated (cos, sin [B, T, D/2] float32 at those rows' positions) with models.layers'
    roundings, written at cache rows [start[b], start[b] + T). The kernel reads the k and v column
    blocks itself, so k never exists in HBM as [B, T, Hkv, D] (a relayout copy of the matmul's tiles
    on TPU) and nothing is padded. Raises Unsupported where qkv_supported is false.

    ctx_rows = Tc > 0 (the draft's context then its block, one call): rows [t0 - Tc, t0) go to
    [ctx_start[b], + Tc) first, then rows [t0, t0 + T) to [start[b], + T) (the block wins where they
    overlap); cos, sin cover all Tc + T rows. Needs 0 <= start - ctx_start <= Tc (the draft's
    pending context ends at the block: ctx_start = start - pending count), so one window of
    window_rows(Tc + T) rows covers both."""
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} "
                         f"{v_cache.dtype} must be equal [B, Hkv, C, D] buffers")
    B, Hkv, C, D = k_cache.shape
    if qkv.ndim != 3 or qkv.shape[0] != B:
        raise ValueError(f"qkv {qkv.shape} must be [B={B}, T, N]")
    Tall, N = qkv.shape[1:]
    T = Tall - t0 if T is None else T
    Tc = int(ctx_rows)
    if Tc and (ctx_start is None or ctx_start.shape != (B,) or t0 < Tc):
        raise ValueError(f"ctx_rows={Tc} needs ctx_start [B]={(B,)} and t0 >= ctx_rows (t0={t0})")
    if start.shape != (B,) or cos.shape != (B, Tc + T, D // 2) or sin.shape != cos.shape:
        raise ValueError(f"start {start.shape}, cos {cos.shape}, sin {sin.shape} must be [B], [B, Tc + T, D/2] "
                         f"for B={B}, Tc={Tc}, T={T}, D={D}")
    if not qkv_supported(Tall, t0 - Tc, Tc + T, num_heads, Hkv, D, C, k_cache.dtype, N):
        raise Unsupported(f"write_kv_rows_qkv: qkv {qkv.shape} t0={t0} T={T} Tc={Tc} Hq={num_heads} "
                          f"cache {k_cache.shape}")
    W = window_rows(Tc + T)
    dtype = jnp.dtype(k_cache.dtype)
    # the window buffers, the k/v blocks (double-buffered) and the rope tables, per batch row
    row_bytes = 2 * Hkv * W * D * dtype.itemsize + 4 * Tall * Hkv * D * qkv.dtype.itemsize + 16 * (Tc + T) * D
    rows = _chunk_rows(B, row_bytes)
    cos_full = jnp.concatenate([cos, cos], axis=-1).astype(jnp.float32)           # [B, Tc + T, D]
    sin_signed = jnp.concatenate([-sin, sin], axis=-1).astype(jnp.float32)        # [B, Tc + T, D]
    starts = (start.astype(jnp.int32),) + ((ctx_start.astype(jnp.int32),) if Tc else ())
    return _call_qkv(k_cache, v_cache, qkv, cos_full, sin_signed, k_norm_weight.reshape(1, D), starts,
                     T=T, W=W, rows=rows, t0=t0 - Tc, Tc=Tc, G=num_heads // Hkv, eps=float(eps),
                     interpret=interpret)


@functools.partial(jax.jit, static_argnames=("T", "W", "rows", "t0", "Tc", "G", "eps", "interpret"))
def _call_qkv(k_cache, v_cache, qkv, cos, sin, w, starts, *, T: int, W: int, rows: int, t0: int, Tc: int,
              G: int, eps: float, interpret):
    # t0: the first row written (the context's where Tc > 0); Tc + T rows in all
    B, Hkv, C, D = k_cache.shape
    Tall = qkv.shape[1]
    n = Tc + T
    dtype = jnp.dtype(k_cache.dtype)
    if not interpret:
        k_cache = pltpu.with_memory_space_constraint(k_cache, pltpu.HBM)
        v_cache = pltpu.with_memory_space_constraint(v_cache, pltpu.HBM)
    # Only the written rows' block where t0 is a multiple of their count (the draft's context then
    # block), else all Tall rows. Column blocks of Hkv*D: q is blocks [0, G), k block G, v block G + 1.
    sub = {4: 8, 2: 16, 1: 32}[qkv.dtype.itemsize]
    if t0 % n == 0 and (n % sub == 0 or n == Tall):
        Tb, tb, r0 = n, t0 // n, 0
    else:
        Tb, tb, r0 = Tall, 0, t0
    k_spec = pl.BlockSpec((rows, Tb, Hkv * D), lambda i, *_: (i, tb, G))
    v_spec = pl.BlockSpec((rows, Tb, Hkv * D), lambda i, *_: (i, tb, G + 1))
    rope_spec = pl.BlockSpec((rows, n, D), lambda i, *_: (i, 0, 0))
    w_spec = pl.BlockSpec((1, D), lambda i, *_: (0, 0))
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    kernel = functools.partial(_qkv_kernel, T=T, W=W, C=C, rows=rows, r0=r0, Hkv=Hkv, D=D, eps=eps, Tc=Tc)
    window_bytes = B * Hkv * W * D * dtype.itemsize
    # the k and v column blocks its BlockSpecs read (B rows of Tb tokens each), not qkv whole
    new_bytes = 2 * B * Tb * Hkv * D * qkv.dtype.itemsize
    ns = len(starts)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, dtype), jax.ShapeDtypeStruct(v_cache.shape, dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=ns,
            grid=(B // rows,),
            in_specs=[k_spec, v_spec, rope_spec, rope_spec, w_spec, hbm, hbm],
            out_specs=(hbm, hbm),
            scratch_shapes=[pltpu.VMEM((rows, Hkv, W, D), dtype), pltpu.VMEM((rows, Hkv, W, D), dtype),
                            pltpu.VMEM((W, D), jnp.float32), pltpu.SemaphoreType.DMA((2, rows))],
        ),
        # operands count the scalar-prefetch starts: (start[, ctx_start], k, v, cos, sin, w, k cache, v cache)
        input_output_aliases={ns + 5: 0, ns + 6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        # what moves: each cache's windows read and written, the k/v blocks and the rope tables read
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=4 * window_bytes + new_bytes + 8 * B * n * D),
        interpret=interpret,
        name="dflash_kv_write_qkv_tpu",
    )(*starts, qkv, qkv, cos, sin, w, k_cache, v_cache)


# ------------------------------------------------------------------ rows into a paged cache's pools

def write_kv_pages(k_pool, v_pool, k, v, start, table, *, interpret=False):
    """The paged form of write_kv_rows: k_pool, v_pool [N, Hkv, page, D] (dflash_jax.cache.
    PagedKVCache's pools) ← k, v [B, T, Hkv, D] at positions [start[b], start[b] + T) of row b,
    position p in page table[b, p // page] at row p % page; positions past the table (p // page >= P)
    are dropped. For each row the kernel reads the n = ceil(T / page) + 1 pages the write can touch
    (whole pages: a page is whole row tiles), puts the new rows in (a rotate and a select, as
    write_kv_rows does in its window) and writes them back; the pools stay in HBM, aliased in/out, so
    nothing else of them moves. Raises Unsupported for a shape it cannot tile."""
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"pools {k_pool.shape} / {v_pool.shape} must be equal [N, Hkv, page, D] buffers")
    N, Hkv, ps, D = k_pool.shape
    B, T = k.shape[:2]
    if k.shape != v.shape or k.shape[2:] != (Hkv, D) or start.shape != (B,) or table.shape[0] != B:
        raise ValueError(f"new rows {k.shape}, start {start.shape}, table {table.shape} do not fit pools {k_pool.shape}")
    dtype = jnp.dtype(k_pool.dtype)
    if dtype not in map(jnp.dtype, _DTYPES):
        raise Unsupported(f"pool dtype {dtype} not supported")
    if ps % (ROW_TILE * (4 // dtype.itemsize)):
        raise Unsupported(f"page size {ps} is not a whole number of {dtype} row tiles")
    n = -(-T // ps) + 1
    rows = _chunk_rows(B, 4 * Hkv * n * ps * D * dtype.itemsize)
    return _pages_call(k_pool, v_pool, k, v, start.astype(jnp.int32), table.astype(jnp.int32), T=T, n=n,
                       rows=rows, interpret=interpret)


def _pages_kernel(start_ref, table_ref, nk_ref, nv_ref, kp_in, vp_in, kp_ref, vp_ref, kbuf, vbuf, sems, *,
                  T: int, n: int, ps: int, P: int, rows: int):
    # start_ref [B], table_ref [B, P] int32 (SMEM); nk_ref/nv_ref [rows, Hkv, n*ps, D] (VMEM, the new
    # rows at the top); kp_ref/vp_ref [N, Hkv, ps, D] (HBM, aliased to kp_in/vp_in); kbuf/vbuf
    # [rows, n, Hkv, ps, D] VMEM: each row's n pages
    del kp_in, vp_in
    b0 = pl.program_id(0) * rows

    def page(j, i):              # (page id, in the table) of page i of batch row b0 + j's write
        b = b0 + j
        at = lax.div(start_ref[b], ps) + i     # lax.div / rem: no sign op (Mosaic lowers it per chip)
        return table_ref[b, jnp.minimum(at, P - 1)], at < P

    def dma(j, i, read: bool):
        pid, _ = page(j, i)
        pairs = ((kp_ref, kbuf, 0), (vp_ref, vbuf, 1))
        return [pltpu.make_async_copy(p.at[pid], buf.at[j, i], sems.at[c, j, i]) if read
                else pltpu.make_async_copy(buf.at[j, i], p.at[pid], sems.at[c, j, i]) for p, buf, c in pairs]

    def each(fn):
        def body(t, c):
            j, i = lax.div(t, n), lax.rem(t, n)
            _, ok = page(j, i)

            @pl.when(ok)
            def _():
                fn(j, i)
            return c
        lax.fori_loop(0, rows * n, body, 0)

    each(lambda j, i: [d.start() for d in dma(j, i, True)])
    each(lambda j, i: [d.wait() for d in dma(j, i, True)])

    def merge(j, i):
        r = lax.rem(start_ref[b0 + j], ps) - i * ps        # the new rows' first row, counted from page i's top
        for new_ref, buf in ((nk_ref, kbuf), (nv_ref, vbuf)):
            new = new_ref[j].astype(jnp.float32)                                  # [Hkv, n*ps, D]
            row = lax.broadcasted_iota(jnp.int32, (new.shape[0], ps, new.shape[2]), 1)
            # page row q holds new row q - r (when in [0, T)): a rotate of the padded rows by r mod n*ps
            rolled = pltpu.roll(new, lax.rem(r + n * ps, n * ps), 1)[:, :ps]
            put = jnp.logical_and(row >= r, row < r + T)
            buf[j, i] = jnp.where(put, rolled, buf[j, i].astype(jnp.float32)).astype(buf.dtype)

    each(merge)
    each(lambda j, i: [d.start() for d in dma(j, i, False)])
    each(lambda j, i: [d.wait() for d in dma(j, i, False)])


@functools.partial(jax.jit, static_argnames=("T", "n", "rows", "interpret"))
def _pages_call(k_pool, v_pool, k, v, start, table, *, T: int, n: int, rows: int, interpret):
    N, Hkv, ps, D = k_pool.shape
    B, P = table.shape
    dtype = jnp.dtype(k_pool.dtype)
    if not interpret:
        k_pool = pltpu.with_memory_space_constraint(k_pool, pltpu.HBM)
        v_pool = pltpu.with_memory_space_constraint(v_pool, pltpu.HBM)

    def pad(x):   # [B, T, Hkv, D] -> [B, Hkv, n*ps, D], the new rows at the top
        x = jnp.swapaxes(x, 1, 2).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, n * ps - T), (0, 0)))

    new_spec = pl.BlockSpec((rows, Hkv, n * ps, D), lambda g, *_: (g, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    kernel = functools.partial(_pages_kernel, T=T, n=n, ps=ps, P=P, rows=rows)
    moved = B * n * Hkv * ps * D * dtype.itemsize
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(k_pool.shape, dtype), jax.ShapeDtypeStruct(v_pool.shape, dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B // rows,),
            in_specs=[new_spec, new_spec, hbm, hbm],
            out_specs=(hbm, hbm),
            scratch_shapes=[pltpu.VMEM((rows, n, Hkv, ps, D), dtype), pltpu.VMEM((rows, n, Hkv, ps, D), dtype),
                            pltpu.SemaphoreType.DMA((2, rows, n))],
        ),
        # operands count the scalar prefetches: (start, table, new k, new v, k pool, v pool)
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=6 * moved),
        interpret=interpret,
        name="dflash_kv_write_pages_tpu",
    )(start, table, pad(k), pad(v), k_pool, v_pool)
