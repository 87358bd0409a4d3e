"""The draft variants by config.json `architectures`: one line per variant. A config without
`architectures` is a DFlash (v1) draft, as the z-lab checkpoints before DFlash2."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.config import ConfigError
from dflash_jax.drafts import dflash, dflash2
from dflash_jax.drafts.variant import Variant

VARIANTS: dict[str, Variant] = {v.architecture: v for v in (
    dflash.VARIANT,
    dflash2.VARIANT,
)}
DEFAULT = dflash.VARIANT.architecture


def variant(architectures) -> Variant:
    """The variant of a config.json's `architectures` list (None or empty: DFlash v1)."""
    if not architectures:
        return VARIANTS[DEFAULT]
    names = [architectures] if isinstance(architectures, str) else list(architectures)
    for name in names:
        if name in VARIANTS:
            return VARIANTS[name]
    raise ConfigError(f"draft: architectures={names} is not supported; supported: {', '.join(sorted(VARIANTS))}")


def variant_of_config(config) -> Variant:
    """The variant that runs `config` (load_draft, init_draft): its `architecture` field where it
    has one, else by config class. A DFlash-1 config with sliding-window or causal layers runs on
    the DFlash2 module (drafts.dflash2: per-layer key ranges; no conv, no selector)."""
    if hasattr(config, "plain_attention") and dflash2.needs_dflash2(config):
        return dflash2.VARIANT
    if getattr(config, "architecture", None) in VARIANTS:
        return VARIANTS[config.architecture]
    for v in VARIANTS.values():
        if type(config) is v.config_class:
            return v
    raise ConfigError(f"draft: no variant has config class {type(config).__name__}; "
                      f"supported: {', '.join(sorted(VARIANTS))}")


def read_config(d: Mapping[str, Any]):
    """A draft's config (its variant's class) from its config.json dict."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"draft: the config must be a JSON object, got {type(d).__name__}")
    return variant(d.get("architectures")).config_class.from_dict(d)
