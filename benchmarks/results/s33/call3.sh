#!/usr/bin/env bash
# Session 33, H200 call 3: call 2's two launch-bound plain steps again with their HLO saved (call 2's
# kernel names matched no HLO instruction): which op is the 17 us input_reduce fusion of every layer.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call3 $(( $(date +%s) - START ))s] $*"; }
say "coder-30b-a3b 12 layers B=1 plain"
timeout 200 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --kinds plain --top 30 \
  --save-hlo --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230
mkdir -p "$OUT/q35" && say "35b-a3b 8 layers B=1 plain"
timeout 150 python scripts/profile_step.py --preset qwen3.5-35b-a3b --layers 8 --batch 1 --kinds plain --top 30 \
  --save-hlo --out "$OUT/q35" 2>&1 | grep -v Warning | cut -c1-230
say done
