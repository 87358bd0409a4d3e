#!/usr/bin/env bash
# Still to run (issue 57). The row-tiled W8A8 GEMM (gpu_w8a8.matmul_tiled, off the model path until timed) against the
# dequantized form the model runs beyond 128 rows (a B = 32 verify: 512 rows; that form writes a bf16 copy of each
# weight, ~3x bf16's bytes, and the B = 32 DFlash iteration ran 1.60x bf16's), per matmul at 512 and 2048 rows and
# chained over 36 layers at 512; then the unfused W8A8 kernel at 128 rows (a B = 8 verify) with 128-row tiles
# ("w8a8 tiled": each weight tile read once) against the model's bm = 64 form. call4.sh tried the per-matmul part
# with a 70 s timeout: compiling its 16 variants took longer, no row came back; give it 200 s.
# If the tiled GEMM beats matmul_dequant, models.layers.linear takes it beyond 128 rows on CUDA (then time B = 32);
# if it loses everywhere it is deleted and its numbers go to docs/perf-log.md.
# Build .clean (git archive of dflash_jax, pallas_kernels, scripts, pyproject.toml, benchmarks/results/s48), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s48/call1.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 200 python3 scripts/bench_fp8_w8a8.py --rows 512,2048 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 dequant,w8a8 tiled,w8a8 tiled bm64" --json "$OUT/tiled.json" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/tiled.txt" | tail -40
timeout -k 5 120 python3 scripts/bench_w8a8_chain.py --rows 128,512 --forms "bf16,w8a8 model,w8a8 tiled" --tbs $TBS 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/w8a8_chain_tiled.txt"
ls -la "$OUT"
