#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (CPU only; no network needed at run time).
#   bash scripts/test.sh                          (the default run: skips the tests marked slow)
#   bash scripts/test.sh -m "slow or not slow" -n 2 --dist loadfile --no-loadscope-reorder   (everything, two workers: .ci/run)
# Creates .venv-test (its own venv: the test extra's torch, transformers and libtpu stay out of the
# .venv that README's main command makes) and installs, pinned by tests/constraints.txt (the versions
# CI passed on):
#   - the package with its [test] extra: jax[tpu] (libtpu, for ahead-of-time TPU compiles), CPU torch
#     2.13.0 and transformers >= 5 for the oracles, pytest + xdist;
#   - the reference `dflash==0.1.0` oracle with --no-deps (its own pins are too tight).
# torch: PyPI's torch==2.13.0 for Linux x86_64 is the CUDA build (several GB). Set
# DFLASH_TORCH_INDEX=https://download.pytorch.org/whl/cpu to take the CPU wheel from PyTorch's own
# index instead (unset by default: a machine whose pip already finds a CPU wheel needs nothing).
# A .venv-test made from other constraints (or another pyproject.toml) is rebuilt.
# Per run: a fresh persistent compilation cache shared by the workers and child processes
# (DFLASH_TEST_JAX_CACHE=dir keeps one across runs), the trained test pairs built once
# (DFLASH_TEST_CACHE=dir keeps them across runs), and ci-artifacts/test-report.json (every test's
# wall seconds and XLA compiles; scripts/test_durations.py turns it into tests/durations.json).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=$(cat pyproject.toml tests/constraints.txt | sha256sum | cut -c1-16)
if [ -x .venv-test/bin/python ] && [ "$(cat .venv-test/.dflash-stamp 2>/dev/null)" != "$STAMP" ]; then
  echo "scripts/test.sh: pyproject.toml or tests/constraints.txt changed; rebuilding .venv-test" >&2
  rm -rf .venv-test
fi
if [ ! -x .venv-test/bin/python ]; then
  "$PY" -m venv .venv-test
  . .venv-test/bin/activate
  t0=$(date +%s)
  python -m pip install -q --upgrade pip
  TORCH_INDEX=()
  [ -n "${DFLASH_TORCH_INDEX:-}" ] && TORCH_INDEX=(--extra-index-url "$DFLASH_TORCH_INDEX")
  python -m pip install -q "${TORCH_INDEX[@]}" -c tests/constraints.txt -e ".[test]"
  python -m pip install -q --no-deps "dflash==0.1.0"
  echo "$STAMP" > .venv-test/.dflash-stamp
  echo "scripts/test.sh: installed .venv-test in $(( $(date +%s) - t0 )) s" >&2
else
  . .venv-test/bin/activate
fi
export JAX_PLATFORMS=cpu
CLEANUP=()
if [ -z "${DFLASH_TEST_JAX_CACHE:-}" ]; then
  DFLASH_TEST_JAX_CACHE=$(mktemp -d); CLEANUP+=("$DFLASH_TEST_JAX_CACHE")
fi
if [ -z "${DFLASH_TEST_CACHE:-}" ]; then
  DFLASH_TEST_CACHE=$(mktemp -d); CLEANUP+=("$DFLASH_TEST_CACHE")
fi
trap '[ ${#CLEANUP[@]} -eq 0 ] || rm -rf "${CLEANUP[@]}"' EXIT
export JAX_COMPILATION_CACHE_DIR=$DFLASH_TEST_JAX_CACHE DFLASH_TEST_CACHE
export DFLASH_TEST_REPORT=${DFLASH_TEST_REPORT:-$PWD/ci-artifacts/test-report.json}
rm -f "$(dirname "$DFLASH_TEST_REPORT")/child-tests.jsonl"
python -m pytest -q "$@"
