#!/usr/bin/env bash
# The one call this session's device budget allowed after its refusals (~1,300 s left): call1.sh's one-row GEMV
# per matmul and chained (issue 57: does gpu_w8a8.matmul_gemv beat XLA's fp8 dot at one row?), then call2.sh's
# offline paged vs fixed vs static B = 32 engine run, traced (issue 56: where the paged c = 32 loss goes), with 96
# prompts and the time left. call1.sh's B = 32 W8A8 rows are left for the next call.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s47/call3.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 80 python3 scripts/bench_fp8_w8a8.py --rows 1 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 xla nk,w8a8 gemv,w8a8 gemv bn16,w8a8 gemv bn64,w8a8 gemv w8,w8a8 gemv s1" \
  --json "$OUT/gemv.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/gemv.txt"
timeout -k 5 70 python3 scripts/bench_w8a8_chain.py --rows 1 --forms "bf16,w8a8 model,w8a8 gemv" --tbs $TBS 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/w8a8_chain.txt"
timeout -k 5 400 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 --prompts 96 \
  --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages off,auto --trace /tmp/engine_trace 2>&1 \
  | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/engine_paged.txt" | tail -70
ls -la "$OUT"
