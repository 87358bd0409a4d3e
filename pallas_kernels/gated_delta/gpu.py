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


def _gdn_chunk_kernel(p_ref, win_ref, cw_ref, alog_ref, dtb_ref, nw_ref, s_ref,
                      o_ref, k_out, g_out, d_out, *, T: int, K: int, HK: int, HV: int, dk: int, dv: int,
                      bv: int, fuse_norm: bool, norm_eps: float, prec: str = "tf32x3", do_conv: bool = True,
                      do_solve: bool = True):
    """`_gdn_kernel`'s block in its chunked form: every token at once, no sequential walk.

    The delta rule over the block, with the state S0 [dk, bv] before it, G the cumulative log decay,
    Δ [T, bv] the deltas: Δ = diag(β) (V - diag(e^G) K S0 - M Δ), M[t, i] = e^(G_t - G_i) k_t·k_i for
    i < t, i.e. (I + diag(β) M) Δ = diag(β) (V - diag(e^G) K S0), a unit lower-triangular system. Its
    inverse is a product of log2(T) factors (N = -diag(β) M is nilpotent: (I - N)^-1 = (I + N)(I + N^2)
    (I + N^4)...), so the block is a few [T, T] and [T, dk] x [dk, bv] products. Outputs
    O = diag(e^G) Q S0 + (Q K^T ⊙ e^(G_t - G_i), i <= t) Δ; the records are the walk's (k, G, Δ). The
    conv's shifted rows are [T, T] 0/1 products (exact), the rows before the block from the window."""
    f32 = jnp.float32
    dt = p_ref.dtype
    hi = CHUNK_PRECISIONS[prec]
    h, jv = pl.program_id(1), pl.program_id(2)
    hk = h // (HV // HK)
    C = 2 * HK * dk + HV * dv
    vd = HV * dv
    q0, k0, v0 = hk * dk, HK * dk + hk * dk, 2 * HK * dk + h * dv + jv * bv
    t_i = lax.broadcasted_iota(jnp.int32, (T, T), 0)          # row (t)
    i_i = lax.broadcasted_iota(jnp.int32, (T, T), 1)          # column (i)
    rows = lax.broadcasted_iota(jnp.int32, (T, 1), 0)

    def conv(col, n):
        """SiLU(depthwise causal conv) of channels [col, col + n) over the block, [T, n] float32
        rounded to the model dtype as XLA rounds it."""
        x = p_ref[:, pl.ds(col, n)]                                              # [T, n] model dtype
        if not do_conv:
            return x.astype(f32)
        acc = x.astype(f32) * cw_ref[pl.ds(col, n), K - 1].astype(f32)[None, :]
        for s in range(1, K):
            shift = (t_i - s == i_i).astype(dt)                                  # row t <- row t - s
            xs = jnp.dot(shift, x, preferred_element_type=f32)                   # exact: one 1.0 per row
            for r in range(s):                                                   # rows t < s: the window
                xs = jnp.where(rows == r, win_ref[K - 1 - s + r, pl.ds(col, n)].astype(f32)[None, :], xs)
            acc = acc + xs * cw_ref[pl.ds(col, n), K - 1 - s].astype(f32)[None, :]
        return (acc * jax.nn.sigmoid(acc)).astype(dt).astype(f32)

    def l2(x):
        return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)

    q = l2(conv(q0, dk)) * (dk ** -0.5)                                          # [T, dk]
    k = l2(conv(k0, dk))                                                         # [T, dk]
    v = conv(v0, bv)                                                             # [T, bv]
    beta = jax.nn.sigmoid(p_ref[:, pl.ds(C + vd + h, 1)].astype(f32))            # [T, 1]
    a = p_ref[:, pl.ds(C + vd + HV + h, 1)].astype(f32) + dtb_ref[h].astype(f32)
    g = -jnp.exp(alog_ref[h].astype(f32)) * (jnp.maximum(a, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(a))))  # [T, 1]
    lower = i_i <= t_i
    G = jnp.sum(jnp.where(lower, jnp.broadcast_to(g.reshape(1, T), (T, T)), 0.0), axis=1, keepdims=True)  # [T, 1]
    Gi = jnp.sum(jnp.where(t_i == i_i, jnp.broadcast_to(G, (T, T)), 0.0), axis=0, keepdims=True)        # [1, T]
    decay = jnp.exp(jnp.where(lower, G - Gi, 0.0))                               # e^(G_t - G_i), i <= t
    S0 = s_ref[...].astype(f32)                                                  # [dk, bv]
    kS = jnp.dot(k, S0, precision=hi, preferred_element_type=f32)                # [T, bv]
    rhs = beta * (v - jnp.exp(G) * kS)
    kk = jnp.dot(k, k.T, precision=hi, preferred_element_type=f32)               # [T, T]
    n_mat = jnp.where(i_i < t_i, -beta * decay * kk, 0.0)                        # N = -diag(β) M
    inv = jnp.where(t_i == i_i, 1.0, 0.0) + n_mat                                # I + N
    p_pow = n_mat
    span = 2 if do_solve else T
    while span < T:                                                              # (I + N^2)(I + N^4)...
        p_pow = jnp.dot(p_pow, p_pow, precision=hi, preferred_element_type=f32)
        inv = inv + jnp.dot(inv, p_pow, precision=hi, preferred_element_type=f32)
        span *= 2
    delta = jnp.dot(inv, rhs, precision=hi, preferred_element_type=f32)         # [T, bv]
    qk = jnp.where(lower, jnp.dot(q, k.T, precision=hi, preferred_element_type=f32) * decay, 0.0)
    o = (jnp.exp(G) * jnp.dot(q, S0, precision=hi, preferred_element_type=f32)
         + jnp.dot(qk, delta, precision=hi, preferred_element_type=f32))         # [T, bv]
    k_out[...] = k
    d_out[...] = delta
    g_out[...] = G.reshape(T)
    if fuse_norm:
        of = o.astype(dt).astype(f32)
        r = lax.rsqrt(jnp.sum(of * of, axis=1, keepdims=True) / dv + norm_eps)
        y = (nw_ref[...].astype(f32)[None, :] * (of * r).astype(dt).astype(f32)).astype(dt).astype(f32)
        z = p_ref[:, pl.ds(C + h * dv, dv)].astype(f32)
        o_ref[...] = (y * (z * jax.nn.sigmoid(z))).astype(o_ref.dtype)
    else:
        o_ref[...] = o


# The chunked form's f32 products: "tf32x3" three TF32 tensor-core passes (~float32 accuracy),
# "highest" Triton's IEEE float32 dot (no tensor cores: 110 us a 9B layer on the H200 against the
# walk's 21, session 35), "default" one TF32 pass (12 us; ~1e-3 relative error). The interpreter
# (CPU) always runs "highest".
CHUNK_PRECISIONS = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "highest": lax.Precision.HIGHEST,
                    "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6, "default": None}


def chunk_supported(T: int, dk: int, bv: int) -> bool:
    """Whether the chunked form compiles for the GPU: Triton's dots need every dim >= 16."""
    return T >= 16 and dk >= 16 and bv >= 16


def gdn_block(p, window, conv_w, A_log, dt_bias, norm_w, state, *, num_k_heads: int, key_dim: int,
              value_dim: int, norm_eps: float, block_v: int = 0, num_warps: int = 0, interpret: bool = False,
              form: str = "walk", _diag: tuple = ()):
    """One GDN layer's mixing of a block from its projection output.

    p [B, T, C + HV dv + 2 HV] the fused input projection (conv channels q | k | v, then z, b, a),
    window [B, K-1, C] the conv inputs before the block, conv_w [C, K], A_log / dt_bias [HV],
    norm_w [dv] (the gated output norm), state [B, HV, dk, dv] float32 (read only).
    num_warps: 0 picks 4 for state blocks up to 128 x 64, else 8. form: "walk" (the tokens in order,
    any T) or "chunk" (`_gdn_chunk_kernel`: the block at once; on the GPU T, dk, bv >= 16).
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
    if form not in ("walk", "chunk"):
        raise ValueError(f"gdn_block: form={form!r}; expected 'walk' or 'chunk'")
    if form == "chunk" and not interpret and not chunk_supported(T, dk, bv):
        raise Unsupported(f"gdn_block: the chunked form needs T, dk, bv >= 16 (T {T}, dk {dk}, bv {bv})")
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
    kernel = functools.partial(_gdn_chunk_kernel if form == "chunk" else _gdn_kernel, T=T, K=K, HK=HK, HV=HV, dk=dk, dv=dv, bv=bv, fuse_norm=fuse,
                               norm_eps=float(norm_eps),
                               **({**dict(_diag), "prec": "highest"} if interpret and form == "chunk" else dict(_diag)))
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
