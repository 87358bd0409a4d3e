#!/usr/bin/env python
"""Why W = 0 of the adaptive program costs more than plain decoding (issue 37): the device time per
step of both, by kernel, side by side (benchmark only; random bf16 weights at a preset's shapes).

    python scripts/profile_width0.py --batch 64 --out $OUT      # H200: Qwen3-8B shapes

Each program runs twice under jax.profiler (--n1 and --n2 new tokens); the per-step time of a
kernel is the difference of the two traces over the difference of their steps, so the prefill
cancels. "w0" is generate(..., verify_width=0) with a draft (the adaptive program held at W = 0:
its taps appended to the pending ones, flushed into the draft cache every block of steps), "plain"
is generate without a draft. Prints the kernel families (names with digits stripped: the two programs number their fusions
apart) whose per-step time differs most."""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for d in (os.path.dirname(HERE), HERE):
    if d not in sys.path:
        sys.path.insert(0, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=80)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    import jax
    import numpy as np
    from bench_gpu import Settings, _family, traced_difference
    from dflash_jax import decode, init_draft, init_target
    s = Settings(a.smoke, a.preset)
    tcfg = s.target_config()
    target = init_target(tcfg, seed=0, dtype="bfloat16")
    draft = init_draft(s.draft_config(tcfg), seed=0, dtype="bfloat16")
    prompt, n1, n2 = (32, 4, 12) if a.smoke else (a.prompt, a.n1, a.n2)
    cap = -(-(prompt + n2 + 40) // 512) * 512
    prompts = np.random.default_rng(0).integers(0, min(tcfg.vocab_size - 2, 150000), (a.batch, prompt)).tolist()
    progs = {"plain": dict(draft=None), "w0": dict(draft=draft, block_size=draft.config.block_size, verify_width=0)}
    per_step = {}
    for name, kw in progs.items():
        def gen(n, kw=kw):
            return decode.generate(target, kw["draft"], prompts, max_new_tokens=n, capacity=cap, seed=0,
                                   **{k: v for k, v in kw.items() if k != "draft"})
        gen(n1)                                                    # compile and warm
        # by kernel family (digits stripped: the two programs number their fusions apart)
        fam, ds, x, y = traced_difference(gen, n1, n2, f"w0prof_{name}_", key=_family)
        per_step[name] = fam
        busy = (y["busy_ms"] - x["busy_ms"]) / ds
        wall = (y["run_ms"] - x["run_ms"]) / ds
        print(f"{name}: {ds} steps; device busy {busy:.3f} ms/step, wall {wall:.3f} ms/step "
              f"(gaps {wall - busy:.3f}); {sum(c for _, c in per_step[name].values()):.0f} kernels/step", flush=True)
    p, w = per_step["plain"], per_step["w0"]
    rows = sorted(set(p) | set(w), key=lambda k: -abs(w.get(k, (0, 0))[0] - p.get(k, (0, 0))[0]))
    print(f"\n{'w0 us':>9} {'plain us':>9} {'diff':>8} {'w0 n':>6} {'pl n':>6}  kernel (per step, B={a.batch})")
    for k in rows[:a.top]:
        (tw, cw), (tp, cp) = w.get(k, (0, 0)), p.get(k, (0, 0))
        print(f"{tw:9.1f} {tp:9.1f} {tw - tp:8.1f} {cw:6.2f} {cp:6.2f}  {k[:100]}")


if __name__ == "__main__":
    main()
