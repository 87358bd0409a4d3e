#!/usr/bin/env bash
# Session 34, H200 call 5 (the last ~250 s of device time): the one-token MoE path's two gmm
# launches, timed in the user's program (profile_step --time-only on, B = 1 plain, Coder-30B-A3B
# 12 layers) with launch overrides (KernelConfig.moe_tuning), one process. They run at 18.4 + 9.7 us
# a layer against 11.9 + 5.9 us of weights (call 3's profile): default tiles bn 32, bk 256, 4 warps,
# 3 stages (gate_up: 192 programs of 256 KB; down: 512 programs of 48 KB, 3 K steps).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T=";gate_up_bn=16;gate_up_num_stages=4,down_num_stages=4;down_bn=64;down_bk=128,down_num_stages=4"
T="$T;gate_up_num_warps=2,down_num_warps=2;gate_up_bk=128,gate_up_num_stages=5;"
timeout 160 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --kinds plain \
  --time-only on --moe-tuning "$T" 2>&1 | grep -v Warning | grep "ms/step\|rror" | tee "$OUT/tiles.log"
