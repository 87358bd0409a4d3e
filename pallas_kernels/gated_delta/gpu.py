"""A Gated DeltaNet layer's token mixing over a short block (decode T = 1, a verify block T <= 64)
as ONE Pallas Triton kernel, from the layer's input projection to the gated output norm.

XLA runs the same work as some tens of small kernels per layer (the conv, l2 norms, gates, the
16x16 triangular solve per v-head or 16 unrolled rank-1 updates, the chunk's matmuls, the output
norm, the records), each launch-bound at B = 1. Here one program per (batch row, v-head, block of
the value dims) does, for its head:

  conv     the depthwise causal conv (kernel K = 4) + SiLU over the block's q, k and v channels
           from the projection output and the conv window before the block (rounded to the model
           dtype as the XLA path rounds it);
  gates    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), float32;
  norms    q, k l2-normalised (q times dk^-1/2); the k-head of v-head h is h // (HV / HK);
  rule     the state block [dk, bv] (float32) in registers, then per token t, in order:
           S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q;
  output   with bv = dv the gated output norm w * norm(o) * silu(z) (the model dtype), written in
           the [B, T, HV * dv] layout the out projection reads; with bv < dv the raw o (float32)
           and the norm is left to XLA;
  records  what the fold needs (no solve again, no re-read of the inputs): k normed per v-head
           [B, HV, T, dk], the cumulative log decay G [B, HV, T], the deltas [B, HV, T, dv]:
           S_n = e^(G_n) S + sum_{i<n} e^(G_n - G_i) k_i delta_i^T (models/gated_delta.fold_deltas).

The state is read, never written: the loop's commit folds the accepted prefix (docs/hybrid-targets.md),
on this path with `fold_deltas`, a second kernel (the n[b] rank-1 updates on the state block).
The value dims are independent columns of the rule, so bv < dv splits a head over programs (more
programs at B = 1: HV = 32 heads are 32 programs on 132 SMs) at the price of the unfused norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, pltriton, quiet_triton

MAX_T = 64
L2_EPS = 1e-6


def _pow2(x: int) -> bool:
    return x >= 1 and not (x & (x - 1))


def value_block(block_v: int, dv: int) -> int:
    """Value dims per program: block_v, or the whole head's dv when block_v is 0 or >= dv."""
    return min(block_v, dv) if block_v else dv


def block_supported(T: int, hk: int, hv: int, dk: int, dv: int, kernel: int, block_v: int = 0) -> bool:
    """Whether `gdn_block` tiles this shape: T a power of two <= 64, power-of-two head dims of at
    any size, the conv kernel 4 (or 2), v-heads a multiple of k-heads, bv (0 or >= dv: dv) dividing dv."""
    bv = value_block(block_v, dv)
    return (_pow2(T) and T <= MAX_T and _pow2(dk) and _pow2(dv)
            and kernel in (2, 4) and hv % hk == 0 and _pow2(bv) and dv % bv == 0)


def _gdn_kernel(p_ref, win_ref, cw_ref, alog_ref, dtb_ref, nw_ref, s_ref,
                o_ref, k_out, g_out, d_out, *, T: int, K: int, HK: int, HV: int, dk: int, dv: int,
                bv: int, fuse_norm: bool, norm_eps: float):
    f32 = jnp.float32
    dt = p_ref.dtype
    h, jv = pl.program_id(1), pl.program_id(2)
    hk = h // (HV // HK)
    C = 2 * HK * dk + HV * dv                      # conv channels: q | k | v
    vd = HV * dv
    q0, k0, v0 = hk * dk, HK * dk + hk * dk, 2 * HK * dk + h * dv + jv * bv

    def taps(col, n):
        return [cw_ref[pl.ds(col, n), j].astype(f32) for j in range(K)]          # tap j: [n]

    def window(col, n):
        return tuple(win_ref[r, pl.ds(col, n)].astype(f32) for r in range(K - 1))

    def conv(rows, w):
        """SiLU(conv) of the last K inputs, rounded to the model dtype as XLA rounds it, float32."""
        acc = rows[0] * w[0]
        for j in range(1, K):
            acc = acc + rows[j] * w[j]
        return (acc * jax.nn.sigmoid(acc)).astype(dt).astype(f32)

    def l2(x):
        return x * lax.rsqrt(jnp.sum(x * x) + L2_EPS)

    # the conv's inputs roll through the block: the last K-1 rows of each slice are carried
    wq, wk, wv = taps(q0, dk), taps(k0, dk), taps(v0, bv)
    neg_a = -jnp.exp(alog_ref[h].astype(f32))
    dtb = dtb_ref[h].astype(f32)
    nw = nw_ref[...].astype(f32)
    tt = lax.broadcasted_iota(jnp.int32, (T,), 0)

    def step(t, carry):
        S, G, G_vec, xq, xk, xv = carry
        xq = xq + (p_ref[t, pl.ds(q0, dk)].astype(f32),)
        xk = xk + (p_ref[t, pl.ds(k0, dk)].astype(f32),)
        xv = xv + (p_ref[t, pl.ds(v0, bv)].astype(f32),)
        q = l2(conv(xq, wq)) * (dk ** -0.5)
        k = l2(conv(xk, wk))
        v = conv(xv, wv)
        beta = jax.nn.sigmoid(p_ref[t, C + vd + h].astype(f32))
        a = p_ref[t, C + vd + HV + h].astype(f32) + dtb
        g = neg_a * (jnp.maximum(a, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(a))))   # softplus
        G = G + g
        G_vec = jnp.where(tt == t, G, G_vec)
        S = S * jnp.exp(g)                                                       # S^T [bv, dk]
        delta = (v - jnp.sum(S * k[None, :], axis=1)) * beta                      # [bv]
        S = S + delta[:, None] * k[None, :]
        o = jnp.sum(S * q[None, :], axis=1)                                      # [bv]
        k_out[t, :] = k
        d_out[t, :] = delta
        if fuse_norm:
            of = o.astype(dt).astype(f32)
            r = lax.rsqrt(jnp.sum(of * of) / dv + norm_eps)
            y = (nw * (of * r).astype(dt).astype(f32)).astype(dt).astype(f32)
            z = p_ref[t, pl.ds(C + h * dv, dv)].astype(f32)
            o_ref[t, :] = (y * (z * jax.nn.sigmoid(z))).astype(o_ref.dtype)
        else:
            o_ref[t, :] = o
        return S, G, G_vec, xq[1:], xk[1:], xv[1:]

    # the state block transposed, [bv, dk]: the per-token reductions over dk run along the last
    # axis (within a warp in Triton's layout) rather than across warps
    carry = (s_ref[...].astype(f32).T, jnp.zeros((), f32), jnp.zeros((T,), f32),
             window(q0, dk), window(k0, dk), window(v0, bv))
    _, _, G_vec, *_ = lax.fori_loop(0, T, step, carry)
    g_out[...] = G_vec


def gdn_block(p, window, conv_w, A_log, dt_bias, norm_w, state, *, num_k_heads: int, key_dim: int,
              value_dim: int, norm_eps: float, block_v: int = 0, num_warps: int = 0, interpret: bool = False):
    """One GDN layer's mixing of a block from its projection output.

    p [B, T, C + HV dv + 2 HV] the fused input projection (conv channels q | k | v, then z, b, a),
    window [B, K-1, C] the conv inputs before the block, conv_w [C, K], A_log / dt_bias [HV],
    norm_w [dv] (the gated output norm), state [B, HV, dk, dv] float32 (read only).
    num_warps: 0 picks 4 for state blocks up to 128 x 64, else 8.
    Returns (o, records): o [B, T, HV dv] in p's dtype (block_v 0 or dv: the gated norm applied)
    or [B, T, HV, dv] float32 (block_v < dv: before the norm); records (k [B, HV, T, dk] l2-normed,
    G [B, HV, T] cumulative log decay, delta [B, HV, T, dv]), all float32."""
    B, T, F = p.shape
    HK, dk, dv = num_k_heads, key_dim, value_dim
    Cw, K = conv_w.shape
    HV = state.shape[1]
    bv = value_block(block_v, dv)
    C = 2 * HK * dk + HV * dv
    if (Cw != C or F != C + HV * dv + 2 * HV or window.shape != (B, K - 1, C)
            or state.shape != (B, HV, dk, dv) or not block_supported(T, HK, HV, dk, dv, K, block_v)):
        raise Unsupported(f"gdn_block: p {p.shape}, window {window.shape}, conv {conv_w.shape}, "
                          f"state {state.shape}, HK {HK}, block_v {block_v}")
    fuse = bv == dv
    num_warps = num_warps or (4 if dk * bv <= 128 * 64 else 8)   # the state block: <= 64 f32 per thread
    nv = dv // bv
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, j: (0,) * len(shape))
    if fuse:
        o_shape = jax.ShapeDtypeStruct((B, T, HV * dv), p.dtype)
        o_spec = pl.BlockSpec((None, T, dv), lambda b, h, j: (b, 0, h))
    else:
        o_shape = jax.ShapeDtypeStruct((B, T, HV, dv), jnp.float32)
        o_spec = pl.BlockSpec((None, T, None, bv), lambda b, h, j: (b, 0, h, j))
    kernel = functools.partial(_gdn_kernel, T=T, K=K, HK=HK, HV=HV, dk=dk, dv=dv, bv=bv, fuse_norm=fuse,
                               norm_eps=float(norm_eps))
    f32 = jnp.float32
    with quiet_triton():
        o, k, G, d = pl.pallas_call(
            kernel,
            out_shape=[o_shape, jax.ShapeDtypeStruct((B, HV, T, dk), f32),
                       jax.ShapeDtypeStruct((B, HV, T), f32), jax.ShapeDtypeStruct((B, HV, T, dv), f32)],
            grid=(B, HV, nv),
            in_specs=[pl.BlockSpec((None, T, F), lambda b, h, j: (b, 0, 0)),
                      pl.BlockSpec((None, K - 1, C), lambda b, h, j: (b, 0, 0)),
                      full((C, K)), full((HV,)), full((HV,)), full((dv,)),
                      pl.BlockSpec((None, None, dk, bv), lambda b, h, j: (b, h, 0, j))],
            out_specs=[o_spec,
                       pl.BlockSpec((None, None, T, dk), lambda b, h, j: (b, h, 0, 0)),
                       pl.BlockSpec((None, None, T), lambda b, h, j: (b, h, 0)),
                       pl.BlockSpec((None, None, T, bv), lambda b, h, j: (b, h, 0, j))],
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name="dflash_gdn_block",
        )(p, window.astype(p.dtype), conv_w, A_log, dt_bias, norm_w, state.astype(f32))
    return o, (k, G, d)


def _fold_kernel(n_ref, k_ref, g_ref, d_ref, s_ref, o_ref, *, T: int):
    f32 = jnp.float32
    nb = n_ref[pl.program_id(0)]
    tt = lax.broadcasted_iota(jnp.int32, (T,), 0)
    G = g_ref[...]                                                               # [T]
    Gn = jnp.sum(jnp.where(tt == nb - 1, G, 0.0))                               # 0 when nb == 0

    def step(t, S):
        coef = jnp.exp(Gn - jnp.sum(jnp.where(tt == t, G, 0.0)))
        return S + (coef * k_ref[t, :])[:, None] * d_ref[t, :][None, :]

    o_ref[...] = lax.fori_loop(0, nb, step, s_ref[...].astype(f32) * jnp.exp(Gn))


def fold_deltas(k, G, delta, state, n, *, block_v: int = 0, num_warps: int = 0, interpret: bool = False):
    """The state after the first n[b] tokens of a `gdn_block`'s records, as one kernel (the XLA
    form is dflash_jax.models.gated_delta.fold_deltas): per (row, v-head, value block) program,
    S_n = e^(G_n) S + sum_{i<n} e^(G_n - G_i) k_i delta_i^T with the n[b] rank-1 updates in
    registers. k [B, HV, T, dk], G [B, HV, T], delta [B, HV, T, dv], state [B, HV, dk, dv] float32
    (its buffer reused for the result), n [B] int32 in [0, T]."""
    B, HV, T, dk = k.shape
    dv = delta.shape[-1]
    bv = value_block(block_v, dv)
    if (state.shape != (B, HV, dk, dv) or G.shape != (B, HV, T) or delta.shape != (B, HV, T, dv)
            or not (_pow2(T) and _pow2(dk) and _pow2(bv) and dv % bv == 0)):
        raise Unsupported(f"fold_deltas: k {k.shape}, delta {delta.shape}, state {state.shape}, block_v {block_v}")
    num_warps = num_warps or (4 if dk * bv <= 128 * 64 else 8)
    blk = lambda shape, f: pl.BlockSpec(shape, f)
    with quiet_triton():
        return pl.pallas_call(
            functools.partial(_fold_kernel, T=T),
            out_shape=jax.ShapeDtypeStruct(state.shape, jnp.float32),
            grid=(B, HV, dv // bv),
            in_specs=[pl.BlockSpec((B,), lambda b, h, j: (0,)),
                      blk((None, None, T, dk), lambda b, h, j: (b, h, 0, 0)),
                      blk((None, None, T), lambda b, h, j: (b, h, 0)),
                      blk((None, None, T, bv), lambda b, h, j: (b, h, 0, j)),
                      blk((None, None, dk, bv), lambda b, h, j: (b, h, 0, j))],
            out_specs=blk((None, None, dk, bv), lambda b, h, j: (b, h, 0, j)),
            input_output_aliases={4: 0},
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name="dflash_gdn_fold",
        )(n.astype(jnp.int32), k, G, delta, state.astype(jnp.float32))
