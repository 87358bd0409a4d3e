"""Per-iteration cost of the paged slot engine against dense rows, same requests, same process.

The paged engine's layers gather each row's pages into a dense view (as wide as the busy rows'
pages, a power of two) and write back the pages they touched; the dense engine reads its fixed rows.
Prints one table: rows, prompt, capacity, dense ms / iteration, paged ms / iteration, ratio.

    python scripts/bench_paged_step.py                  # Qwen3-8B layer shapes, 4 layers (GPU)
    python scripts/bench_paged_step.py --smoke          # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np

from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.serving.slots import RowRequest, Slots
from dflash_jax.weights import init_draft, init_target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="target layers (Qwen3-8B's shapes otherwise)")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = TargetConfig.preset("qwen3-8b")
    if a.smoke:
        cfg = dataclasses.replace(cfg, num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                                  num_kv_heads=2, head_dim=16, vocab_size=256)
        a.rows, a.prompt, a.new, a.capacity, a.dtype = "2", 40, 16, 256, "float32"
    else:
        cfg = dataclasses.replace(cfg, num_layers=a.layers)
    target = init_target(cfg, dtype=a.dtype)
    draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=16), dtype=a.dtype, target=target)
    rng = np.random.default_rng(0)
    print(f"device {jax.devices()[0].device_kind}, target {cfg.num_layers} layers of hidden {cfg.hidden_size}, "
          f"block 16, page {a.page_size}, {a.dtype}")
    print("| rows | prompt | capacity | dense ms/iter | paged ms/iter | paged / dense |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = []
    for rows in [int(x) for x in a.rows.split(",")]:
        reqs = [RowRequest(prompt=tuple(int(t) for t in rng.integers(1, cfg.vocab_size, a.prompt)), max_new=a.new)
                for _ in range(rows)]
        ms = {}
        for name, kw in (("dense", {}), ("paged", dict(kv_pages=rows * a.capacity // a.page_size + 8,
                                                         page_size=a.page_size, prefix_cache=False))):
            eng = Slots(target, draft, slots=rows, capacity=a.capacity, steps=4, step_buckets=None, **kw)
            eng.run(reqs)                                       # compiles
            best = None
            for _ in range(2):
                t0 = time.perf_counter()
                res = eng.run(reqs)
                dt = time.perf_counter() - t0
                iters = max(len(r.acceptance_lengths) for r in res)
                best = dt / iters if best is None else min(best, dt / iters)
            ms[name] = best * 1e3
        print(f"| {rows} | {a.prompt} | {a.capacity} | {ms['dense']:.2f} | {ms['paged']:.2f} | "
              f"{ms['paged'] / ms['dense']:.2f} |", flush=True)
        out.append(dict(rows=rows, prompt=a.prompt, capacity=a.capacity, **ms))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
