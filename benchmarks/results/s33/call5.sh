#!/usr/bin/env bash
# Session 33, H200 call 5: the one-token MoE kernels (gmm_rows: gate_up + SwiGLU, then down, 8 of 128
# Coder-30B-A3B experts) alone over tilings: after call 4 they are the largest part of the B = 1 plain
# step (19 + 10.5 us a layer against 11.9 + 5.9 us of weights).
# (The tiles section was removed after this call: commit 35c4245, docs/perf-log.md session 33.)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call5 $(( $(date +%s) - START ))s] $*"; }
timeout 300 python scripts/bench_moe.py --sections tiles --budget-s 280 --out "$OUT" 2>&1 | grep -v Warning | grep "tiles\|#" | cut -c1-250
say done
