"""dflash-jax: DFlash block-diffusion speculative decoding for Qwen3 in JAX.

    from dflash_jax import load_target, load_draft, generate
    target = load_target("Qwen/Qwen3-8B", dtype="bfloat16")
    draft = load_draft("z-lab/Qwen3-8B-DFlash-b16", target=target, dtype="bfloat16")
    res = generate(target, draft, [prompt_ids], max_new_tokens=256)
"""

from dflash_jax.config import ConfigError, DraftConfig, TargetConfig, PRESETS
from dflash_jax.decode import GenerateResult, generate
from dflash_jax.kernel_config import KernelConfig
from dflash_jax.weights import init_draft, init_target, load_draft, load_target

__all__ = ["load_target", "load_draft", "init_target", "init_draft", "generate", "GenerateResult",
           "TargetConfig", "DraftConfig", "ConfigError", "PRESETS", "KernelConfig"]
__version__ = "0.1.0"
