#!/usr/bin/env bash
# Session 40 device call 4: issue 59's structured-output cost again after the grammar insert's first
# drafts (d6f... "Grammar inserts return each row's first drafts"), bf16 and float32 (float32: the
# greedy equality checks; bf16 programs that differ may round a near-tie differently).
# run(command="bash benchmarks/results/s40/call5.sh", timeout_s=400, carry=[".whl"])
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
for spec in "regex bfloat16" "regex float32" "json bfloat16" "json float32"; do
  set -- $spec
  timeout 110 python3 scripts/bench_structured.py --grammar $1 --dtype $2 --slots 4 --prompts 16 --new 128 \
    --json "$OUT/structured_$1_$2.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/structured_$1_$2.log" | grep "^|\|==\|device"
done
ls -la "$OUT"
