"""The Qwen3.5 MoE target (GDN + gated attention + routed experts with a gated shared expert)
against transformers' Qwen3_5MoeForCausalLM (the independent oracle), float32 on a tiny random
config whose router really routes (random router weights: tokens pick different experts).
Issue 38."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
from tests.checkpoints import hf_greedy, random_prompts
from tests.doubles import truth_proposer

from dflash_jax import PRESETS, DraftConfig, generate, init_draft, init_target, load_target
from dflash_jax.config import ConfigError
from dflash_jax.models.qwen3_5_moe import Qwen35Moe, Qwen35MoeConfig

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, full_attention_interval=2,
            max_position_embeddings=4096, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))


def write_qwen3_5_moe(path: str, seed: int = 0, stacked_prefix: str = "") -> str:
    """A random transformers Qwen3_5MoeForCausalLM (float32; norms, dt_bias and the router
    perturbed so that routing depends on the token) saved as a HF directory (per-expert keys, as
    save_pretrained writes them). stacked_prefix: rewrite the file with the experts stacked
    ([E, 2I, H], [E, H, I]) and `model.` renamed to this prefix (a multimodal checkpoint's)."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(seed)
    m = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TINY)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or n.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            if n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    m.save_pretrained(path, safe_serialization=True)
    if stacked_prefix:
        f = os.path.join(path, "model.safetensors")
        t, out = load_file(f), {}
        E = TINY["num_experts"]
        for i in range(TINY["num_hidden_layers"]):
            e = f"model.layers.{i}.mlp.experts."
            out[e + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{e}{j}.gate_proj.weight"),
                                                              t.pop(f"{e}{j}.up_proj.weight")]) for j in range(E)])
            out[e + "down_proj"] = torch.stack([t.pop(f"{e}{j}.down_proj.weight") for j in range(E)])
        out.update(t)
        save_file({(stacked_prefix + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
                   for k, v in out.items()}, f)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = write_qwen3_5_moe(str(tmp_path_factory.mktemp("q35moe")))
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    return hf, load_target(path, dtype="float32")


def _positions(B, T, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + T, dtype=jnp.int32), (B, T))


def test_config_reader_and_preset():
    d = {"model_type": "qwen3_5_moe", "text_config": {**TINY, "model_type": "qwen3_5_moe_text"}}
    from dflash_jax.models import read_config
    c = read_config(d)
    assert isinstance(c, Qwen35MoeConfig) and c.model_type == "qwen3_5_moe"
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) \
        == (8, 2, 32, 48)
    assert c.intermediate_size == 48 and c.full_layers == (1, 3)     # the draft's MLP width: the shared expert's
    with pytest.raises(ConfigError, match="lacks num_experts"):
        read_config({k: v for k, v in {**TINY, "model_type": "qwen3_5_moe_text"}.items() if k != "num_experts"})
    with pytest.raises(ConfigError, match="num_experts_per_tok=9"):
        read_config({**TINY, "model_type": "qwen3_5_moe_text", "num_experts_per_tok": 9})
    p = PRESETS["qwen3.5-35b-a3b"]
    assert p.model_type == "qwen3_5_moe" and len(p.full_layers) == 10 and len(p.linear_layers) == 30
    small = dataclasses.replace(p, **{"vocab_size": 64, "hidden_size": 32, "num_layers": 4,
                               "layer_types": p.layer_types[:4], "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                               "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                               "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
                               "intermediate_size": 8})
    from flax import nnx
    assert type(nnx.eval_shape(lambda: init_target(small, dtype="float32"))) is Qwen35Moe


def test_prefill_logits_match_transformers_and_routing_is_real(pair):
    hf, ours = pair
    assert type(ours) is Qwen35Moe
    ids = np.random.RandomState(0).randint(0, 128, (2, 13))
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_router_logits=True)
    chosen = torch.topk(ref.router_logits[0], 2, dim=-1).indices        # layer 0's choices per token
    assert len({tuple(sorted(r)) for r in chosen.tolist()}) >= 4        # tokens route to different experts
    pos = _positions(2, 13)
    h, _, _ = ours(jnp.asarray(ids), pos, ours.new_cache(2, 32), pos + 1, prefill=True)
    np.testing.assert_allclose(np.asarray(ours.logits(h)), ref.logits.numpy(), atol=1e-4)


def test_stacked_experts_and_language_model_prefix_load_the_same_weights(tmp_path, pair):
    from flax import nnx
    _, ours = pair
    other = load_target(write_qwen3_5_moe(str(tmp_path), stacked_prefix="model.language_model."), dtype="float32")
    for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)), jax.tree.leaves(nnx.state(other, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))




@pytest.mark.slow
@pytest.mark.parametrize("verify_width", ["block", "auto", pytest.param(1, id="W1")])
def test_greedy_and_dflash_greedy_match_transformers(pair, verify_width):
    """Plain greedy, DFlash with a random draft (blocks rejected early) and with the truth
    proposer cut after 2 drafts (the state rolled back mid-block every iteration), at the block,
    at "auto" and at the prefix width W = 1 (block 4: widths 0, 1, 3; 2 tokens an iteration)."""
    hf, ours = pair
    n = 16
    prompts = random_prompts(2, 128, min_len=3, max_len=10, seed=7)
    expected = [hf_greedy(hf, p, n) for p in prompts]
    assert generate(ours, None, prompts, max_new_tokens=n).tokens == expected
    draft = init_draft(DraftConfig.for_target(ours.config, num_layers=1, block_size=4, target_layer_ids=(1, 2)),
                       seed=1, dtype="float32")
    if verify_width == "block":      # the random draft's blocks (one more program each width) once
        assert generate(ours, draft, prompts, max_new_tokens=n, verify_width=verify_width).tokens == expected
    truth = np.zeros((2, 64), np.int32)
    for i, (p, e) in enumerate(zip(prompts, expected)):
        truth[i, :len(p) + n] = p + e
    res = generate(ours, truth_proposer(draft, truth, 2, 128), prompts, max_new_tokens=n, verify_width=verify_width)
    assert res.tokens == expected
    if verify_width == "auto":
        assert all(1 <= a <= 3 for row in res.acceptance_lengths for a in row)
        assert max(a for row in res.acceptance_lengths for a in row) >= 2
    else:
        want = 3 if verify_width == "block" else 2
        assert all(a == want for row in res.acceptance_lengths for a in row[:-1]), res.acceptance_lengths
