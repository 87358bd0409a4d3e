"""Block attention as a Pallas Mosaic TPU kernel.

Same contract as `reference.block_attention`: q [B,T,Hq,D] over a cache [B,Hkv,C,D]; row t of batch b
attends keys [0, k_end[b,t]).

Layout. The GQA group is folded into the query rows: for each (b, kv head) the kernel sees
R = T*G rows ordered (t, g), so all T block tokens and all G query heads of that kv head share one
K/V tile (the tile is read from HBM once per row tile, not once per query head). Rows are cut into
tiles of `block_q`; for decode/verify/draft R <= 512 is one tile, prefill (T up to 32k) uses many.

Grid (B, Hkv, row tiles, kv tiles); the kv axis is last and "arbitrary" (sequential on a core), with
the online-softmax state (m, l, acc) in VMEM scratch. The per-row-tile max k_end travels by scalar
prefetch (SMEM) and does two jobs: the K/V index_map clamps the tile index to the last tile that
row tile needs (Pallas skips the DMA when the block index does not change, so tiles past the end
cost no HBM traffic), and the body skips compute on those tiles. Tiles entirely below the tile's
min k_end skip the mask as well.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# A finite "minus infinity": exp(MASK - m) underflows to 0 without the inf - inf = nan of -inf.
_MASK = -1e30
# Sublane packing: a block's second-to-last dim must be a multiple of 8 (f32) / 16 (bf16).
_SUBLANE = {4: 8, 2: 16, 1: 32}
_HEAD_DIMS = (64, 128, 256)


class Unsupported(ValueError):
    """The shape cannot be tiled for this kernel; callers fall back to the reference."""


def _precision(dtype):
    # f32 inputs: full-precision passes (the default is TF32 on GPU, bf16 passes on some TPUs).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def choose_blocks(R: int, C: int, D: int, dtype, *, block_q: int | None = None,
                  block_k: int | None = None) -> tuple[int, int]:
    """Row tile and KV tile sizes for R folded rows over capacity C (raises Unsupported)."""
    if D not in _HEAD_DIMS:
        raise Unsupported(f"head_dim={D} not in {_HEAD_DIMS}")
    sub = _SUBLANE.get(jnp.dtype(dtype).itemsize)
    if sub is None:
        raise Unsupported(f"dtype {dtype} not supported")
    if block_k is None:
        # Big KV tiles: decode is HBM-bound and each grid step costs ~0.35 us of overhead.
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


def _kernel(tmax_ref, tmin_ref, q_ref, k_ref, v_ref, kend_ref, o_ref, m_sc, l_sc, acc_sc, *,
            scale: float, block_k: int, n_q_tiles: int):
    # q_ref [bq, D], k_ref/v_ref [bk, D], kend_ref [bq, 1] int32, o_ref [bq, D]
    # m_sc/l_sc [bq, 1] f32, acc_sc [bq, D] f32
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    n_k = pl.num_programs(3)
    tile = b * n_q_tiles + i
    hi = tmax_ref[tile]            # max k_end over this row tile
    lo = tmin_ref[tile]            # min k_end over the tile's live rows (k_end > 0)
    k0 = j * block_k

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def _step(masked: bool):
        q = q_ref[...]
        k = k_ref[...]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=_precision(q.dtype)) * scale                # [bq, bk]
        if masked:
            col = k0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)          # [bq, bk]
            visible = col < kend_ref[...]                                   # [bq, bk]
            s = jnp.where(visible, s, _MASK)
        m_prev = m_sc[...]                                                   # [bq, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)                                               # [bq, bk]
        if masked:
            # A row with nothing visible yet has m_new == _MASK and exp(0) == 1: zero it.
            p = jnp.where(visible, p, 0.0)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32,
                             precision=_precision(v.dtype))                       # [bq, D]
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    # Every live row of the tile sees the whole KV tile: no mask needed (most of a long context).
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
        o_ref[...] = o.astype(o_ref.dtype)


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


def check_shapes(q, k_cache, v_cache, k_end):
    """Shape errors that no backend can handle (as opposed to Unsupported tilings)."""
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [B,T,Hq,D] and k_cache [B,Hkv,C,D]; got {q.shape}, {k_cache.shape}")
    B, T, Hq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape} (batch, head_dim)")
    if Hq % k_cache.shape[1]:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={k_cache.shape[1]}")
    if k_end.shape != (B, T):
        raise ValueError(f"k_end must be [B,T]={(B, T)}; got {k_end.shape}")


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None,
                    interpret=False, block_q: int | None = None, block_k: int | None = None):
    """Pallas TPU block attention. interpret: False, or pltpu.InterpretParams() to run on CPU."""
    check_shapes(q, k_cache, v_cache, k_end)
    B, T, Hq, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = Hq // Hkv
    R = T * G
    scale = D ** -0.5 if scale is None else float(scale)
    bq, bk = choose_blocks(R, C, D, q.dtype, block_q=block_q, block_k=block_k)
    R_pad = _round_up(R, bq)
    n_q, n_k = R_pad // bq, C // bk

    qf, kr = fold_queries(q, k_end, G, R_pad)                               # [B,Hkv,R_pad,D], [B,R_pad]
    kr = jnp.clip(kr, 0, C)
    tiles = kr.reshape(B * n_q, bq)
    tmax = jnp.max(tiles, axis=1)                                            # [B*n_q] (SMEM: keep 1-D)
    # min over live rows only: padding rows and rows with k_end == 0 (zeroed at the end) must not
    # force every tile onto the masked path.
    tmin = jnp.min(jnp.where(tiles > 0, tiles, C), axis=1)                   # [B*n_q]
    kr = kr[:, :, None]                                                      # [B, R_pad, 1]

    def kv_map(b, h, i, j, tmax_ref, tmin_ref):
        # Past the tile's last needed KV block, keep pointing at it: no new DMA is issued.
        last = jnp.maximum(pl.cdiv(tmax_ref[b * n_q + i], bk) - 1, 0)
        return (b, h, jnp.minimum(j, last), 0)

    kernel = functools.partial(_kernel, scale=scale, block_k=bk, n_q_tiles=n_q)
    itemsize = jnp.dtype(q.dtype).itemsize
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, Hkv, R_pad, D), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hkv, n_q, n_k),
            in_specs=[
                pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, *_: (b, h, i, 0)),
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *_: (b, i, 0)),
            ],
            out_specs=pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, *_: (b, h, i, 0)),
            scratch_shapes=[
                pltpu.VMEM((bq, 1), jnp.float32),
                pltpu.VMEM((bq, 1), jnp.float32),
                pltpu.VMEM((bq, D), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=4 * B * Hkv * R_pad * C * D,
            transcendentals=B * Hkv * R_pad * C,
            bytes_accessed=itemsize * (2 * B * Hkv * C * D + 2 * B * Hkv * R_pad * D)),
        interpret=interpret,
        name="dflash_block_attention_tpu",
    )(tmax, tmin, qf, k_cache, v_cache, kr)
    return unfold_output(out, B, T, Hq, G)
