#!/usr/bin/env bash
# Session 39 device call: issue 57's int8 / fp8 rows (quant_call.sh, its own budget), then issue 56's
# paged slot engine against dense rows (scripts/bench_paged_step.py, 4 Qwen3-8B layers, 8 rows).
# run(command="bash benchmarks/results/s39/call2.sh", timeout_s=590)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
QUANT=${QUANT:-int8,int8+head@1,fp8@1} TOTAL_S=${QUANT_S:-400} bash benchmarks/results/s39/quant_call.sh
echo "[call2] paged step"
timeout ${PAGED_S:-150} python3 scripts/bench_paged_step.py --rows 8 --prompt 1024 --new 48 --capacity 8192 \
  --json "$OUT/paged_step.json" 2>&1 | grep -v "Warning\|^W0000\|^E0000\|^I0000" | tee "$OUT/paged_step.log"
