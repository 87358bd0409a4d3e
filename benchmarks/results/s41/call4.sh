#!/usr/bin/env bash
# Prepared in session 41 for the next device session (issue 57, not yet run): Qwen3-Coder-30B-A3B shapes
# (12-layer cut + 8-layer bf16 draft) plain step / DFlash iteration at B = 1, 8 with int8 and FP8 experts
# read by the Pallas GPU gmm kernel, against bf16 in the same process; then Qwen3-8B at B = 32 (int8, FP8).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s41/call4.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
echo "[call4] A: Coder-30B-A3B (12 layers), int8 / fp8 experts in the gmm kernel vs bf16"
timeout -k 10 ${A_S:-330} python3 scripts/bench_moe.py --sections loop --quantize "int8,fp8" --batches 1,8 \
  --moe-gmms pallas_gpu --floor-tbs $TBS --precompile-workers 6 --budget-s $(( ${A_S:-330} - 25 )) --out "$OUT" \
  --json bench_moe_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/moe_quant.log" | tail -40
echo "[call4] B: Qwen3-8B B = 32, int8 and fp8 vs bf16"
timeout -k 10 ${B_S:-220} python3 scripts/bench_gpu.py --sections quant --quantize "int8,fp8" --quant-batches 32 \
  --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( ${B_S:-220} - 20 )) \
  --out "$OUT" --json bench_gpu_quant_b32.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant_b32.log" | tail -30
ls -la "$OUT"
