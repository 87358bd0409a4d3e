#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (CPU only; no network needed at run time).
#   bash scripts/test.sh                          (the default run: skips the tests marked slow)
#   bash scripts/test.sh -m "slow or not slow" -n 2 --dist loadfile --durations=40   (everything, two workers: .ci/run; the 40 slowest tests listed at the end)
# Creates .venv-test (its own venv: the test extra's torch, transformers and libtpu stay out of the
# .venv that README's main command makes), installs the package with its [test] extra (CPU torch
# 2.13.0 for the oracles, jax[tpu] for ahead-of-time TPU compilation), then the reference
# `dflash==0.1.0` oracle with --no-deps (its own pins are too tight), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-test/bin/python ] || "$PY" -m venv .venv-test
. .venv-test/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "dflash==0.1.0"
export JAX_PLATFORMS=cpu
python -m pytest -q "$@"
