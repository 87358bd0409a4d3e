"""The Qwen3-MoE target family (HF model_type "qwen3_moe"; Qwen3-30B-A3B, Qwen3-Coder-30B-A3B):
Qwen3's attention and norms, with the MLP of most layers replaced by the sparse MoE block
(models/moe.py). A layer i is sparse iff i is not in `mlp_only_layers` and (i + 1) %
`decoder_sparse_step` == 0 (transformers' rule); the other layers keep the dense MLP of
`intermediate_size`.

Checkpoints (Hub format): besides Qwen3's tensors, per sparse layer `mlp.gate.weight` [E, H] (the
router) and `mlp.experts.{e}.{gate,up,down}_proj.weight` for every expert; they are stacked into
[E, ...] arrays as they stream in (gate columns before up).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import ConfigError, TargetConfig, _qwen3_fields, _read_json
from dflash_jax.modeling.layers import DecoderLayer, RMSNorm, _init
from dflash_jax.modeling.qwen3 import Qwen3
from dflash_jax.models.moe import MoE

__all__ = ["Qwen3MoeConfig", "Qwen3Moe", "PRESETS", "load_qwen3_moe", "init_qwen3_moe", "is_qwen3_moe"]

MODEL_TYPE = "qwen3_moe"


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(TargetConfig):
    """A Qwen3-MoE causal LM. intermediate_size: the dense layers' MLP width (and the draft's)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Qwen3MoeConfig":
        if not isinstance(d, Mapping) or d.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"target: model_type={d.get('model_type') if isinstance(d, Mapping) else None!r}; "
                              f"expected {MODEL_TYPE!r}")
        base = _qwen3_fields({**d, "model_type": "qwen3"}, "target")
        E = d.get("num_experts", d.get("num_local_experts"))
        if E is None:
            raise ConfigError("target: config.json lacks num_experts")
        fields = dict(num_experts=E, num_experts_per_tok=d.get("num_experts_per_tok"),
                      moe_intermediate_size=d.get("moe_intermediate_size"),
                      decoder_sparse_step=d.get("decoder_sparse_step", 1))
        for k, v in fields.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"target: {k}={v!r} must be a positive integer")
        if fields["num_experts_per_tok"] > E:
            raise ConfigError(f"target: num_experts_per_tok={fields['num_experts_per_tok']} > num_experts={E}")
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise ConfigError(f"target: mlp_only_layers={dense!r} must be a list of layer indices")
        if d.get("shared_expert_intermediate_size"):
            raise ConfigError("target: shared experts are not supported (Qwen3-MoE has none)")
        return cls(**base, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), **fields,
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   mlp_only_layers=tuple(sorted(set(int(i) for i in dense))))

    @classmethod
    def from_pretrained(cls, path: str) -> "Qwen3MoeConfig":
        return cls.from_dict(_read_json(path))


def is_qwen3_moe(path: str) -> bool:
    """Whether the HF directory at path holds a Qwen3-MoE config."""
    return _read_json(path).get("model_type") == MODEL_TYPE


class Qwen3Moe(Qwen3):
    """Qwen3 with the MoE block in its sparse layers; the forward, cache and LM head are Qwen3's."""

    def __init__(self, config: Qwen3MoeConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, V = config.hidden_size, config.vocab_size
        self.embed = _init(rngs, (V, H), dtype, 1.0)                             # [V, H]
        self.layers = nnx.List([
            DecoderLayer(config, dtype, rngs, mlp=MoE(H, config.moe_intermediate_size, config.num_experts,
                                                      config.num_experts_per_tok, config.norm_topk_prob,
                                                      dtype, rngs) if config.is_sparse(i) else None)
            for i in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else _init(rngs, (H, V), dtype, H ** -0.5)


# ------------------------------------------------------------------------------------- checkpoints

_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_ROUTER = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.gate\.weight$")


def stacked_experts(config: Qwen3MoeConfig, named_tensors, what: str):
    """(name, array) pairs with each sparse layer's router and per-expert tensors taken out and
    stacked into our [in, out] arrays: yields (None, (layer, leaf, array)) for leaf in router
    [H, E], experts_gate_up [E, H, 2I], experts_down [E, I, H] as soon as a layer's experts are complete, and every
    other pair unchanged. Missing or mis-shaped experts are refused naming the tensor."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    want = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    parts: dict[int, dict] = {}
    for name, t in named_tensors:
        m, r = _EXPERT.match(name), _ROUTER.match(name)
        layer = int((m or r).group(1)) if (m or r) else None
        if layer is None:
            yield name, t
            continue
        if layer >= config.num_layers or not config.is_sparse(layer):
            raise ValueError(f"{what}: checkpoint has {name} but layer {layer} is not a sparse MoE layer "
                             f"of this config ({config.num_layers} layers, decoder_sparse_step="
                             f"{config.decoder_sparse_step}, mlp_only_layers={list(config.mlp_only_layers)})")
        got = parts.setdefault(layer, {})
        if r:
            if tuple(t.shape) != (E, H):
                raise ValueError(f"{what}: tensor {name} has shape {tuple(t.shape)}, the config implies {(E, H)}")
            got["router"] = np.asarray(t).T
        else:
            e, kind = int(m.group(2)), m.group(3)
            if e >= E:
                raise ValueError(f"{what}: checkpoint has {name} but the config has num_experts={E}")
            if tuple(t.shape) != want[kind]:
                raise ValueError(f"{what}: tensor {name} has shape {tuple(t.shape)}, the config implies {want[kind]}")
            got[(e, kind)] = np.asarray(t).T                                        # [in, out]
        if len(got) == 1 + 3 * E:
            del parts[layer]
            yield None, (layer, "router", got.pop("router"))
            yield None, (layer, "experts_gate_up", np.stack([np.concatenate([got[(e, "gate")], got[(e, "up")]], axis=1)
                                                     for e in range(E)]))
            yield None, (layer, "experts_down", np.stack([got[(e, "down")] for e in range(E)]))
    for layer, got in sorted(parts.items()):
        lacking = [f"mlp.gate.weight"] if "router" not in got else []
        lacking += [f"mlp.experts.{e}.{k}_proj.weight" for e in range(E) for k in ("gate", "up", "down")
                    if (e, k) not in got]
        raise ValueError(f"{what}: layer {layer} lacks {len(lacking)} MoE tensor(s): "
                         + ", ".join(f"model.layers.{layer}.{n}" for n in lacking[:4])
                         + (" ..." if len(lacking) > 4 else ""))


def load_qwen3_moe(path_or_hub_id: str, dtype="bfloat16") -> Qwen3Moe:
    """A Qwen3-MoE causal LM from a HF directory or hub id (one device; `sharding.shard_model` then
    places it on a mesh, experts over 'model')."""
    from dflash_jax import weights
    dt = weights._dtype(dtype)
    d = weights.resolve_model_dir(path_or_hub_id)
    config = Qwen3MoeConfig.from_pretrained(d)
    what = f"target {path_or_hub_id}"
    model = nnx.eval_shape(lambda: Qwen3Moe(config, dt, rngs=nnx.Rngs(0)))
    moe_leaves: dict[tuple, np.ndarray] = {}

    def dense(stream):
        for name, t in stream:
            if name is None:          # a stacked MoE leaf: placed after the dense pass below
                layer, leaf, arr = t
                moe_leaves[(layer, leaf)] = arr
                continue
            yield name, t

    top = {"model.embed_tokens.weight": (("embed",), None), "model.norm.weight": (("norm", "weight"), None)}
    skip = [r"lm_head\.weight"] if config.tie_word_embeddings else []
    if not config.tie_word_embeddings:
        top["lm_head.weight"] = (("lm_head",), "T")
    skip += [r".*rotary_emb\.inv_freq"]
    moe_paths = {("layers", i, "mlp", leaf) for i in range(config.num_layers) if config.is_sparse(i)
                 for leaf in ("router", "experts_gate_up", "experts_down")}
    weights._fill(model, dense(stacked_experts(config, weights._iter_tensors(d), what)), top, dt, what, skip,
                  expect_later=moe_paths)
    for (layer, leaf), arr in moe_leaves.items():
        if not np.isfinite(arr).all():
            raise ValueError(f"{what}: layer {layer}'s MoE {leaf} holds NaN or inf values")
        getattr(model.layers[layer].mlp, leaf).set_value(jnp.asarray(arr).astype(dt))
    return model


def init_qwen3_moe(config: Qwen3MoeConfig | str, seed: int = 0, dtype="bfloat16") -> Qwen3Moe:
    """Random weights (benchmarks); config may be a preset name."""
    from dflash_jax import validation, weights
    if isinstance(config, str):
        config = PRESETS[config.lower()]
    return Qwen3Moe(config, weights._dtype(dtype), rngs=nnx.Rngs(validation.check_seed(seed)))


# Real shapes of the public Qwen3-MoE checkpoints (random-weight benchmarks).
PRESETS: dict[str, Qwen3MoeConfig] = {
    "qwen3-coder-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rope_theta=1e7, max_position_embeddings=262144,
        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=()),
}
