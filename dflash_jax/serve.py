"""`python -m dflash_jax.serve`: the OpenAI-compatible server command; its code is
dflash_jax.serving.server."""

import sys

if __name__ == "__main__":
    from dflash_jax.serving.server import main

    sys.exit(main())
