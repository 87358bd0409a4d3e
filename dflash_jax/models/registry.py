"""The target families by HF `model_type`: one line per family. `family` names the supported types
when a checkpoint is none of them."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.config import PRESETS, ConfigError, TargetConfig
from dflash_jax.models import llama, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe
from dflash_jax.models.family import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    qwen3.FAMILY,
    llama.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5.TEXT_FAMILY,
    qwen3_5_moe.FAMILY,
    qwen3_5_moe.TEXT_FAMILY,
)}
# random-weight presets of the families defined here (config.PRESETS holds the dense ones)
PRESETS.setdefault("qwen3.5-35b-a3b", qwen3_5_moe.PRESET_35B_A3B)


def family(model_type) -> Family:
    """The family registered for `model_type` (a TargetConfig's or config.json's)."""
    try:
        return FAMILIES[model_type]
    except (KeyError, TypeError):
        raise ConfigError(f"target: model_type={model_type!r} is not supported; supported: "
                          f"{', '.join(sorted(FAMILIES))}") from None


def read_config(d: Mapping[str, Any]) -> TargetConfig:
    """A target's TargetConfig from its HF config.json dict, read by its family."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"target: the config must be a JSON object, got {type(d).__name__}")
    return family(d.get("model_type")).read_config(d)
