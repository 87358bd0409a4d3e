#!/usr/bin/env bash
# Session 34, H200 call 1: the Qwen3.5-9B hybrid at B = 1 through the user's program (generate's,
# N1/N2 wall per step, while graphs on; session 33's bench_hybrid figure of 6.523 ms had per-call
# overhead and a floor without the draft's head), then every kernel of a B = 1 MoE layer with its
# HLO (issue 36: which small kernels a fused routing kernel would replace).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call1 $(( $(date +%s) - START ))s] $*"; }
say "9b 32 layers B=1, while graphs on"
timeout 200 python scripts/profile_step.py --preset qwen3.5-9b --layers 0 --draft-layers 5 --batch 1 \
  --kinds plain,dflash --time-only on 2>&1 | grep -v Warning | grep "ms/step"
say "coder-30b-a3b 12 layers B=1 plain, every kernel"
timeout 150 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --kinds plain \
  --top 60 --out "$OUT" 2>&1 | grep -v Warning | cut -c1-260
say "35b-a3b 8 layers B=1 plain, every kernel"
timeout 150 python scripts/profile_step.py --preset qwen3.5-35b-a3b --layers 8 --batch 1 --kinds plain \
  --top 60 --out "$OUT" 2>&1 | grep -v Warning | cut -c1-260
say done
