#!/usr/bin/env bash
# Session 30, H200 call 1: the host-overhead fixes (Slots keeps its programs and width fields; generate
# hashes its key once and reads the mesh off its own split). Run from the repo root with carry [".whl"].
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call1 $(( $(date +%s) - START ))s] $*"; }
python -m pip install -q --no-index --find-links .whl/srv fastapi uvicorn prometheus-client > "$OUT/pip.log" 2>&1 || say "pip failed"
say "served"
timeout 260 python scripts/load_test.py --preset qwen3-8b --random --simulated-tau 6.35 --requests 48 --requests-at-1 8 \
  --concurrency 1,32,32x256 --rates "" --step-buckets 1,32 --json "$OUT/load.json" --server-log "$OUT/server.log" \
  2>&1 | tee "$OUT/load.log"
say "adaptive B=128, B=1"
timeout $(( 585 - ($(date +%s) - START) )) python scripts/bench_adaptive.py --taus 6.54 --batches 128,1 \
  --true-plain-batches 128,1 --n2 256 --reps 3 --out "$OUT" --json ad.json --budget-s $(( 540 - ($(date +%s) - START) )) \
  2>&1 | tee "$OUT/ad.log"
say done
