"""The Qwen3-MoE target family (HF model_type "qwen3_moe"; Qwen3-30B-A3B, Qwen3-Coder-30B-A3B):
Qwen3's attention and norms, with the MLP of the sparse layers replaced by the MoE block
(models/moe.py). Layer i is sparse iff i is not in `mlp_only_layers` and (i + 1) %
`decoder_sparse_step` == 0 (transformers' rule, `Qwen3MoeConfig.is_sparse`); the other layers keep
the dense MLP of `intermediate_size`.

Checkpoints (Hub format): besides Qwen3's tensors, each sparse layer has `mlp.gate.weight` [E, H]
(the router, not a gate_proj) and `mlp.experts.{e}.{gate,up,down}_proj.weight` for every expert;
`stacked_experts` stacks a layer's experts into [E, ...] arrays as they stream in (gate columns
before up), refusing a missing or mis-shaped expert in one line.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import ConfigError, Qwen3MoeConfig, dense_fields
from dflash_jax.models import qwen3
from dflash_jax.models.family import Family
from dflash_jax.models.layers import DecoderLayer, RMSNorm, init_param
from dflash_jax.models.moe import MoE
from dflash_jax.models.stack import CausalLM

__all__ = ["Qwen3Moe", "read_config", "stacked_experts", "FAMILY"]

MODEL_TYPE = "qwen3_moe"


def read_config(d: Mapping[str, Any]) -> Qwen3MoeConfig:
    """A Qwen3-MoE config.json → Qwen3MoeConfig (Qwen3's checks, then the experts')."""
    q = dense_fields(d, "target")
    if d.get("attention_bias"):
        raise ConfigError("target: attention_bias=True is not supported (Qwen3-MoE has no attention bias)")
    if d.get("use_sliding_window"):
        raise ConfigError("target: use_sliding_window=True is not supported")
    E = d.get("num_experts", d.get("num_local_experts"))     # transformers 5 writes num_local_experts
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
    return Qwen3MoeConfig(**q, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), model_type=MODEL_TYPE,
                          **fields, norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                          mlp_only_layers=tuple(sorted(set(int(i) for i in dense))))


class Qwen3Moe(CausalLM):
    """Qwen3 with the MoE block in its sparse layers; the forward, cache and LM head are CausalLM's."""

    def __init__(self, config: Qwen3MoeConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, V = config.hidden_size, config.vocab_size

        def moe(i):
            if not config.is_sparse(i):
                return None
            return MoE(H, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                       config.norm_topk_prob, dtype, rngs)

        self.embed = init_param(rngs, (V, H), dtype, 1.0)                             # [V, H]
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs, mlp=moe(i)) for i in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else init_param(rngs, (H, V), dtype, H ** -0.5)  # [H, V]


# ------------------------------------------------------------------------------------- checkpoints

_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

# Qwen3's layer tensors, the router, and the two stacked expert arrays stacked_experts makes
# (already in our [E, in, out] layout: taken as they are).
LAYER_WEIGHTS = {
    **qwen3.LAYER_WEIGHTS,
    "mlp.gate.weight": (("mlp", "router"), "T"),
    "mlp.experts.gate_up": (("mlp", "experts_gate_up"), None),
    "mlp.experts.down": (("mlp", "experts_down"), None),
}


def stacked_experts(config: Qwen3MoeConfig, named_tensors, what: str):
    """The checkpoint's (name, array) stream with each sparse layer's per-expert tensors replaced
    by `model.layers.N.mlp.experts.gate_up` [E, H, 2I] and `...experts.down` [E, I, H], yielded
    as soon as a layer's experts are complete. A missing or mis-shaped expert is refused in one
    line naming the tensor."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    want = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    parts: dict[int, dict] = {}
    for name, t in named_tensors:
        m = _EXPERT.match(name)
        if m is None:
            yield name, t
            continue
        layer, e, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        if layer >= config.num_layers or not config.is_sparse(layer):
            raise ValueError(f"{what}: checkpoint has {name} but layer {layer} is not a sparse MoE layer "
                             f"of this config ({config.num_layers} layers, decoder_sparse_step="
                             f"{config.decoder_sparse_step}, mlp_only_layers={list(config.mlp_only_layers)})")
        if e >= E:
            raise ValueError(f"{what}: checkpoint has {name} but the config has num_experts={E}")
        if tuple(t.shape) != want[kind]:
            raise ValueError(f"{what}: tensor {name} has shape {tuple(t.shape)}, the config implies {want[kind]}")
        got = parts.setdefault(layer, {})
        got[(e, kind)] = np.asarray(t).T                                           # [in, out]
        if len(got) == 3 * E:
            del parts[layer]
            yield f"model.layers.{layer}.mlp.experts.gate_up", np.stack(
                [np.concatenate([got[(e, "gate")], got[(e, "up")]], axis=1) for e in range(E)])
            yield f"model.layers.{layer}.mlp.experts.down", np.stack([got[(e, "down")] for e in range(E)])
    for layer, got in sorted(parts.items()):
        lacking = [f"model.layers.{layer}.mlp.experts.{e}.{k}_proj.weight" for e in range(E)
                   for k in ("gate", "up", "down") if (e, k) not in got]
        raise ValueError(f"{what}: layer {layer} lacks {len(lacking)} expert tensor(s): {', '.join(lacking[:4])}"
                         + (" ..." if len(lacking) > 4 else ""))


_STACKED = re.compile(r"layers/(\d+)/mlp/experts_(gate_up|down)")


def expert_slices(config: Qwen3MoeConfig, name: str, checkpoint):
    """A mesh load's reader of the stacked experts: for our `layers/N/mlp/experts_gate_up`
    [E, H, 2I] or `experts_down` [E, I, H], (shape, block(index)), the block of experts index[0]
    read from their own per-expert tensors only (the rows and columns index asks for), so a device
    holding E / tp experts reads those and no others. Every expert tensor of the layer is checked
    first (present, of the config's shape), refused in one line naming it. None: another parameter."""
    m = _STACKED.fullmatch(name)
    if m is None:
        return None
    layer, which = int(m.group(1)), m.group(2)
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    base = f"model.layers.{layer}.mlp.experts."
    have = checkpoint.names()
    for e in range(E):
        for kind, want in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            t = f"{base}{e}.{kind}_proj.weight"
            if t not in have:
                raise ValueError(f"checkpoint lacks tensor {t!r} (layer {layer}'s expert {e} of {E})")
            if tuple(checkpoint.shape(t)) != want:
                raise ValueError(f"tensor {t} has shape {tuple(checkpoint.shape(t))}, the config implies {want}")
    read = checkpoint.read

    if which == "down":                  # ours [E, I, H] = HF down_proj [H, I] transposed, per expert
        def block(index):
            es, rows, cols = index
            return np.stack([read(f"{base}{e}.down_proj.weight", (cols, rows)).T for e in range(E)[es]])
        return (E, I, H), block

    def block(index):                    # ours [E, H, 2I]: gate columns [0, I), up columns [I, 2I)
        es, rows, cols = index
        c0, c1, _ = cols.indices(2 * I)
        parts = [(kind, max(c0, lo) - lo, min(c1, lo + I) - lo) for kind, lo in (("gate", 0), ("up", I))
                 if max(c0, lo) < min(c1, lo + I)]
        return np.stack([np.concatenate([read(f"{base}{e}.{kind}_proj.weight", (slice(a, b), rows)).T
                                         for kind, a, b in parts], axis=1) for e in range(E)[es]])
    return (E, H, 2 * I), block


FAMILY = Family(model_type=MODEL_TYPE, read_config=read_config, model=Qwen3Moe,
                layer_weights=lambda config: LAYER_WEIGHTS, top_weights=qwen3.top_weights,
                skip=qwen3.FAMILY.skip, tensors=stacked_experts, sliced=expert_slices)
