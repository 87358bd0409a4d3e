#!/usr/bin/env bash
# Session 41 device call 1 (issue 57): the 8-bit GPU matmul kernel (pallas_kernels/quantized/gpu.py)
# against XLA's int8 / FP8 paths per matmul at Qwen3-8B shapes (+ a tile sweep at 16 rows), then the
# whole plain step / DFlash iteration with the kernel in models.layers.linear: int8 at B = 1, 8 and
# FP8 at B = 1 against bf16 in the same process.
# run(command="bash benchmarks/results/s41/call1.sh", timeout_s=590)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
echo "[call1] A: per-matmul kernel vs XLA"
timeout -k 5 ${A_S:-200} python3 scripts/bench_quantized_matmul.py --rows 16,1,128 --sweep --tbs $TBS --out "$OUT" 2>&1 \
  | grep -v "$FILTER" | cut -c1-300 | tee "$OUT/qmm.log" | tail -80
echo "[call1] B: whole step, int8 B = 1, 8 and fp8 B = 1 vs bf16"
timeout -k 10 ${B_S:-340} python3 scripts/bench_gpu.py --sections quant --quantize "int8,fp8@1" --quant-batches 1,8 \
  --loop-n 32,160 --reps 3 --compile-workers 5 --floor-tbs $TBS --budget-s $(( ${B_S:-340} - 20 )) \
  --out "$OUT" --json bench_gpu_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant.log" | tail -40
ls -la "$OUT"
