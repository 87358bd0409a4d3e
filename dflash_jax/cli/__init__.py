"""The command lines: `generate` (prompts through DFlash, streamed) and `benchmark` (τ and speed-up
on a prompt set). Run them as `python -m dflash_jax.generate` / `python -m dflash_jax.benchmark`
(or `python -m dflash_jax.cli.generate`); the library's `dflash_jax.generate` is the function."""
