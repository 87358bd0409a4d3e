#!/usr/bin/env bash
# Session 41 device call 3 (issue 57): the 8-bit kernel with the tiles chosen from call 1b's sweep
# (pallas_kernels/quantized/gpu.tiles; used where gpu.worthwhile: FP8 blocks, int8 at one row of large
# matrices), per matmul at its default tiles, then the whole plain step / DFlash iteration: int8 and FP8
# at B = 1, 8 against bf16 in the same process.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s41/call3.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
echo "[call3] A: per matmul, default tiles"
timeout -k 5 ${A_S:-120} python3 scripts/bench_quantized_matmul.py --rows 1,16,128 --tbs $TBS --out "$OUT" 2>&1 \
  | grep -v "$FILTER" | cut -c1-200 | tee "$OUT/qmm.log" | tail -80
echo "[call3] B: whole step, int8 and fp8 at B = 1, 8 vs bf16"
timeout -k 10 ${B_S:-420} python3 scripts/bench_gpu.py --sections quant --quantize "int8,fp8" --quant-batches 1,8 \
  --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( ${B_S:-420} - 20 )) \
  --out "$OUT" --json bench_gpu_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant.log" | tail -40
ls -la "$OUT"
