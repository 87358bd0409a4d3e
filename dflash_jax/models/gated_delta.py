"""The gated delta rule (Gated DeltaNet's token mixer) in XLA ops: the recurrent form, the chunked
form, the causal depthwise conv in front of it, and the fold that rolls a layer's state forward
over a prefix of a block (the hybrid target's rollback after acceptance).

Shapes: q, k [B, T, HK, dk]; v [B, T, HV, dv]; g, beta [B, T, HV]; state [B, HV, dk, dv] float32.
Each k-head serves HV / HK consecutive v-heads (`jnp.repeat`, HF's repeat_interleave). The math is
in float32 whatever the model dtype (as transformers' reference, with the state kept in float32).

Recurrence per token t (decay first, then the delta update, then the read):
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
A token with g = 0 and beta = 0 leaves S unchanged: masking tokens that way is how a fold stops
at a row's accepted count and how prefill ignores a prompt's padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6   # transformers' l2norm eps (FLA's convention: rsqrt(sum(x^2) + eps))


def l2norm(x, eps: float = L2_EPS):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent(q, k, v, g, beta, state):
    """The recurrent form over T tokens of prepared inputs (float32; q, k l2-normalised and
    expanded to the v-heads, q scaled by dk^-1/2), unrolled (T is a block:
    <= 16 rows). Returns (o [B, T, HV, dv] float32, final state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * jnp.exp(g[:, t])[..., None, None]
        mem = jnp.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - mem) * beta[:, t][..., None]
        state = state + k[:, t][..., None] * delta[..., None, :]
        outs.append(jnp.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return jnp.stack(outs, axis=1), state


def _substitute(a, rhs):
    """(I + a) x = rhs by forward substitution, a [..., L, L] strictly lower: row i of x is rhs_i
    minus a_i . x, where x's rows >= i are still zero (a fori_loop over the L rows)."""
    def row(i, x):
        a_i = jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)                  # [..., L]
        r_i = jax.lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=False)                # [..., D]
        return jax.lax.dynamic_update_index_in_dim(x, r_i - jnp.einsum("...j,...jd->...d", a_i, x), i, axis=-2)
    return jax.lax.fori_loop(0, a.shape[-1], row, jnp.zeros_like(rhs))


def _trsm(a, rhs):
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    return jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)


def unit_lower_solve(a, rhs):
    """x with (I + a) x = rhs, a [..., L, L] strictly lower triangular, rhs [..., L, D]. On CPU by
    forward substitution: jaxlib's CPU triangular solve (LAPACK trsm) splits its batch over the
    thread pool it runs on and waits for the pieces, so two of them running at once on a 2-thread
    pool (a 2-core machine) deadlock; elsewhere the backend's triangular solve."""
    return jax.lax.platform_dependent(a, rhs, cpu=_substitute, default=_trsm)


def _chunk_terms(k, v, g, beta):
    """The within-chunk quantities of the chunked form, inputs [B, HV, N, L, .] (N chunks of L):
    (cumulative log decay G [B, HV, N, L], u, w) with u = (I + A)^-1 (beta v) and
    w = (I + A)^-1 (beta k exp(G)), A the strictly lower (beta_i k_i.k_j exp(G_i - G_j))."""
    L = k.shape[-2]
    G = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((L, L), bool), -1)
    decay = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))   # strictly lower
    kb = k * beta[..., None]
    a = jnp.einsum("...ik,...jk->...ij", kb, k) * decay
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(G)[..., None]], axis=-1)
    sol = unit_lower_solve(a, rhs)
    dv = v.shape[-1]
    return G, sol[..., :dv], sol[..., dv:]


def _to_chunks(x, L: int):
    """[B, T, HV, ...] -> [B, HV, N, L, ...] with T padded to a multiple of L (padding: zeros,
    i.e. g = 0 and beta = 0, tokens that change nothing)."""
    B, T = x.shape[:2]
    pad = -T % L
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(B, x.shape[1], -1, L, *x.shape[3:])


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The chunked form (prefill): the same numbers as `recurrent` up to float rounding, with the
    state read and written once per chunk of `chunk` tokens. Prepared inputs; returns
    (o [B, T, HV, dv] float32, final state)."""
    B, T, HV, _ = v.shape
    L = min(chunk, T)
    qc, kc, vc = (_to_chunks(x, L) for x in (q, k, v))                         # [B, HV, N, L, d]
    gc, bc = _to_chunks(g, L), _to_chunks(beta, L)                               # [B, HV, N, L]
    G, u, w = _chunk_terms(kc, vc, gc, bc)
    incl = jnp.tril(jnp.ones((L, L), bool))
    decay = jnp.exp(jnp.where(incl, G[..., :, None] - G[..., None, :], -jnp.inf))
    attn = jnp.einsum("...ik,...jk->...ij", qc, kc) * decay                      # [B, HV, N, L, L]
    q_dec = qc * jnp.exp(G)[..., None]
    k_dec = kc * jnp.exp(G[..., -1:] - G)[..., None]
    last = jnp.exp(G[..., -1])[..., None, None]                                  # [B, HV, N, 1, 1]

    def step(s, xs):
        u_i, w_i, qd, kd, at, dec = xs
        v_new = u_i - jnp.einsum("bhlk,bhkv->bhlv", w_i, s)
        o = jnp.einsum("bhlk,bhkv->bhlv", qd, s) + jnp.einsum("bhij,bhjv->bhiv", at, v_new)
        s = s * dec + jnp.einsum("bhlk,bhlv->bhkv", kd, v_new)
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_dec, k_dec, attn, last))
    state, o = jax.lax.scan(step, state, xs)                                     # o [N, B, HV, L, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, HV, -1, o.shape[-1])[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state


def fold(k, v, g, beta, state, n, chunk: int = 64):
    """The state after the first n[b] tokens of each row (prepared k, v, g, beta [B, T, ...]) from
    `state`: the chunked form's state path alone, with tokens t >= n masked to identity updates.
    This is the rollback after a verify: state = the pre-block state, n = the row's accepted count."""
    T = k.shape[1]
    keep = (jnp.arange(T)[None, :] < n[:, None])[..., None]                     # [B, T, 1]
    g, beta = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
    L = min(chunk, T)
    kc, vc = _to_chunks(k, L), _to_chunks(v, L)
    gc, bc = _to_chunks(g, L), _to_chunks(beta, L)
    G, u, w = _chunk_terms(kc, vc, gc, bc)
    k_dec = kc * jnp.exp(G[..., -1:] - G)[..., None]
    last = jnp.exp(G[..., -1])[..., None, None]

    def step(s, xs):
        u_i, w_i, kd, dec = xs
        v_new = u_i - jnp.einsum("bhlk,bhkv->bhlv", w_i, s)
        return s * dec + jnp.einsum("bhlk,bhlv->bhkv", kd, v_new), None

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, k_dec, last))
    return jax.lax.scan(step, state, xs)[0]


def block(q, k, v, g, beta, state):
    """A verify block (T <= 16 or so) as ONE chunk of the chunked form, keeping what the rollback
    needs: (o [B, T, HV, dv] float32, terms) with terms = (k, G, v_new) in chunk layout [B, HV, T, .]:
    k the keys, G the cumulative log decay and v_new = u - w S the chunk's pseudo-values, which
    `fold_deltas` turns into the state after any prefix (rows i >= n of the solved system do not
    enter rows < n: it is lower triangular) in one pass over the state, without the solve or a
    second product with S. The state is read, not advanced."""
    qc, kc, vc = (jnp.moveaxis(x, 2, 1) for x in (q, k, v))                   # [B, HV, T, d]
    gc, bc = jnp.moveaxis(g, 2, 1), jnp.moveaxis(beta, 2, 1)                   # [B, HV, T]
    G, u, w = _chunk_terms(kc, vc, gc, bc)
    T = q.shape[1]
    incl = jnp.tril(jnp.ones((T, T), bool))
    attn = jnp.einsum("bhik,bhjk->bhij", qc, kc) * jnp.exp(jnp.where(incl, G[..., :, None] - G[..., None, :], -jnp.inf))
    v_new = u - jnp.einsum("bhlk,bhkv->bhlv", w, state)
    o = jnp.einsum("bhlk,bhkv->bhlv", qc * jnp.exp(G)[..., None], state) + jnp.einsum("bhij,bhjv->bhiv", attn, v_new)
    return jnp.moveaxis(o, 1, 2), (kc, G, v_new)


def fold_deltas(k, G, delta, state, n):
    """The state after the first n[b] tokens of a block run token by token (the GPU kernel's
    records, pallas_kernels/gated_delta): k [B, HV, T, dk] l2-normed, G [B, HV, T] the cumulative
    log decay, delta [B, HV, T, dv] the per-token updates beta (v - S^T k). Unrolling the recurrence,
    S_n = exp(G_n) S + sum_{i<n} exp(G_n - G_i) k_i delta_i^T (a `block`'s v_new are such deltas)."""
    T = G.shape[-1]
    keep = jnp.arange(T)[None, None, :] < n[:, None, None]                      # [B, 1, T]
    Gn = jnp.take_along_axis(G, jnp.broadcast_to(jnp.maximum(n - 1, 0)[:, None, None], G.shape[:2] + (1,)), axis=-1)
    Gn = jnp.where(n[:, None, None] > 0, Gn, 0.0)                               # [B, HV, 1]
    coef = jnp.where(keep, jnp.exp(Gn - G), 0.0)                                # [B, HV, T]
    return state * jnp.exp(Gn)[..., None] + jnp.einsum("bhlk,bhlv->bhkv", k * coef[..., None], delta)


def causal_conv(x, window, weight):
    """Depthwise causal conv + SiLU. x [B, T, C] new inputs, window [B, K-1, C] the K-1 inputs
    before them, weight [C, K]. Returns (SiLU(conv) [B, T, C] in x's dtype, the inputs with their
    window [B, K-1+T, C])."""
    K = weight.shape[1]
    xx = jnp.concatenate([window.astype(x.dtype), x], axis=1)                   # [B, K-1+T, C]
    T = x.shape[1]
    xf, w = xx.astype(jnp.float32), weight.astype(jnp.float32)
    out = sum(xf[:, j:j + T] * w[:, j] for j in range(K))
    return jax.nn.silu(out).astype(x.dtype), xx


def window_after(xx, n, K: int):
    """The conv window after the first n[b] new inputs: rows [n, n + K-1) of xx [B, K-1+T, C]."""
    if xx.shape[0] == 1:
        return jax.lax.dynamic_slice_in_dim(xx, n[0], K - 1, axis=1)
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, K - 1, axis=0))(xx, n)
