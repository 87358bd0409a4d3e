"""Expert parallelism (issue 36) on virtual CPU devices: the MoE block and the whole loop with an
MoE target on meshes whose 'model' axis splits the experts (2, 4, 8) = one device.

As tests/test_sharding.py, the cases need XLA_FLAGS=--xla_force_host_platform_device_count=8 before
JAX starts, so they run in a child pytest: tests/test_sharding.py::test_on_8_devices's 8-device child
(one process start for both files' cases); run them directly with
    DFLASH_MOE_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_moe_sharding.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest

CHILD = os.environ.get("DFLASH_MOE_CHILD") == "1"
child = pytest.mark.skipif(not CHILD, reason="runs in the 8-device child (tests/test_sharding.py::test_on_8_devices)")


if CHILD:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax import sharding as sh
    from dflash_jax.config import DraftConfig, Qwen3MoeConfig
    from dflash_jax.models.qwen3_moe import Qwen3Moe
    from dflash_jax.weights import init_draft

    # 8 experts (top-2, renormalised), layer 1 dense; 8 q / 2 kv heads as test_sharding's TINY8
    MOE = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8,
                         num_kv_heads=2, head_dim=8, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(1,))


def _mesh(spec):
    d, m = sh.parse_mesh(spec)
    return sh.make_mesh(spec, devices=jax.devices()[: d * m])


def _target(mesh=None, cfg=None):
    t = Qwen3Moe(cfg or MOE, jnp.float32, rngs=nnx.Rngs(0))
    return sh.shard_model(t, mesh) if mesh is not None else t


@child
@pytest.mark.parametrize("spec", ["1x2", "1x4", "1x8", "2x4"])
def test_moe_block_on_expert_shards_matches_one_device(spec):
    mesh = _mesh(spec)
    one = _target()
    moe = one.layers[0].mlp
    h = jax.random.normal(jax.random.key(1), (4, 5, 64), jnp.float32)
    want = moe(h)
    sharded = _target(mesh).layers[0].mlp
    assert sharded.experts_gate_up[...].sharding.spec[0] == "model"
    ep = sh.model_axis_size(mesh)
    assert sharded.experts_down[...].addressable_shards[0].data.shape[0] == 8 // ep    # local experts only
    with sh.active(mesh):
        got = jax.jit(lambda x: sharded(x))(h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@child
@pytest.mark.parametrize("spec", ["1x4", "2x4"])
def test_generate_with_moe_target_on_mesh_matches_one_device(spec):
    """Greedy tokens and acceptance lengths of plain decoding and of DFlash (a proposer double that
    errs at slot 1, so acceptance varies) with the experts split over 'model'."""
    from dflash_jax import decode
    from tests.doubles import truth_proposer
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3], [100, 101]]
    kw = dict(max_new_tokens=10, attention_impl="xla", capacity=64)
    dcfg = DraftConfig.for_target(MOE, num_layers=2, block_size=4)
    plain = decode.generate(_target(), None, prompts, **kw)
    truth = np.zeros((len(prompts), 64), np.int32)
    for i, (p, t) in enumerate(zip(prompts, plain.tokens)):
        truth[i, :len(p) + len(t)] = p + t
    mesh = _mesh(spec)
    out = []
    for m in (None, mesh):
        draft = init_draft(dcfg, dtype="float32")
        if m is not None:
            sh.shard_model(draft, m)
        out.append(decode.generate(_target(m), truth_proposer(draft, truth, 1, 128), prompts, mesh=m, **kw, verify_width="block"))
    assert out[0].tokens == plain.tokens
    assert out[1].tokens == out[0].tokens
    assert out[1].acceptance_lengths == out[0].acceptance_lengths
    assert max(max(a) for a in out[1].acceptance_lengths) > 1
    assert decode.generate(_target(mesh), None, prompts, mesh=mesh, **kw).tokens == plain.tokens


@child
def test_experts_the_mesh_cannot_divide_are_refused_in_one_line():
    import dataclasses
    cfg = dataclasses.replace(MOE, num_experts=6)
    with pytest.raises(ValueError, match=r"^[^\n]*num_experts=6 is not divisible by the model axis size 4[^\n]*$"):
        _target(_mesh("1x4"), cfg)


@child
@pytest.mark.parametrize("spec", ["1x4", "2x4"])
def test_sliced_load_reads_each_expert_once_on_its_shard(spec, tmp_path, monkeypatch):
    """load_target(..., mesh=) of a Hub-format MoE checkpoint builds every parameter from the
    safetensors slices its devices hold: the stacked experts come out equal to the host load
    placed by shard_model, split over 'model', and each per-expert tensor is read exactly once (its
    shard's block; the data axis's replicas reuse it), never the whole layer per device."""
    from dflash_jax import load_target
    from dflash_jax import weights as wl
    from tests.checkpoints import write_moe_target
    path = write_moe_target(str(tmp_path), seed=3, num_experts=8, num_experts_per_tok=2, mlp_only_layers=(1,),
                            num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=128)
    reads: dict = {}
    real = wl._Checkpoint.read

    def counting(self, name, index):
        reads[name] = reads.get(name, 0) + 1
        return real(self, name, index)
    monkeypatch.setattr(wl._Checkpoint, "read", counting)
    mesh = _mesh(spec)
    got = load_target(path, "float32", mesh=mesh)
    monkeypatch.setattr(wl._Checkpoint, "read", real)
    experts = {n: c for n, c in reads.items() if ".mlp.experts." in n}
    assert len(experts) == 2 * 8 * 3 and set(experts.values()) == {1}, experts       # 2 sparse layers
    want = sh.shard_model(load_target(path, "float32"), mesh)
    g, w = dict(nnx.to_flat_state(nnx.state(got, nnx.Param))), dict(nnx.to_flat_state(nnx.state(want, nnx.Param)))
    assert g.keys() == w.keys()
    for k in g:
        a, b = g[k].get_value(), w[k].get_value()
        assert a.sharding.spec == b.sharding.spec, k
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(k))
    gu = got.layers[0].mlp.experts_gate_up[...]
    assert gu.sharding.spec[0] == "model" and gu.addressable_shards[0].data.shape[0] == 8 // sh.model_axis_size(mesh)


@child
def test_sliced_load_names_a_missing_expert(tmp_path):
    from safetensors.numpy import load_file, save_file
    from dflash_jax import load_target
    from tests.checkpoints import write_moe_target
    path = write_moe_target(str(tmp_path), seed=3, num_heads=8, num_kv_heads=2, head_dim=8)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(t, f)
    with pytest.raises(ValueError, match=r"^[^\n]*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight[^\n]*$"):
        load_target(path, "float32", mesh=_mesh("1x4"))
