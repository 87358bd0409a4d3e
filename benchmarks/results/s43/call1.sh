#!/usr/bin/env bash
# Session 43, call 1: the fixed-slot engine's served tok/s (issue 56; warm-up now compiles in threads), then, with
# what is left of the call, the FP8 W8A8 matmul microbenchmark (issue 57).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s43/call1.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s)
ENGINE=${ENGINE:-fixed} OUT=$OUT bash benchmarks/results/s42/call2c.sh
left=$(( 560 - ($(date +%s) - T0) )); [ $left -gt 170 ] && left=170
echo "[call1] $left s left for the W8A8 microbenchmark"
if [ $left -gt 60 ]; then
  PYTHONPATH=$PWD timeout -k 5 $left python3 scripts/bench_fp8_w8a8.py --rows 1,16 --budget-s $(( left - 25 )) \
    --json $OUT/w8a8.json 2>&1 | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-300 | tee $OUT/w8a8.log | tail -60
fi
