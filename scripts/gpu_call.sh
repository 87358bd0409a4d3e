#!/usr/bin/env bash
# The one GPU call: environment, a correctness check, the attention benchmark (if present) and the
# full benchmark, every log teed to $OUT. Run it from the repo root through the device tool:
#
#   run(command="bash scripts/gpu_call.sh", carry=[".whl"], timeout_s=600)      # kind nvidia-h200
#
# carry [".whl"] is required: the GPU machine has no network, and .whl/ (gitignored) holds the
# PyTorch reference's wheel. Make it here once:
#   mkdir -p .whl && pip download --no-deps dflash==0.1.0 -d .whl
#
# Budget: the device tool's limit is 600 s per command. This script keeps ~10 s spare and gives
# bench_gpu.py what is left after the earlier steps (it stops starting new measurements ~45 s before
# its hard timeout, and on SIGTERM prints the report of what it has). Knobs (environment):
#   BENCH_ARGS="--sections b1,profile"   extra arguments for bench_gpu.py (e.g. a second call for
#                                        sections a first call skipped)
#   SKIP_CHECK=1 SKIP_ATTN=1             skip the correctness check / bench_attention.py
#   ATTN_TIMEOUT=120 CHECK_TIMEOUT=90    their time limits in seconds
#   ATTN_ARGS="--budget-s 150"           extra arguments for bench_attention.py
#   TOTAL_S=590                          the whole script's time limit
#   SMOKE=1                              tiny shapes (tries this script on a CPU machine)
#   BENCH_ARGS="--no-fused-layer"        KernelConfig flags of bench_gpu.py: --no-fused-layer,
#                                        --no-sampling-kernels, --gpu-attn "block_k=128,num_warps=8"
#   EXTRA_RUNS="flags:sections ..."      after the main run, more bench_gpu.py runs, each in its own
#                                        process with those flags (A/B of a kernel setting); "~" in
#                                        flags is a space: "--no-fused-layer:b1 --gpu-attn~num_stages=4:b1"
# Files back in $OUT (the tool returns at most 8): env.log (with the check), bench_attention.log,
# bench_gpu.log, bench_gpu.json, profile_dflash_b1_*.trace.json.gz, and what bench_attention.py writes.
set -o pipefail
export PYTHONUNBUFFERED=1
# Never use NVLink multicast (see the device notes); harmless on one GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
SMOKE_ARG=${SMOKE:+--smoke}
TOTAL_S=${TOTAL_S:-590}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
say() { echo "[gpu_call $(( $(date +%s) - START ))s] $*"; }

# 1. the reference's wheel (no dependencies: torch and transformers are on the machine)
SITE=$(mktemp -d)   # a scratch site-packages for the carried wheels
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || say "WARN: wheel install failed: the reference section will fail"
else
  say "WARN: no .whl/ (call with carry [\".whl\"]): the reference section will fail"
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

# 2. environment
{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  python3 - <<'EOF'
import sys, jax, flax
print("python", sys.version.split()[0], "| jax", jax.__version__, "| flax", flax.__version__)
try:
    import torch, transformers
    print("torch", torch.__version__, "| transformers", transformers.__version__)
    import dflash
    print("dflash reference", getattr(dflash, "__version__", "0.1.0"), "from", dflash.__file__)
except Exception as e:
    print("reference stack:", type(e).__name__, e)
print("devices", jax.devices())
EOF
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"

# 3. correctness on the GPU: tests that target it if any, else bench_gpu.py's check section
if [ -z "$SKIP_CHECK" ]; then
  if grep -lqsE 'requires_gpu|needs_gpu|default_backend\(\) *(==|in) *.*(gpu|cuda)' tests/test_*.py 2>/dev/null; then
    say "pytest -k gpu"
    timeout -k 10 "${CHECK_TIMEOUT:-90}" python3 -m pytest -q -x tests -k gpu -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/env.log"
    say "check rc=${PIPESTATUS[0]}" | tee -a "$OUT/env.log"
  else
    say "no GPU tests in tests/: bench_gpu.py --sections check (Pallas vs XLA, DFlash vs plain greedy)"
    # --out '' : no JSON (the tool returns at most 8 files from $OUT); the result lines go to env.log
    timeout -k 10 "${CHECK_TIMEOUT:-90}" python3 scripts/bench_gpu.py --sections check --out '' $SMOKE_ARG 2>&1 \
      | grep -E 'check:|ERROR|Error|elapsed' | tee -a "$OUT/env.log"
    say "check rc=${PIPESTATUS[0]}" | tee -a "$OUT/env.log"
  fi
fi

# A fused attention prologue that fails its check on this GPU must not sink every measurement:
# the benchmark then runs without it (and says so).
if grep -qE "check: kernel (prologue|add_rmsnorm).*(ERROR|FAIL)" "$OUT/env.log" 2>/dev/null; then
  BENCH_ARGS="$BENCH_ARGS --no-fused-layer"
  say "a fused kernel failed its check: --no-fused-layer for the benchmark" | tee -a "$OUT/env.log"
fi

# 4. the attention benchmark (another engineer's script), if it exists
if [ -z "$SKIP_ATTN" ] && [ -f scripts/bench_attention.py ]; then
  say "bench_attention.py"
  timeout -k 10 "${ATTN_TIMEOUT:-120}" python3 scripts/bench_attention.py $ATTN_ARGS 2>&1 | tee "$OUT/bench_attention.log"
  say "bench_attention rc=$?"
fi

# 5. the full benchmark, with what time is left
REM=$(left)
BUDGET=$(( REM - 45 ))
say "bench_gpu.py: ${REM}s left, budget ${BUDGET}s"
if [ "$BUDGET" -lt 60 ]; then
  say "too little time left for bench_gpu.py"; exit 1
fi
timeout -k 15 -s TERM $(( REM - 15 )) python3 scripts/bench_gpu.py --budget-s "$BUDGET" --out "$OUT" $SMOKE_ARG $BENCH_ARGS \
  2>&1 | grep --line-buffered -vE 'Logging before InitGoogle|^E0000|common_lib.cc|Source Location Trace|libtpu_init_utils' \
  | tee "$OUT/bench_gpu.log"
RC=${PIPESTATUS[0]}

# 6. extra runs, each in its own process with its own kernel flags (A/B of a KernelConfig setting):
#    EXTRA_RUNS="--gpu-attn~num_stages=4:b1 --no-fused-layer:b1"
for spec in $EXTRA_RUNS; do
  flags=${spec%%:*}; flags=${flags//\~/ }; secs=${spec#*:}
  tag=$(echo "${flags}_${secs}" | tr -c 'A-Za-z0-9\n' '_' | cut -c1-80)
  REM=$(left)
  if [ "$REM" -lt 90 ]; then say "no time left for extra run $spec"; continue; fi
  say "extra run: $flags --sections $secs (${REM}s left)"
  timeout -k 10 $(( REM - 20 )) python3 scripts/bench_gpu.py --budget-s $(( REM - 40 )) --out '' \
    --sections "$secs" $flags $SMOKE_ARG 2>&1 | grep --line-buffered -vE 'Logging before InitGoogle|^E0000|common_lib.cc' \
    | tee "$OUT/extra_${tag}.log" | grep -E "ms/iter|sampling:|overhead|kernels:|Error|ERROR"
done
say "bench_gpu rc=$RC; files in \$OUT:"
ls -la "$OUT"
exit $RC
