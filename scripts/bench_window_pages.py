"""Pages behind a sliding draft window (issue 56): window pages held, and requests in flight at a fixed
KV budget, with the windowed draft layers in a pool of their own (`pages.WindowPages`) against the
shared-table design (every draft layer's context in the main pages, the window only a mask).

Counts, not speed: a host-only simulation driving the engine's real allocators (`pages.PageAllocator`,
`pages.WindowPages`) with the slot engine's rules (dflash_jax.serving.slots.Slots):
  admit   the queue head, if its prompt + one step's reach fits (main pages, and window pages from
          first_kept(prompt) on; the prompt's pages behind its window best effort), and a slot is free
  grow    before each step, every running row to known + (in flight + K) x S + S (in flight: the step
          dispatched ahead, K iterations, pipeline 1); window rows trimmed to first_kept(known) first;
          short: preempt the newest running request (its pages released, full final ones published)
  commit  each iteration commits 1 + accepted tokens per row (accepted ~ a geometric draw, mean tau - 1,
          at most S - 1), rows end at their output length
Requests arrive at t = 0 (a saturated server), random prompt tokens (no prefix shared), lengths
log-uniform or uniform on [--min-prompt, --max-prompt] and [--min-output, --max-output].

KV budget in bytes: --budget-gib of target + draft K/V at the geometry of --target-layers / --kv-heads /
--head-dim (default Qwen3-8B: 36 layers, 8 kv heads of 128, bf16) and a draft of --draft-layers of which
--sliding-layers slide with --window (default 5 and 4, W 2048: a DFlash2-style draft).
  shared  one pool: pages = budget / (target + every draft layer) bytes per page
  window  window pool: --window-pages, default the engine's rule (pages.WindowPages.default_pages:
          slots x one row's live window + one row's every page), at most the shared pages; the main
          pool: the rest of the budget / (target + full draft layers) bytes per page

  python scripts/bench_window_pages.py                     # the default run (seconds)
  python scripts/bench_window_pages.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))

from dflash_jax.serving.pages import PageAllocator, WindowPages, pages_for  # noqa: E402


def draw(dist: str, n: int, lo: int, hi: int, rng) -> np.ndarray:
    if dist == "loguniform":
        x = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n))
    else:
        x = rng.uniform(lo, hi + 1, n)
    return np.clip(np.floor(x).astype(np.int64), lo, hi)


class Sim:
    def __init__(self, args, reqs, *, main_pages: int, window_pages: int | None, seed: int):
        self.a = args
        self.S, self.K, self.ps = args.block, args.steps, args.page_size
        self.capacity = pages_for(args.max_prompt + args.max_output + self.S, self.ps) * self.ps
        self.ppr = self.capacity // self.ps
        self.main = PageAllocator(main_pages, self.ps)
        self.win = None if window_pages is None else WindowPages(
            window_pages, self.ps, window=args.window, block_size=self.S, slots=args.slots, pages_per_row=self.ppr)
        self.rng = np.random.default_rng(seed)
        self.queue = collections.deque({"tokens": list(p), "stop": len(p) + n, "id": i} for i, (p, n) in enumerate(reqs))
        self.running: list[dict] = []
        self.free = list(range(args.slots))[::-1]
        self.finished = self.preemptions = self.steps = 0
        self.inflight, self.win_used, self.main_used = [], [], []
        self.draft_window_equiv = []   # what the shared design's sliding layers held: every page of every row

    def reach(self, r, extra):
        return min(r["known"] + (r["inflight"] + extra) * self.S + self.S, r["stop"] + self.S, self.capacity)

    def admit(self) -> bool:
        q = self.queue[0]
        tokens = q["tokens"]
        if not self.free or len(tokens) + 1 > self.capacity - self.S:
            return False
        pages, hit = self.main.match(tokens, count=False)
        wrow = []
        if self.win:
            pages, hit, wrow = self.win.match(self.main, tokens, pages, hit)
        reach = min(len(tokens) + self.K * self.S + self.S, q["stop"] + self.S, self.capacity)
        n = pages_for(reach, self.ps)
        new = self.main.allocate(max(0, n - len(pages)))
        row = None
        if new is not None and self.win:
            row = self.win.admit(wrow, len(tokens), n)
            if row is None:
                self.main.release(new)
                new = None
        if new is None:
            self.main.release(pages)
            if self.win:
                self.win.release_row(wrow)
            return False
        self.queue.popleft()
        slot = self.free.pop()
        r = dict(q, slot=slot, pages=pages + new, known=len(tokens), inflight=0)
        if self.win:
            self.win.start(slot, row)
        self.main.publish(tokens, r["pages"])
        if self.win:
            self.win.publish(slot, tokens)
            self.win.trim(slot, len(tokens))
        self.running.append(r)
        return True

    def release(self, r, requeue: bool):
        final = max(0, r["known"] - self.S)
        self.main.publish(r["tokens"][:final], r["pages"])
        self.main.release(r["pages"])
        if self.win:
            self.win.publish(r["slot"], r["tokens"][:final])
            self.win.release(r["slot"])
        self.free.append(r["slot"])
        self.running.remove(r)
        if requeue:   # resumes by recomputing what it delivered (its prompt + output so far)
            self.queue.appendleft({"tokens": r["tokens"], "stop": r["stop"], "id": r["id"]})
            self.preemptions += 1

    def give(self, r, positions) -> bool:
        need = pages_for(positions, self.ps) - len(r["pages"])
        wneed = 0 if self.win is None else pages_for(positions, self.ps) - len(self.win.rows[r["slot"]])
        if need > self.main.available() or (self.win and wneed > self.win.alloc.available()):
            return False
        if need > 0:
            r["pages"] += self.main.allocate(need)
        if self.win and wneed > 0:
            assert self.win.grow(r["slot"], pages_for(positions, self.ps))
        return True

    def step(self):
        self.steps += 1
        while self.queue and self.admit():
            pass
        if self.win:
            for r in self.running:
                self.win.trim(r["slot"], r["known"])
        for r in list(self.running):
            while r in self.running and not self.give(r, self.reach(r, self.K)):
                self.release(self.running[-1], requeue=True)     # the newest
        if self.queue:   # saturated: the number the budget decides
            self.inflight.append(len(self.running))
            self.main_used.append(self.main.used())
            self.draft_window_equiv.append(self.main.used())
            if self.win:
                self.win_used.append(self.win.used())
        # the step runs: pipeline 1, so the host reads the previous step's commits now
        for r in list(self.running):
            r["inflight"] = self.K
            for _ in range(self.K):
                acc = min(int(self.rng.geometric(1 / self.a.tau)) - 1, self.S - 1)
                n = min(1 + acc, r["stop"] - r["known"])
                r["tokens"] += [int(t) for t in self.rng.integers(1, 1000, n)]
                r["known"] += n
                if r["known"] >= r["stop"]:
                    break
            if r["known"] >= r["stop"]:
                r["inflight"] = 0
                self.release(r, requeue=False)
                self.finished += 1

    def run(self, total: int):
        t0 = time.perf_counter()
        while self.finished < total:
            self.step()
            if self.steps > 100_000:
                raise RuntimeError("no progress")
        self.main.check()
        assert self.main.used() == 0
        if self.win:
            self.win.check()
            assert self.win.used() == 0
        return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--target-layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--sliding-layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--window-pages", type=int, default=None, help="the window pool (default: the engine's rule)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="iterations per step (K)")
    ap.add_argument("--tau", type=float, default=4.0, help="mean tokens committed per iteration")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("-R", "--requests", type=int, default=300)
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=32768)
    ap.add_argument("--min-output", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=4096)
    ap.add_argument("--dist", choices=("loguniform", "uniform"), nargs="+", default=["loguniform", "uniform"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    per_layer = 2 * args.kv_heads * args.head_dim * args.dtype_bytes * args.page_size     # K and V, one page
    budget = int(args.budget_gib * 2**30)
    shared_pages = budget // (per_layer * (args.target_layers + args.draft_layers))
    main_page = per_layer * (args.target_layers + args.draft_layers - args.sliding_layers)
    window_page = per_layer * args.sliding_layers
    capacity = pages_for(args.max_prompt + args.max_output + args.block, args.page_size) * args.page_size
    wp = args.window_pages or WindowPages.default_pages(args.slots, args.window, args.block, args.page_size,
                                                        args.steps, capacity // args.page_size)
    wp = min(wp, shared_pages)
    main_pages = (budget - wp * window_page) // main_page
    print(f"# budget {args.budget_gib} GiB: shared design {shared_pages} pages of {per_layer * (args.target_layers + args.draft_layers)} B; "
          f"window design {main_pages} main pages of {main_page} B + {wp} window pages of {window_page} B")
    results = []
    for dist in args.dist:
        rng = np.random.default_rng([args.seed, ("loguniform", "uniform").index(dist)])
        plen = draw(dist, args.requests, args.min_prompt, args.max_prompt, rng)
        olen = draw(dist, args.requests, args.min_output, args.max_output, rng)
        reqs = [(tuple(int(t) for t in rng.integers(1, 1000, int(p))), int(o)) for p, o in zip(plen, olen)]
        row = {"dist": dist}
        for name, mp, w in (("shared", shared_pages, None), ("window", main_pages, wp)):
            sim = Sim(args, reqs, main_pages=mp, window_pages=w, seed=args.seed)
            secs = sim.run(len(reqs))
            inflight = float(np.mean(sim.inflight)) if sim.inflight else float("nan")
            res = dict(main_pages=mp - 1, window_pages=None if w is None else w - 1, inflight=inflight,
                       peak=int(max(sim.inflight, default=0)), preemptions=sim.preemptions, steps=sim.steps,
                       main_used=float(np.mean(sim.main_used)) if sim.main_used else float("nan"),
                       sliding_layers_pages_held=(float(np.mean(sim.win_used)) if w is not None
                                                  else float(np.mean(sim.main_used))) if sim.main_used else float("nan"),
                       sliding_layers_pages_peak=(sim.win.peak if w is not None else sim.main.used()),
                       seconds=secs)
            row[name] = res
            print(f"{dist:10s} {name:6s}: in flight while queued {inflight:6.2f} (peak {res['peak']}), "
                  f"main pages used {res['main_used']:.0f} / {mp - 1}, sliding layers' pages held "
                  f"{res['sliding_layers_pages_held']:.0f}" + ("" if w is None else f" / {w - 1} (peak {sim.win.peak})")
                  + f", {sim.preemptions} preemptions, {sim.steps} steps, {secs:.1f} s", flush=True)
        s, w = row["shared"], row["window"]
        row["inflight_ratio"] = w["inflight"] / s["inflight"]
        row["held_ratio"] = w["sliding_layers_pages_held"] / s["sliding_layers_pages_held"]
        print(f"{dist:10s} window / shared: requests in flight {row['inflight_ratio']:.3f}x, "
              f"sliding layers' pages held {row['held_ratio']:.3f}x")
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
