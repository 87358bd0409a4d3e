#!/usr/bin/env bash
# Session 41 device call 2 (issue 56): served tok/s of the paged engine against the fixed-slot engine,
# Qwen3-8B shapes (random bf16), simulated acceptance tau 6.35, concurrency 1 (8 requests) and 32
# concurrent over 256 requests, one server each in the same call. Same KV budget: 32 slots x 1,024
# positions fixed; 2,048 pages of 16 (+ the dummy page 0) paged, prefix cache on (random prompts: no hits).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s41/call2.sh", timeout_s=590, carry=[".clean"])  (.clean/whl: the wheels)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
# the device's Python lacks the [serve] extra: wheels carried in whl/ (pip download fastapi uvicorn pydantic
# prometheus-client --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 -d whl)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
COMMON=(--preset qwen3-8b --random --simulated-tau 6.35 --requests 256 --requests-at-1 8 --concurrency 1,32x256 --rates "")
for eng in fixed paged; do
  extra=(); [ $eng = paged ] && extra=(--server-arg=--kv-pages=2049)
  echo "[call2] $eng"
  timeout -k 10 ${RUN_S:-270} python3 scripts/load_test.py "${COMMON[@]}" "${extra[@]}" --json "$OUT/load_$eng.json" \
    --server-log "$OUT/server_$eng.log" 2>&1 | grep -v "$FILTER" | cut -c1-300 | tee "$OUT/load_$eng.log" | tail -25
done
ls -la "$OUT"
