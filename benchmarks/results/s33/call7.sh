#!/usr/bin/env bash
# Session 33, H200 call 7: while graphs on the user's program (generate's, N1/N2 wall per step) for the
# Qwen3.5-35B-A3B hybrid MoE at B = 1: call 6's bench_hybrid loop ran its plain step 24% slower with
# the compile options than call 4's without.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call7 $(( $(date +%s) - START ))s] $*"; }
for wg in on off; do
  say "35b-a3b 40 layers B=1, while graphs $wg"
  timeout 140 python scripts/profile_step.py --preset qwen3.5-35b-a3b --layers 0 --batch 1 --kinds plain,dflash \
    --time-only $wg 2>&1 | grep -v Warning | grep "ms/step"
done
say done
