#!/usr/bin/env bash
# Session 31, H200 call 3: (1) where the hybrid B = 1 iteration's time above its floor goes (a trace
# of the timed iterations by kernel family, issue 38); (2) what the new default verify_width="auto"
# costs a one-shot CLI process at Qwen3-8B shapes (compile and run, random bf16, against "block").
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call3 $(( $(date +%s) - START ))s] $*"; }
say "hybrid trace"
timeout 200 python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 1 --no-fold-share \
  --trace "${TMPDIR:-/tmp}/htrace" --out "$OUT/hybrid_trace.jsonl" 2>&1 | tee "$OUT/hybrid_trace.log" | cut -c1-400
for vw in block auto; do
  say "one-shot CLI, --verify-width $vw"
  /usr/bin/time -f "wall %e s, max rss %M KB" timeout 170 python -m dflash_jax.generate --random-init qwen3-8b \
    --verify-width $vw --prompt-len 512 --max-new-tokens 256 --json > "$OUT/cli_$vw.out" 2> "$OUT/cli_$vw.log"
  tail -2 "$OUT/cli_$vw.log"; cut -c1-300 "$OUT/cli_$vw.out"
done
say done
