"""Draft variants behind one proposer interface, registered by config.json `architectures`
(registry.py): dflash.py (DFlash v1), dflash2.py (DFlash2, and DFlash drafts with sliding-window or causal layers)."""

from dflash_jax.drafts.registry import VARIANTS, read_config, variant, variant_of_config
from dflash_jax.drafts.variant import Variant

__all__ = ["Variant", "VARIANTS", "variant", "variant_of_config", "read_config"]
