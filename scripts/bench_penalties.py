"""Per-iteration cost of the penalties program (presence / frequency penalties, a 300-entry
logit_bias: dflash_jax.penalties) against the default program, same requests, same process.

One-shot generate, greedy, whole-block verify; an iteration's cost is the run time of N new tokens
less that of 2 (the prefill), over the iterations between them (random weights: ~1 token each).
Prints one table: rows, capacity, default ms / iteration, penalties ms / iteration, ratio.

    python scripts/bench_penalties.py                  # Qwen3-8B's vocabulary, 2 small layers
    python scripts/bench_penalties.py --smoke          # tiny
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from dflash_jax import generate
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.weights import init_draft, init_target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    cfg = TargetConfig.preset("qwen3-8b")
    cfg = dataclasses.replace(cfg, num_layers=a.layers, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                              num_heads=4, num_kv_heads=2, head_dim=a.hidden // 4)
    if a.smoke:
        cfg = dataclasses.replace(cfg, vocab_size=512)
        a.rows, a.new, a.capacity, a.prompt, a.rounds = "2", 12, 256, 20, 1
    target = init_target(cfg, dtype=a.dtype)
    draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=16), dtype=a.dtype, target=target)
    rng = np.random.default_rng(0)
    ids = rng.choice(cfg.vocab_size, 300, replace=False)
    adjusted = dict(presence_penalty=0.5, frequency_penalty=0.5,
                    logit_bias={int(t): float(b) for t, b in zip(ids, rng.uniform(-1, 1, 300))})
    print(f"device {jax.devices()[0].device_kind}, vocab {cfg.vocab_size}, target {cfg.num_layers} layers of hidden "
          f"{cfg.hidden_size}, block 16, {a.dtype}, penalties: presence + frequency + 300 logit_bias entries")
    print("| rows | capacity | default ms/iter | penalties ms/iter | penalties / default |")
    print("| --- | --- | --- | --- | --- |")
    for rows in [int(x) for x in a.rows.split(",")]:
        prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, a.prompt)] for _ in range(rows)]

        def run(new, kw):
            r = generate(target, draft, prompts, max_new_tokens=new, capacity=a.capacity, verify_width="block", **kw)
            return r.run_time_s, r.num_iterations
        best = {}
        for kw in ({}, adjusted):                               # compile both first
            run(2, kw), run(a.new, kw)
        for _ in range(a.rounds):
            for name, kw in (("default", {}), ("penalties", adjusted)):
                (t2, i2), (tn, i_n) = run(2, kw), run(a.new, kw)
                best[name] = min(best.get(name, np.inf), (tn - t2) / max(i_n - i2, 1))
        d, p = best["default"] * 1e3, best["penalties"] * 1e3
        print(f"| {rows} | {a.capacity} | {d:.2f} | {p:.2f} | {p / d:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
