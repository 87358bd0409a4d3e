#!/usr/bin/env bash
# Set up dflash-jax on a Cloud TPU VM and run one DFlash generation.
#
#   git clone <this repo> dflash-jax && cd dflash-jax && bash scripts/tpu_vm_setup.sh
#
# Environment knobs:
#   VENV=.venv-tpu        where the virtual environment goes
#   PYTHON=python3        interpreter used to create it (3.11 or newer)
#   MODEL=Qwen/Qwen3-8B   target (hub id or local directory)
#   DRAFT=z-lab/Qwen3-8B-DFlash-b16
#   SKIP_EXAMPLE=1        stop after the install and the device check
#
# The example downloads ~18 GB of weights from the Hugging Face hub (set HF_TOKEN if your account
# needs it; HF_HOME to put the cache on a larger disk).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO_DIR/.venv-tpu}"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-Qwen/Qwen3-8B}"
DRAFT="${DRAFT:-z-lab/Qwen3-8B-DFlash-b16}"

say() { printf '\n== %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install Python 3.11+ or set PYTHON=..."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$("$PYTHON" -V 2>&1) is too old: dflash-jax needs Python 3.11+ (set PYTHON=python3.11)"

say "virtual environment: $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || die "could not create the venv (on Debian/Ubuntu: sudo apt-get install python3-venv)"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --upgrade pip >/dev/null

say "installing dflash-jax[tpu] from $REPO_DIR"
# [tpu] pulls jax[tpu], i.e. libtpu matched to the jax version.
python -m pip install -e "$REPO_DIR[tpu]"

say "checking that JAX sees the TPU"
python - <<'PY'
import sys
import jax
devices = jax.devices()
print(devices)
if devices[0].platform != "tpu":
    sys.exit(f"error: JAX sees {devices[0].platform} devices, not TPU. Is this a TPU VM, and is no other "
             "process holding the TPU (check: sudo lsof -w /dev/accel* or /dev/vfio/*)?")
print(f"{len(devices)} x {devices[0].device_kind}")
PY

if [ "${SKIP_EXAMPLE:-0}" = "1" ]; then
  say "done (example skipped)"; exit 0
fi

say "example: $MODEL + $DRAFT"
python -m dflash_jax.generate --model "$MODEL" --draft "$DRAFT" --max-new-tokens 256 \
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"

say "done. Next: python -m dflash_jax.benchmark --model $MODEL --draft $DRAFT --dataset gsm8k --max-samples 32 (see docs/cli.md)"
