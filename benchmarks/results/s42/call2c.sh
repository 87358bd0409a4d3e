#!/usr/bin/env bash
# For the next device session (issue 56): served tok/s of ONE engine per call (ENGINE=fixed or ENGINE=paged),
# Qwen3-8B shapes, simulated tau 6.35, concurrency 1 (8 requests) and 32 over 128 requests. Session 42 learnt
# (benchmarks/results/s42/call2, call2b) that a server's warm-up on the H100 takes 265 s (fixed) and 420 s
# (paged) with both compiling side by side, and more than 240 s alone: one engine per call, 480 s to come up.
# run(command="cd .clean && ENGINE=fixed OUT=$OUT bash benchmarks/results/s42/call2c.sh", timeout_s=590, carry=[".clean"])
# run(command="cd .clean && ENGINE=paged OUT=$OUT bash benchmarks/results/s42/call2c.sh", timeout_s=590, carry=[".clean"])
# (.clean: git archive of dflash_jax pallas_kernels scripts pyproject.toml benchmarks/results/s42/call2c.sh, plus
#  whl/ from: pip download fastapi uvicorn pydantic prometheus-client --python-version 3.12 --only-binary=:all:
#  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d whl)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; ENGINE=${ENGINE:-fixed}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')" || exit 1
python3 scripts/load_test.py --help > /dev/null || exit 1          # the client imports before the long warm-up
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
extra=(); [ "$ENGINE" = paged ] && extra=(--kv-pages 2049)
python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
  --capacity 1024 --engine-steps auto --max-queue 256 --warmup-prompt-len 65:128 "${extra[@]}" --port 8101 \
  > "$OUT/server_$ENGINE.log" 2>&1 &
pid=$!
for i in $(seq 1 240); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && break; sleep 2; done
echo "[call2c] $ENGINE ready after ~$((i * 2)) s"; grep -h "warm-up done" "$OUT/server_$ENGINE.log"
timeout -k 5 ${RUN_S:-90} python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
  --requests 128 --requests-at-1 8 --concurrency 1,32x128 --rates "" --json "$OUT/load_$ENGINE.json" 2>&1 \
  | tee "$OUT/load_$ENGINE.log" | grep -v "Warning" | tail -14
kill $pid; wait $pid 2>/dev/null
ls -la "$OUT"
