#!/usr/bin/env bash
# Prepared in session 47 for the next device session (issue 56, not yet run). Session 47 (H100, s47/call2) found the
# paged engine offline at 0.971x the fixed one, its loss in the step (14% more busy time, 53% more kernels: every
# layer's XLA page write gathers the touched pages, updates them and scatters them back, for K and V, target and
# draft), not in admission. This call A/Bs KernelConfig.page_write "positions" (one scatter of the block's positions)
# against "pages" in one process, beside the fixed rows and the static B = 32 program, each traced. If "positions"
# closes the step's gap, it becomes the GPU default (resolve()), else it is deleted with its numbers in perf-log.
# Build .clean (git archive of dflash_jax incl. dflash_jax/datasets, pallas_kernels, scripts, pyproject.toml,
# benchmarks/results/s48), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s48/call2.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout -k 10 560 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 --prompts 96 \
  --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages off,auto --page-write pages,positions --trace /tmp/engine_trace 2>&1 \
  | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-400 | tee "$OUT/engine_page_write.txt" | tail -80
ls -la "$OUT"
