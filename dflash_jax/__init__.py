"""dflash-jax: DFlash block-diffusion speculative decoding in JAX.

Targets: Qwen3, Llama-3.x, Qwen3-MoE and Qwen3.5 hybrids (dense and MoE), chosen by the checkpoint's
model_type (dflash_jax.models); drafts: DFlash and DFlash2 (dflash_jax.drafts).

    from dflash_jax import load_target, load_draft, generate
    target = load_target("Qwen/Qwen3-8B", dtype="bfloat16")
    draft = load_draft("z-lab/Qwen3-8B-DFlash-b16", target=target, dtype="bfloat16")
    res = generate(target, draft, [prompt_ids], max_new_tokens=256)
    out = generate_text(target, draft, tokenizer, ["What is 17 * 23?"], stop=["\n\n"])  # text in/out
"""

from dflash_jax import startup

if startup.is_command_run():  # first, before jax loads: Ctrl-C while a command starts is exit 130, one line
    startup.exit_on_interrupt()

from dflash_jax.config import ConfigError, DraftConfig, TargetConfig, PRESETS  # noqa: E402
from dflash_jax.decode import GenerateResult, generate  # noqa: E402
from dflash_jax.kernel_config import KernelConfig  # noqa: E402
from dflash_jax.weights import init_draft, init_target, load_draft, load_target  # noqa: E402
from dflash_jax.text import TextResult, generate_text  # noqa: E402

__all__ = ["load_target", "load_draft", "init_target", "init_draft", "generate", "GenerateResult", "generate_text",
           "TextResult", "TargetConfig", "DraftConfig", "ConfigError", "PRESETS", "KernelConfig"]
__version__ = "0.1.0"
