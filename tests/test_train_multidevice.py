"""Loss and gradients identical on 1 device and on 8 virtual CPU devices (data parallel over the
mesh axis 'data'), with uneven valid-anchor counts across the batch: the loss is normalised over the
global batch, not per device. Runs in a subprocess (the device count is fixed at JAX start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from dflash_jax import DraftConfig, TargetConfig, init_draft, init_target
    from dflash_jax.train.step import StepConfig, Trainer, init_state, make_mesh, split_draft, loss_and_metrics
    assert jax.device_count() == 8, jax.devices()
    tc = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e4)
    target = init_target(tc, dtype="float32")
    dcfg = DraftConfig.for_target(tc, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    B, T = 8, 32
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 63, (B, T)).astype(np.int32)
    lm = np.zeros((B, T), np.int32)
    for r in range(B):                      # 1 .. ~25 valid anchors per row: uneven per device
        start = 3 + r; lm[r, start:start + 2 + 3 * r] = 1
    cfg = StepConfig(block_size=4, mask_token_id=dcfg.mask_token_id, target_layer_ids=(1, 2), num_anchors=8,
                     compute_dtype="float32", total_steps=10, chunk_blocks=4, head_chunk=16)
    gd, params = split_draft(init_draft(dcfg, seed=3, dtype="float32"), "float32")
    out = {}
    for name, devs in (("one", jax.devices()[:1]), ("eight", jax.devices())):
        tr = Trainer(target, gd, cfg, make_mesh(devs))
        state = tr.place_state(init_state(jax.tree.map(jnp.array, params), cfg))
        ms = []
        for i in range(3):
            state, m = tr.step(state, tokens, lm, np.arange(B), 0)
            ms.append(float(m["loss"]))
        out[name] = (ms, [np.asarray(x) for x in jax.tree.leaves(state.params)])
    # the gradient itself, sharded vs not
    tdef, tstate = nnx.split(target)
    def grad_of(tok, mask):
        f = lambda p: loss_and_metrics(p, gd, nnx.merge(tdef, tstate), tok, mask, jnp.arange(B), 0, cfg)[0]
        return jax.grad(f)(params)
    g1 = jax.jit(grad_of)(jnp.asarray(tokens), jnp.asarray(lm))
    mesh = make_mesh()
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    g8 = jax.jit(grad_of)(jax.device_put(tokens, sh), jax.device_put(lm, sh))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(out["one"][0], out["eight"][0], rtol=1e-5)
    for a, b in zip(out["one"][1], out["eight"][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("OK", out["one"][0], out["eight"][0])
""")


@pytest.mark.slow
def test_one_device_equals_eight_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
