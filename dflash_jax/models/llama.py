"""The Llama-3.x family (HF LlamaForCausalLM, `model_type: llama`): the shared decoder stack
(models/stack.py) without q/k norms, with `rope_type: llama3` frequency scaling and optional
attention / MLP biases; its config reader, checkpoint tensor names and registry entry.

Llama-3.2-1B/3B tie the LM head to the embedding (no `lm_head.weight`), 3.1-8B does not; the
tokenizer's chat template already starts with <|begin_of_text|> (the text path encodes it without
adding another) and the instruct models stop on a list of eos ids (generation_config.json)."""

from __future__ import annotations

from dflash_jax.config import TargetConfig
from dflash_jax.models import qwen3
from dflash_jax.models.family import Family
from dflash_jax.models.stack import CausalLM


class Llama(CausalLM):
    """A Llama-3.x causal LM (HF LlamaForCausalLM)."""

    def layer_options(self, config: TargetConfig) -> dict:
        return dict(qk_norm=False, attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)


def layer_weights(config: TargetConfig) -> dict:
    """Qwen3's layer tensors without q/k norms, with the biases the config declares."""
    leaves = {k: v for k, v in qwen3.LAYER_WEIGHTS.items() if "_norm." not in k or "layernorm" in k}
    if config.attention_bias:
        leaves.update({f"self_attn.{p}_proj.bias": (("qkv_bias",), ("q", "k", "v")) for p in "qkv"})
        leaves["self_attn.o_proj.bias"] = (("o_bias",), None)
    if config.mlp_bias:
        leaves.update({f"mlp.{p}_proj.bias": (("mlp", "gate_up_bias"), ("gate", "up")) for p in ("gate", "up")})
        leaves["mlp.down_proj.bias"] = (("mlp", "down_bias"), None)
    return leaves


def read_config(d) -> TargetConfig:
    """A Llama config.json → TargetConfig (rms_norm_eps as given: 1e-5 for Llama-3; bias flags;
    default or llama3 RoPE; head_dim = hidden / heads unless set)."""
    return TargetConfig.from_dict(d)


FAMILY = Family(model_type="llama", read_config=read_config, model=Llama, layer_weights=layer_weights,
                top_weights=qwen3.top_weights, skip=qwen3.FAMILY.skip)
