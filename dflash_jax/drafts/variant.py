"""What a draft variant is: everything `load_draft` / `init_draft` need to build one, registered by
its config.json `architectures` entry in dflash_jax.drafts.registry.

A variant is a config class (`from_dict`, `check_fits`, `block_size`, `target_layer_ids`), the
proposer module (`propose`, `write_context`, `new_cache`: the loop's interface, dflash_jax.drafts.dflash)
and the names of its checkpoint tensors."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Variant:
    architecture: str                    # config.json `architectures[0]`
    config_class: type                   # .from_dict(config.json dict), .check_fits(target config)
    model: Callable                      # model(config, dtype, *, rngs) → the proposer module
    top_weights: Mapping[str, tuple[tuple[str, ...], Any]]   # HF name → (our path, how)
    layer_weights: Mapping[str, tuple[tuple[str, ...], Any]]  # HF leaf after `layers.N.` → (path, how)
    skip: tuple[str, ...] = (r".*rotary_emb\.inv_freq",)
