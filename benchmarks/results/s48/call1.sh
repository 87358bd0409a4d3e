#!/usr/bin/env bash
# Prepared in session 47 for the next device session (issue 57, not yet run). Session 47 (H100) found the fused W8A8
# kernel (x quantized in every program) 2.1x slower than the unfused one at 128 rows, and b33b558 moved the model to
# the unfused kernel beyond 16 rows. This call times what that changed:
# (1) the 36 layers' matmuls chained at 16, 32, 64 and 128 rows: the model's form (fused up to 16 rows, unfused
#     beyond) against the fused kernel at every row count ("w8a8 pallas"), the FP8 weight-only kernel and bf16:
#     whether 16 is the right cut-over;
# (2) the row-tiled W8A8 GEMM (gpu_w8a8.matmul_tiled, off the model path until timed) against the dequantized form the
#     model runs beyond 128 rows (a B = 32 verify: 512 rows; session 47: that form costs ~3x bf16's bytes and the
#     B = 32 DFlash iteration 1.60x bf16's), per matmul at 256 / 512 / 2048 rows and chained at 512;
# (3) the B = 8 DFlash iteration with W8A8 against bf16 (session 47 before the change: B = 8 25.26 ms
#     against bf16's 8.94).
# If the tiled GEMM beats matmul_dequant, models.layers.linear takes it beyond 128 rows on CUDA (then time B = 32).
# Trimmed on the day it ran (device time lost to refused starts): 256 rows, the bn64 tiling and B = 1 left out.
# Build .clean (git archive of dflash_jax, pallas_kernels, scripts, pyproject.toml, benchmarks/results/s48), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s48/call1.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 120 python3 scripts/bench_w8a8_chain.py --rows 16,32,64,128 \
  --forms "bf16,w8a8 model,w8a8 pallas,fp8 weight-only" --tbs $TBS 2>&1 | grep -v "$FILTER" | tee "$OUT/w8a8_chain.txt"
timeout -k 5 90 python3 scripts/bench_fp8_w8a8.py --rows 512,2048 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 dequant,w8a8 tiled,w8a8 tiled bm64" --json "$OUT/tiled.json" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/tiled.txt" | tail -16
timeout -k 5 60 python3 scripts/bench_w8a8_chain.py --rows 512 --forms "bf16,w8a8 model,w8a8 tiled" --tbs $TBS 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/w8a8_chain_512.txt"
timeout -k 10 150 python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8" --quant-batches 8 \
  --loop-n 32,160 --reps 3 --compile-workers 8 --floor-tbs $TBS --budget-s 130 \
  --out "$OUT" --json bench_gpu_w8a8_b8.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_w8a8_b8.log" | tail -30
ls -la "$OUT"
