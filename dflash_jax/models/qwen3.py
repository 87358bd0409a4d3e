"""The Qwen3 family: the shared decoder stack (models/stack.py) with q/k RMSNorm before RoPE, no
biases; its config reader, checkpoint tensor names and registry entry."""

from __future__ import annotations

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.models.family import Family
from dflash_jax.models.stack import CausalLM


class Qwen3(CausalLM):
    """A Qwen3 causal LM (HF Qwen3ForCausalLM)."""


# ------------------------------------------------------------------------------ the family's faces

LAYER_WEIGHTS = {  # HF leaf (after `model.layers.N.`) → (our path inside the layer, how: family.py)
    "input_layernorm.weight": (("input_layernorm", "weight"), None),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), None),
    "self_attn.q_norm.weight": (("q_norm", "weight"), None),
    "self_attn.k_norm.weight": (("k_norm", "weight"), None),
    "self_attn.o_proj.weight": (("o",), "T"),
    "self_attn.q_proj.weight": (("qkv",), ("q", "k", "v")),
    "self_attn.k_proj.weight": (("qkv",), ("q", "k", "v")),
    "self_attn.v_proj.weight": (("qkv",), ("q", "k", "v")),
    "mlp.gate_proj.weight": (("mlp", "gate_up"), ("gate", "up")),
    "mlp.up_proj.weight": (("mlp", "gate_up"), ("gate", "up")),
    "mlp.down_proj.weight": (("mlp", "down"), "T"),
}


def top_weights(config: TargetConfig) -> dict:
    """The checkpoint's tensors outside the layers → (our path, how); a tied head has no lm_head."""
    top = {"model.embed_tokens.weight": (("embed",), None), "model.norm.weight": (("norm", "weight"), None)}
    if not config.tie_word_embeddings:
        top["lm_head.weight"] = (("lm_head",), "T")
    return top


def read_config(d) -> TargetConfig:
    """A Qwen3 config.json → TargetConfig: no attention bias, no sliding window."""
    cfg = TargetConfig.from_dict(d)
    if d.get("attention_bias"):
        raise ConfigError("target: attention_bias=True is not supported (Qwen3 has no attention bias)")
    if d.get("use_sliding_window"):
        raise ConfigError("target: use_sliding_window=True is not supported")
    return cfg


FAMILY = Family(model_type="qwen3", read_config=read_config, model=Qwen3,
                layer_weights=lambda config: LAYER_WEIGHTS, top_weights=top_weights,
                skip=(r"lm_head\.weight", r".*rotary_emb\.inv_freq"))
