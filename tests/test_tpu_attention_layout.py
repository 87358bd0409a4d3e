"""The TPU attention kernel's token-major layout with its q prologue (block_attention_qkv): q read
straight out of the fused projection's output, q_norm and RoPE applied in the kernel, o written in
the o-projection's layout. Against the XLA layer's ops + the reference attention, in the TPU
interpreter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import reference, tpu


def _layer_q(qkv, positions, w, eps, Hq, D, t0, theta):
    """models.layers' q: split, q_norm (RMSNorm), RoPE, in XLA ops."""
    from dflash_jax.models.layers import RMSNorm, rope
    norm = RMSNorm(D, eps, qkv.dtype)
    norm.weight[...] = w
    B, Tall, _ = qkv.shape
    q = qkv[:, t0:, :Hq * D].reshape(B, Tall - t0, Hq, D)
    return rope(norm(q), positions, theta)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,B,T,t0,Hq,Hkv,C", [
    (jnp.float32, 2, 8, 8, 4, 2, 256),      # the draft: queries after t0 context rows
    (jnp.bfloat16, 2, 16, 0, 8, 2, 256),    # the verify
])
def test_block_attention_qkv_matches_the_layer_and_reference(dtype, B, T, t0, Hq, Hkv, C):
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.models.layers import rope_tables
    D, eps, theta = 128, 1e-6, 10000.0
    ks = jax.random.split(jax.random.key(1), 5)
    N = (Hq + 2 * Hkv) * D
    qkv = (jax.random.normal(ks[0], (B, t0 + T, N)) * 2.0).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(ks[1], (D,))).astype(dtype)
    kc = jax.random.normal(ks[2], (B, Hkv, C, D)).astype(dtype)
    vc = jax.random.normal(ks[3], (B, Hkv, C, D)).astype(dtype)
    start = jnp.array([3, 100])[:B]
    positions = start[:, None] + jnp.arange(T)[None]                        # [B, T]
    k_end = positions + 1
    q = _layer_q(qkv, positions, w, eps, Hq, D, t0, theta)
    cos, sin = rope_tables(positions, D, theta)
    out = tpu.block_attention_qkv(qkv, cos, sin, w, eps, kc, vc, k_end, num_heads=Hq, t0=t0,
                                  interpret=pltpu.InterpretParams())
    assert out.shape == (B, T, Hq * D) and out.dtype == dtype
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = np.asarray(reference.block_attention(f32(q), f32(kc), f32(vc), k_end)).reshape(B, T, -1)
    err = np.abs(np.asarray(f32(out)) - ref).max()
    tol = 2e-5 if dtype == jnp.float32 else 2e-2 * np.abs(ref).max()
    assert err <= tol, err


def test_fused_q_support():
    assert tpu.fused_q_supported(16, 16, 32, 8, 128, 1024, jnp.bfloat16)     # Qwen3-8B draft block
    assert tpu.fused_q_supported(16, 0, 32, 8, 128, 1024, jnp.bfloat16)      # verify
    assert not tpu.fused_q_supported(1, 0, 32, 8, 128, 1024, jnp.bfloat16)   # decode: folded layout
    assert not tpu.fused_q_supported(16, 0, 4, 2, 64, 1024, jnp.float32)     # head_dim < a lane row
    assert not tpu.fused_q_supported(16, 8, 8, 2, 128, 1024, jnp.bfloat16)   # t0 not on a tile
