"""The fused attention prologue of a decoder layer on the GPU path (short blocks): q/k RMSNorm, RoPE
and the in-place K/V cache writes (the draft's context rows first) as one Pallas Triton kernel."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import HEAD_DIMS as _HEAD_DIMS, Unsupported, pltriton

# Fused attention prologue for short blocks (decode T=1, verify T=16) on the GPU path.
#
# After the fused q/k/v projection, XLA runs q-norm, k-norm, RoPE and the two cache writes as about
# six small kernels per layer (two row reductions, two elementwise fusions, two dynamic-update-slices;
# each launch-bound at these sizes). This kernel does all of it in one launch: one program per
# (batch row, head), q heads first, then kv heads. The caches are updated in place
# (input_output_aliases). Numerics follow models.layers exactly: RMSNorm in float32, cast back,
# times the weight in the input dtype; RoPE in float32 from that, cast back.

def _prologue_kernel(qkv_ref, cos_ref, sin_ref, qw_ref, kw_ref, start_ref, ctx_start_ref, kc_in, vc_in,
                     q_ref, kc_ref, vc_ref, *, Hq: int, D: int, eps: float, Tc: int, barrier: bool,
                     norm: bool = True):
    """qkv_ref [Tc + T, F]: Tc context rows (the draft's; their K/V only) then the block's T rows."""
    del kc_in, vc_in  # aliased to kc_ref / vc_ref
    b, h = pl.program_id(0), pl.program_id(1)
    half = D // 2
    dt = qkv_ref.dtype
    f32 = jnp.float32
    T = q_ref.shape[1]

    def norm_rope(r0, n, col0, w_ref):
        rows = pl.ds(r0, n)
        cos, sin = cos_ref[rows, :], sin_ref[rows, :]                           # [n, D/2] f32
        x1 = qkv_ref[rows, pl.ds(col0, half)].astype(f32)                      # [n, D/2]
        x2 = qkv_ref[rows, pl.ds(col0 + half, half)].astype(f32)
        if not norm:   # a family without q/k norm (Llama): RoPE of the projection itself
            return (x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt)
        r = lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        y1 = (w_ref[pl.ds(0, half)][None, :].astype(f32) * (x1 * r).astype(dt).astype(f32)).astype(dt).astype(f32)
        y2 = (w_ref[pl.ds(half, half)][None, :].astype(f32) * (x2 * r).astype(dt).astype(f32)).astype(dt).astype(f32)
        return (y1 * cos - y2 * sin).astype(dt), (y2 * cos + y1 * sin).astype(dt)

    @pl.when(h < Hq)
    def _q():
        o1, o2 = norm_rope(Tc, T, h * D, qw_ref)
        pltriton.store(q_ref.at[b, :, h, pl.ds(0, half)], o1.astype(q_ref.dtype))
        pltriton.store(q_ref.at[b, :, h, pl.ds(half, half)], o2.astype(q_ref.dtype))

    @pl.when(h >= Hq)
    def _kv():
        j = h - Hq
        n_kv = pl.num_programs(1) - Hq

        def write(r0, n, start):
            o1, o2 = norm_rope(r0, n, (Hq + j) * D, kw_ref)
            pltriton.store(kc_ref.at[b, j, pl.ds(start, n), pl.ds(0, half)], o1.astype(kc_ref.dtype))
            pltriton.store(kc_ref.at[b, j, pl.ds(start, n), pl.ds(half, half)], o2.astype(kc_ref.dtype))
            v = qkv_ref[pl.ds(r0, n), pl.ds((Hq + n_kv + j) * D, D)]                 # [n, D]
            pltriton.store(vc_ref.at[b, j, pl.ds(start, n), :], v.astype(vc_ref.dtype))

        if Tc:
            write(0, Tc, ctx_start_ref[b])
            # the block's rows win where the two ranges overlap: every thread's context stores
            # land before any block store (the interpreter runs them in order and has no barrier)
            if barrier:
                pltriton.debug_barrier()
        write(Tc, T, start_ref[b])


def prologue_supported(T: int, D: int) -> bool:
    return D in _HEAD_DIMS and 1 <= T <= 64 and not (T & (T - 1))


def qk_norm_rope_write(qkv, cos, sin, q_weight, k_weight, eps: float, k_cache, v_cache, start, *,
                       num_heads: int, ctx_rows: int = 0, ctx_start=None, interpret=False, norm: bool = True):
    """qkv [B, T, (Hq + 2 Hkv) D] (the fused projection's output), cos/sin [B, T, D/2] float32,
    q/k norm weights [D], caches [B, Hkv, C, D], start [B] (the block's first cache row, clamped to
    [0, C - T] as dynamic_update_slice would). Returns (q [B, T, Hq, D] normed and rotated, k_cache, v_cache) with
    rows [start, start + T) of every kv head holding the block's normed, rotated keys and its values.

    ctx_rows = Tc > 0 (the draft's layers): the first Tc rows of qkv (and cos/sin) are context
    tokens, whose keys and values only are written, at rows [ctx_start, ctx_start + Tc) (clamped
    likewise), before the block's; q then covers the last T - Tc rows.

    norm=False: no q/k RMSNorm (the Llama family), RoPE only; the weights and eps are then unused."""
    B, T_all, F = qkv.shape
    _, Hkv, C, D = k_cache.shape
    Hq, Tc = num_heads, ctx_rows
    T = T_all - Tc
    if (F != (Hq + 2 * Hkv) * D or not prologue_supported(T, D) or cos.shape[1] != T_all
            or (Tc and (not prologue_supported(Tc, D) or ctx_start is None))):
        raise Unsupported(f"prologue: qkv {qkv.shape} ({Tc} context rows), cache {k_cache.shape}, Hq {Hq}")
    full = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    kernel = functools.partial(_prologue_kernel, Hq=Hq, D=D, eps=float(eps), Tc=Tc, barrier=not interpret,
                               norm=bool(norm))
    # clamped as dynamic_update_slice clamps: finished rows still run the (fixed-shape) iteration,
    # and their writes must stay inside their own rows
    clamp = lambda s, n: jnp.clip(s.astype(jnp.int32), 0, C - n)
    ctx_start = clamp(ctx_start, Tc) if Tc else jnp.zeros((B,), jnp.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        q, k_cache, v_cache = pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((B, T, Hq, D), qkv.dtype),
                       jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                       jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
            grid=(B, Hq + Hkv),
            in_specs=[pl.BlockSpec((None, T_all, F), lambda b, h: (b, 0, 0)),
                      pl.BlockSpec((None, T_all, D // 2), lambda b, h: (b, 0, 0)),
                      pl.BlockSpec((None, T_all, D // 2), lambda b, h: (b, 0, 0)),
                      full((D,)), full((D,)), full((B,)), full((B,)),
                      full(k_cache.shape), full(v_cache.shape)],
            out_specs=[full((B, T, Hq, D)), full(k_cache.shape), full(v_cache.shape)],
            input_output_aliases={7: 1, 8: 2},
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            interpret=interpret,
            name="dflash_qk_norm_rope_write",
        )(qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), q_weight, k_weight,
          clamp(start, T), ctx_start, k_cache, v_cache)
    return q, k_cache, v_cache
