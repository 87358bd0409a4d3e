"""Model configurations: frozen, hashable dataclasses read from HF `config.json` files.

`TargetConfig` describes a causal LM of one of the families in dflash_jax.models (their readers
check what each can run); `DraftConfig` a z-lab DFlash draft. Both are static (compile keys), so they
hold only Python scalars, tuples and frozen dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from dflash_jax.validation import check_block_size, finite_float, positive_int

__all__ = ["TargetConfig", "Qwen3MoeConfig", "DraftConfig", "ConfigError", "PRESETS", "default_target_layer_ids", "RopeScaling",
           "dense_fields", "read_json"]


class ConfigError(ValueError):
    """A config.json that this library cannot run, with the offending field named."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """`rope_type: llama3` frequency scaling (transformers `_compute_llama3_parameters`): wavelengths
    above original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
    original / high_freq_factor kept, the band between interpolated."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


def _rope(d: Mapping[str, Any], what: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None) of a config. transformers >= 5 nests RoPE settings in
    `rope_parameters`; older files have `rope_theta` and `rope_scaling`."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    found = None
    for block, name in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind in ("default", None):
            continue
        if kind != "llama3":
            raise ConfigError(f"{what}: {name}.rope_type={kind!r} is not supported (default or llama3 RoPE)")
        try:
            found = RopeScaling(factor=float(block["factor"]), low_freq_factor=float(block["low_freq_factor"]),
                                high_freq_factor=float(block["high_freq_factor"]),
                                original_max_position_embeddings=int(block["original_max_position_embeddings"]))
        except KeyError as e:
            raise ConfigError(f"{what}: {name} (llama3) lacks {e.args[0]}") from None
        if not found.factor > 0 or not found.high_freq_factor > found.low_freq_factor > 0 or \
                found.original_max_position_embeddings < 1:
            raise ConfigError(f"{what}: {name} (llama3) needs factor > 0, high_freq_factor > low_freq_factor > 0 "
                              f"and original_max_position_embeddings >= 1, got {block}")
    return _float(params.get("rope_theta", d.get("rope_theta", 10000.0)), "rope_theta", what, positive=True), found


def dense_fields(d: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The fields every dense decoder config.json shares (a family's reader adds its own checks):
    sizes, heads, norm eps, RoPE. what: "target" or "draft", for the messages."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{what}: the config must be a JSON object, got {type(d).__name__}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise ConfigError(f"{what}: config.json lacks {', '.join(missing)}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{what}: hidden_act={act!r}; only 'silu' is supported")
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        _positive(d, k, what)
    n_heads = int(d["num_attention_heads"])
    if d.get("num_key_value_heads") is not None:
        _positive(d, "num_key_value_heads", what)
    if d.get("head_dim") is not None:
        _positive(d, "head_dim", what)
    if d.get("max_position_embeddings") is not None:
        _positive(d, "max_position_embeddings", what)
    n_kv = int(d.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv:
        raise ConfigError(f"{what}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    theta, scaling = _rope(d, what)
    return dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // n_heads),
        rms_norm_eps=_float(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", what),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
    )


def _qwen3_fields(d: Mapping[str, Any], what: str, sliding_ok: bool = False) -> dict[str, Any]:
    """dense_fields of a Qwen3-style stack (the DFlash draft's): no attention bias, no sliding window."""
    q = dense_fields(d, what)
    if d.get("attention_bias"):
        raise ConfigError(f"{what}: attention_bias=True is not supported (Qwen3 has no attention bias)")
    if d.get("use_sliding_window") and not sliding_ok:   # drafts read layer_types instead
        raise ConfigError(f"{what}: use_sliding_window=True is not supported")
    return q


def _positive(d: Mapping[str, Any], key: str, what: str) -> None:
    try:
        positive_int(d[key], key, what)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _float(value, key: str, what: str, positive: bool = False) -> float:
    try:
        return finite_float(value, key, what, positive=positive)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _int(value, key: str, what: str, minimum: int) -> int:
    try:
        return positive_int(value, key, what, minimum)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_numbers(cfg, what: str) -> None:
    """Every config, however built (from_dict, for_target, by hand): finite float fields."""
    _float(cfg.rope_theta, "rope_theta", what, positive=True)
    _float(cfg.rms_norm_eps, "rms_norm_eps", what)


def read_json(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A causal LM (the verifier) of one of the families in dflash_jax.models, by `model_type`.
    The fields are HF `config.json`'s; a family's reader (dflash_jax.models) checks what it cannot
    run and builds this."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    model_type: str = "qwen3"
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        _check_numbers(self, "target")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TargetConfig":
        """The fields of any family (no family's own checks: dflash_jax.models.read_config does those)."""
        return cls(**dense_fields(d, "target"), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   model_type=str(d.get("model_type") or ""), attention_bias=bool(d.get("attention_bias", False)),
                   mlp_bias=bool(d.get("mlp_bias", False)))

    @classmethod
    def from_pretrained(cls, path: str) -> "TargetConfig":
        return cls.from_dict(read_json(path))

    @classmethod
    def preset(cls, name: str) -> "TargetConfig":
        try:
            return PRESETS[name.lower()]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(TargetConfig):
    """A Qwen3-MoE causal LM (model_type "qwen3_moe"; its reader: dflash_jax.models.qwen3_moe).
    intermediate_size is the dense layers' MLP width (and a draft's made by for_target)."""

    model_type: str = "qwen3_moe"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule: MoE unless in mlp_only_layers or off the step."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """The z-lab default taps: round(1 + i * (L - 4) / (n - 1)); [L // 2] for a single tap."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))


def _layer_fields(d: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """layer_types / sliding_window / is_causal of a draft config.json (top level, as the reference
    reads them). The window is read whether or not use_sliding_window is set, as the reference's MLX
    port does (transformers' Qwen3Config drops it without use_sliding_window)."""
    types = d.get("layer_types") or ()
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ConfigError(f"draft: layer_types must list {num_layers} layer types, got {types!r}")
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConfigError(f"draft: layer_types {bad} are not supported (full_attention, sliding_attention)")
    window = None
    if "sliding_attention" in types:
        window = d.get("sliding_window")
        if window is None:
            raise ConfigError("draft: sliding_attention layers need sliding_window")
        _positive(d, "sliding_window", "draft")
        window = int(window)
    is_causal = d.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ConfigError(f"draft: is_causal must be true, false or absent, got {is_causal!r}")
    return dict(layer_types=tuple(types) if "sliding_attention" in types else (), sliding_window=window,
                is_causal=is_causal)


def _dflash2_fields(d: Mapping[str, Any], dcfg: Mapping[str, Any], dflash2: bool, q: dict) -> dict[str, Any]:
    """The DFlash2 fields (dflash_config first, then the top level, as the reference's _draft_value)."""
    def value(name, default=None):
        return dcfg.get(name, d.get(name, default))
    mult, cap = value("output_multiplier", 1.0), value("final_logit_softcapping")
    if not dflash2:
        if float(mult) != 1.0:
            raise ConfigError(f"draft: output_multiplier={mult} is not supported (DFlash-1 drafts use 1.0)")
        if cap:
            raise ConfigError("draft: final_logit_softcapping is not supported for DFlash-1 drafts")
        return {}
    out = {}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        v = value(name)
        if v is None:
            raise ConfigError(f"draft: a DFlash2DraftModel config needs {name}")
        try:
            out[name] = positive_int(v, name, "draft")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if q["hidden_size"] % out["conv_group_size"]:
        raise ConfigError(f"draft: conv_group_size={out['conv_group_size']} does not divide "
                          f"hidden_size={q['hidden_size']}")
    if out["selector_top_k"] > q["vocab_size"]:
        raise ConfigError(f"draft: selector_top_k={out['selector_top_k']} is above vocab_size={q['vocab_size']}")
    return dict(out, architecture="DFlash2DraftModel", output_multiplier=float(mult),
                final_logit_softcapping=None if cap is None else _float(cap, "final_logit_softcapping", "draft",
                                                                        positive=True))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A z-lab DFlash draft: a Qwen3-style stack without embedding or LM head of its own."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    rope_scaling: RopeScaling | None = None
    # Per-layer attention (reference model.py Qwen3DFlashAttention): "full_attention" or
    # "sliding_attention" per layer (() = all full); the window W of sliding layers (a block row at
    # position p sees context keys > p - W); is_causal None = causal iff the layer slides.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    # DFlash2 (architectures ["DFlash2DraftModel"]): a grouped dynamic causal conv around every
    # sublayer (conv_kernel_size taps, conv_group_size channels per group; 0 = none) and a candidate
    # selector over the top selector_top_k of each slot (selector_rank; 0 = argmax drafts).
    architecture: str = "DFlashDraftModel"
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def layer_window(self, i: int) -> int | None:
        """The sliding window of draft layer i, None for a full-attention layer."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "sliding_attention" else None

    def layer_causal(self, i: int) -> bool:
        """Whether draft layer i's block attends causally: the explicit is_causal, else the
        reference's default (sliding layers causal, full layers not)."""
        return self.layer_window(i) is not None if self.is_causal is None else bool(self.is_causal)

    @property
    def plain_attention(self) -> bool:
        """Every layer full and non-causal: the DFlash-1 block attention."""
        return all(self.layer_window(i) is None and not self.layer_causal(i) for i in range(self.num_layers))

    def __post_init__(self):
        _check_numbers(self, "draft")
        if self.final_logit_softcapping is not None:  # 0 would divide by zero, < 0 is no cap: absent means none
            _float(self.final_logit_softcapping, "final_logit_softcapping", "draft", positive=True)
        try:
            check_block_size(self.block_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DraftConfig":
        q = _qwen3_fields(d, "draft", sliding_ok=True)
        dcfg = d.get("dflash_config") or {}
        mask = dcfg.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ConfigError("draft: config.json lacks dflash_config.mask_token_id")
        if "num_target_layers" not in d:
            raise ConfigError("draft: config.json lacks num_target_layers")
        n_target = _int(d["num_target_layers"], "num_target_layers", "draft", 1)
        mask = _int(mask, "mask_token_id", "draft", 0)
        taps = dcfg.get("target_layer_ids", d.get("target_layer_ids"))
        if taps and not isinstance(taps, (list, tuple)):
            raise ConfigError(f"draft: target_layer_ids={taps!r} must be a list of layer indices")
        taps = tuple(_int(t, "target_layer_ids", "draft", 0) for t in taps) if taps \
            else default_target_layer_ids(n_target, q["num_layers"])
        v = dcfg.get("input_embedding_scale", d.get("input_embedding_scale", 1.0))
        if _float(v, "input_embedding_scale", "draft") != 1.0:
            raise ConfigError(f"draft: input_embedding_scale={v} is not supported (DFlash drafts use 1.0)")
        archs = d.get("architectures") or ["DFlashDraftModel"]
        dflash2 = "DFlash2DraftModel" in (archs if isinstance(archs, (list, tuple)) else [archs])
        extra = _layer_fields(d, q["num_layers"]) | _dflash2_fields(d, dcfg, dflash2, q)
        # as the reference's _draft_value: dflash_config first, then the top level
        block = _int(dcfg.get("block_size", d.get("block_size", 16)), "block_size", "draft", 1)
        return cls(**q, block_size=block, num_target_layers=n_target, mask_token_id=mask, target_layer_ids=taps,
                   **extra)

    @classmethod
    def from_pretrained(cls, path: str) -> "DraftConfig":
        return cls.from_dict(read_json(path))

    def check_fits(self, target: TargetConfig) -> None:
        """Refuse a draft that was not made for this target, naming the mismatch."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target num_hidden_layers {target.num_layers}")
        bad = [t for t in self.target_layer_ids if not 0 <= t < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {list(bad)} outside the target's {target.num_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target vocab of {target.vocab_size}")
        if self.block_size < 1:
            problems.append(f"block_size {self.block_size} < 1")
        if self.selector_top_k > target.vocab_size:
            problems.append(f"selector_top_k {self.selector_top_k} > target vocab_size {target.vocab_size}")
        if problems:
            raise ConfigError("draft does not fit the target: " + "; ".join(problems))

    @classmethod
    def for_target(cls, target: TargetConfig, num_layers: int = 5, block_size: int = 16,
                   mask_token_id: int | None = None, target_layer_ids=None) -> "DraftConfig":
        """The z-lab draft shape for a target (benchmarks: Qwen3-8B → 5 layers, taps [1,9,17,25,33]).

        For targets under 4 layers the z-lab formula leaves [0, L); its taps are clipped into the
        target's layers and deduplicated (fewer taps than draft layers)."""
        if not isinstance(target, TargetConfig):
            hint = " (pass target.config: the model's TargetConfig)" \
                if isinstance(getattr(target, "config", None), TargetConfig) else ""
            raise TypeError(f"DraftConfig.for_target takes a TargetConfig, got {type(target).__name__}{hint}")
        if target_layer_ids:
            taps = tuple(int(t) for t in target_layer_ids)
        else:
            L = target.num_layers
            taps = tuple(sorted({min(max(t, 0), L - 1) for t in default_target_layer_ids(L, num_layers)}))
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, vocab_size=target.vocab_size, block_size=block_size,
                   num_target_layers=target.num_layers,
                   mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
                   target_layer_ids=taps, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   rope_scaling=target.rope_scaling,
                   max_position_embeddings=target.max_position_embeddings)


# Real shapes of the public Qwen3 checkpoints (for random-weight benchmarks on machines without weights).
PRESETS: dict[str, TargetConfig] = {
    "qwen3-0.6b": TargetConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                               num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                               tie_word_embeddings=True),
    "qwen3-4b": TargetConfig(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                             tie_word_embeddings=True),
    "qwen3-8b": TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                             tie_word_embeddings=False),
    # Llama-3.x (model_type llama): no q/k norm, eps 1e-5, llama3 RoPE scaling, vocab 128256
    "llama3.1-8b": TargetConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                                max_position_embeddings=131072, tie_word_embeddings=False, model_type="llama",
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
    "llama3.2-1b": TargetConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                                max_position_embeddings=131072, tie_word_embeddings=True, model_type="llama",
                                rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
    # Qwen3-MoE (model_type qwen3_moe): 128 experts, top-8 renormalised, every layer sparse
    "qwen3-coder-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rope_theta=1e7, max_position_embeddings=262144,
        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=()),
}
