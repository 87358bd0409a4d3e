#!/usr/bin/env bash
# Session 30, H200 call 3: call 1 served again at --engine-steps auto (4 iterations a step over fewer than 16 rows, 2 over more), after the host-path fixes (Slots keeps its programs and width fields; generate
# hashes its key once and reads the mesh off its own split). Run from the repo root with carry [".whl"].
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call3 $(( $(date +%s) - START ))s] $*"; }
python -m pip install -q --no-index --find-links .whl/srv fastapi uvicorn prometheus-client > "$OUT/pip.log" 2>&1 || say "pip failed"
for K in auto; do
  say "served, K = $K"
  timeout $(( 575 - ($(date +%s) - START) )) python scripts/load_test.py --preset qwen3-8b --random \
    --simulated-tau 6.35 --requests 48 --requests-at-1 8 --concurrency 1,1x24,32x256 --engine-steps $K --rates "" \
    --step-buckets 1,32 --json "$OUT/load_k$K.json" --server-log "$OUT/server_k$K.log" 2>&1 | tee "$OUT/load_k$K.log"
done
say done
