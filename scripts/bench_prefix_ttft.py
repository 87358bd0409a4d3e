"""Time to first token on a prefix-cache hit against a miss (issue 56): a multi-turn chat whose
requests share a 2k-token system prompt, on the paged slot engine.

Each request is the shared system prompt + its own short user turn (distinct random tokens), sent one
at a time, so its TTFT is the engine's own (admission, prefill, the step that reads the first token
out). Three runs of the same requests, same process, same engine settings:

  miss      --prefix-cache off: every request prefills its whole prompt
  hit       prefix cache on, the system prompt cached by a first request (not timed): each request
            prefills only what its cached full pages do not cover
  cold-on   prefix cache on, every request with a system prompt of its own (nothing to hit: the
            cache's bookkeeping cost on a miss)

Prints the TTFT p50 / p90 of each and hit / miss (goal <= 0.2). Greedy; the embedded pair by default
(random-token prompts: acceptance is not the point here).

    python scripts/bench_prefix_ttft.py                  # 2,048-token system prompt, 16 requests
    python scripts/bench_prefix_ttft.py --smoke
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target dir (default: the embedded pair)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--system", type=int, default=2048, help="tokens of the shared system prompt")
    ap.add_argument("--turn", type=int, default=48, help="tokens of each request's own turn")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.system, a.turn, a.requests, a.new = 256, 16, 4, 4
    import dflash_jax as dj
    from dflash_jax.serving.engine import Request, SlotEngine

    if a.target is None:
        from dflash_jax.assets import default_pair
        a.target, a.draft = default_pair()
    target = dj.load_target(a.target, dtype=a.dtype)
    draft = dj.load_draft(a.draft, target=target, dtype=a.dtype)
    V = target.config.vocab_size
    rng = np.random.default_rng(0)
    capacity = 1 << (a.system + a.turn + a.new + 64).bit_length()
    pages = 4 * capacity // a.page_size
    system = tuple(int(t) for t in rng.integers(16, V, a.system))
    turns = [tuple(int(t) for t in rng.integers(16, V, a.turn)) for _ in range(a.requests + 2)]

    def run(prefix_cache: bool, own_system: bool):
        engine = SlotEngine(target, draft, slots=2, capacity=capacity, kv_pages=pages, page_size=a.page_size,
                            prefix_cache=prefix_cache, max_queue=4)
        try:
            def one(prompt):
                t0 = time.perf_counter()
                h = engine.submit(Request(prompt=prompt, max_tokens=a.new, ignore_eos=True))
                first = None
                for ev in h.events():
                    if first is None and hasattr(ev, "ids"):
                        first = time.perf_counter() - t0
                return first
            for t in turns[-2:]:                 # compile (and, for the hit run, cache the system prompt)
                one(system + t)
            if own_system:
                prompts = [tuple(int(x) for x in rng.integers(16, V, a.system)) + t for t in turns[:a.requests]]
            else:
                prompts = [system + t for t in turns[:a.requests]]
            ttft = [one(p) for p in prompts]
            stats = engine.stats()
        finally:
            engine.shutdown(timeout=5)
        return np.asarray(ttft) * 1e3, stats

    res = {}
    for name, pc, own in (("miss (prefix cache off)", False, False), ("hit", True, False),
                          ("cold, cache on", True, True)):
        ms, _ = run(pc, own)
        res[name] = dict(p50=float(np.percentile(ms, 50)), p90=float(np.percentile(ms, 90)))
    print(f"device {jax.devices()[0].device_kind}, {a.dtype}, system prompt {a.system} tokens + {a.turn}-token turns, "
          f"{a.requests} requests one at a time, pages of {a.page_size}, capacity {capacity}")
    print("| run | TTFT p50 ms | TTFT p90 ms | p50 / miss p50 |")
    print("| --- | --- | --- | --- |")
    miss = res["miss (prefix cache off)"]["p50"]
    for name, r in res.items():
        print(f"| {name} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p50'] / miss:.3f} |")
    print(f"hit / miss p50: {res['hit']['p50'] / miss:.3f} (goal <= 0.2)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=res, device=jax.devices()[0].device_kind, args=vars(a)), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
