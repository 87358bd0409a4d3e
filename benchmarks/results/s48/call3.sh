#!/usr/bin/env bash
# Prepared in session 47 for the next device session (issue 56, not yet run): the served gap. Offline (s47/call2) the
# engines make 0.95-0.98x the static B = 32 program; served (s46) they made 0.75-0.81x of it at concurrency 32. A
# closed loop of 32 clients on 32 slots leaves each freed slot empty until its client's next request arrives and
# the engine's next step boundary admits it (a request lives ~16 iterations, ~4 steps of K 4: losing about one step
# per request is ~20%); with a queue (more clients than slots) a freed slot refills at once, as offline. This call
# serves the fixed engine and loads it at concurrency 1, 32 and 48 (128 requests each) to separate the two.
# Stage .clean with the serve wheels (fastapi, uvicorn, pydantic, prometheus-client for Python 3.12 in .clean/whl), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s48/call3.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
t=$(date +%s)
python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
  --capacity 1024 --engine-steps auto --max-queue 256 --warmup-prompt-len 65:128 --port 8101 > "$OUT/server_fixed.log" 2>&1 &
PID=$!; UP=
while [ $(( $(date +%s) - t )) -lt 430 ]; do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { UP=$(( $(date +%s) - t )); break; }
  sleep 2
done
echo "[s48 call3] fixed server up after ${UP:-(not within 430)} s"
if [ -n "$UP" ]; then
  timeout -k 5 100 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
    --requests 128 --requests-at-1 8 --concurrency 1,32x128,48x128 --rates "" --json "$OUT/load_fixed.json" 2>&1 \
    | tee "$OUT/load_fixed.log" | grep -v "Warning" | tail -16
fi
kill $PID; wait $PID 2>/dev/null
ls -la "$OUT"
