"""FP8 checkpoints (issue 57): Qwen's / DeepSeek's `quant_method: fp8` format (float8_e4m3fn weights,
`weight_scale_inv` per 128 x 128 block) loads in 8 bits as quantize.Fp8BlockWeight, computes the same
logits as transformers running the dequantized weights, keeps DFlash lossless, and bad input is one
line."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from tests import checkpoints as ck

from dflash_jax import DraftConfig, generate, init_draft, init_target, load_target
from dflash_jax.models.layers import linear
from dflash_jax.quantize import Fp8BlockWeight, Int8Weight, concat_columns, quantized_leaves, weight_bytes

# hidden 96 and intermediate 200: no multiple of 128 (ragged last blocks; down_proj's two K blocks);
# q 8 x 32 = 256 and k / v 4 x 32 = 128 make the fused qkv's block grids line up, gate | up (200 |
# 200) does not (per-column scales)
SHAPES = dict(vocab_size=128, hidden_size=96, intermediate_size=200, num_layers=3, num_heads=8, num_kv_heads=4,
              head_dim=32)
KEEP_FLOAT = ("model.layers.0.self_attn.o_proj.weight",)     # as modules_to_not_convert leaves one


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory):
    path = ck.write_fp8_target(str(tmp_path_factory.mktemp("fp8_target")), keep_float=KEEP_FLOAT, seed=3, **SHAPES)
    return path, ck.fp8_dequantized_hf(path), load_target(path, dtype="float32")


def _blocks_oracle(q, scale, block):
    """q [K, N] float8 and its block scales in float64 NumPy, dequantized block by block."""
    w = np.asarray(q, np.float64).copy()
    bk, bn = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bk:(i + 1) * bk, j * bn:(j + 1) * bn] *= float(scale[i, j])
    return w


def test_fp8_matmul_matches_numpy_dequantize_oracle():
    rng = np.random.default_rng(0)
    K, N, block = 200, 150, (128, 128)
    q = (rng.normal(size=(K, N)) * 40).astype(ml_dtypes.float8_e4m3fn)
    scale = np.exp2(rng.uniform(-6, 2, size=(2, 2))).astype(np.float32)
    w = Fp8BlockWeight(jnp.asarray(q), jnp.asarray(scale), block)
    want_w = _blocks_oracle(q, scale, block)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), want_w.astype(np.float32))
    for shape in ((2, 3, K), (1, 1, K)):
        x = rng.normal(size=shape).astype(np.float32)
        want = np.asarray(x, np.float64) @ want_w
        np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), w)), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: x @ w)(jnp.asarray(x), w)), want, rtol=1e-5,
                                   atol=1e-4)
    # a column permutation (sharding's fused layout) and the scales spread per row / column keep
    # the values: whole aligned blocks move as blocks, anything else spreads per column first
    whole = Fp8BlockWeight(jnp.asarray(q[:, :128]), jnp.asarray(scale[:, :1]), (64, 32))
    whole = Fp8BlockWeight(whole.q, jnp.asarray(np.exp2(rng.uniform(-3, 3, size=(4, 4))), jnp.float32), (64, 32))
    for cols, bn in ((np.r_[64:96, 0:32, 0:32], 32), (np.r_[16:48], 1), (np.r_[96:128, 0:16], 1)):
        got = whole.take_columns(cols)
        assert got.block == (64, bn)
        np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(whole.dequantize())[:, cols])
    for ax, spread in ((-2, (1, 128)), (-1, (128, 1))):
        assert w.spread(ax).block == spread
        np.testing.assert_array_equal(np.asarray(w.spread(ax).dequantize()), want_w.astype(np.float32))
    # the transpose (the checkpoint's [out, in] → ours) and fused parts: aligned grids concatenate,
    # a ragged part spreads its scales per column
    np.testing.assert_array_equal(np.asarray(w.T.dequantize()), want_w.T.astype(np.float32))
    other = Fp8BlockWeight(jnp.asarray(q[:, :128]), jnp.asarray(scale[:, :1] * 3), block)
    for parts, bn in (((other, w), 128), ((w, other), 1)):
        fused = concat_columns(list(parts))
        assert fused.block == (128, bn) and fused.shape == (K, N + 128)
        np.testing.assert_array_equal(np.asarray(fused.dequantize()),
                                      np.concatenate([np.asarray(p.dequantize()) for p in parts], axis=1))


def test_fp8_checkpoint_logits_match_transformers_on_the_dequantized_weights(fp8_target):
    path, hf, target = fp8_target
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "fp8"
    fp8 = quantized_leaves(target)
    # qkv, o, gate_up, down of 3 layers, less layer 0's o_proj the checkpoint left in floats
    assert len(fp8) == 4 * 3 - 1 and all(isinstance(w, Fp8BlockWeight) for w in fp8)
    assert all(w.q.dtype == jnp.float8_e4m3fn and w.scale.dtype == jnp.float32 for w in fp8)
    assert {w.block for w in fp8} == {(128, 128), (128, 1)}            # qkv aligned, gate_up per column
    assert target.layers[0].o[...].dtype == jnp.float32 and target.lm_head[...].dtype == jnp.float32
    assert target.quantize == "fp8"
    assert weight_bytes(target) < 0.5 * weight_bytes(init_target(target.config, dtype="float32"))
    # quantize="int8" on an FP8 checkpoint: its fp8 weights stay, the one it left in floats turns int8
    both = load_target(path, dtype="float32", quantize="int8")
    assert both.quantize == "fp8+int8" and isinstance(both.layers[0].o[...], Int8Weight)
    assert sum(isinstance(w, Fp8BlockWeight) for w in quantized_leaves(both)) == len(fp8)
    ids = np.random.RandomState(0).randint(0, 128, (2, 13))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids), attention_mask=torch.ones(2, 13, dtype=torch.long)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    h, _, _ = target(jnp.asarray(ids), pos, target.new_cache(2, 32), pos + 1)
    np.testing.assert_allclose(np.asarray(target.logits(h)), want, atol=1e-4, rtol=0)


def test_fp8_target_dflash_greedy_equals_plain_greedy(fp8_target):
    _, _, target = fp8_target
    draft = init_draft(DraftConfig.for_target(target.config, num_layers=1, block_size=4), seed=2, dtype="float32",
                       target=target)
    prompts = [[3, 17, 99, 5, 64, 2, 8], [5, 9, 77, 3, 1]]
    res = generate(target, draft, prompts, max_new_tokens=20, block_size=4)
    plain = generate(target, None, prompts, max_new_tokens=20)
    assert res.tokens == plain.tokens and all(len(t) == 20 for t in res.tokens)


def _rewrite(src: str, dst: str, config=None, tensors=None):
    """A copy of checkpoint `src` with its config.json dict and tensors {name: torch tensor} edited."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(src, dst)
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        with safe_open(os.path.join(dst, "model.safetensors"), "pt") as st:
            have = {k: st.get_tensor(k) for k in st.keys()}
        tensors(have)
        save_file(have, os.path.join(dst, "model.safetensors"))
    return dst


def test_fp8_bad_input_is_one_line(fp8_target, tmp_path):
    src = fp8_target[0]
    name = "model.layers.1.mlp.down_proj.weight"
    cases = [
        (dict(config=lambda c: c["quantization_config"].update(quant_method="gptq")),
         r"quantization_config.quant_method='gptq' is not supported; supported: quant_method 'fp8'"),
        (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[128])),
         r"quantization_config.weight_block_size=\[128\] must be two positive integers"),
        (dict(tensors=lambda t: t.pop(name + "_scale_inv")),
         rf"tensor {name} is float8 but the checkpoint has no {name}_scale_inv"),
        (dict(tensors=lambda t: t.update({name + "_scale_inv": torch.ones(1, 1)})),
         rf"tensor {name}_scale_inv has shape \(1, 1\); weight {name} \(96, 200\) in blocks of \[128, 128\] "
         r"needs \(1, 2\)"),
        (dict(config=lambda c: c.pop("quantization_config")),
         rf"tensor model.layers.0.mlp.down_proj.weight has dtype float8_e4m3fn; weights must be floating point"),
    ]
    for i, (edit, msg) in enumerate(cases):
        bad = _rewrite(src, str(tmp_path / f"bad{i}"), **edit)
        with pytest.raises(ValueError, match=msg) as e:
            load_target(bad, dtype="float32")
        assert "\n" not in str(e.value)


def test_fp8_checkpoint_on_the_generate_cli(fp8_target, tmp_path, capsys):
    """The CLI loads an FP8 checkpoint like any other; an unsupported method is a usage error (exit
    2) of one line, no traceback."""
    from dflash_jax.cli import generate as gen_cli
    src = fp8_target[0]
    code = gen_cli.main(["--model", src, "--draft", "none", "--dtype", "float32", "--prompt-ids", "1,2,3",
                         "--max-new-tokens", "4", "--no-stream"])
    out, _ = capsys.readouterr()
    assert code == 0 and len(out.split()) == 4
    bad = _rewrite(src, str(tmp_path / "awq"), config=lambda c: c["quantization_config"].update(quant_method="awq"))
    with pytest.raises(SystemExit) as e:
        gen_cli.main(["--model", bad, "--draft", "none", "--prompt-ids", "1"])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and "quant_method='awq' is not supported" in err and "Traceback" not in err


@pytest.mark.parametrize("moe_gmm,inter", [("xla", 200), ("pallas_gpu_interpret", 192)])
def test_fp8_moe_checkpoint_keeps_its_experts_in_8_bits(tmp_path, moe_gmm, inter):
    """A Qwen3-MoE FP8 checkpoint (experts in fp8 too, moe_intermediate 200: gate | up per column):
    its stacked experts load as 3-D Fp8BlockWeights and the logits equal those of the same checkpoint
    dequantized in torch and loaded in float32 (whose loader tests/test_moe.py checks against
    transformers). (DFlash greedy on quantized MoE experts: tests/test_quantize.py's int8 cases.)
    moe_gmm "pallas_gpu_interpret" (moe_intermediate 192, which its 16-multiple tiles divide; down's
    second K block ragged, 64 of 128): the experts read as float8 by the GPU grouped-matmul kernel
    (interpreted), the same logits, and DFlash greedy through it equals plain greedy through it."""
    from dflash_jax import KernelConfig
    from dflash_jax.models.moe import experts
    path = ck.write_fp8_target(str(tmp_path / "moe_fp8"), moe=True, seed=5, hidden_size=96, moe_intermediate_size=inter,
                               num_experts=4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    target = load_target(path, dtype="float32")
    ref = load_target(ck.write_fp8_dequantized(path, str(tmp_path / "deq")), dtype="float32")
    gu, down = target.layers[0].mlp.experts_gate_up[...], target.layers[0].mlp.experts_down[...]
    assert isinstance(gu, Fp8BlockWeight) and gu.q.shape == (4, 96, 2 * inter) and gu.scale.shape == (4, 1, 2 * inter)
    assert isinstance(down, Fp8BlockWeight) and down.scale.shape == (4, 2, 1) and down.block == (128, 128)
    assert not isinstance(target.layers[0].mlp.router[...], Fp8BlockWeight)
    np.testing.assert_array_equal(np.asarray(gu.dequantize()), np.asarray(ref.layers[0].mlp.experts_gate_up[...]))
    x = jax.random.normal(jax.random.key(0), (3, 96))
    idx = jnp.asarray([[0, 2], [1, 3], [2, 3]], jnp.int32)
    w = jnp.full((3, 2), 0.5)
    np.testing.assert_allclose(np.asarray(experts(x, w, idx, gu, down, first_expert=None, gmm_impl=moe_gmm)),
                               np.asarray(experts(x, w, idx, ref.layers[0].mlp.experts_gate_up[...],
                                                  ref.layers[0].mlp.experts_down[...], first_expert=None)),
                               rtol=1e-5, atol=1e-5)
    kernels = KernelConfig(attention="xla", moe_gmm=moe_gmm)
    if moe_gmm != "xla":
        assert "dflash_gmm_gpu_fp8" in str(jax.make_jaxpr(
            lambda x, gu, down: experts(x, w, idx, gu, down, first_expert=None, gmm_impl=moe_gmm))(x, gu, down))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 11)))
    pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    got = np.asarray(target.logits(target(ids, pos, target.new_cache(2, 32), pos + 1, kernels=kernels.resolve("cpu"))[0]))
    want = np.asarray(ref.logits(ref(ids, pos, ref.new_cache(2, 32), pos + 1)[0]))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    if moe_gmm != "xla":
        draft = init_draft(DraftConfig.for_target(target.config, num_layers=1, block_size=4), seed=2,
                           dtype="float32", target=target)
        prompts = [[3, 17, 99, 5, 64, 2, 8], [5, 9, 77, 3, 1]]
        # the full block: a width only changes how many rows reach the kernel (its own cases vary
        # the rows: test_moe.py, test_quantize.py's experts oracle); auto's extra verify programs,
        # each through the interpreted kernel, cost 15 of this case's 26 s, and the width logic is
        # test_adaptive.py's and every family's width-parametrized oracle test's
        res = generate(target, draft, prompts, max_new_tokens=12, block_size=4, kernels=kernels, verify_width="block")
        assert res.tokens == generate(target, None, prompts, max_new_tokens=12, kernels=kernels).tokens


# Qwen's Qwen3.5-*-FP8 layout: attention q / k / v / o, GDN in_proj_qkv / in_proj_z / out_proj, the
# MLP, shared expert and experts in fp8; in_proj_a / in_proj_b, conv, norms, router, the shared
# expert's gate, embeddings and LM head in floats
QWEN3_5_FP8 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "out_proj")


@pytest.mark.parametrize("case", ["qwen-layout-128", "all-linears-16x32", "moe-16x32"])
def test_fp8_qwen3_5_checkpoint_logits_match_transformers_on_the_dequantized_weights(case, tmp_path):
    """A Qwen3.5 (hybrid; `moe`: Qwen3.5-MoE) FP8 checkpoint loads through the family's own loader
    with its linears in 8 bits and gives transformers' logits on the torch-dequantized weights
    (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, float32). Qwen's layout keeps in_proj_a / b in
    floats, so the fused GDN in_proj loads dequantized (exact); with every linear in fp8 it stays
    fp8."""
    import transformers

    from dflash_jax.models.qwen3_5 import Qwen35
    moe = case.startswith("moe")
    if moe:
        from tests.test_qwen3_5_moe import write_qwen3_5_moe as write
        hf_cls = transformers.Qwen3_5MoeForCausalLM
    else:
        from tests.test_qwen3_5 import write_qwen3_5 as write
        hf_cls = transformers.Qwen3_5ForCausalLM
    linears = QWEN3_5_FP8 + (() if case == "qwen-layout-128" else ("in_proj_a", "in_proj_b"))
    path = write(str(tmp_path / "q35"), seed=4)
    ck.to_fp8(path, block=(128, 128) if case == "qwen-layout-128" else (16, 32), linears=linears, seed=4)
    target = load_target(path, dtype="float32")
    assert isinstance(target, Qwen35) and target.quantize == "fp8"
    gdn = next(layer.mixer for layer in target.layers if layer.kind != "full_attention")
    attn = next(layer.mixer for layer in target.layers if layer.kind == "full_attention")
    assert isinstance(attn.qkv[...], Fp8BlockWeight) and isinstance(attn.o[...], Fp8BlockWeight)
    assert isinstance(gdn.out[...], Fp8BlockWeight)
    assert isinstance(gdn.in_proj[...], Fp8BlockWeight) == (case != "qwen-layout-128")
    assert gdn.conv[...].dtype == jnp.float32 and target.lm_head[...].dtype == jnp.float32
    mlp = target.layers[0].mlp
    if moe:
        assert isinstance(mlp.experts.experts_gate_up[...], Fp8BlockWeight)
        assert isinstance(mlp.shared.down[...], Fp8BlockWeight) and mlp.shared_gate[...].dtype == jnp.float32
    else:
        assert isinstance(mlp.gate_up[...], Fp8BlockWeight)
    hf = hf_cls.from_pretrained(ck.write_fp8_dequantized(path, str(tmp_path / "deq")),
                                attn_implementation="eager").float().eval()
    ids = np.random.RandomState(0).randint(0, 128, (2, 13))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids), attention_mask=torch.ones(2, 13, dtype=torch.long)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    h, _, _ = target(jnp.asarray(ids), pos, target.new_cache(2, 32), pos + 1)
    np.testing.assert_allclose(np.asarray(target.logits(h)), want, atol=2e-4, rtol=0)
    if case == "all-linears-16x32":      # float8 tensors without the config that gives their scales
        bad = _rewrite(path, str(tmp_path / "bad"), config=lambda c: c.pop("quantization_config"))
        with pytest.raises(ValueError, match=r"tensor model\.layers\.\d+\.\S+ has dtype float8_e4m3fn; weights "
                                             r"must be floating point .*quant_method 'fp8'") as e:
            load_target(bad, dtype="float32")
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_fp8_qwen3_5_target_dflash_greedy_equals_plain_greedy(tmp_path):
    """DFlash greedy on a Qwen3.5 FP8 target (Qwen's layout, block 128) equals its plain greedy."""
    from tests.test_qwen3_5 import write_qwen3_5
    path = ck.to_fp8(write_qwen3_5(str(tmp_path / "q35"), seed=4), linears=QWEN3_5_FP8, seed=4)
    target = load_target(path, dtype="float32")
    draft = init_draft(DraftConfig.for_target(target.config, num_layers=1, block_size=4), seed=2, dtype="float32",
                       target=target)
    prompts = [[3, 17, 99, 5, 64, 2, 8], [5, 9, 77, 3, 1]]
    # the full block (auto, the default width, on an fp8 target: test_fp8_target_dflash_greedy_equals_plain_greedy;
    # the width logic does not depend on the weight format)
    res = generate(target, draft, prompts, max_new_tokens=12, block_size=4, verify_width="block")
    assert res.tokens == generate(target, None, prompts, max_new_tokens=12).tokens
    assert max(a for r in res.acceptance_lengths for a in r) >= 1


# ------------------------------------------------------------------------- a 2 x 2 mesh (child)

MESH_CHILD = os.environ.get("DFLASH_FP8_MESH_CHILD") == "1"


def _dflash_on_the_mesh_equals_one_device(one, target, mesh):
    """DFlash greedy with a random draft (placed on `mesh` for the placed `target`): the mesh gives
    one device's tokens and acceptance lengths, which equal plain decoding's."""
    from dflash_jax import decode, sharding
    cfg = DraftConfig.for_target(one.config, num_layers=1, block_size=4)
    drafts = [init_draft(cfg, seed=2, dtype="float32", target=one) for _ in range(2)]
    sharding.shard_model(drafts[1], mesh)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3], [100, 101]]
    kw = dict(max_new_tokens=10, attention_impl="xla", capacity=64)
    a = decode.generate(one, drafts[0], prompts, verify_width="block", **kw)
    b = decode.generate(target, drafts[1], prompts, mesh=mesh, verify_width="block", **kw)
    assert a.tokens == decode.generate(one, None, prompts, **kw).tokens
    assert b.tokens == a.tokens and b.acceptance_lengths == a.acceptance_lengths


# The mesh_child cases below run in the 4-device child of
# tests/test_quantize.py::test_int8_and_fp8_on_a_2x2_mesh_equal_one_device (one process for the int8
# and the fp8 mesh cases). Directly:
#     DFLASH_FP8_MESH_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/test_fp8.py -k mesh_child


@pytest.mark.skipif(not MESH_CHILD, reason="runs in the 4-device child")
def test_mesh_child_fp8_checkpoint_on_2x2_equals_one_device(tmp_path):
    """load_target(fp8 checkpoint, mesh="2x2") (--model <fp8> --mesh 2x2): each block scale sits on
    its weight's shard, and DFlash greedy gives one device's tokens and acceptance lengths (which
    equal plain decoding's). Blocks [16, 32] (ours (32, 16)) on a toy model place all four ways:
    qkv's fused-layout permutation moves whole blocks (its one kv head copied to each shard), o's
    rows split on a block boundary, gate_up's permutation (40-column halves) cuts blocks, so its
    scales spread per column, and down's row halves (40) cut blocks, so its scales spread per row."""
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 4
    path = ck.write_fp8_target(str(tmp_path / "fp8"), block=(16, 32), seed=6, vocab_size=128, hidden_size=64,
                               intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16)
    one = load_target(path, dtype="float32")
    target = load_target(path, dtype="float32", mesh="2x2")
    assert target.quantize == "fp8"
    layer = target.layers[1]
    want = {"qkv": ((32, 16), P(None, "model"), (2, 4)), "o": ((32, 16), P("model", None), (1, 4)),
            "mlp/gate_up": ((32, 1), P(None, "model"), (2, 80)), "mlp/down": ((1, 16), P("model", None), (40, 4))}
    for name, (block, spec, local) in want.items():
        w = layer.mlp.gate_up[...] if name == "mlp/gate_up" else layer.mlp.down[...] if name == "mlp/down" else \
            getattr(layer, name)[...]
        assert isinstance(w, Fp8BlockWeight) and w.block == block, (name, w)
        assert w.q.sharding.spec == spec and w.scale.sharding.spec == spec, name
        assert w.scale.addressable_shards[0].data.shape == local, (name, w.scale.shape)
    _dflash_on_the_mesh_equals_one_device(one, target, layer.qkv[...].q.sharding.mesh)


@pytest.mark.skipif(not MESH_CHILD, reason="runs in the 4-device child")
def test_mesh_child_fp8_moe_checkpoint_on_2x2_equals_one_device(tmp_path):
    """A Qwen3-MoE FP8 checkpoint on a 2 x 2 mesh: the stacked fp8 experts and their block scales
    split by expert over 'model' (the MoE shard_map takes both), plain greedy equals one device's."""
    from jax.sharding import PartitionSpec as P

    from dflash_jax import decode
    path = ck.write_fp8_target(str(tmp_path / "moe"), moe=True, block=(16, 32), seed=5, hidden_size=64,
                               intermediate_size=64, moe_intermediate_size=64, num_experts=4, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=16)
    target = load_target(path, dtype="float32", mesh="2x2")
    gu = target.layers[0].mlp.experts_gate_up[...]
    assert isinstance(gu, Fp8BlockWeight) and gu.scale.shape == (4, 2, 8)
    assert gu.q.sharding.spec == gu.scale.sharding.spec == P("model", None, None)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    kw = dict(max_new_tokens=8, attention_impl="xla", capacity=64)
    one = decode.generate(load_target(path, dtype="float32"), None, prompts, **kw)
    assert decode.generate(target, None, prompts, mesh=gu.q.sharding.mesh, **kw).tokens == one.tokens


@pytest.mark.skipif(not MESH_CHILD, reason="runs in the 4-device child")
def test_mesh_child_w8a8_checkpoint_on_2x2_equals_one_device(tmp_path):
    """load_target(fp8 checkpoint, mesh="2x2", w8a8=True) (--w8a8 --mesh 2x2): each weight placed in
    its [K, N] form, then back to the checkpoint's [N, K] with its sharding transposed (o / down
    split on K, so the activations' groups and each partial product stay on one shard), and DFlash
    greedy gives one device's tokens and acceptance lengths, which equal plain decoding's."""
    from jax.sharding import PartitionSpec as P

    from dflash_jax.quantize import Fp8W8A8Weight
    path = ck.write_fp8_target(str(tmp_path / "fp8"), block=(32, 32), seed=6, vocab_size=128, hidden_size=64,
                               intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    one = load_target(path, dtype="float32", w8a8=True)
    target = load_target(path, dtype="float32", mesh="2x2", w8a8=True)
    assert target.quantize == "fp8+w8a8"
    layer = target.layers[1]
    for name, w, spec in (("qkv", layer.qkv[...], P("model", None)), ("o", layer.o[...], P(None, "model")),
                          ("gate_up", layer.mlp.gate_up[...], P("model", None)),
                          ("down", layer.mlp.down[...], P(None, "model"))):
        assert isinstance(w, Fp8W8A8Weight) and w.q.sharding.spec == spec, (name, w, w.q.sharding.spec)
    _dflash_on_the_mesh_equals_one_device(one, target, layer.qkv[...].q.sharding.mesh)
    # W8A8 per channel (--w8a8 channel --mesh 2x2): requantized on one device, then placed as an int8
    # weight's columns would be (q [N, K] with its sharding transposed, the scales [N] with q's N)
    from dflash_jax.quantize import Fp8ChannelWeight, to_w8a8
    one = load_target(path, dtype="float32", w8a8="channel")
    target = load_target(path, dtype="float32", mesh="2x2", w8a8="channel")
    assert target.quantize == "fp8+w8a8-channel"
    layer = target.layers[1]
    for name, w, spec, s_spec in (("qkv", layer.qkv[...], P("model", None), P("model")),
                                  ("o", layer.o[...], P(None, "model"), P()),
                                  ("gate_up", layer.mlp.gate_up[...], P("model", None), P("model")),
                                  ("down", layer.mlp.down[...], P(None, "model"), P())):
        assert isinstance(w, Fp8ChannelWeight) and w.q.sharding.spec == spec, (name, w, w.q.sharding.spec)
        assert tuple(w.scale.sharding.spec) in (tuple(s_spec), tuple(s_spec) + (None,)), (name, w.scale.sharding)
    _dflash_on_the_mesh_equals_one_device(one, target, layer.qkv[...].q.sharding.mesh)
    # converting a target already placed is refused in one line (it requantizes on one device)
    with pytest.raises(ValueError, match=r"^w8a8='channel' requantizes on one device: layers/.* is already placed"):
        to_w8a8(load_target(path, dtype="float32", mesh="2x2"), "channel")
