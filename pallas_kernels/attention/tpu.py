"""Block attention as a Pallas Mosaic TPU kernel.

Same contract as `pallas_kernels.attention.reference.block_attention`: q [B,T,Hq,D] over a cache [B,Hkv,C,D]; row t of batch b
attends keys [0, k_end[b,t]).

Layout. The GQA group is folded into the query rows: for each (b, kv head) the kernel sees
R = T*G rows, so all T block tokens and all G query heads of that kv head share one K/V tile (the
tile is read from HBM once per row tile, not once per query head). Rows are cut into tiles of
`block_q`; for decode/verify/draft R <= 512 is one tile, prefill (T up to 32k) uses many.

Two ways to get those rows:
  * token-major (the verify, the draft block, prefill): the kernel reads q as it is born, [B, T,
    Hq*D] (a free view of [B, T, Hq, D]), one block [bt, G*D] per (b, kv head, token tile) — the G
    heads of a kv head are contiguous columns — and stacks the G column slices into rows (g, t) in
    VMEM; it writes o the same way, in the [B, T, Hq*D] layout the o-projection reads. No XLA
    transpose of q or o (at 512 rows those were HBM copies on v5p). Needs G*D % 128 == 0 and a
    token tile that is a multiple of the sublane packing (or all of T).
  * folded (decode T=1, small heads): XLA reshapes q to [B, Hkv, T*G, D] rows (t, g) (for T=1 a
    bitcast) and back after.

Grid (B, Hkv, row tiles, kv tiles); the kv axis is last and "arbitrary" (sequential on a core), with
the online-softmax state (m, l, acc) in VMEM scratch. The per-row-tile max k_end travels by scalar
prefetch (SMEM) and does two jobs: the K/V index_map clamps the tile index to the last tile that
row tile needs (Pallas skips the DMA when the block index does not change, so tiles past the end
cost no HBM traffic), and the body skips compute on those tiles. Tiles entirely below the tile's
min k_end skip the mask as well.

Paged caches (`block_attention_paged`): K/V live in page pools [N, Hkv, page, D] and row b's key t
in pool page table[b, t // page]. The kernel is the same; a KV tile is `pages_per_block` whole
pages, each its own BlockSpec whose index_map reads the page id from the scalar-prefetched table
(flattened to 1-D for SMEM), so every page is one DMA straight from the pool into VMEM and the tile
is their concatenation. The tile index is clamped as above, so pages past a row tile's max k_end
are neither fetched nor computed. `block_attention_qkv_paged` is the same with the q prologue.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (HEAD_DIMS as _HEAD_DIMS, MASK as _MASK, Unsupported, check_shapes,
                                    online_softmax_step, round_up as _round_up)

# Sublane packing: a block's second-to-last dim must be a multiple of 8 (f32) / 16 (bf16).
_SUBLANE = {4: 8, 2: 16, 1: 32}


def choose_blocks(R: int, C: int, D: int, dtype, *, block_q: int | None = None,
                  block_k: int | None = None) -> tuple[int, int]:
    """Row tile and KV tile sizes for R folded rows over capacity C (raises Unsupported)."""
    if D not in _HEAD_DIMS:
        raise Unsupported(f"head_dim={D} not in {_HEAD_DIMS}")
    sub = _SUBLANE.get(jnp.dtype(dtype).itemsize)
    if sub is None:
        raise Unsupported(f"dtype {dtype} not supported")
    if block_k is None:
        # Big KV tiles: decode is HBM-bound and each grid step has a fixed overhead.
        block_k = next((bk for bk in (512, 256, 128) if C % bk == 0), None)
        if block_k is None:
            if C > 1024:
                raise Unsupported(f"capacity C={C} is not a multiple of 128")
            block_k = C          # a block equal to the full dim is always legal
    if C % block_k or (block_k % 128 and block_k != C):
        raise Unsupported(f"block_k={block_k} must divide C={C} and be a multiple of 128")
    if block_q is None:
        # One tile for decode/verify/draft rows; 256-row tiles for prefill (the s/p tiles of
        # block_q x block_k f32 stay at 512 KiB, well inside the default scoped VMEM).
        block_q = _round_up(R, sub) if R <= 512 else 256
    if block_q % sub:
        raise Unsupported(f"block_q={block_q} must be a multiple of {sub} for {jnp.dtype(dtype).name}")
    return block_q, block_k


def _kernel(tmax_ref, tmin_ref, *refs, scale: float, block_k: int,
            n_q_tiles: int, groups: int = 0, prologue: bool = False, eps: float = 0.0, has_start: bool = False,
            ring: bool = False):
    # folded (groups == 0): q_ref [bq, D], o_ref [bq, D]
    # token-major (groups == G): q_ref [bt, G*D], o_ref [bt, G*D], q_sc [G*bt, D] (rows (g, t)); bq = G*bt
    # prologue (token-major only): cos_ref, sin_ref [bt, D] f32 (sin signed: [-sin | sin]), w_ref
    #   [1, D] the q_norm weight; q_ref holds the projection's raw q, normed and rotated here
    # k_ref/v_ref [bk, D], kend_ref [bq, 1] int32, m_sc/l_sc [bq, 1] f32, acc_sc [bq, D] f32
    # has_start: a third scalar (the tile's lowest k_start over live rows) and kstart_ref [bq, 1]
    # after kend_ref: rows attend [k_start, k_end) (sliding-window draft layers); every tile masked
    # ring (with has_start): k_start / k_end absolute, grid step j is the absolute KV tile
    # (first // bk + j), read from the ring's slot tile of that mod its tile count (kv_map)
    if has_start:
        tstart_ref, q_ref, k_ref, v_ref, kend_ref, kstart_ref, *refs = refs
    else:
        q_ref, k_ref, v_ref, kend_ref, *refs = refs
    if prologue:
        cos_ref, sin_ref, w_ref, *refs = refs
    o_ref, m_sc, l_sc, acc_sc, *q_sc = refs
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    n_k = pl.num_programs(3)
    tile = b * n_q_tiles + i
    hi = tmax_ref[tile]            # max k_end over this row tile
    lo = tmin_ref[tile]            # min k_end over the tile's live rows (k_end > 0)
    first = tstart_ref[tile] if has_start else 0
    k0 = (first // block_k + j) * block_k if ring else j * block_k

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        if groups:
            # the G heads' column slices stacked into rows (g, t), once per row tile
            bt, D = q_ref.shape[0], acc_sc.shape[1]
            for g in range(groups):
                x = q_ref[:, g * D:(g + 1) * D]                                  # [bt, D]
                if prologue:
                    x = norm_rope(x, cos_ref[...], sin_ref[...], w_ref[...], eps)
                q_sc[0][g * bt:(g + 1) * bt, :] = x

    def _step(masked: bool):
        q = q_sc[0][...] if groups else q_ref[...]
        k = k_ref[...]

        def visible():
            col = k0 + lax.broadcasted_iota(jnp.int32, (q.shape[0], k.shape[0]), 1)   # [bq, bk]
            if has_start:
                return (col < kend_ref[...]) & (col >= kstart_ref[...])
            return col < kend_ref[...]                                      # [bq, bk]
        m, l, acc = online_softmax_step(q, k, lambda: v_ref[...], m_sc[...], l_sc[...], acc_sc[...],
                                        scale=scale, visible=visible if masked else None)
        l_sc[...] = l
        acc_sc[...] = acc
        m_sc[...] = m

    # Every live row of the tile sees the whole KV tile: no mask needed (most of a long context).
    if has_start:
        @pl.when(jnp.logical_and(k0 + block_k > first, k0 < hi))
        def _windowed():
            _step(masked=True)
    else:
        @pl.when(jnp.logical_and(k0 + block_k <= lo, k0 < hi))
        def _full():
            _step(masked=False)

        @pl.when(jnp.logical_and(k0 + block_k > lo, k0 < hi))
        def _partial():
            _step(masked=True)

    @pl.when(j == n_k - 1)
    def _finish():
        l = l_sc[...]
        live = kend_ref[...] > 0                                             # [bq, 1]
        o = jnp.where(live, acc_sc[...], 0.0) / jnp.where(l > 0, l, 1.0)
        if not groups:
            o_ref[...] = o.astype(o_ref.dtype)
            return
        bt, D = o_ref.shape[0], acc_sc.shape[1]
        for g in range(groups):
            o_ref[:, g * D:(g + 1) * D] = o[g * bt:(g + 1) * bt].astype(o_ref.dtype)


class _PageTile:
    """The refs of a KV tile's pages read as one tile: `tile[...]` is their rows concatenated, the
    only way `_kernel` reads its k_ref / v_ref."""

    def __init__(self, refs):
        self.refs = refs

    def __getitem__(self, idx):
        if len(self.refs) == 1:
            return self.refs[0][idx]
        return jnp.concatenate([r[idx] for r in self.refs], axis=0)              # [m*page, D]


def _paged_kernel(*refs, n_scalars: int, pages_per_block: int, **kw):
    # refs: the scalars (the table last), q_ref, the tile's m K page refs, its m V page refs, the rest
    m = pages_per_block
    scalars, q_ref, rest = refs[:n_scalars - 1], refs[n_scalars], refs[n_scalars + 1:]
    _kernel(*scalars, q_ref, _PageTile(rest[:m]), _PageTile(rest[m:2 * m]), *rest[2 * m:], **kw)


def norm_rope(x, cos, sin, w, eps: float):
    """models.layers' q_norm then RoPE of one head's rows x [bt, D], with its roundings: the norm
    in float32 cast to x's dtype and scaled by the weight in that dtype, the rotation in float32.
    rotate_half as a lane roll by D/2 ([x1 | x2] -> [x2 | x1]) times the signed sin [-sin | sin]."""
    dt = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    xn = (w.astype(jnp.float32) * xf.astype(dt).astype(jnp.float32)).astype(dt).astype(jnp.float32)
    rot = pltpu.roll(xn, xn.shape[-1] // 2, 1)
    return (xn * cos + rot * sin).astype(dt)


def fold_queries(q, k_end, G: int, R_pad: int):
    """q [B,T,Hq,D] -> [B,Hkv,R_pad,D] rows (t, g); k_end [B,T] -> per-row [B,R_pad] (pad rows: 0)."""
    B, T, Hq, D = q.shape
    Hkv = Hq // G
    qf = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
    kr = jnp.repeat(k_end.astype(jnp.int32), G, axis=1)                     # [B, T*G]
    if R_pad > T * G:
        qf = jnp.pad(qf, ((0, 0), (0, 0), (0, R_pad - T * G), (0, 0)))
        kr = jnp.pad(kr, ((0, 0), (0, R_pad - T * G)))
    return qf, kr


def unfold_output(of, B: int, T: int, Hq: int, G: int):
    """[B,Hkv,R_pad,D] -> [B,T,Hq,D]."""
    Hkv, D = Hq // G, of.shape[-1]
    of = of[:, :, : T * G].reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4)
    return of.reshape(B, T, Hq, D)


def token_tile(T: int, G: int, D: int, dtype, *, block_q: int | None = None) -> int | None:
    """Tokens per row tile of the token-major layout (rows = G * tile), or None where it cannot tile
    (then the folded layout): the G heads' columns must be whole lanes and the tile whole sublanes."""
    sub = _SUBLANE.get(jnp.dtype(dtype).itemsize)
    if sub is None or (G * D) % 128:
        return None
    if block_q is not None:
        if block_q % G:
            return None
        bt = block_q // G
    elif T * G <= 512:
        bt = T
    else:
        bt = max(sub, (256 // G) // sub * sub)
    if bt % sub or T % bt:
        return None
    return bt


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None, k_start=None,
                    interpret=False, block_q: int | None = None, block_k: int | None = None,
                    ring: bool = False):
    """Pallas TPU block attention. interpret: False, or pltpu.InterpretParams() to run on CPU.
    k_start [B, T] (or None): each row's first key (rows attend [k_start, k_end)). ring: the cache
    is a ring of C slots (key p in slot p mod C), k_start / k_end absolute
    (pallas_kernels.attention.reference)."""
    check_shapes(q, k_cache, v_cache, k_end)
    if ring and k_start is None:
        raise ValueError("ring=True needs k_start (absolute first keys)")
    B, T, Hq, D = q.shape
    return _attention(q, None, k_cache, v_cache, k_end, B=B, T=T, Hq=Hq, D=D, t0=0, scale=scale,
                      interpret=interpret, block_q=block_q, block_k=block_k, k_start=k_start, ring=ring)


def paged_supported(page: int, D: int, dtype, pages_per_block: int = 1) -> str | None:
    """Why `block_attention_paged` cannot take pages of `page` rows (None: it can). A page is a
    whole block of the pool (always a legal BlockSpec); the tile concatenates pages along
    sublanes, so they must be whole sublane tiles (8 rows f32, 16 bf16) when there are several."""
    if D not in _HEAD_DIMS:
        return f"head_dim={D} not in {_HEAD_DIMS}"
    sub = _SUBLANE.get(jnp.dtype(dtype).itemsize)
    if sub is None:
        return f"dtype {jnp.dtype(dtype).name} not supported"
    if page % sub:
        return f"page={page} is not a multiple of {sub} rows ({jnp.dtype(dtype).name} sublane packing)"
    if pages_per_block < 1 or page * pages_per_block > 1024:
        return f"pages_per_block={pages_per_block} of {page} rows: a KV tile must hold 1..1024 keys"
    return None


# Keys per KV tile the paged kernel aims for when pages_per_block is not given: the dense kernel's
# tiles are 512 keys at long contexts (a grid step has a fixed cost); 256 keeps the DMAs per step
# (one per page) modest at page 16.
PAGED_TILE_KEYS = 256


def block_attention_paged(q, k_pool, v_pool, table, k_end, *, scale: float | None = None, k_start=None,
                          interpret=False, block_q: int | None = None,
                          pages_per_block: int | None = None):
    """Pallas TPU block attention over a paged cache: the same result as `block_attention` on the
    gathered view [B, Hkv, P*page, D] (view[b, :, t] = pool[table[b, t // page], :, t % page]).

    q [B, T, Hq, D]; k_pool / v_pool [N, Hkv, page, D]; table [B, P] int32 page ids (entries past a
    row's pages may name any page, e.g. the dummy page 0: keys there are past k_end); k_end,
    k_start [B, T] as in `block_attention`. A KV tile is pages_per_block pages (default: enough for
    PAGED_TILE_KEYS keys, at most P); the table is padded with page 0 to whole tiles. Raises
    Unsupported where `paged_supported` says why."""
    B, T, Hq, D = q.shape
    return _attention(q, None, k_pool, v_pool, k_end, B=B, T=T, Hq=Hq, D=D, t0=0, scale=scale,
                      interpret=interpret, block_q=block_q, k_start=k_start,
                      pages=_page_tiles(k_pool, table, D, q.dtype, pages_per_block))


def _page_tiles(k_pool, table, D: int, dtype, pages_per_block: int | None):
    """(table [B, P_pad] padded with page 0 to whole tiles, pages per tile), or Unsupported."""
    page, P = k_pool.shape[2], table.shape[1]
    m = max(1, min(PAGED_TILE_KEYS // page, P)) if pages_per_block is None else int(pages_per_block)
    why = paged_supported(page, D, dtype, m)
    if why:
        raise Unsupported(why)
    P_pad = _round_up(P, m)
    return jnp.pad(table.astype(jnp.int32), ((0, 0), (0, P_pad - P))), m


def fused_q_supported(T: int, t0: int, Hq: int, Hkv: int, D: int, C: int, dtype) -> bool:
    """Whether `block_attention_qkv` takes this shape: token-major tiles (head_dim a whole number
    of lanes, so each head's roll stays in its own vregs) that also tile the row offset t0."""
    if D % 128 or D not in _HEAD_DIMS or Hq % Hkv:
        return False
    bt = token_tile(T, Hq // Hkv, D, dtype)
    if not bt or t0 % bt:
        return False
    try:
        choose_blocks(T * Hq // Hkv, C, D, dtype, block_q=Hq // Hkv * bt)
    except Unsupported:
        return False
    return True


def block_attention_qkv(qkv, cos, sin, q_norm_weight, eps: float, k_cache, v_cache, k_end, *,
                        num_heads: int, t0: int = 0, scale: float | None = None, interpret=False):
    """Block attention that reads its queries straight out of the fused projection's output and
    applies q_norm and RoPE itself (models.layers' roundings), so q never exists in HBM in
    [B, T, Hq, D] form (on TPU that view is a relayout of the matmul's [rows, Hq*D] tiles).

    qkv [B, t0 + T, N] with the q heads in columns [0, num_heads*D) (the plain [q | k | v] layout);
    the queries are rows [t0, t0 + T) (the draft's block after its context rows). cos, sin [B, T, D/2]
    float32 (models.layers.rope_tables at the queries' positions); q_norm_weight [D].
    Returns o [B, T, num_heads*D], the layout the o-projection reads. Raises Unsupported where
    fused_q_supported is false."""
    B, Tall, N = qkv.shape
    _, Hkv, C, D = k_cache.shape
    T = Tall - t0
    Hq = num_heads
    if k_end.shape != (B, T) or cos.shape != (B, T, D // 2) or N < Hq * D:
        raise ValueError(f"block_attention_qkv: qkv {qkv.shape}, cos {cos.shape}, k_end {k_end.shape} "
                         f"do not fit {num_heads} heads of cache {k_cache.shape} at row {t0}")
    if not fused_q_supported(T, t0, Hq, Hkv, D, C, qkv.dtype):
        raise Unsupported(f"block_attention_qkv: T={T} t0={t0} Hq={Hq} Hkv={Hkv} D={D} C={C}")
    out = _attention(qkv, _q_prologue(cos, sin, q_norm_weight, eps), k_cache, v_cache, k_end, B=B, T=T,
                     Hq=Hq, D=D, t0=t0, scale=scale, interpret=interpret)
    return out.reshape(B, T, Hq * D)


def _q_prologue(cos, sin, q_norm_weight, eps: float):
    """The kernel's prologue inputs: cos and the signed sin [B, T, D] f32, the weight [1, D], eps."""
    cos_full = jnp.concatenate([cos, cos], axis=-1).astype(jnp.float32)           # [B, T, D]
    sin_signed = jnp.concatenate([-sin, sin], axis=-1).astype(jnp.float32)        # [B, T, D]
    return cos_full, sin_signed, q_norm_weight.reshape(1, -1), float(eps)


def block_attention_qkv_paged(qkv, cos, sin, q_norm_weight, eps: float, k_pool, v_pool, table, k_end, *,
                              num_heads: int, t0: int = 0, scale: float | None = None, interpret=False,
                              pages_per_block: int | None = None):
    """`block_attention_qkv` over a paged cache (pools [N, Hkv, page, D], table [B, P]; see
    `block_attention_paged`): the same result as it on the gathered view. Raises Unsupported where
    either cannot take the shape."""
    B, Tall, N = qkv.shape
    _, Hkv, page, D = k_pool.shape
    T, Hq = Tall - t0, num_heads
    if k_end.shape != (B, T) or cos.shape != (B, T, D // 2) or N < Hq * D or table.shape[0] != B:
        raise ValueError(f"block_attention_qkv_paged: qkv {qkv.shape}, cos {cos.shape}, k_end {k_end.shape}, "
                         f"table {table.shape} do not fit {num_heads} heads of pool {k_pool.shape} at row {t0}")
    pages = _page_tiles(k_pool, table, D, qkv.dtype, pages_per_block)
    # the token-major tiles' conditions, checked on a capacity of one KV tile (a legal whole block)
    if not fused_q_supported(T, t0, Hq, Hkv, D, pages[1] * page, qkv.dtype):
        raise Unsupported(f"block_attention_qkv_paged: T={T} t0={t0} Hq={Hq} Hkv={Hkv} D={D} page={page}")
    out = _attention(qkv, _q_prologue(cos, sin, q_norm_weight, eps), k_pool, v_pool, k_end, B=B, T=T,
                     Hq=Hq, D=D, t0=t0, scale=scale, interpret=interpret, pages=pages)
    return out.reshape(B, T, Hq * D)


def _attention(q, prologue, k_cache, v_cache, k_end, *, B, T, Hq, D, t0, scale, interpret,
               block_q=None, block_k=None, k_start=None, ring=False, pages=None):
    """q: [B, T, Hq, D] (prologue None), or the [B, t0 + T, N] projection output (prologue: cos,
    sin, weight, eps; token-major tiles only). pages: None, or (table [B, P] int32, m) with k_cache /
    v_cache page pools [N, Hkv, page, D] and KV tiles of m pages (P a multiple of m)."""
    _, Hkv, C, _ = k_cache.shape
    G = Hq // Hkv
    R = T * G
    scale = D ** -0.5 if scale is None else float(scale)
    bt = token_tile(T, G, D, q.dtype, block_q=block_q) if D in _HEAD_DIMS else None
    if pages is not None:   # C: the gathered view's rows; a tile of m pages is legal as a whole block
        table, ppb = pages
        page, P = C, table.shape[1]
        C, block_k = P * page, ppb * page
        bq, bk = choose_blocks(R, block_k, D, q.dtype, block_q=G * bt if bt else block_q, block_k=block_k)
    else:
        bq, bk = choose_blocks(R, C, D, q.dtype, block_q=G * bt if bt else block_q, block_k=block_k)
    R_pad = _round_up(R, bq)
    n_q, n_k = R_pad // bq, C // bk
    # a ring row's range (<= C keys) may start mid-tile and so touch n_k + 1 absolute tiles
    n_steps = n_k + 1 if ring else n_k
    lo_clip = lambda e: jnp.maximum(e, 0) if ring else jnp.clip(e, 0, C)      # noqa: E731

    def per_row(e):
        """k_end / k_start [B, T] as the kernel's rows and per tile: (rows, tiles [B*n_q, rows])."""
        if bt:  # per-row values of each token tile, rows (g, t): [B, n_q, G*bt, 1]
            ke = lo_clip(e.astype(jnp.int32)).reshape(B, n_q, 1, bt)
            return jnp.broadcast_to(ke, (B, n_q, G, bt)).reshape(B, n_q, G * bt, 1), ke.reshape(B * n_q, bt)
        _, r = fold_queries(q, e, G, R_pad)                                    # [B, R_pad]
        r = lo_clip(r)
        return r[:, :, None], r.reshape(B * n_q, bq)

    kr, tiles = per_row(k_end)
    if bt:
        q_in = q if prologue is not None else q.reshape(B, T, Hq * D)            # a view, no copy
    else:
        q_in = fold_queries(q, k_end, G, R_pad)[0]                            # [B,Hkv,R_pad,D]
    tmax = jnp.max(tiles, axis=1)                                            # [B*n_q] (SMEM: keep 1-D)
    # min over live rows only: padding rows and rows with k_end == 0 (zeroed at the end) must not
    # force every tile onto the masked path.
    tmin = jnp.min(jnp.where(tiles > 0, tiles, C), axis=1)                   # [B*n_q]
    scalars = [tmax, tmin]
    if k_start is not None:
        ks_rows, ks_tiles = per_row(k_start)
        scalars.append(jnp.min(jnp.where(tiles > 0, ks_tiles, 0 if ring else C), axis=1))   # the tile's first key

    def kv_block(b, i, j, tmax_ref, start_ref):
        # Past the tile's last needed KV block, keep pointing at it: no new DMA is issued; before
        # its first (a window's start), point at that one.
        last = jnp.maximum(pl.cdiv(tmax_ref[b * n_q + i], bk) - 1, 0)
        if ring:   # grid step j: absolute tile first + j, in the ring's slot tile (mod n_k)
            first = start_ref[0][b * n_q + i] // bk
            return lax.rem(jnp.minimum(first + j, jnp.maximum(last, first)), n_k)
        first = jnp.minimum(start_ref[0][b * n_q + i] // bk, last) if start_ref else 0
        return jnp.clip(j, first, last)

    def kv_map(b, h, i, j, tmax_ref, tmin_ref, *start_ref):
        return (b, h, kv_block(b, i, j, tmax_ref, start_ref), 0)

    if pages is None:
        kv_specs, kv_args = [pl.BlockSpec((None, None, bk, D), kv_map)] * 2, [k_cache, v_cache]
    else:
        if ring:
            raise Unsupported("a ring cache is not paged")

        def page_map(s):
            def index_map(b, h, i, j, tmax_ref, tmin_ref, *rest):   # rest: (start_ref,) table_ref
                blk = kv_block(b, i, j, tmax_ref, rest[:-1])
                return (rest[-1][b * P + blk * ppb + s], h, 0, 0)
            return index_map
        page_specs = [pl.BlockSpec((None, None, page, D), page_map(s)) for s in range(ppb)]
        kv_specs, kv_args = page_specs * 2, [k_cache] * ppb + [v_cache] * ppb

    extra_in, extra_args = [], []
    if bt:
        tb0 = t0 // bt
        q_spec = pl.BlockSpec((None, bt, G * D), lambda b, h, i, j, *_: (b, tb0 + i, h))
        o_spec = pl.BlockSpec((None, bt, G * D), lambda b, h, i, j, *_: (b, i, h))
        kend_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j, *_: (b, i, 0, 0))
        out_shape = jax.ShapeDtypeStruct((B, T, Hq * D), q.dtype)
        extra_scratch = [pltpu.VMEM((bq, D), q.dtype)]
        if prologue is not None:
            rope_spec = pl.BlockSpec((None, bt, D), lambda b, h, i, j, *_: (b, i, 0))
            extra_in = [rope_spec, rope_spec, pl.BlockSpec((1, D), lambda b, h, i, j, *_: (0, 0))]
            extra_args = list(prologue[:3])
    else:
        if prologue is not None:
            raise Unsupported("the q prologue needs token-major tiles")
        q_spec = o_spec = pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, *_: (b, h, i, 0))
        kend_spec = pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *_: (b, i, 0))
        out_shape = jax.ShapeDtypeStruct((B, Hkv, R_pad, D), q.dtype)
        extra_scratch = []
    if k_start is not None:
        extra_in, extra_args = [kend_spec] + extra_in, [ks_rows] + extra_args
    kernel = functools.partial(_kernel, scale=scale, block_k=bk, n_q_tiles=n_q, groups=G if bt else 0,
                               prologue=prologue is not None,
                               eps=prologue[3] if prologue is not None else 0.0,
                               has_start=k_start is not None, ring=ring)
    if pages is not None:   # the table rides last among the scalars (SMEM: 1-D)
        scalars.append(table.reshape(-1))
        kernel = functools.partial(_paged_kernel, n_scalars=len(scalars), pages_per_block=ppb,
                                   **kernel.keywords)
    itemsize = jnp.dtype(q.dtype).itemsize
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(B, Hkv, n_q, n_steps),
            in_specs=[
                q_spec,
                *kv_specs,
                kend_spec,
                *extra_in,
            ],
            out_specs=o_spec,
            scratch_shapes=[
                pltpu.VMEM((bq, 1), jnp.float32),
                pltpu.VMEM((bq, 1), jnp.float32),
                pltpu.VMEM((bq, D), jnp.float32),
                *extra_scratch,
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=4 * B * Hkv * R_pad * C * D,
            transcendentals=B * Hkv * R_pad * C,
            bytes_accessed=itemsize * (2 * B * Hkv * C * D + 2 * B * Hkv * R_pad * D)),
        interpret=interpret,
        name="dflash_block_attention_tpu" if pages is None else "dflash_block_attention_paged_tpu",
    )(*scalars, q_in, *kv_args, kr, *extra_args)
    if bt:
        return out.reshape(B, T, Hq, D)                                       # a view, no copy
    return unfold_output(out, B, T, Hq, G)
