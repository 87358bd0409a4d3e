#!/usr/bin/env bash
# Session 41 device call 1b (issue 57): call 1's default tiles lost to XLA's int8 path at every
# shape; this sweeps split-K 2-8 and smaller K tiles at 16 and 1 rows for int8 and FP8.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s41/call1b.sh", timeout_s=330, carry=[".clean"])
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 ${A_S:-300} python3 scripts/bench_quantized_matmul.py --rows 16,1 --sweep --sweep-rows 16,1 --tbs $TBS \
  --out "$OUT" 2>&1 | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-200 | tee "$OUT/qmm.log" | tail -5
