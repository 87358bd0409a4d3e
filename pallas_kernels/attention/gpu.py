"""Block attention as a Pallas GPU kernel through the Triton lowering.

Same contract as `pallas_kernels.attention.reference.block_attention`. The Pallas Triton backend is deprecated upstream (JAX
0.11 warns); everything Triton-specific is inside this module so it can be swapped for Mosaic GPU or
tokamax later. The backend is picked by the type of `compiler_params` (pltriton.CompilerParams);
without it JAX >= 0.9 would lower through Mosaic GPU.

Layout: the G = Hq/Hkv query heads that share a kv head are read together, straight from q's
[B, T, Hq, D] layout (viewed as [B, T, Hkv, G, D], a free reshape), as a [block_t, G, D] tile that
the kernel reshapes to R = block_t*G rows ordered (t, g). The output is written back the same way,
so no transpose or pad runs around the kernel. Plain decode (T == 1, G < 16) reads its G rows as a
masked 16-row tile (Triton dots need >= 16 rows). Sizes must be powers of two (Triton tensors).

Grid (B, Hkv, row tiles, kv splits). Unlike TPU, GPU programs run concurrently, so the KV loop is a
`fori_loop` inside the program. When B*Hkv*row_tiles cannot fill the GPU (batch 1 decode: 8 programs
on 132 SMs), the KV range [0, max k_end of the tile) is split into `kv_splits` chunks (sized from the
actual length, not the capacity, so all splits get work), each writes a normalised partial output
and its log-sum-exp, and a merge combines them: `merge_splits`, a second Pallas kernel, for caches
of >= SPLIT_MIN_CAPACITY rows; for shorter ones a small XLA epilogue (one elementwise fusion).
Caches shorter than SPLIT_MIN_CAPACITY are split as SHORT_SPLITS says (8 ways in chunks of >= 64
keys for a batch-1 block, 4 of >= 128 for decode) when the block is short (decode, verify, draft)
and the programs few: at batch 1 and a 512-token prompt the unsplit kernel is latency-bound (8
programs, ~9 tiles each).

Paged caches (`block_attention_paged`): K/V live in page pools [N, Hkv, page, D] and row b's key t
in pool page table[b, t // page]. The program gets its kv head of the whole pool ([N, page, D], a
pointer, nothing copied) and its row of the table. A KV tile inside one page (block_k divides the
page) loads its page id and reads rows [k0 % page, + block_k) of that page; a tile over several
pages (smaller or odd pages) loads each key's page id and reads its row (a gather load).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (HEAD_DIMS as _HEAD_DIMS, MASK as _MASK, Unsupported, check_shapes,
                                    online_softmax_step, pltriton,
                                    round_up as _round_up)
from pallas_kernels.attention.merge import MERGE_COLS, MERGE_ROWS, merge, merge_splits

# The online softmax runs in base 2: scores are scaled by scale * log2(e) and exponentiated with
# exp2 (libdevice's exp2f, the hardware's ex2); jnp.exp lowers to libdevice's accurate expf
# (several instructions per element, on the per-tile critical path).
_LOG2E = math.log2(math.e)
# SM count for a program built where no GPU can be asked (the interpreter, a CUDA export from a CPU
# host): a Hopper-class part. Library callers pass the device's (dflash_jax.KernelConfig.n_sms).
FALLBACK_SMS = 132


def sm_count(device=None) -> int:
    """The streaming multiprocessors of `device` (default: the first device) if it is a GPU that
    says, else FALLBACK_SMS."""
    device = device if device is not None else jax.devices()[0]
    n = getattr(device, "core_count", None) if device.platform in ("gpu", "cuda", "rocm") else None
    return n if isinstance(n, int) and n > 0 else FALLBACK_SMS


# Shared memory Triton may use per program for the q tile and the pipelined K/V tiles (an H200 has
# 227 KiB; Triton needs some for layout conversions too). The bf16 prefill tile run in float32 asks
# for more than an SM has, so wider dtypes shrink the pipeline until it fits.
_SMEM_BUDGET = 128 * 1024


def _fit_smem(cfg: dict, rows: int, D: int, itemsize: int) -> dict:
    if itemsize <= 2:
        return cfg  # the tuned bf16/f16 settings fit
    def need(c):
        return (rows * D + 2 * c["num_stages"] * c["block_k"] * D) * itemsize
    while need(cfg) > _SMEM_BUDGET:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["block_k"] > 16:
            cfg["block_k"] //= 2
        elif cfg["block_t"] > 1 and rows > 16:
            cfg["block_t"] //= 2
            rows //= 2
        else:
            break
    return cfg


def _row_tile(T: int, G: int, rows: int = 64) -> int:
    """Query positions per program (bt): a power of two dividing T, with bt*G <= rows (or bt = 1)."""
    bt = 1
    while bt * 2 <= T and T % (bt * 2) == 0 and bt * 2 * G <= rows:
        bt *= 2
    return bt


# Below this capacity the split count does not come from filling the GPU: short blocks with fewer
# programs than SMs split into the first (splits, min chunk) of SHORT_SPLITS whose programs fit in
# one wave of two per SM (blocks of 2+ positions: 8 of >= 64 keys up to batch 4 at Qwen3-8B heads,
# else 4 of >= 128), everything else not at all. Splitting beat the unsplit kernel in the whole loop;
# 8 short splits won for blocks, while plain decode (T = 1, 16-row tiles of 4 live rows) kept 4
# (docs/perf-log.md).
SPLIT_MIN_CAPACITY = 4096
SHORT_SPLITS = ((8, 64), (4, 128))


def default_config(T: int, G: int, C: int, D: int, B: int, Hkv: int, *, n_sms: int) -> dict:
    """Tile sizes, kv splits and Triton launch parameters for T query positions (G heads each) over C.

    From sweeps on an H200 (Qwen3-8B heads, bf16; docs/perf-log.md):
    - 64-row tiles, block_k 64, 4 warps, 3 stages: best for verify/draft and for prefill too
      (against 128-row tiles or 8 warps).
    - Splits: fewer programs than SMs (batch 1-8) -> two waves' worth of splits; under two waves,
      2 splits from 16k rows on, 1 below.
    n_sms: the GPU's SM count (dflash_jax.KernelConfig.n_sms, from the device).
    """
    block_t = _row_tile(T, G, 64)
    block_k = 32 if D > 128 else 64
    while block_k > 16 and C % block_k:
        block_k //= 2
    programs = B * Hkv * (T // block_t)
    min_chunk = 512
    if C < SPLIT_MIN_CAPACITY:
        kv_splits = 1
        if T <= 64 and programs < n_sms:
            splits, chunk = next((sc for sc in SHORT_SPLITS[:-1] if T > 1 and sc[0] * programs <= 2 * n_sms),
                                 SHORT_SPLITS[-1])
            if C >= 2 * chunk:
                kv_splits, min_chunk = splits, chunk
    elif programs < n_sms:
        # Two programs fit on an SM (~112 KiB of shared memory each): fill exactly one wave of
        # 2 * n_sms, rounding down: rounding up leaves a small second wave that runs at a fraction
        # of the bandwidth. At most 16 splits below 16k rows; from 16k on the wave is filled
        # (docs/perf-log.md).
        cap = 16 if C < 16384 else 2 * n_sms
        kv_splits = max(1, min(2 * n_sms // programs, max(1, C // block_k), cap))
    elif programs < 4 * n_sms and C >= 16384:
        kv_splits = 2
    else:
        kv_splits = 1
    # Long caches merge their splits in merge_splits' kernel with >= 512 programs: 4 x 32 tiles when
    # the output is small (B=1: 512 rows), 16 x 64 from B=4 on; faster than XLA's fusion of the
    # merge at 8k and 32k. Short caches (few, small partials) keep XLA's fusion, which can overlap
    # its launch with the next GEMM's (PDL); docs/perf-log.md has the measurements.
    big = B * T * Hkv * G * D // (MERGE_ROWS * MERGE_COLS) >= n_sms     # 16 x 64 tiles fill the GPU
    return dict(block_t=block_t, block_k=block_k, kv_splits=kv_splits, num_warps=4,
                num_stages=3, min_chunk=min_chunk,
                merge_kernel=int(kv_splits > 1 and C >= SPLIT_MIN_CAPACITY),
                merge_rows=MERGE_ROWS if big else 4, merge_cols=MERGE_COLS if big else 32)


def _visible(k0, cols, kend, kstart):
    """The mask of one KV tile: keys below each row's end (and at or past its start)."""
    if kstart is None:
        return lambda: (k0 + cols) < kend[:, None]
    return lambda: ((k0 + cols) < kend[:, None]) & ((k0 + cols) >= kstart[:, None])


def _kernel(q_ref, k_ref, v_ref, kend_ref, *refs, scale: float, block_k: int, kv_splits: int,
            min_chunk: int, decode_rows: int, G: int, has_start: bool = False, ring: bool = False,
            page: int = 0):
    """One (batch, kv head, row tile, kv split) program.

    Tiled mode (decode_rows == 0): q_ref [bt, G, D] holds bt query positions of the G query heads
    that share this kv head, read straight from q's [B, T, Hq, D] layout (no transpose before or
    after the kernel); kend_ref [bt]; outputs o [bt, G, D] (+ lse [bt, G] when split).
    Decode mode (T == 1, decode_rows = 16): q_ref is the whole [B*Hq, D] array; this program's G
    rows are loaded as a 16-row tile with a mask (Triton dots need 16 rows), kend_ref is the whole
    [B] array, outputs are whole [B*Hq, D] (+ [B*Hq]) arrays written with the same mask. This saves
    the pad and slice kernels an XLA-side fold would cost at every layer.
    k_ref/v_ref [C, D]: the whole head; tiles are sliced in the loop.
    has_start (tiled mode only): refs[0] is kstart [bt], each row's first key (a sliding-window
    draft layer): the KV range starts at the tile's lowest start, every tile masked.
    ring (with has_start): k_start / k_end are absolute key positions and the cache a ring of C
    slots: the loop walks absolute tiles and reads tile k0 from slots k0 mod C (C a multiple of
    block_k, so a tile never wraps).
    page (paged caches): k_ref/v_ref [N, page, D] the kv head of the page pools, and the ref after
    kstart (if any) this row's page table [P]; key k0 + r of a tile is row (k0 + r) % page of page
    table[(k0 + r) // page] (one page and a slice when block_k divides the page).
    """
    kstart_ref, out_refs = (refs[0], refs[1:]) if has_start else (None, refs)
    table_ref, out_refs = (out_refs[0], out_refs[1:]) if page else (None, out_refs)
    s_idx = pl.program_id(3)
    if decode_rows:
        b, h = pl.program_id(0), pl.program_id(1)
        n_kv = pl.num_programs(1)
        R = decode_rows
        r0 = (b * n_kv + h) * G
        row_ok = lax.broadcasted_iota(jnp.int32, (R,), 0) < G
        q = pltriton.load(q_ref.at[pl.ds(r0, R), :], mask=row_ok[:, None], other=0.0)  # [R, D]
        kend_b = kend_ref[b]
        kend = jnp.where(row_ok, kend_b, 0)                                   # [R]
        hi = kend_b
        lo = jnp.where(kend_b > 0, kend_b, jnp.iinfo(jnp.int32).max)
    else:
        bt, _, D = q_ref.shape
        R = bt * G
        q = q_ref[...].reshape(R, D)                                          # rows (t, g)
        kend_t = kend_ref[...]                                                # [bt]
        kend = jnp.broadcast_to(kend_t[:, None], (bt, G)).reshape(R)
        hi = jnp.max(kend_t)
        lo = jnp.min(jnp.where(kend_t > 0, kend_t, jnp.iinfo(jnp.int32).max))
    base = 0
    if has_start:
        kstart = jnp.broadcast_to(kstart_ref[...][:, None], (bt, G)).reshape(R)
        first = jnp.min(jnp.where(kend_t > 0, kstart_ref[...], hi))
        base = jnp.minimum(first, hi) // block_k * block_k
    D = q.shape[1]
    # This split's KV range: [start, stop), a bk-aligned share of [0, hi) of at least min_chunk
    # keys. The split count is static (from the capacity) but the length is not: a 32k cache
    # holding 1k tokens uses 2 splits, not 32 tiny ones whose partials cost more than they save.
    chunk = jnp.maximum(pl.cdiv(pl.cdiv(hi - base, kv_splits), block_k) * block_k, min_chunk)
    start = base + s_idx * chunk
    stop = jnp.minimum(start + chunk, hi)
    n_iter = jnp.maximum(pl.cdiv(stop - start, block_k), 0)
    # Tiles below every live row's k_end need no mask (most of a long context, the lower
    # triangle of a prefill). Rows with k_end == 0 (padding, or empty by contract) are left out of
    # `lo` and zeroed at the end.
    live = kend > 0                                                           # [R]
    n_full = 0 if has_start else jnp.clip((lo - start) // block_k, 0, n_iter)

    base = _LOG2E
    scale2, exp = scale * base, jnp.exp2
    cols = lax.broadcasted_iota(jnp.int32, (R, block_k), 1)

    def make_body(masked: bool):
        def body(it, carry):
            acc, m, l = carry
            k0 = pl.multiple_of(start + it * block_k, block_k)
            if page and page % block_k == 0:   # the tile's page and its rows in it (one indexer)
                at = (table_ref[k0 // page], pl.ds(pl.multiple_of(lax.rem(k0, page), block_k), block_k))
            elif page:   # a tile over several pages: each key's page and row (a gather load)
                keys = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)                   # [bk]
                at = (table_ref[keys // page], lax.rem(keys, page))
            else:
                slot = pl.multiple_of(lax.rem(k0, k_ref.shape[0]), block_k) if ring else k0
                at = (pl.ds(slot, block_k),)
            k = k_ref[(*at, slice(None))]                                     # [bk, D]
            m, l, acc = online_softmax_step(
                q, k, lambda: v_ref[(*at, slice(None))], m, l, acc, scale=scale2, exp=exp,
                visible=(_visible(k0, cols, kend, kstart if has_start else None)) if masked else None)
            return acc, m, l
        return body

    acc0 = jnp.zeros((R, D), jnp.float32)
    m0 = jnp.full((R,), _MASK, jnp.float32)
    l0 = jnp.zeros((R,), jnp.float32)
    carry = lax.fori_loop(0, n_full, make_body(False), (acc0, m0, l0))
    acc, m, l = lax.fori_loop(n_full, n_iter, make_body(True), carry)
    l = jnp.where(live, l, 0.0)
    o = jnp.where(live[:, None], acc, 0.0) / jnp.where(l > 0, l, 1.0)[:, None]
    lse = jnp.where(l > 0, m / base + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)

    if decode_rows:
        o_ref = out_refs[0]
        o_at = o_ref.at[pl.ds(r0, R), :] if kv_splits == 1 else o_ref.at[s_idx, pl.ds(r0, R), :]

        def store_o():
            pltriton.store(o_at, o.astype(o_ref.dtype), mask=row_ok[:, None])
        if kv_splits > 1:
            lse_ref = out_refs[1]
            pltriton.store(lse_ref.at[s_idx, pl.ds(r0, R)], lse, mask=row_ok)
    else:
        o_ref = out_refs[0]

        def store_o():
            o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
        if kv_splits > 1:
            lse_ref = out_refs[1]
            lse_ref[...] = lse.reshape(lse_ref.shape)
    if kv_splits == 1:
        store_o()
    else:
        # An empty split writes only lse = -inf; `merge` never reads its (unwritten) o.
        pl.when(n_iter > 0)(store_o)


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None, interpret=False,
                    block_t: int | None = None, block_k: int | None = None,
                    kv_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, min_chunk: int | None = None,
                    merge_kernel: bool | None = None,
                    merge_rows: int | None = None, merge_cols: int | None = None,
                    n_sms: int | None = None, k_start=None, ring: bool = False, table=None):
    """Pallas Triton block attention. Tuning arguments override `default_config`.

    merge_kernel: split partials merged by `merge_splits` (a Pallas kernel) instead of XLA's fusion
    of `merge`; None: as default_config says. n_sms: the GPU's SM count (None: `sm_count()`).
    k_start [B, T] (or None): each row's first key (rows attend [k_start, k_end)); blocks only.
    ring: the cache is a ring of C slots (key p in slot p mod C), k_start / k_end absolute
    (pallas_kernels.attention.reference).
    table [B, P] int32 (or None): k_cache / v_cache are page pools [N, Hkv, page, D] read through it
    (`block_attention_paged`)."""
    B, T, Hq, D = q.shape
    if table is None:
        check_shapes(q, k_cache, v_cache, k_end)
        _, Hkv, C, _ = k_cache.shape
    else:
        N, Hkv, page, _ = k_cache.shape
        C = table.shape[1] * page
        if ring:
            raise Unsupported("a ring cache is not paged")
    G = Hq // Hkv
    if D not in _HEAD_DIMS:
        raise Unsupported(f"head_dim={D} not in {_HEAD_DIMS}")
    if G & (G - 1):
        raise Unsupported(f"GQA group {G} is not a power of two (Triton tensor shapes)")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise Unsupported(f"dtype {q.dtype} not supported")
    if T > 1 and T * G < 16:
        # Too few rows for a Triton dot and not the decode layout (T == 1): pad the positions
        # with empty rows (k_end 0). No Qwen3 shape takes this path (T is 1, the block, or a prefill).
        Tp = 16 // G
        out = block_attention(jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))), k_cache, v_cache,
                              jnp.pad(k_end, ((0, 0), (0, Tp - T))), scale=scale,
                              interpret=interpret, block_k=block_k, kv_splits=kv_splits,
                              num_warps=num_warps, num_stages=num_stages, min_chunk=min_chunk,
                              merge_kernel=merge_kernel, merge_rows=merge_rows,
                              merge_cols=merge_cols, n_sms=n_sms,
                              k_start=None if k_start is None else jnp.pad(k_start, ((0, 0), (0, Tp - T))),
                              ring=ring, table=table)
        return out[:, :T]
    n_sms = sm_count() if n_sms is None else n_sms
    cfg = default_config(T, G, C, D, B, Hkv, n_sms=n_sms)
    if block_t is not None:
        cfg["block_t"] = block_t
    cfg = _fit_smem(cfg, 16 if T == 1 else cfg["block_t"] * G, D, jnp.dtype(q.dtype).itemsize)
    for name, val in dict(block_k=block_k, kv_splits=kv_splits, num_warps=num_warps,
                          num_stages=num_stages, min_chunk=min_chunk,
                          merge_kernel=merge_kernel, merge_rows=merge_rows,
                          merge_cols=merge_cols).items():
        if val is not None:
            cfg[name] = val
    bt, bk, n_split = cfg["block_t"], cfg["block_k"], cfg["kv_splits"]
    if bk < 16 or bk & (bk - 1):
        raise Unsupported(f"block_k={bk} must be a power of two >= 16")
    if C % bk:
        raise Unsupported(f"capacity C={C} is not a multiple of block_k={bk}")
    decode_rows = 16 if (T == 1 and G < 16) else 0
    if k_start is not None and decode_rows:
        raise Unsupported("k_start in the decode layout (T == 1)")
    if ring and k_start is None:
        raise ValueError("ring=True needs k_start (absolute first keys)")
    if not decode_rows:
        if bt < 1 or bt & (bt - 1) or T % bt:
            raise Unsupported(f"block_t={bt} must be a power of two dividing T={T}")
        if bt * G < 16:
            raise Unsupported(f"row tile {bt}x{G} < 16 rows (Triton dots need 16)")
    scale = D ** -0.5 if scale is None else float(scale)
    # absolute positions in a ring may pass C; a plain cache's ends are clipped to it
    k_end = jnp.maximum(k_end.astype(jnp.int32), 0) if ring else jnp.clip(k_end.astype(jnp.int32), 0, C)
    # Triton cannot do two dtypes in one dot: keep K/V and q alike (the contract has them equal).
    k_cache = k_cache.astype(q.dtype)
    v_cache = v_cache.astype(q.dtype)
    if table is None:
        kv_spec = pl.BlockSpec((None, None, C, D), lambda b, h, i, s: (b, h, 0, 0))
    else:   # the kv head of the whole pool; the table's row b
        kv_spec = pl.BlockSpec((N, None, page, D), lambda b, h, i, s: (0, h, 0, 0))
    # Split partials in the input's dtype: for bf16 this halves the merge's traffic and costs about
    # one bf16 rounding (the output is bf16 anyway); f32 inputs keep f32 partials.
    if decode_rows:                      # q, k_end and the outputs as whole arrays (see _kernel)
        n_t = 1
        q_in, kend_in = q.reshape(B * Hq, D), k_end.reshape(B)
        q_spec = pl.BlockSpec((B * Hq, D), lambda b, h, i, s: (0, 0))
        kend_spec = pl.BlockSpec((B,), lambda b, h, i, s: (0,))
        if n_split == 1:
            out_shape = jax.ShapeDtypeStruct((B * Hq, D), q.dtype)
            out_specs = q_spec
        else:
            out_shape = [jax.ShapeDtypeStruct((n_split, B * Hq, D), q.dtype),
                         jax.ShapeDtypeStruct((n_split, B * Hq), jnp.float32)]
            out_specs = [pl.BlockSpec((n_split, B * Hq, D), lambda b, h, i, s: (0, 0, 0)),
                         pl.BlockSpec((n_split, B * Hq), lambda b, h, i, s: (0, 0))]
    else:                                # q as [B, T, Hkv, G, D]: a free reshape
        n_t = T // bt
        q_in, kend_in = q.reshape(B, T, Hkv, G, D), k_end
        q_spec = pl.BlockSpec((None, bt, None, G, D), lambda b, h, i, s: (b, i, h, 0, 0))
        kend_spec = pl.BlockSpec((None, bt), lambda b, h, i, s: (b, i))
        if n_split == 1:
            out_shape = jax.ShapeDtypeStruct((B, T, Hkv, G, D), q.dtype)
            out_specs = q_spec
        else:
            out_shape = [jax.ShapeDtypeStruct((n_split, B, T, Hkv, G, D), q.dtype),
                         jax.ShapeDtypeStruct((n_split, B, T, Hkv, G), jnp.float32)]
            out_specs = [pl.BlockSpec((None, None, bt, None, G, D), lambda b, h, i, s: (s, b, i, h, 0, 0)),
                         pl.BlockSpec((None, None, bt, None, G), lambda b, h, i, s: (s, b, i, h, 0))]
    min_chunk = _round_up(max(cfg["min_chunk"], bk), bk)
    kernel = functools.partial(_kernel, scale=scale, block_k=bk, kv_splits=n_split,
                               min_chunk=min_chunk, decode_rows=decode_rows, G=G,
                               has_start=k_start is not None, ring=ring, page=page if table is not None else 0)
    extra_in, extra_spec = (), []
    if k_start is not None:
        ks = k_start.astype(jnp.int32)
        extra_in, extra_spec = (jnp.maximum(ks, 0) if ring else jnp.clip(ks, 0, C),), [kend_spec]
    if table is not None:
        extra_in += (table.astype(jnp.int32),)
        extra_spec += [pl.BlockSpec((None, table.shape[1]), lambda b, h, i, s: (b, 0))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        out = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(B, Hkv, n_t, n_split),
            in_specs=[q_spec, kv_spec, kv_spec, kend_spec] + extra_spec,
            out_specs=out_specs,
            compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"],
                                                    num_stages=cfg["num_stages"]),
            interpret=interpret,
            name="dflash_block_attention_gpu" if table is None else "dflash_block_attention_paged_gpu",
        )(q_in, k_cache, v_cache, kend_in, *extra_in)
    if n_split > 1 and cfg["merge_kernel"]:
        out = merge_splits(*out, q.dtype, rows=cfg["merge_rows"], cols=cfg["merge_cols"],
                           interpret=interpret)
    elif n_split > 1:
        out = merge(*out).astype(q.dtype)
    return out.reshape(B, T, Hq, D)


def block_attention_paged(q, k_pool, v_pool, table, k_end, **kw):
    """Pallas Triton block attention over a paged cache: the same result as `block_attention` on the
    gathered view [B, Hkv, P*page, D] (view[b, :, t] = pool[table[b, t // page], :, t % page]).
    q [B, T, Hq, D]; k_pool / v_pool [N, Hkv, page, D] (any page; C = P * page must be a multiple
    of block_k); table [B, P] int32; k_end (k_start) [B, T]; kw: `block_attention`'s tuning, k_start."""
    return block_attention(q, k_pool, v_pool, k_end, table=table, **kw)
