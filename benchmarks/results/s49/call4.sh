#!/usr/bin/env bash
# (Ran once in session 49, raw call4/: the reduce forms lost or tied and gpu_w8a8.matmul_reduce was deleted after it.)
# Issue 57, the B = 1 goal (<= 0.6x bf16): the one-row 8-bit matmul as XLA's multiply + reduce
# (gpu_w8a8.matmul_reduce: a row-reduction kernel streaming q's K-contiguous rows) against what the model runs
# (XLA's fp8 dot: cuBLAS at ~1.5x its bytes), per matmul (kernel names: did XLA keep the reduction?) and
# chained over 36 layers at 1 row (and 4, to see how a re-read weight scales).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s49/call4.sh", timeout_s=300, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 120 python3 scripts/bench_w8a8_chain.py --rows 1,4 --tbs $TBS \
  --forms "bf16,w8a8 model,w8a8 reduce,w8a8 reduce blocked,fp8 reduce wo,fp8 weight-only" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/chain_reduce.txt"
timeout -k 5 100 python3 scripts/bench_fp8_w8a8.py --rows 1 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 xla nk,w8a8 reduce,w8a8 reduce blocked" --json "$OUT/reduce.json" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/reduce.txt" | tail -30
ls -la "$OUT"
