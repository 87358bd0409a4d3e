"""The TPU row writer that takes K/V straight out of the fused projection's output
(tpu_cache_write.write_kv_rows_qkv): k_norm + RoPE in the kernel, rows written in place. Against the
XLA layer's k/v (split, k_norm, RoPE) written with dynamic_update_slice, in the TPU interpreter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import tpu_cache_write


@pytest.mark.slow
@pytest.mark.parametrize("dtype,B,Tall,t0,T,Hq,Hkv,C,starts", [
    (jnp.float32, 2, 16, 8, 8, 4, 2, 64, (3, 56)),     # the draft's block after 8 context rows
    (jnp.float32, 2, 16, 0, 8, 4, 2, 64, (0, 13)),     # the draft's context rows
    (jnp.bfloat16, 2, 16, 0, 16, 4, 2, 64, (5, 48)),   # the verify (window moved down at the end)
    (jnp.bfloat16, 1, 12, 4, 8, 2, 1, 32, (9,)),       # rows not on a block boundary
])
def test_write_kv_rows_qkv_matches_the_layer(dtype, B, Tall, t0, T, Hq, Hkv, C, starts):
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.cache import write_rows
    from dflash_jax.models.layers import RMSNorm, rope, rope_tables
    D, eps, theta = 128, 1e-6, 10000.0
    ks = jax.random.split(jax.random.key(2), 4)
    qkv = (jax.random.normal(ks[0], (B, Tall, (Hq + 2 * Hkv) * D)) * 2.0).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(ks[1], (D,))).astype(dtype)
    kc = jax.random.normal(ks[2], (B, Hkv, C, D)).astype(dtype)
    vc = jax.random.normal(ks[3], (B, Hkv, C, D)).astype(dtype)
    start = jnp.array(starts, jnp.int32)
    positions = start[:, None] + jnp.arange(T)[None]                        # [B, T]
    norm = RMSNorm(D, eps, dtype)
    norm.weight[...] = w
    rows = qkv[:, t0:t0 + T]
    k = rope(norm(rows[..., Hq * D:(Hq + Hkv) * D].reshape(B, T, Hkv, D)), positions, theta)
    v = rows[..., (Hq + Hkv) * D:].reshape(B, T, Hkv, D)
    want_k, want_v = write_rows(kc, k, start), write_rows(vc, v, start)
    cos, sin = rope_tables(positions, D, theta)
    got_k, got_v = tpu_cache_write.write_kv_rows_qkv(kc, vc, qkv, cos, sin, w, eps, start, num_heads=Hq,
                                                     t0=t0, T=T, interpret=pltpu.InterpretParams())
    f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(f32(got_v), f32(want_v))
    tol = 1e-5 if dtype == jnp.float32 else 0.0
    np.testing.assert_allclose(f32(got_k), f32(want_k), atol=tol * 8, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,B,Tc,T,C,starts,pending", [
    (jnp.float32, 2, 8, 8, 64, (9, 56), (3, 8)),       # overlap (3 pending of 8), window at the end
    (jnp.bfloat16, 2, 16, 16, 64, (16, 40), (16, 0)),  # the Qwen3-8B draft's shape; 0 pending: all overwritten
])
def test_write_kv_rows_qkv_context_and_block_in_one_call(dtype, B, Tc, T, C, starts, pending):
    """ctx_rows: the draft's context rows at start - pending, then its block at start (the block
    wins), as two dynamic_update_slices of the layer's k/v."""
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.cache import write_rows
    from dflash_jax.models.layers import RMSNorm, rope, rope_tables
    D, eps, theta, Hq, Hkv = 128, 1e-6, 10000.0, 4, 2
    ks = jax.random.split(jax.random.key(7), 4)
    qkv = (jax.random.normal(ks[0], (B, Tc + T, (Hq + 2 * Hkv) * D)) * 2.0).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(ks[1], (D,))).astype(dtype)
    kc = jax.random.normal(ks[2], (B, Hkv, C, D)).astype(dtype)
    vc = jax.random.normal(ks[3], (B, Hkv, C, D)).astype(dtype)
    start = jnp.array(starts, jnp.int32)
    ctx_start = start - jnp.array(pending, jnp.int32)
    positions = jnp.concatenate([ctx_start[:, None] + jnp.arange(Tc)[None], start[:, None] + jnp.arange(T)[None]], 1)
    norm = RMSNorm(D, eps, dtype)
    norm.weight[...] = w
    k = rope(norm(qkv[..., Hq * D:(Hq + Hkv) * D].reshape(B, Tc + T, Hkv, D)), positions, theta)
    v = qkv[..., (Hq + Hkv) * D:].reshape(B, Tc + T, Hkv, D)
    want_k = write_rows(write_rows(kc, k[:, :Tc], ctx_start), k[:, Tc:], start)
    want_v = write_rows(write_rows(vc, v[:, :Tc], ctx_start), v[:, Tc:], start)
    cos, sin = rope_tables(positions, D, theta)
    got_k, got_v = tpu_cache_write.write_kv_rows_qkv(kc, vc, qkv, cos, sin, w, eps, start, num_heads=Hq, t0=Tc,
                                                     T=T, ctx_rows=Tc, ctx_start=ctx_start,
                                                     interpret=pltpu.InterpretParams())
    f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(f32(got_v), f32(want_v))
    tol = 1e-5 if dtype == jnp.float32 else 0.0
    np.testing.assert_allclose(f32(got_k), f32(want_k), atol=tol * 8, rtol=tol)


def test_write_kv_rows_qkv_support():
    assert tpu_cache_write.qkv_supported(32, 16, 16, 32, 8, 128, 1024, jnp.bfloat16, 48 * 128)  # Qwen3-8B draft
    assert not tpu_cache_write.qkv_supported(16, 0, 16, 4, 2, 64, 64, jnp.float32, 8 * 64)       # D < a lane row
    assert not tpu_cache_write.qkv_supported(16, 0, 16, 4, 2, 128, 64, jnp.float32, 9 * 128)     # not [q | k | v]
