"""`python -m dflash_jax.generate`: the README's command; its code is dflash_jax.cli.generate.

`dflash_jax.generate` is the library's function. A module of the same name, imported, would rebind
that package attribute to itself, so imported (rather than run) this module puts the function in
its own place in sys.modules: `import dflash_jax.generate` then leaves `dflash_jax.generate` the
function."""

import sys

if __name__ == "__main__":
    from dflash_jax.cli.generate import main

    sys.exit(main())
else:
    from dflash_jax.decode import generate

    sys.modules[__name__] = generate
