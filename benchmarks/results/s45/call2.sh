#!/usr/bin/env bash
# Session 45, the last ~500 s of device budget (issue 57): the whole B = 1 plain step and DFlash iteration of
# Qwen3-8B shapes with an FP8 checkpoint run W8A8 (and W8A8 with the LM head int8) against bf16 in the same process.
# run(command="cd .clean && B_S=360 OUT=$OUT bash benchmarks/results/s45/call2.sh", timeout_s=400, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 10 ${B_S:-360} python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8,fp8-w8a8+head@1" --quant-batches 1 \
  --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( ${B_S:-360} - 20 )) \
  --out "$OUT" --json bench_gpu_w8a8.json 2>&1 | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-400 | tee "$OUT/gpu_w8a8.log"
ls -la "$OUT"
