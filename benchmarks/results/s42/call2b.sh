#!/usr/bin/env bash
# Session 42 device call 2b (issue 56): call2.sh's measurement with the servers one after the other (side by side
# each took 265-420 s to compile on the H100), 128 requests at c = 32: served tok/s of the fixed-slot engine, then
# of the paged engine (2,048 pages of 16 + page 0, prefix cache on), Qwen3-8B shapes, simulated tau 6.35.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s42/call2b.sh", timeout_s=520, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
SERVE=(--random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 --capacity 1024 --engine-steps auto
       --max-queue 256 --warmup-prompt-len 65:128)
for eng in fixed paged; do
  extra=(); [ $eng = paged ] && extra=(--kv-pages 2049)
  python3 scripts/serve_simulated.py --tau 6.35 "${SERVE[@]}" "${extra[@]}" --port 8101 > "$OUT/server_$eng.log" 2>&1 &
  pid=$!
  for i in $(seq 1 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && break; sleep 2; done
  echo "[call2b] $eng ready after ~$((i * 2)) s"; grep -h "warm-up done" "$OUT/server_$eng.log"
  timeout -k 5 ${RUN_S:-60} python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
    --requests 128 --requests-at-1 8 --concurrency 1,32x128 --rates "" --json "$OUT/load_$eng.json" 2>&1 \
    | tee "$OUT/load_$eng.log" | grep -v "Warning" | tail -14
  kill $pid; wait $pid 2>/dev/null
done
ls -la "$OUT"
