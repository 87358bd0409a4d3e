#!/usr/bin/env bash
# Prepared in session 46 for the next device session (issue 57, not yet run).
# (1) the one-row GEMV experiment (gpu_w8a8.matmul_gemv: no tensor cores, x quantized inside) per matmul against
#     XLA's fp8 dot (the model's one-row path) and bf16, its tilings; then chained over 36 layers (launch gaps
#     count). Session 46 (H100): XLA's fp8 dot at one row runs at 1.48x its byte floor in busy time, bf16 at 1.09x;
#     a GEMV at bf16's efficiency would take the chain from 0.724x to ~0.55x bf16.
# (2) B = 32: W8A8 and weight-only FP8 against bf16 in one process (its budget counts the precompile: session 46's
#     12-program precompile took 194 of 310 s and no row ran). Only B = 32 and B = 1 DFlash here.
# Build .clean (git archive of dflash_jax, pallas_kernels, scripts, pyproject.toml, benchmarks/results/s47), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s47/call1.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 10 90 python3 scripts/bench_fp8_w8a8.py --rows 1 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 xla nk,w8a8 gemv,w8a8 gemv bn16,w8a8 gemv bn64,w8a8 gemv w8,w8a8 gemv s1" \
  --json "$OUT/gemv.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/gemv.txt"
timeout -k 10 80 python3 scripts/bench_w8a8_chain.py --rows 1 --forms "bf16,w8a8 model,w8a8 gemv" --tbs $TBS 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/w8a8_chain.txt"
timeout -k 10 380 python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8,fp8@32" --quant-batches 32,1 \
  --loop-n 32,160 --reps 3 --compile-workers 8 --floor-tbs $TBS --budget-s 360 \
  --out "$OUT" --json bench_gpu_w8a8_b32.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_w8a8_b32.log" | tail -40
ls -la "$OUT"
