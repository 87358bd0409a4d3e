#!/usr/bin/env bash
# The day's one device call when refused starts had spent half the device time: the decisions of call1.sh (issue
# 57) and call2.sh (issue 56) in one call, most decisive first:
# (1) the row-tiled W8A8 GEMM (gpu_w8a8.matmul_tiled, off the model path) against the dequantized form the model
#     runs beyond 128 rows, per matmul at 512 rows (a B = 32 verify): it joins the model or is deleted;
# (2) the W8A8 matmuls of 36 layers chained at 16 / 32 / 64 rows, the model's form (fused kernel up to 16 rows,
#     x quantized by XLA beyond) against the fused kernel everywhere: is 16 the cut-over;
# (3) the paged engine's page writes, "pages" against "positions" (KernelConfig.page_write), offline;
# (4) the B = 8 DFlash iteration with W8A8 against bf16 (before the unfused cut-over: 25.26 ms against 8.94).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s48/call4.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 70 python3 scripts/bench_fp8_w8a8.py --rows 512 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 dequant,w8a8 tiled,w8a8 tiled bm64" --json "$OUT/tiled.json" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/tiled.txt" | tail -20
timeout -k 5 80 python3 scripts/bench_w8a8_chain.py --rows 16,32,64 \
  --forms "bf16,w8a8 model,w8a8 pallas" --tbs $TBS 2>&1 | grep -v "$FILTER" | tee "$OUT/w8a8_chain.txt"
timeout -k 10 200 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 --prompts 96 \
  --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages auto --page-write pages,positions 2>&1 \
  | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/engine_page_write.txt" | tail -12
timeout -k 10 150 python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8" --quant-batches 8 \
  --loop-n 32,160 --reps 3 --compile-workers 8 --floor-tbs $TBS --budget-s 130 \
  --out "$OUT" --json bench_gpu_w8a8_b8.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_w8a8_b8.log" | tail -24
ls -la "$OUT"
