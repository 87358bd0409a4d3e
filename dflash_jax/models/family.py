"""What a target family is: everything `load_target` / `init_target` need to build one, registered
by its HF `model_type` in dflash_jax.models.registry.

A family is a config reader (HF config.json → TargetConfig, refusing what it cannot run), the
module that runs it (`forward`, `logits`, `embed_tokens`, `new_cache`: dflash_jax.models.qwen3),
the names of its checkpoint tensors and its partition rules on a mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from dflash_jax import sharding
from dflash_jax.config import TargetConfig

# A decoder layer's HF tensors (after `model.layers.N.`) → (our path inside the layer, how): how is
# None (as is), "T" (transposed to [in, out]) or the part names of a fused matrix in their order
# (each HF part [out_i, in], ours [in, sum of out_i]; a bias [out_i] → [sum of out_i]).
LayerWeights = Mapping[str, tuple[tuple[str, ...], Any]]


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    read_config: Callable[[Mapping[str, Any]], TargetConfig]
    model: Callable                      # model(config, dtype, *, rngs) → the nnx module
    layer_weights: Callable[[TargetConfig], LayerWeights]
    top_weights: Callable[[TargetConfig], dict[str, tuple[tuple[str, ...], Any]]]  # HF name → (path, how)
    rules: tuple = sharding.RULES
    # checkpoint tensors the module has no parameter for, never read (regular expressions)
    skip: tuple[str, ...] = (r".*rotary_emb\.inv_freq",)
    # a rewrite of the checkpoint's (name, array) stream before the table above reads it, as
    # tensors(config, stream, what) (Qwen3-MoE: per-expert tensors stacked into [E, ...] arrays);
    # without `sliced` such a family is loaded whole and then placed on a mesh
    tensors: Callable | None = None
    # what a mesh load reads for the parameters `tensors` builds, slice by slice:
    # sliced(config, name, checkpoint) → (shape, block(index) → ndarray) for our parameter `name`
    # ("layers/N/..."), or None for a parameter the tables map (checkpoint: .read(name, index),
    # .shape(name), .names()); each device then reads only its own block (Qwen3-MoE: its experts)
    sliced: Callable | None = None
    # a family whose checkpoint the tables cannot say (per-layer-type tensors, a key prefix, reshaped
    # tensors) loads it itself: load(directory, config, dtype, what) → the module (one device)
    load: Callable | None = None
