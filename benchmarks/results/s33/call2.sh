#!/usr/bin/env bash
# Session 33, H200 call 2: call 1 again, each kernel now named by the compiled program's HLO
# (as_text). Call 1: where the launch-bound MoE step's time goes, kernel by kernel with each
# kernel's HLO (issue 36: Qwen3-Coder-30B-A3B B = 1 plain at 2.89x its floor; the 35B-A3B hybrid plain
# step at 3.74x with 254 input_reduce fusions), and the Qwen3.5-9B DFlash iteration's 16-row matmuls
# shape by shape (issue 38: 1.19x the weights' floor).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call2 $(( $(date +%s) - START ))s] $*"; }
say "coder-30b-a3b 12 layers B=1"
timeout 200 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --top 45 \
  --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230
say "35b-a3b 8 layers B=1 plain"
timeout 150 python scripts/profile_step.py --preset qwen3.5-35b-a3b --layers 8 --batch 1 --kinds plain --top 45 \
  --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230
say "9b 8 layers B=1 dflash"
timeout 150 python scripts/profile_step.py --preset qwen3.5-9b --layers 8 --draft-layers 5 --batch 1 --kinds dflash \
  --top 60 --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230
say "coder-30b-a3b 12 layers B=8"
timeout 150 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 8 --top 45 \
  --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230
say done
