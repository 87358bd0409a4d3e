"""The fused SwiGLU MLP kernel of the TPU path (pallas_kernels/fused_layer/tpu_mlp.py): in the TPU
interpreter against the XLA layer's ops, and through the whole loop against the XLA path's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernel_config import KernelConfig
from tests import tpu_aot


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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_mlp_reads_int8_weights_like_the_dequantize_oracle(dtype):
    """int8 gate_up / down (dflash_jax.quantize.Int8Weight q + per-column scales) in the kernel's
    prologue, the whole MLP block (norm, residual, the next norm's row scale): float32 against NumPy
    on the dequantized weights; bf16 against the XLA layer's int8 ops (models.layers.linear) within
    two bf16 roundings."""
    from jax.experimental.pallas import tpu as pltpu
    from dflash_jax.models.layers import RMSNorm, gated_silu, linear
    from dflash_jax.quantize import quantize_int8
    from pallas_kernels.fused_layer import tpu_mlp
    H, I = 256, 384
    rng = np.random.default_rng(11)
    x = jnp.asarray(3.0 * rng.normal(size=(2, 5, H)), dtype)
    # columns of different magnitudes: the scales matter
    gu = quantize_int8(jnp.asarray(rng.normal(size=(H, 2 * I)) * H ** -0.5 * rng.uniform(0.2, 3, 2 * I), jnp.float32))
    down = quantize_int8(jnp.asarray(rng.normal(size=(I, H)) * I ** -0.5 * rng.uniform(0.2, 3, H), jnp.float32))
    norm = RMSNorm(H, 1e-6, dtype)
    norm.weight[...] = jnp.asarray(1.0 + 0.1 * rng.normal(size=(H,)), dtype)
    y, r = tpu_mlp.mlp(x, gu.q, down.q, gate_up_scale=gu.scale, down_scale=down.scale,
                       norm_weight=norm.weight[...], eps=norm.eps, row_scale_eps=1e-5, block_i=128,
                       interpret=pltpu.InterpretParams())
    assert y.shape == x.shape and y.dtype == dtype and r.shape == (2, 5, 1)
    if dtype == jnp.float32:
        xf = np.asarray(x, np.float64)
        n = xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(norm.weight[...], np.float64)
        h = n @ np.asarray(gu.dequantize(), np.float64)
        ref = xf + (h[..., :I] / (1 + np.exp(-h[..., :I])) * h[..., I:]) @ np.asarray(down.dequantize(), np.float64)
        tol = 1e-5 * np.abs(ref).max()
    else:
        ref = np.asarray((x + linear(gated_silu(linear(norm(x), gu)), down)).astype(jnp.float32))
        tol = 2 ** -6 * np.abs(ref).max()    # XLA rounds x @ q to bf16 before its scales: two roundings
    err = np.abs(np.asarray(y, np.float64) - ref).max()
    assert err <= tol, (err, tol)
    yf = np.asarray(y, np.float64)
    np.testing.assert_allclose(np.asarray(r)[..., 0], 1 / np.sqrt((yf ** 2).mean(-1) + 1e-5), rtol=1e-5)
    # the Int8Weights themselves: the same call
    np.testing.assert_array_equal(np.asarray(tpu_mlp.mlp(x, gu, down, norm_weight=norm.weight[...], eps=norm.eps,
                                                         block_i=128, interpret=pltpu.InterpretParams())),
                                  np.asarray(tpu_mlp.mlp(x, gu.q, down.q, gate_up_scale=gu.scale,
                                                         down_scale=down.scale, norm_weight=norm.weight[...],
                                                         eps=norm.eps, block_i=128, interpret=pltpu.InterpretParams())))
    with pytest.raises(ValueError, match="both"):
        tpu_mlp.mlp(x, gu.q, down.q, gate_up_scale=gu.scale)
    from pallas_kernels._common import Unsupported
    with pytest.raises(Unsupported):
        tpu_mlp.mlp(x, gu.q, down.q)                        # int8 without its scales is not floats


@tpu_aot.requires_libtpu
def test_tpu_mlp_int8_compiles_for_v5e_reading_int8():
    """Qwen3-8B's MLP block (H 4096, I 12288) at a B = 1 verify's 16 rows with int8 weights through
    Mosaic for v5e: the kernel's operands are the int8 matrices and their scales, nothing converted
    in HBM (temporaries ~0) and the weights counted at their int8 bytes."""
    from pallas_kernels.fused_layer import tpu_mlp
    dev = tpu_aot.tpu_device("v5e:2x2")
    H, I = 4096, 12288
    args = (tpu_aot.abstract((1, 16, H), jnp.bfloat16, dev), tpu_aot.abstract((H, 2 * I), jnp.int8, dev),
            tpu_aot.abstract((I, H), jnp.int8, dev), tpu_aot.abstract((2 * I,), jnp.float32, dev),
            tpu_aot.abstract((H,), jnp.float32, dev), tpu_aot.abstract((H,), jnp.bfloat16, dev))
    compiled = tpu_aot.compile_for_tpu(
        lambda x, gu, d, gs, ds, nw: tpu_mlp.mlp(x, gu, d, gate_up_scale=gs, down_scale=ds, norm_weight=nw,
                                                 eps=1e-6), *args)
    assert "dflash_mlp_tpu_int8" in compiled.as_text()
    ma = compiled.memory_analysis()
    assert ma.argument_size_in_bytes < 3 * H * I * 1.01 + 1e6 and ma.temp_size_in_bytes < 4e6, ma


def test_tpu_mlp_refuses_what_it_cannot_tile():
    from pallas_kernels._common import Unsupported
    from pallas_kernels.fused_layer import tpu_mlp
    x = jnp.zeros((1, 4, 96), jnp.float32)
    with pytest.raises(Unsupported):
        tpu_mlp.mlp(x, jnp.zeros((96, 256)), jnp.zeros((128, 96)))
    with pytest.raises(ValueError, match="do not fit"):
        tpu_mlp.mlp(jnp.zeros((1, 4, 128)), jnp.zeros((128, 200)), jnp.zeros((128, 128)))


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_loop_with_the_tpu_mlp_gives_the_xla_tokens(tmp_path, quantize, monkeypatch):
    """head_dim 128: the attention also takes the fused-q path (block_attention_qkv) in the loop;
    an int8 target's MLP weights go into the kernel as int8 (models.layers: DecoderLayer._mlp_block)."""
    from tests.checkpoints import random_prompts, write_draft, write_target
    from dflash_jax import generate, load_draft, load_target
    tp = write_target(str(tmp_path / "t"), hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=128, seed=9)
    dp = write_draft(str(tmp_path / "d"), tp, num_layers=1, block_size=8, target_layer_ids=[0, 1], seed=10)
    target = load_target(tp, dtype="float32", quantize=quantize)
    draft = load_draft(dp, target=target, dtype="float32")
    prompts = random_prompts(2, 127, min_len=3, max_len=11, seed=2)
    xla = generate(target, draft, prompts, max_new_tokens=10, kernels=KernelConfig(attention="xla"), verify_width="block")
    from pallas_kernels.fused_layer import tpu_mlp
    weights = []
    real = tpu_mlp.mlp
    monkeypatch.setattr(tpu_mlp, "mlp", lambda x, gu, down, **kw: weights.append(type(gu).__name__) or real(x, gu, down, **kw))
    fused = generate(target, draft, prompts, max_new_tokens=10,
                     kernels=KernelConfig(attention="pallas", tpu_mlp=True), verify_width="block")
    assert ("Int8Weight" in weights) == bool(quantize), weights    # the target's layers ran it on int8 (the draft's on floats)
    assert fused.tokens == xla.tokens
    assert fused.acceptance_lengths == xla.acceptance_lengths
