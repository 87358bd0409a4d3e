#!/usr/bin/env bash
# Session 46: this call ran benchmarks/results/s45/call1.sh as it is (END_S=560), on the H100 that call2.sh had just
# warmed: the paged server first, then (skipped: 262 s left after the paged one's 283 s warm-up) the fixed one, then
# the W8A8 B = 1 step with what was left. Raw output: call1/. The fixed server ran in the next call (call3.sh).
# run(command="cd .clean && END_S=560 OUT=$OUT bash benchmarks/results/s45/call1.sh", timeout_s=590, carry=[".clean"])
exec bash "$(dirname "$0")/../s45/call1.sh" "$@"
