"""`python -m dflash_jax.benchmark`: the command; its code is dflash_jax.cli.benchmark."""

import sys

if __name__ == "__main__":
    from dflash_jax.cli.benchmark import main

    sys.exit(main())
