"""Target families, one room each, registered by HF `model_type` (registry.py); shared pieces in
layers.py."""

from dflash_jax.models.family import Family
from dflash_jax.models.registry import FAMILIES, family, read_config

__all__ = ["Family", "FAMILIES", "family", "read_config"]
