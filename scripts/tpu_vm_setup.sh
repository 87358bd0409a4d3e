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
#   MESH=data=1,model=4   run the example on many chips (--mesh); e.g. model=4 on a v5e-4 (Qwen3-8B
#                         in bf16 does not fit one 16 GB v5e chip), data=2,model=4 on a v6e-8
#   TPU_NAME=... ZONE=... run from your workstation: the SAME command (this script) is started on
#                         every worker of the slice through `gcloud compute tpus tpu-vm ssh
#                         --worker=all`, each joins the run (DFLASH_DISTRIBUTED=1 ->
#                         jax.distributed.initialize()), and only process 0 prints. The repository
#                         must be cloned at the same path (REMOTE_DIR, default ~/dflash-jax) on each.
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

if [ -n "${TPU_NAME:-}" ]; then   # from a workstation: the same command on every worker
  [ -n "${ZONE:-}" ] || die "TPU_NAME needs ZONE (the slice's zone)"
  REMOTE_DIR="${REMOTE_DIR:-~/dflash-jax}"
  envs="DFLASH_DISTRIBUTED=1 MODEL='$MODEL' DRAFT='$DRAFT' MESH='${MESH:-}' SKIP_EXAMPLE='${SKIP_EXAMPLE:-0}'"
  exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all \
    --command "cd $REMOTE_DIR && env $envs bash scripts/tpu_vm_setup.sh"
fi
MESH_ARGS=()
[ -n "${MESH:-}" ] && MESH_ARGS=(--mesh "$MESH")

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
import os, sys
import jax
if os.environ.get("DFLASH_DISTRIBUTED") == "1":   # a multi-host slice: every worker joins
    jax.distributed.initialize()
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
python -m dflash_jax.generate --model "$MODEL" --draft "$DRAFT" --max-new-tokens 256 ${MESH_ARGS[@]+"${MESH_ARGS[@]}"} \
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"

say "done. Next: python -m dflash_jax.benchmark --model $MODEL --draft $DRAFT --dataset gsm8k --max-samples 32 (see docs/cli.md)"
