"""Training's context attention as a Pallas GPU (Triton) flash-attention pair: forward and backward.

`context_attention(q[B, L, Hq, D], kc[B, T, Hkv, D], vc[B, T, Hkv, D], k_end[B, L]) -> (o, lse)`:
query position l of batch b attends the context keys [0, k_end[b, l]); o [B, L, Hq, D] (q.dtype) is
normalised over those keys and lse [B, L, Hq] (float32, natural log) is their log-sum-exp, MASK for a
row that sees nothing (o = 0 there). Differentiable in q, kc, vc through `jax.custom_vjp`, with a
cotangent on lse too: the caller merges o with the block-diagonal part by log-sum-exp.

Training's packed blocks (dflash_jax/train/packed.py) give every query of block j the key end a_j.
Scores never reach HBM: each program keeps one query tile's online softmax in registers and visits
only the key tiles below the tile's largest end (anchors are sorted within a sequence, so a tile of
consecutive blocks has a tight end), masking only the tiles that straddle an end. The backward is
FlashAttention-2's: a dq kernel over query tiles (the same key range) and a dk/dv kernel over key
tiles that visits only the query tiles whose end lies past the key tile (a range computed from the
ends outside the kernel). The G = Hq/Hkv query heads of a kv head are read together as R = bt·G rows,
straight from q's layout, as attention/gpu.py does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (MASK, Unsupported, next_pow2, online_softmax_step, pltriton,
                                    precision, quiet_triton, round_up)

__all__ = ["context_attention", "check_context_attention", "context_attention_reference", "DEFAULT_TILES"]

_LOG2E = math.log2(math.e)
# Query rows (positions × GQA group) per program and keys per tile; Triton launch settings. The
# forward takes attention/gpu.py's prefill tiling (64 rows, 64 keys, 4 warps, 3 stages); the
# backward kernels hold two f32 [bk, D] accumulators (dk/dv) or one [R, D] (dq) plus q/do tiles.
DEFAULT_TILES = dict(rows=64, block_k=64, num_warps=4, num_stages=3, bwd_rows=64, bwd_block_k=64,
                     bwd_num_warps=4, bwd_num_stages=2)


def _dot(a, b):
    """a [M, K] @ b [K, N] in float32 (full precision for f32 inputs)."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=precision(a.dtype))


def _dot_t(a, b):
    """a [M, K] @ b[N, K]^T in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=precision(a.dtype))


def _rows(kend_t, G):
    """Per-position ends [bt] -> per-row ends [bt·G] (rows ordered (t, g))."""
    bt = kend_t.shape[0]
    return jnp.broadcast_to(kend_t[:, None], (bt, G)).reshape(bt * G)


def _fwd_kernel(q_ref, k_ref, v_ref, kend_ref, o_ref, lse_ref, *, scale2: float, block_k: int, G: int):
    """One (batch, kv head, query tile) program. q_ref [bt, G, D]; k_ref, v_ref [Tp, D] (the whole
    head; tiles sliced in the loop); kend_ref [bt]. o_ref [bt, G, D]; lse_ref [bt, G] (base 2)."""
    bt, _, D = q_ref.shape
    R = bt * G
    q = q_ref[...].reshape(R, D)
    kend_t = kend_ref[...]
    kend = _rows(kend_t, G)                                                   # [R]
    live = kend > 0
    hi = jnp.max(kend_t)
    lo = jnp.min(jnp.where(kend_t > 0, kend_t, jnp.iinfo(jnp.int32).max))
    n_iter = pl.cdiv(hi, block_k)
    n_full = jnp.clip(lo // block_k, 0, n_iter)      # tiles below every live row's end: no mask
    cols = lax.broadcasted_iota(jnp.int32, (R, block_k), 1)

    def make_body(masked: bool):
        def body(it, carry):
            acc, m, l = carry
            k0 = pl.multiple_of(it * block_k, block_k)
            k = k_ref[pl.ds(k0, block_k), :]                                  # [bk, D]
            m, l, acc = online_softmax_step(
                q, k, lambda: v_ref[pl.ds(k0, block_k), :], m, l, acc, scale=scale2, exp=jnp.exp2,
                visible=(lambda: (k0 + cols) < kend[:, None]) if masked else None)
            return acc, m, l
        return body

    carry = (jnp.zeros((R, D), jnp.float32), jnp.full((R,), MASK, jnp.float32), jnp.zeros((R,), jnp.float32))
    carry = lax.fori_loop(0, n_full, make_body(False), carry)
    acc, m, l = lax.fori_loop(n_full, n_iter, make_body(True), carry)
    ok = live & (l > 0)
    l_safe = jnp.where(ok, l, 1.0)
    o = jnp.where(ok[:, None], acc, 0.0) / l_safe[:, None]
    lse2 = jnp.where(ok, m + jnp.log2(l_safe), MASK)
    o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = lse2.reshape(lse_ref.shape)


def _dq_kernel(q_ref, k_ref, v_ref, kend_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale: float,
               block_k: int, G: int):
    """dq of one (batch, kv head, query tile): the forward's key range, p recomputed from lse."""
    bt, _, D = q_ref.shape
    R = bt * G
    q = q_ref[...].reshape(R, D)
    do = do_ref[...].reshape(R, D)
    kend_t = kend_ref[...]
    kend = _rows(kend_t, G)
    live = kend > 0
    # A row that sees nothing gets lse = +big: exp2(s - lse) = 0 on every tile, masked or not.
    lse2 = jnp.where(live, lse_ref[...].reshape(R), -MASK)
    delta = delta_ref[...].reshape(R)
    hi = jnp.max(kend_t)
    lo = jnp.min(jnp.where(kend_t > 0, kend_t, jnp.iinfo(jnp.int32).max))
    n_iter = pl.cdiv(hi, block_k)
    n_full = jnp.clip(lo // block_k, 0, n_iter)
    cols = lax.broadcasted_iota(jnp.int32, (R, block_k), 1)
    scale2 = scale * _LOG2E

    def make_body(masked: bool):
        def body(it, dq):
            k0 = pl.multiple_of(it * block_k, block_k)
            k = k_ref[pl.ds(k0, block_k), :]                                  # [bk, D]
            v = v_ref[pl.ds(k0, block_k), :]
            p = jnp.exp2(_dot_t(q, k) * scale2 - lse2[:, None])               # [R, bk]
            if masked:
                p = jnp.where((k0 + cols) < kend[:, None], p, 0.0)
            ds = p * (_dot_t(do, v) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)
        return body

    dq = lax.fori_loop(0, n_full, make_body(False), jnp.zeros((R, D), jnp.float32))
    dq = lax.fori_loop(n_full, n_iter, make_body(True), dq)
    dq_ref[...] = (dq * scale).reshape(dq_ref.shape).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, kend_ref, do_ref, lse_ref, delta_ref, first_ref, last_ref,
                dk_ref, dv_ref, *, scale: float, block_k: int, bt: int, G: int):
    """dk, dv of one (batch, kv head, key tile). q_ref / do_ref [Lp, G, D], lse_ref / delta_ref
    [Lp, G], kend_ref [Lp]: the whole head; first_ref / last_ref [n_kt]: the query tiles
    [first, last) whose end lies past this key tile (all others see none of it), indexed by the tile."""
    kt = pl.program_id(2)
    D = k_ref.shape[-1]
    R = bt * G
    k0 = kt * block_k
    k = k_ref[...]                                                            # [bk, D]
    v = v_ref[...]
    cols = lax.broadcasted_iota(jnp.int32, (R, block_k), 1)
    scale2 = scale * _LOG2E

    def body(i, carry):
        dk, dv = carry
        t0 = pl.multiple_of(i * bt, bt)
        q = q_ref[pl.ds(t0, bt), :, :].reshape(R, D)
        do = do_ref[pl.ds(t0, bt), :, :].reshape(R, D)
        kend = _rows(kend_ref[pl.ds(t0, bt)], G)
        lse2 = jnp.where(kend > 0, lse_ref[pl.ds(t0, bt), :].reshape(R), -MASK)
        delta = delta_ref[pl.ds(t0, bt), :].reshape(R)
        p = jnp.exp2(_dot_t(q, k) * scale2 - lse2[:, None])                   # [R, bk]
        p = jnp.where((k0 + cols) < kend[:, None], p, 0.0)
        dv = dv + _dot(p.astype(do.dtype).T, do)
        ds = p * (_dot_t(do, v) - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype).T, q)
        return dk, dv

    zero = jnp.zeros((block_k, D), jnp.float32)
    dk, dv = lax.fori_loop(first_ref[kt], last_ref[kt], body, (zero, zero))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _tiles(L, T, G, D, itemsize, tiles):
    """(bt, bk, Lp, Tp) for the forward / dq row tile and key tile: powers of two, >= 16 rows."""
    if G & (G - 1):
        raise Unsupported(f"GQA group {G} is not a power of two (Triton tensor shapes)")
    if D & (D - 1) or D < 16:
        raise Unsupported(f"head_dim {D} is not a power of two >= 16")
    rows = tiles["rows"]
    bt = max(1, rows // G)
    bt = max(bt, -(-16 // G))                      # Triton dots need >= 16 rows
    bt = min(bt, max(next_pow2(L), -(-16 // G)))
    bk = min(tiles["block_k"], max(16, next_pow2(T)))
    return bt, bk, round_up(L, bt), round_up(T, bk)


def _pad_to(x, n, axis):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


def _call(kernel, name, grid, in_specs, out_specs, out_shape, warps, stages, interpret):
    with quiet_triton():
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                              out_specs=out_specs, interpret=interpret, name=name,
                              compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))


def _forward(q, kc, vc, k_end, scale, tiles, interpret):
    """(o [B, L, Hq, D] q.dtype, lse2 [B, Lp, Hkv, G] f32 base 2, padded operands) of the forward."""
    B, L, Hq, D = q.shape
    T, Hkv = kc.shape[1], kc.shape[2]
    G = Hq // Hkv
    bt, bk, Lp, Tp = _tiles(L, T, G, D, q.dtype.itemsize, tiles)
    qg = _pad_to(q.reshape(B, L, Hkv, G, D), Lp, 1)                          # [B, Lp, Hkv, G, D]
    ends = _pad_to(jnp.clip(k_end.astype(jnp.int32), 0, T), Lp, 1)           # [B, Lp]; pad rows see nothing
    kp, vp = _pad_to(kc.astype(q.dtype), Tp, 1), _pad_to(vc.astype(q.dtype), Tp, 1)   # [B, Tp, Hkv, D]
    q_spec = pl.BlockSpec((None, bt, None, G, D), lambda b, h, i: (b, i, h, 0, 0))
    kv_spec = pl.BlockSpec((None, Tp, None, D), lambda b, h, i: (b, 0, h, 0))
    e_spec = pl.BlockSpec((None, bt), lambda b, h, i: (b, i))
    l_spec = pl.BlockSpec((None, bt, None, G), lambda b, h, i: (b, i, h, 0))
    o, lse2 = _call(functools.partial(_fwd_kernel, scale2=scale * _LOG2E, block_k=bk, G=G),
                    "dflash_train_context_fwd", (B, Hkv, Lp // bt), [q_spec, kv_spec, kv_spec, e_spec],
                    [q_spec, l_spec],
                    [jax.ShapeDtypeStruct(qg.shape, q.dtype), jax.ShapeDtypeStruct((B, Lp, Hkv, G), jnp.float32)],
                    tiles["num_warps"], tiles["num_stages"], interpret)(qg, kp, vp, ends)
    return o, lse2


def _backward(q, kc, vc, k_end, o, lse2, do, dlse, scale, tiles, interpret):
    B, L, Hq, D = q.shape
    T, Hkv = kc.shape[1], kc.shape[2]
    G = Hq // Hkv
    bwd = dict(rows=tiles["bwd_rows"], block_k=tiles["bwd_block_k"])
    bt, bk, Lp, Tp = _tiles(L, T, G, D, q.dtype.itemsize, bwd)
    qg = _pad_to(q.reshape(B, L, Hkv, G, D), Lp, 1)                           # [B, Lp, Hkv, G, D]
    ends = _pad_to(jnp.clip(k_end.astype(jnp.int32), 0, T), Lp, 1)            # [B, Lp]
    kp, vp = _pad_to(kc.astype(q.dtype), Tp, 1), _pad_to(vc.astype(q.dtype), Tp, 1)
    do_g = do.reshape(B, L, Hkv, G, D)
    # delta = rowsum(do · o) - dlse: the lse cotangent enters ds = p·(dp - delta) like a shift of dp.
    delta = jnp.sum(do_g.astype(jnp.float32) * o[:, :L].astype(jnp.float32), axis=-1)   # [B, L, Hkv, G]
    delta = delta - dlse.reshape(B, L, Hkv, G).astype(jnp.float32)
    delta = _pad_to(delta, Lp, 1)
    do_g = _pad_to(do_g.astype(q.dtype), Lp, 1)
    lse2 = _pad_to(lse2[:, :L], Lp, 1)
    q_spec = pl.BlockSpec((None, bt, None, G, D), lambda b, h, i: (b, i, h, 0, 0))
    kv_whole = pl.BlockSpec((None, Tp, None, D), lambda b, h, i: (b, 0, h, 0))
    e_spec = pl.BlockSpec((None, bt), lambda b, h, i: (b, i))
    l_spec = pl.BlockSpec((None, bt, None, G), lambda b, h, i: (b, i, h, 0))
    warps, stages = tiles["bwd_num_warps"], tiles["bwd_num_stages"]
    dq = _call(functools.partial(_dq_kernel, scale=scale, block_k=bk, G=G), "dflash_train_context_dq",
               (B, Hkv, Lp // bt), [q_spec, kv_whole, kv_whole, e_spec, q_spec, l_spec, l_spec], q_spec,
               jax.ShapeDtypeStruct(qg.shape, q.dtype), warps, stages, interpret)(
        qg, kp, vp, ends, do_g, lse2, delta)
    # Per key tile, the range of query tiles whose largest end lies past the tile's first key.
    n_qt, n_kt = Lp // bt, Tp // bk
    tile_end = jnp.max(ends.reshape(B, n_qt, bt), axis=-1)                    # [B, n_qt]
    sees = tile_end[:, None, :] > (jnp.arange(n_kt) * bk)[None, :, None]      # [B, n_kt, n_qt]
    any_ = jnp.any(sees, axis=-1)
    first = jnp.where(any_, jnp.argmax(sees, axis=-1), 0).astype(jnp.int32)   # [B, n_kt]
    last = jnp.where(any_, n_qt - jnp.argmax(sees[..., ::-1], axis=-1), 0).astype(jnp.int32)
    nr = next_pow2(n_kt)                       # a power-of-two block: read by scalar index only
    first, last = _pad_to(first, nr, 1), _pad_to(last, nr, 1)                 # [B, nr]
    qw_spec = pl.BlockSpec((None, Lp, None, G, D), lambda b, h, k: (b, 0, h, 0, 0))
    lw_spec = pl.BlockSpec((None, Lp, None, G), lambda b, h, k: (b, 0, h, 0))
    ew_spec = pl.BlockSpec((None, Lp), lambda b, h, k: (b, 0))
    kv_tile = pl.BlockSpec((None, bk, None, D), lambda b, h, k: (b, k, h, 0))
    r_spec = pl.BlockSpec((None, nr), lambda b, h, k: (b, 0))
    dk, dv = _call(functools.partial(_dkv_kernel, scale=scale, block_k=bk, bt=bt, G=G),
                   "dflash_train_context_dkv", (B, Hkv, n_kt),
                   [qw_spec, kv_tile, kv_tile, ew_spec, qw_spec, lw_spec, lw_spec, r_spec, r_spec],
                   [kv_tile, kv_tile],
                   [jax.ShapeDtypeStruct(kp.shape, kc.dtype), jax.ShapeDtypeStruct(vp.shape, vc.dtype)],
                   warps, stages, interpret)(qg, kp, vp, ends, do_g, lse2, delta, first, last)
    return (dq[:, :L].reshape(B, L, Hq, D), dk[:, :T], dv[:, :T])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _context_attention(q, kc, vc, k_end, scale, tiles, interpret):
    o, lse2 = _forward(q, kc, vc, k_end, scale, dict(tiles), interpret)
    return _outputs(q, o, lse2)


def _outputs(q, o, lse2):
    B, L, Hq, D = q.shape
    o_out = o[:, :L].reshape(B, L, Hq, D)
    lse2 = lse2[:, :L].reshape(B, L, Hq)
    lse = jnp.where(lse2 > MASK / 2, lse2 / _LOG2E, MASK)                    # natural log
    return o_out, lse


def _ca_fwd(q, kc, vc, k_end, scale, tiles, interpret):
    o, lse2 = _forward(q, kc, vc, k_end, scale, dict(tiles), interpret)
    return _outputs(q, o, lse2), (q, kc, vc, k_end, o, lse2)


def _ca_bwd(scale, tiles, interpret, res, cts):
    q, kc, vc, k_end, o, lse2 = res
    do, dlse = cts
    dq, dk, dv = _backward(q, kc, vc, k_end, o, lse2, do, dlse, scale, dict(tiles), interpret)
    return dq, dk, dv, None


_context_attention.defvjp(_ca_fwd, _ca_bwd)


def context_attention(q, kc, vc, k_end, *, scale: float | None = None, interpret=False, **tiles):
    """q [B, L, Hq, D], kc / vc [B, T, Hkv, D], k_end [B, L] int → (o [B, L, Hq, D] q.dtype, lse
    [B, L, Hq] f32): attention of each query position over the context keys [0, k_end). Tiling
    overrides: any key of DEFAULT_TILES. Raises Unsupported for a head_dim or group Triton cannot tile."""
    if q.ndim != 4 or kc.ndim != 4 or kc.shape != vc.shape:
        raise ValueError(f"q must be [B, L, Hq, D] and kc, vc [B, T, Hkv, D]; got {q.shape}, {kc.shape}, {vc.shape}")
    B, L, Hq, D = q.shape
    if kc.shape[0] != B or kc.shape[3] != D or Hq % kc.shape[2]:
        raise ValueError(f"kc {kc.shape} does not match q {q.shape} (batch, head_dim, kv heads)")
    if k_end.shape != (B, L):
        raise ValueError(f"k_end must be [B, L]={(B, L)}; got {k_end.shape}")
    unknown = set(tiles) - set(DEFAULT_TILES)
    if unknown:
        raise ValueError(f"unknown tiling settings {sorted(unknown)}; known: {sorted(DEFAULT_TILES)}")
    cfg = tuple(sorted({**DEFAULT_TILES, **tiles}.items()))
    _tiles(L, kc.shape[1], Hq // kc.shape[2], D, q.dtype.itemsize, dict(cfg))   # Unsupported early
    scale = D ** -0.5 if scale is None else float(scale)
    kc, vc = kc.astype(q.dtype), vc.astype(q.dtype)
    return _context_attention(q, kc, vc, k_end, scale, cfg, interpret)


def check_context_attention(q, kc, **tiles) -> None:
    """Raises Unsupported when the kernels cannot tile these shapes (e.g. a GQA group of 3)."""
    B, L, Hq, D = q.shape
    _tiles(L, kc.shape[1], Hq // kc.shape[2], D, q.dtype.itemsize, {**DEFAULT_TILES, **tiles})


def context_attention_reference(q, kc, vc, k_end, *, scale: float | None = None):
    """The jnp oracle of `context_attention` (dense scores; tests only)."""
    B, L, Hq, D = q.shape
    T, Hkv = kc.shape[1], kc.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, L, Hkv, Hq // Hkv, D)
    s = jnp.einsum("blhgd,bthd->blhgt", qg, kc, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST) * scale
    vis = jnp.arange(T)[None, None, :] < k_end[:, :, None]                    # [B, L, T]
    s = jnp.where(vis[:, :, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(vis[:, :, None, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("blhgt,bthd->blhgd", p, vc.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    lse = jnp.where(jnp.isfinite(lse), lse, MASK)
    return o.reshape(B, L, Hq, D).astype(q.dtype), lse.reshape(B, L, Hq)
