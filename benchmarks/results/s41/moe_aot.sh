#!/bin/bash
# Session 41 (issue 57): Qwen3-Coder-30B-A3B bf16 vs int8 per chip on v5e-4 and v6e-1, ahead of time.
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv-test/bin/python}
OUT=benchmarks/results/s41
$PY scripts/tpu_moe_aot.py --chips v5e-4,v6e-1 --programs dflash,plain --quantize none,int8 \
    --json $OUT/tpu_moe_aot_int8_b1.json 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" > $OUT/tpu_moe_aot_int8_b1.log
$PY scripts/tpu_moe_aot.py --chips v5e-4,v6e-1 --programs dflash,plain --quantize int8 --moe-gmm xla \
    --json $OUT/tpu_moe_aot_int8_xla_b1.json 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" > $OUT/tpu_moe_aot_int8_xla_b1.log
# the whole 48 layers compiled for v6e-1, int8, DFlash (does the compiler agree with the extrapolation?)
$PY scripts/tpu_moe_aot.py --chips v6e-1 --programs dflash --quantize int8 --layers 47,48 \
    --json $OUT/tpu_moe_aot_int8_v6e1_full.json 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" > $OUT/tpu_moe_aot_int8_v6e1_full.log
