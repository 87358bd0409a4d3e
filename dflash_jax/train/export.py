"""Export a draft to the z-lab Hugging Face format that `load_draft`, the reference
`dflash.model.DFlashDraftModel`, vLLM and SGLang read: config.json (a Qwen3 config with
`architectures: ["DFlashDraftModel"]`, block_size, num_target_layers, dflash_config {mask_token_id,
target_layer_ids}) and model.safetensors with the z-lab names, [out, in] layout, no embedding or LM head.

The inverse of dflash_jax/weights.py: our fused [in, out] matrices are split (qkv → q/k/v, gate_up →
gate/up) and transposed back."""

from __future__ import annotations

import json
import os

import numpy as np

from dflash_jax.drafts.dflash import DFlashDraft

__all__ = ["export_draft", "draft_tensors", "draft_config_json"]


def _np(x, dtype):
    import ml_dtypes  # shipped with jax
    a = np.asarray(x, np.float32)
    return a.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else a.astype(dtype)


def draft_tensors(draft: DFlashDraft, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """z-lab tensor name → array [out, in] (numpy; bfloat16 via ml_dtypes)."""
    c = draft.config
    Hq, Hkv, D, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    t = {"fc.weight": _np(draft.fc[...], dtype).T, "hidden_norm.weight": _np(draft.hidden_norm.weight[...], dtype),
         "norm.weight": _np(draft.norm.weight[...], dtype)}
    for i, L in enumerate(draft.layers):
        p = f"layers.{i}."
        qkv = _np(L.qkv[...], dtype)                                           # [H, (Hq + 2Hkv) D]
        gu = _np(L.mlp.gate_up[...], dtype)                                    # [H, 2I]
        t.update({
            p + "input_layernorm.weight": _np(L.input_layernorm.weight[...], dtype),
            p + "post_attention_layernorm.weight": _np(L.post_attention_layernorm.weight[...], dtype),
            p + "self_attn.q_proj.weight": qkv[:, : Hq * D].T,
            p + "self_attn.k_proj.weight": qkv[:, Hq * D: (Hq + Hkv) * D].T,
            p + "self_attn.v_proj.weight": qkv[:, (Hq + Hkv) * D:].T,
            p + "self_attn.o_proj.weight": _np(L.o[...], dtype).T,
            p + "self_attn.q_norm.weight": _np(L.q_norm.weight[...], dtype),
            p + "self_attn.k_norm.weight": _np(L.k_norm.weight[...], dtype),
            p + "mlp.gate_proj.weight": gu[:, :I].T,
            p + "mlp.up_proj.weight": gu[:, I:].T,
            p + "mlp.down_proj.weight": _np(L.mlp.down[...], dtype).T,
        })
        for conv in ("attention_conv", "mlp_conv"):     # DFlash2 layers (drafts.dflash2)
            m = getattr(L, conv, None)
            if m is not None:
                t[p + conv + ".base_kernel"] = _np(m.base_kernel[...], dtype)
                t[p + conv + ".kernel_projection.weight"] = _np(m.kernel_projection[...], dtype).T
    sel = getattr(draft, "candidate_selector", None)
    if sel is not None:   # the codebooks without `.weight`, as z-lab stores them
        t["candidate_selector.predecessor_codebook"] = _np(sel.predecessor_codebook[...], dtype)
        t["candidate_selector.successor_codebook"] = _np(sel.successor_codebook[...], dtype)
        t["candidate_selector.hidden_projection.weight"] = _np(sel.hidden_projection[...], dtype).T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def draft_config_json(draft: DFlashDraft, dtype: str = "bfloat16") -> dict:
    c = draft.config
    out = _v1_config_json(c, dtype)
    if c.layer_types:     # per-layer windows (read back by load_draft and the reference alike)
        out.update(use_sliding_window=True, sliding_window=c.sliding_window, layer_types=list(c.layer_types))
    if c.is_causal is not None:
        out["is_causal"] = c.is_causal
    if c.is_dflash2:
        out["architectures"] = ["DFlash2DraftModel"]
        out["auto_map"] = {"AutoModel": "dflash.DFlash2DraftModel"}
        out["dflash_config"].update(conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                                    selector_rank=c.selector_rank, selector_top_k=c.selector_top_k,
                                    output_multiplier=c.output_multiplier)
        if c.final_logit_softcapping:
            out["dflash_config"]["final_logit_softcapping"] = c.final_logit_softcapping
    return out


def _v1_config_json(c, dtype: str) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * c.num_layers, "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype,
        "block_size": c.block_size, "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
    }


def export_draft(draft: DFlashDraft, out_dir: str, *, dtype: str = "bfloat16") -> str:
    """Write `draft` to a new directory `out_dir` (refuses an existing one: nothing is overwritten)."""
    from safetensors.numpy import save_file
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype={dtype!r}; expected bfloat16, float32 or float16")
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; export writes a new directory (remove it or pick another)")
    tmp = out_dir.rstrip("/") + ".partial"
    if os.path.exists(tmp):
        raise FileExistsError(f"{tmp} exists (an interrupted export?); remove it first")
    os.makedirs(tmp)
    save_file(draft_tensors(draft, dtype), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(draft_config_json(draft, dtype), f, indent=2)
    os.replace(tmp, out_dir)
    return out_dir
