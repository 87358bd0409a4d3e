"""The embedded default pair: a small Qwen3 target (with its tokenizer) and its DFlash draft, both
trained by this project (scripts/train_demo_pair.py), shipped as package data in HF format.

    from dflash_jax.assets import default_pair
    pair = default_pair()            # (target_dir, draft_dir) or None when no pair is shipped
    if pair:
        target = load_target(pair[0]); draft = load_draft(pair[1], target=target)

Layout under this package: `pair/target/` (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), `pair/draft/` (z-lab format), `pair/README.md` (the model
card, filled from MODEL_CARD.md.in). `save_target` writes a target in the HF layout that both
`load_target` and transformers' Qwen3ForCausalLM read.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

__all__ = ["PAIR_DIR", "default_pair", "save_target", "target_hf_config", "model_card_template"]

ASSETS_DIR = os.path.dirname(os.path.abspath(__file__))
PAIR_DIR = os.path.join(ASSETS_DIR, "pair")


def _is_model_dir(d: str) -> bool:
    return (os.path.isfile(os.path.join(d, "config.json"))
            and any(f.endswith(".safetensors") for f in os.listdir(d)))


def default_pair(root: str | None = None) -> tuple[str, str] | None:
    """(target_dir, draft_dir) of the shipped pair, or None when the package carries none.

    The target directory also holds the tokenizer. `root` (tests) replaces the package's pair dir."""
    root = PAIR_DIR if root is None else root
    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    if os.path.isdir(target) and os.path.isdir(draft) and _is_model_dir(target) and _is_model_dir(draft):
        return target, draft
    return None


def model_card_template() -> str:
    with open(os.path.join(ASSETS_DIR, "MODEL_CARD.md.in"), encoding="utf-8") as f:
        return f.read()


def target_hf_config(config, dtype: str = "bfloat16", *, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None) -> dict:
    """The HF `config.json` of a Qwen3ForCausalLM with our TargetConfig's shapes."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
    }


def _hf_tensors(target, dtype) -> dict[str, jax.Array]:
    """Our fused [in, out] parameters → HF names and [out, in] layout (the inverse of weights._fill)."""
    c = target.config
    Hq, Hkv, D, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    cast = lambda x: jnp.asarray(x[...], dtype)  # noqa: E731
    out = {"model.embed_tokens.weight": cast(target.embed), "model.norm.weight": cast(target.norm.weight)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = cast(target.lm_head).T
    for i, layer in enumerate(target.layers):
        p = f"model.layers.{i}."
        qkv = cast(layer.qkv)                                                   # [H, (Hq + 2 Hkv) D]
        gate_up = cast(layer.mlp.gate_up)                                       # [H, 2 I]
        out.update({
            p + "input_layernorm.weight": cast(layer.input_layernorm.weight),
            p + "post_attention_layernorm.weight": cast(layer.post_attention_layernorm.weight),
            p + "self_attn.q_norm.weight": cast(layer.q_norm.weight),
            p + "self_attn.k_norm.weight": cast(layer.k_norm.weight),
            p + "self_attn.q_proj.weight": qkv[:, :Hq * D].T,
            p + "self_attn.k_proj.weight": qkv[:, Hq * D:(Hq + Hkv) * D].T,
            p + "self_attn.v_proj.weight": qkv[:, (Hq + Hkv) * D:].T,
            p + "self_attn.o_proj.weight": cast(layer.o).T,
            p + "mlp.gate_proj.weight": gate_up[:, :I].T,
            p + "mlp.up_proj.weight": gate_up[:, I:].T,
            p + "mlp.down_proj.weight": cast(layer.mlp.down).T,
        })
    return {k: jnp.array(v) for k, v in out.items()}  # contiguous copies of the transposes


def save_target(target, out_dir: str, dtype: str = "bfloat16", *, bos_token_id=None, eos_token_id=None,
                pad_token_id=None) -> str:
    """Write `target` (a dflash_jax Qwen3) as a HF checkpoint: config.json + model.safetensors with
    HF tensor names, loadable by `load_target` and by transformers' Qwen3ForCausalLM."""
    from safetensors.flax import save_file

    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype={dtype!r}; expected bfloat16, float32 or float16")
    os.makedirs(out_dir, exist_ok=True)
    tensors = _hf_tensors(target, jnp.dtype(dtype))
    path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors writes 0600; package data must be readable by every user
    cfg = target_hf_config(target.config, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir

