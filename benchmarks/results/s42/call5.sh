#!/usr/bin/env bash
# Session 42 device call 5 (issue 57): the one-row GEMV variant of the 8-bit GPU matmul (no dot, no padded
# row; now the default at one row, and int8 at one row now also takes o / down) and the "swap" variant at 16
# rows (the converted tile as the dot's large operand), swept per matmul against XLA and the dot kernel;
# then the whole plain step / DFlash iteration at B = 1, int8 and FP8 against bf16 in the same process
# (session 41, old rule, same H100 kind: int8 plain 4.623 / DFlash 5.579 ms, fp8 4.729 / 6.079, bf16 5.642 / 7.240).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s42/call5.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
echo "[call5] A: per matmul: gemv at 1 row, swap at 16 rows"
timeout -k 5 ${A_S:-170} python3 scripts/bench_quantized_matmul.py --rows 1,16 --shapes qkv,o,gate_up,down --tbs $TBS \
  --sweep --sweep-rows 1,16 --sweep-sets gemv,swap --out "$OUT" 2>&1 \
  | grep -v "$FILTER" | cut -c1-200 | tee "$OUT/qmm.log" | tail -4
echo "[call5] B: whole step at B = 1, int8 and fp8 vs bf16 (the new rule)"
timeout -k 10 ${B_S:-320} python3 scripts/bench_gpu.py --sections quant --quantize "int8,fp8" --quant-batches 1 \
  --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( ${B_S:-320} - 20 )) \
  --out "$OUT" --json bench_gpu_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant.log" | tail -22
ls -la "$OUT"
