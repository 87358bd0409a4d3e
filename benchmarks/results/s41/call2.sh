#!/usr/bin/env bash
# Session 41 device call 2 (issue 56): served tok/s of the paged engine against the fixed-slot engine,
# Qwen3-8B shapes (random bf16), simulated acceptance tau 6.35 (scripts/serve_simulated.py), concurrency 1
# (8 requests) and 32 concurrent over 256 requests. Same KV budget: 32 slots x 1,024 positions fixed;
# 2,048 pages of 16 (+ the dummy page 0) paged, prefix cache on (random prompts: no hits).
# One server's warm-up compile takes ~165 s at these shapes, so both servers start and compile side by
# side (each with 45% of the GPU's memory), then load_test.py --url measures them one after the other
# (the other server idle).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s41/call2.sh", timeout_s=590, carry=[".clean"])  (.clean/whl: the wheels)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# the device's Python lacks the [serve] extra: wheels carried in whl/ (pip download fastapi uvicorn pydantic
# prometheus-client --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 -d whl)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
SERVE=(--random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 --capacity 1024 --engine-steps auto
       --max-queue 256 --warmup-prompt-len 65:128)
python3 scripts/serve_simulated.py --tau 6.35 "${SERVE[@]}" --port 8101 > "$OUT/server_fixed.log" 2>&1 &
python3 scripts/serve_simulated.py --tau 6.35 "${SERVE[@]}" --kv-pages 2049 --port 8102 > "$OUT/server_paged.log" 2>&1 &
for port in 8101 8102; do
  for i in $(seq 1 90); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break; sleep 4; done
  echo "[call2] server $port ready after ~$((i * 4)) s"
done
grep -h "warm-up done" "$OUT"/server_*.log
for eng in fixed paged; do
  port=8101; [ $eng = paged ] && port=8102
  echo "[call2] $eng"
  timeout -k 5 ${RUN_S:-150} python3 scripts/load_test.py --url "http://127.0.0.1:$port" --preset qwen3-8b \
    --requests 256 --requests-at-1 8 --concurrency 1,32x256 --rates "" --json "$OUT/load_$eng.json" 2>&1 \
    | tee "$OUT/load_$eng.log" | grep -v "Warning" | tail -25
done
kill %1 %2 2>/dev/null
ls -la "$OUT"
