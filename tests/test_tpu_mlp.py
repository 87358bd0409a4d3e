"""The fused SwiGLU MLP kernel of the TPU path (pallas_kernels/fused_layer/tpu_mlp.py): in the TPU
interpreter against the XLA layer's ops, and through the whole loop against the XLA path's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernel_config import KernelConfig


def test_tpu_mlp_is_a_tpu_path_setting():
    assert KernelConfig(attention="pallas_tpu", tpu_mlp=True).resolve("cpu").tpu_mlp
    assert KernelConfig(attention="pallas", tpu_mlp=True).resolve("cpu").tpu_mlp       # interpreted
    assert not KernelConfig(attention="xla", tpu_mlp=True).resolve("cpu").tpu_mlp
    assert not KernelConfig(attention="pallas_gpu", tpu_mlp=True).resolve("cpu").tpu_mlp
    assert KernelConfig(attention="pallas_tpu").resolve("cpu").tpu_mlp                # on by default on TPU
    assert not KernelConfig(attention="pallas").resolve("cpu").tpu_mlp                # not in the interpreter
    assert not KernelConfig(attention="pallas_tpu", tpu_mlp=False).resolve("cpu").tpu_mlp
    # part of the compile key
    assert KernelConfig(attention="pallas_tpu", tpu_mlp=True).resolve("cpu") != \
        KernelConfig(attention="pallas_tpu", tpu_mlp=False).resolve("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,lead,H,I,block_i", [
    (jnp.float32, (2, 5), 256, 384, 128),      # rows padded to the sublane tile, 3 intermediate tiles
    (jnp.bfloat16, (2, 16), 128, 512, 256),
    (jnp.bfloat16, (1, 1), 128, 256, None),    # the plain step's one row
])
def test_tpu_mlp_matches_the_xla_layer(dtype, lead, H, I, block_i):
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.models.layers import gated_silu
    from pallas_kernels.fused_layer import tpu_mlp
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (*lead, H), jnp.float32).astype(dtype)
    gu = (jax.random.normal(k[1], (H, 2 * I)) * H ** -0.5).astype(dtype)
    down = (jax.random.normal(k[2], (I, H)) * I ** -0.5).astype(dtype)
    ref = np.asarray((gated_silu(x @ gu) @ down).astype(jnp.float32))
    out = tpu_mlp.mlp(x, gu, down, block_i=block_i, interpret=pltpu.InterpretParams())
    assert out.shape == x.shape and out.dtype == x.dtype
    err = np.abs(np.asarray(out.astype(jnp.float32)) - ref).max()
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7 * np.abs(ref).max()   # bf16: one rounding step
    assert err <= tol, err


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_mlp_block_with_norm_and_residual_matches_the_xla_layer(dtype):
    """norm_weight: the layer's MLP block x + mlp(RMSNorm(x)), as DecoderLayer.attn_mlp in XLA ops."""
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.models.layers import RMSNorm, gated_silu
    from pallas_kernels.fused_layer import tpu_mlp
    H, I = 256, 384
    k = jax.random.split(jax.random.key(3), 4)
    x = (3.0 * jax.random.normal(k[0], (2, 8, H))).astype(dtype)
    gu = (jax.random.normal(k[1], (H, 2 * I)) * H ** -0.5).astype(dtype)
    down = (jax.random.normal(k[2], (I, H)) * I ** -0.5).astype(dtype)
    norm = RMSNorm(H, 1e-6, dtype)
    norm.weight[...] = (1.0 + 0.1 * jax.random.normal(k[3], (H,))).astype(dtype)
    ref = np.asarray((x + gated_silu(norm(x) @ gu) @ down).astype(jnp.float32))
    out = tpu_mlp.mlp(x, gu, down, norm_weight=norm.weight[...], eps=norm.eps, block_i=128,
                      interpret=pltpu.InterpretParams())
    err = np.abs(np.asarray(out.astype(jnp.float32)) - ref).max()
    tol = 1e-4 if dtype == jnp.float32 else 2 ** -7 * np.abs(ref).max()
    assert err <= tol, err


@pytest.mark.slow
def test_tpu_mlp_row_scale_is_the_next_norms_scale():
    """row_scale_eps: the kernel also returns rsqrt(mean(y²) + eps) of its output rows, and
    RMSNorm.scaled with it is the next RMSNorm of y (the reduction done in the kernel)."""
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.models.layers import RMSNorm, RowScale
    from pallas_kernels.fused_layer import tpu_mlp
    H, I = 256, 256
    k = jax.random.split(jax.random.key(5), 4)
    x = 3.0 * jax.random.normal(k[0], (2, 5, H))
    gu = jax.random.normal(k[1], (H, 2 * I)) * H ** -0.5
    down = jax.random.normal(k[2], (I, H)) * I ** -0.5
    norm = RMSNorm(H, 1e-6, jnp.float32)
    nxt = RMSNorm(H, 1e-5, jnp.float32)
    nxt.weight[...] = 1.0 + 0.1 * jax.random.normal(k[3], (H,))
    kw = dict(norm_weight=norm.weight[...], eps=norm.eps, block_i=128, interpret=pltpu.InterpretParams())
    plain = tpu_mlp.mlp(x, gu, down, **kw)
    y, r = tpu_mlp.mlp(x, gu, down, row_scale_eps=nxt.eps, **kw)
    assert r.shape == (2, 5, 1) and r.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))
    ref = jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + nxt.eps)
    np.testing.assert_allclose(np.asarray(r), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nxt.scaled(y, RowScale(r, nxt.eps))), np.asarray(nxt(y)), rtol=1e-5,
                               atol=1e-6)
    # a scale made with another eps is not used: the norm reduces itself
    np.testing.assert_array_equal(np.asarray(nxt.scaled(y, RowScale(r * 0, 1e-3))), np.asarray(nxt(y)))


def test_tpu_mlp_refuses_what_it_cannot_tile():
    from pallas_kernels._common import Unsupported
    from pallas_kernels.fused_layer import tpu_mlp
    x = jnp.zeros((1, 4, 96), jnp.float32)
    with pytest.raises(Unsupported):
        tpu_mlp.mlp(x, jnp.zeros((96, 256)), jnp.zeros((128, 96)))
    with pytest.raises(ValueError, match="do not fit"):
        tpu_mlp.mlp(jnp.zeros((1, 4, 128)), jnp.zeros((128, 200)), jnp.zeros((128, 128)))


@pytest.mark.slow
def test_loop_with_the_tpu_mlp_gives_the_xla_tokens(tmp_path):
    """head_dim 128: the attention also takes the fused-q path (block_attention_qkv) in the loop."""
    from tests.checkpoints import random_prompts, write_draft, write_target
    from dflash_jax import generate, load_draft, load_target
    tp = write_target(str(tmp_path / "t"), hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=128, seed=9)
    dp = write_draft(str(tmp_path / "d"), tp, num_layers=1, block_size=8, target_layer_ids=[0, 1], seed=10)
    target = load_target(tp, dtype="float32")
    draft = load_draft(dp, target=target, dtype="float32")
    prompts = random_prompts(2, 127, min_len=3, max_len=11, seed=2)
    xla = generate(target, draft, prompts, max_new_tokens=10, kernels=KernelConfig(attention="xla"), verify_width="block")
    fused = generate(target, draft, prompts, max_new_tokens=10,
                     kernels=KernelConfig(attention="pallas", tpu_mlp=True), verify_width="block")
    assert fused.tokens == xla.tokens
    assert fused.acceptance_lengths == xla.acceptance_lengths
