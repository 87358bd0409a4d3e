"""Draft training: the paper's recipe on the library's own target and draft modules.

    python -m dflash_jax.train regenerate ...   # prompts -> the target's responses, sharded on disk
    python -m dflash_jax.train train ...        # Orbax-checkpointed training run
    python -m dflash_jax.train export ...       # a checkpoint -> a z-lab format draft directory
"""
