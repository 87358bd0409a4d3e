#!/usr/bin/env bash
# Session 43, a short call (the budget left after refusals): the FP8 W8A8 microbenchmark alone (issue 57).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s43/call4.sh", timeout_s=300, carry=[".clean"])
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 ${W_S:-240} python3 scripts/bench_fp8_w8a8.py --rows 1,16 --tbs $TBS --budget-s $(( ${W_S:-240} - 30 )) \
  --json $OUT/w8a8.json 2>&1 | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-300 | tee $OUT/w8a8.log | tail -70
