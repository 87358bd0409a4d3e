#!/usr/bin/env bash
# Session 43, call 2: the paged engine's served tok/s (issue 56), then with what is left of the call the
# quantized rows not yet timed (issue 57): Qwen3-8B at B = 32, then Coder-30B-A3B shapes.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s43/call2.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); FILTER="Warning\|^W0000\|^E0000\|^I0000"
ENGINE=paged OUT=$OUT bash benchmarks/results/s42/call2c.sh
export PYTHONPATH=$PWD
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
left=$(( 565 - ($(date +%s) - T0) )); echo "[call2] $left s left for the quantized rows"
if [ $left -gt 120 ]; then
  b=$(( left < 220 ? left : 220 ))
  timeout -k 10 $b python3 scripts/bench_gpu.py --sections quant --quantize "int8,fp8" --quant-batches 32 \
    --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( b - 20 )) \
    --out "$OUT" --json bench_gpu_quant_b32.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant_b32.log" | tail -30
fi
left=$(( 565 - ($(date +%s) - T0) )); echo "[call2] $left s left for Coder-30B-A3B"
if [ $left -gt 150 ]; then
  timeout -k 10 $left python3 scripts/bench_moe.py --sections loop --quantize "int8,fp8" --batches 1,8 \
    --moe-gmms pallas_gpu --floor-tbs $TBS --precompile-workers 6 --budget-s $(( left - 25 )) --out "$OUT" \
    --json bench_moe_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/moe_quant.log" | tail -40
fi
ls -la "$OUT"
