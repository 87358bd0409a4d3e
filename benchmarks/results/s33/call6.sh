#!/usr/bin/env bash
# Session 33, H200 call 6: (1) bench_hybrid's timed loop compiled with the program's compile options
# (while graphs on CUDA, as generate() compiles it), A/B against the old compile (--no-compile-options),
# Qwen3.5-9B B = 1 with traces (the idle share), then 35B-A3B B = 1; the floor now counts the draft's
# LM-head pass. (2) A dense small target at B = 1 (Qwen3-0.6B: every projection under 10M weights)
# with and without the two-row dots.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call6 $(( $(date +%s) - START ))s] $*"; }
for opt in "" "--no-compile-options"; do
  say "9b B=1 $opt"
  timeout 170 python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 1 --no-fold-share $opt \
    --trace "${TMPDIR:-/tmp}/htrace$opt" --budget-s 160 --out "$OUT/hybrid9b$opt.jsonl" 2>&1 | grep -v Warning \
    | python -c "
import json,sys
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: print(l.rstrip()[:200]); continue
    print({k: d.get(k) for k in ('block','ms_per_iteration','floor_ms','x_floor','trace_busy_ms_per_iteration','trace_idle_ms_per_iteration','trace_kernels_per_iteration','compile_options')})"
done
say "35b-a3b B=1"
timeout 200 python scripts/bench_hybrid.py --paths kernel-bv32 --models 35b-a3b --batches 1 --moe-batches 1 \
  --no-fold-share --budget-s 190 --out "$OUT/hybrid35b.jsonl" 2>&1 | grep -v Warning | cut -c1-260
for sd in 0 default; do
  x=$([ $sd = default ] && echo "" || echo "--small-dot $sd")
  say "qwen3-0.6b B=1 plain, small-dot $sd"
  timeout 100 python scripts/profile_step.py --preset qwen3-0.6b --layers 0 --batch 1 --kinds plain --top 6 $x \
    --out "$OUT" 2>&1 | grep -v Warning | cut -c1-200
done
say done
