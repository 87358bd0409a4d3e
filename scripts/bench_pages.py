"""Requests in flight at a fixed KV budget: the paged slot engine against the fixed-slot one (issue 56's
measurement "goal >= 3x the fixed-slot engine" on a mixed-length workload).

Memory is the point, not speed: a tiny random target + draft (float32, CPU by default) stands in for a
real pair, because how many requests fit is decided by the KV cache's accounting, not by the weights.
Default pair: target 2 layers, hidden 64, 2 heads / 1 kv head of 8, vocab 256; draft 1 layer, block 8
(the XLA paged attention on CPU gathers every row's whole capacity each layer, so the head sizes set the
run's time, not what it measures: a page holds page_size token positions whatever their K/V's width).

Workload: R requests (seeded), all arriving at t = 0 (a saturated server), prompt and output lengths
drawn from one of two distributions (each reported):
  loguniform  log-uniform on [--min-prompt, --max-prompt] and [--min-output, --max-output]
              (heavy-tailed: most requests short, a few long; the shape of chat traces)
  uniform     uniform on the same ranges
Prompt tokens are random ids (so no prefix is shared: prefix hits stay ~0 and do not flatter the
paged engine); outputs are forced (ignore_eos, max_tokens = the drawn length).

KV budget: --budget token positions, each holding the target's AND the draft's K/V of one token.
  fixed   slots = budget // capacity, capacity = max prompt + max output + block (every slot reserves
          a whole row, whatever its request needs);
  paged   kv_pages = budget // page_size (page 0 of the pool is the allocator's dummy page, so one page
          fewer is usable), slots = --paged-slots (large, so pages are the binding limit); admission by
          pages, preemption of the newest request when a running one cannot grow.

Both engines get every request at once; a sampler thread reads eng.stats() every --sample-ms
(slots_busy, queue_depth, kv_pages_used) until all finish. Reported per engine: requests in flight,
mean over the whole run, mean while the queue is non-empty from the first engine step on (the
saturated phase: the number the budget decides; time-weighted, and over the engine steps sampled, on
which compile pauses weigh nothing) and peak; the paged/fixed ratio; preemptions; wall time; tokens/s;
KV pages used.

--fixed computed (the default): the fixed-slot engine is not run: with every request queued at t = 0
its in-flight count is exactly min(slots, requests not finished) — slots whenever the queue is
non-empty — so its saturated-phase mean and its peak are its slot count (no time or tokens/s then).
--fixed run runs it for real too (slow on CPU: it decodes the whole workload 'slots' rows at a time).

  python scripts/bench_pages.py                      # R=120, both distributions, budget 65,536
  python scripts/bench_pages.py --smoke              # tiny: seconds, the fixed engine run for real
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time

import numpy as np

DISTS = ("loguniform", "uniform")


@dataclasses.dataclass
class Run:
    engine: str
    dist: str
    slots: int
    capacity: int
    kv_pages_total: int = 0
    measured: bool = True
    mean_inflight: float = 0.0
    sat_inflight: float = 0.0            # mean while queue_depth > 0, from the first step on
    step_inflight: float = 0.0           # mean over the engine steps sampled while queued (compiles weigh nothing)
    peak_inflight: int = 0
    preemptions: int = 0
    wall_s: float = 0.0
    tokens: int = 0
    tok_s: float = 0.0
    mean_pages_used: float = 0.0
    sat_pages_used: float = 0.0
    prefix_hits_tokens: int = 0
    compiles: int = 0
    samples: int = 0
    sat_s: float = 0.0                   # seconds with a non-empty queue, from the first step on
    wrong_finishes: list = dataclasses.field(default_factory=list)   # requests that ended short of max_tokens


def build(args):
    import dflash_jax as dj
    from dflash_jax.config import TargetConfig

    cfg = TargetConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.head_dim)
    target = dj.init_target(cfg, seed=0, dtype="float32")
    draft = dj.init_draft(dj.DraftConfig.for_target(cfg, num_layers=1, block_size=args.block), seed=1,
                          dtype="float32")
    return target, draft


def draw(dist: str, n: int, lo: int, hi: int, rng) -> np.ndarray:
    if dist == "loguniform":
        x = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n))
    else:
        x = rng.uniform(lo, hi + 1, n)
    return np.clip(np.floor(x).astype(np.int64), lo, hi)


def workload(args, dist: str):
    """[(prompt tuple, max_tokens)], the same for both engines (seeded by --seed and the dist)."""
    rng = np.random.default_rng([args.seed, DISTS.index(dist)])
    plen = draw(dist, args.requests, args.min_prompt, args.max_prompt, rng)
    olen = draw(dist, args.requests, args.min_output, args.max_output, rng)
    return [(tuple(int(t) for t in rng.integers(1, args.vocab, int(p))), int(o)) for p, o in zip(plen, olen)]


def run_engine(args, target, draft, reqs, *, paged: bool, dist: str) -> Run:
    from dflash_jax.serving.engine import Finished, Request, SlotEngine, parse_step_buckets

    capacity = args.max_prompt + args.max_output + args.block
    if paged:
        slots, kw = args.paged_slots, dict(kv_pages=args.budget // args.page_size, page_size=args.page_size,
                                           prefix_cache=not args.no_prefix_cache)
    else:
        slots, kw = args.budget // capacity, {}
    eng = SlotEngine(target, draft, slots=slots, capacity=capacity, max_queue=len(reqs) + 1, eos_token_ids=(0,),
                     attention_impl="xla", steps=args.steps, insert_width=args.insert_width,
                     step_buckets=parse_step_buckets(args.step_buckets), **kw)
    samples = []                         # (t, busy, queue, pages used, steps dispatched)
    stop = threading.Event()

    def steps_so_far() -> int:
        for _ in range(5):
            try:
                return sum(eng.slots.bucket_steps.values())
            except RuntimeError:         # the engine thread added a bucket while we summed
                continue
        return -1

    def sample():
        shown = time.perf_counter()
        while not stop.is_set():
            st = eng.stats()
            now = time.perf_counter()
            samples.append((now, st.slots_busy, st.queue_depth, st.kv_pages_used, steps_so_far()))
            if args.progress_s and now - shown >= args.progress_s:
                shown = now
                print(f"#   {now - t0:6.1f} s: {st.slots_busy} running, {st.queue_depth} queued, "
                      f"{st.kv_pages_used} pages, "
                      f"{samples[-1][4]} steps, {st.preemptions} preemptions, {st.compiles} compiles", file=sys.stderr,
                      flush=True)
            stop.wait(args.sample_ms / 1e3)

    engine_name = "paged" if paged else "fixed-slot"
    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        handles = [eng.submit(Request(prompt=p, max_tokens=n, ignore_eos=True)) for p, n in reqs]
        sampler.start()
        tokens, short = 0, []
        for i, (h, (prompt, n)) in enumerate(zip(handles, reqs)):
            fin = [ev for ev in h.events() if isinstance(ev, Finished)][0]
            if fin.finish_reason != "length" or len(fin.tokens) != n:
                msg = (f"request {i} (prompt {len(prompt)} tokens, max_tokens {n}): finished {fin.finish_reason!r} "
                       f"with {len(fin.tokens)} tokens ({fin.error})")
                if args.strict:
                    raise RuntimeError(msg)
                print(f"# WRONG FINISH: {engine_name} {dist} {msg}", file=sys.stderr, flush=True)
                short.append(msg)
            tokens += len(fin.tokens)
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        final = eng.stats()
    finally:
        stop.set()
        eng.shutdown(timeout=30)
    if paged:
        eng.slots.pages.check()
        if eng.slots.pages.used():
            raise RuntimeError(f"{eng.slots.pages.used()} KV pages still referenced after every request ended")
    s = np.array(samples, dtype=np.float64)
    dt = np.diff(np.append(s[:, 0], t0 + wall))      # each sample holds until the next
    sat = (s[:, 2] > 0) & (s[:, 4] >= 1)             # queued, after the first step (not the first admissions)
    w = lambda col, m=None: float(np.average(s[m, col] if m is not None else s[:, col],
                                             weights=dt[m] if m is not None else dt)) if (m is None or m.any()) else 0.0
    by_step = {}                                      # the last sample at each step count, while queued
    for row in s:
        if row[4] >= 0 and row[2] > 0:
            by_step[int(row[4])] = row[1]
    r = Run(engine="paged" if paged else "fixed-slot", dist=dist, slots=slots, capacity=eng.slots.capacity,
            kv_pages_total=final.kv_pages_total, mean_inflight=w(1), sat_inflight=w(1, sat),
            step_inflight=float(np.mean(list(by_step.values()))) if by_step else 0.0,
            peak_inflight=int(s[:, 1].max()), preemptions=final.preemptions, wall_s=wall, tokens=tokens,
            tok_s=tokens / wall, mean_pages_used=w(3), sat_pages_used=w(3, sat),
            prefix_hits_tokens=final.prefix_hits_tokens, compiles=final.compiles, samples=len(s),
            sat_s=float(dt[sat].sum()), wrong_finishes=short)
    return r


def computed_fixed(args, reqs, dist: str) -> Run:
    capacity = args.max_prompt + args.max_output + args.block
    slots = args.budget // capacity
    n = min(slots, len(reqs))
    return Run(engine="fixed-slot", dist=dist, slots=slots, capacity=capacity, measured=False,
               sat_inflight=float(n) if len(reqs) > slots else 0.0, peak_inflight=n, step_inflight=float("nan"),
               mean_inflight=float("nan"), wall_s=float("nan"), tok_s=float("nan"),
               mean_pages_used=float("nan"), sat_pages_used=float("nan"))


def fmt(x, spec=".1f"):
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def table(args, rows: list[Run], wl: dict) -> str:
    out = []
    for dist in [d for d in DISTS if any(r.dist == d for r in rows)]:
        reqs = wl[dist]
        p = np.array([len(q) for q, _ in reqs])
        o = np.array([n for _, n in reqs])
        out.append(f"\n### {dist}: {len(reqs)} requests, prompts {p.min()}-{p.max()} (mean {p.mean():.0f}, median "
                   f"{np.median(p):.0f}), outputs {o.min()}-{o.max()} (mean {o.mean():.0f}, median {np.median(o):.0f})")
        out.append("| engine | slots | KV positions reserved | in flight: mean | mean while queued "
                   "| per step while queued "
                   "| peak | preemptions | wall s | tokens | tok/s (CPU) | KV pages used / total (mean, while queued) "
                   "| prefix hits (tokens) |")
        out.append("|" + " --- |" * 13)
        by = {r.engine: r for r in rows if r.dist == dist}
        for name in ("fixed-slot", "paged"):
            r = by.get(name)
            if r is None:
                continue
            if r.engine == "paged":
                n_pages = r.kv_pages_total + 1
                reserved = f"{n_pages * args.page_size:,} ({n_pages} pages of {args.page_size})"
                pages = (f"{fmt(r.mean_pages_used, '.0f')} / {r.kv_pages_total} "
                         f"({r.mean_pages_used / r.kv_pages_total:.0%}), "
                         f"{fmt(r.sat_pages_used, '.0f')} ({r.sat_pages_used / r.kv_pages_total:.0%})")
            else:
                reserved = f"{r.slots * r.capacity:,} ({r.slots} x {r.capacity})"
                pages = "- (rows)"
            tag = "" if r.measured else " (computed)"
            out.append(f"| {r.engine}{tag} | {r.slots} | {reserved} | {fmt(r.mean_inflight, '.2f')} | "
                       f"{fmt(r.sat_inflight, '.2f')} | {fmt(r.step_inflight, '.2f')} | {r.peak_inflight} | "
                       f"{r.preemptions if r.engine == 'paged' else '-'} | {fmt(r.wall_s)} | "
                       f"{r.tokens if r.measured else '-'} | {fmt(r.tok_s)} | {pages} | "
                       f"{r.prefix_hits_tokens if r.engine == 'paged' else '-'} |")
        for r in by.values():
            for msg in r.wrong_finishes:
                out.append(f"WRONG FINISH ({r.engine}): {msg}")
        if "fixed-slot" in by and "paged" in by:
            f, g = by["fixed-slot"], by["paged"]
            ratio_sat = g.sat_inflight / f.sat_inflight if f.sat_inflight else float("nan")
            ratio_peak = g.peak_inflight / f.peak_inflight
            ratio_step = g.step_inflight / f.sat_inflight if f.sat_inflight else float("nan")
            line = (f"paged / fixed-slot, requests in flight: {ratio_sat:.2f}x while the queue is non-empty "
                    f"({ratio_step:.2f}x per step), {ratio_peak:.2f}x at peak")
            if f.measured:
                line += f", {g.mean_inflight / f.mean_inflight:.2f}x over the whole run"
            line += f" (goal >= 3x: {'MET' if ratio_sat >= 3 else 'NOT MET'})"
            out.append(line)
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny run in seconds (prompts 4-64, outputs 4-32, 10 "
                   "requests, budget 256: 2 fixed slots; one layer, few programs, samples every 5 ms; the fixed "
                   "engine run for real)")
    p.add_argument("--requests", "-R", type=int, default=120,
                   help="requests per distribution (default 120: ~10 min on a 2-core CPU host; 200 took 19 min)")
    p.add_argument("--dists", default="loguniform,uniform", help="comma list of " + ", ".join(DISTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=65536, help="KV token positions (target + draft K/V each)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--paged-slots", type=int, default=96, help="the paged engine's slots (large: pages bind)")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--block", type=int, default=8, help="the draft's block size")
    p.add_argument("--steps", type=int, default=4, help="iterations per engine step")
    p.add_argument("--layers", type=int, default=2, help="target layers")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=8,
                   help="(heads 2, kv heads 1, head_dim 8: the XLA paged attention on CPU gathers every row's whole "
                        "capacity, so these set the run's time, not what it measures)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--fixed", choices=("computed", "run"), default=None,
                   help="the fixed-slot engine: computed (its slot count while queued; default) or run")
    p.add_argument("--insert-width", type=int, default=1,
                   help="prefills batched at most (default 1: the same prefill work on CPU, a quarter of the insert "
                        "programs to compile; the engine's own default is 8)")
    p.add_argument("--step-buckets", default="auto", help="the engine's step buckets: auto, off or 1,2,4,...")
    p.add_argument("--strict", action="store_true", help="stop at the first request that ends short of max_tokens "
                   "(default: report it and go on)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--progress-s", type=float, default=30.0, help="a progress line on stderr this often (0: none)")
    p.add_argument("--json", help="write the rows here as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests = min(args.requests, 10)
        args.min_prompt, args.max_prompt, args.min_output, args.max_output = 4, 64, 4, 32
        args.budget, args.paged_slots, args.layers = 256, 8, 1
        args.insert_width, args.step_buckets = 1, "off"
        args.sample_ms = min(args.sample_ms, 5.0)
        args.strict = True
        args.fixed = args.fixed or "run"
    args.fixed = args.fixed or "computed"
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]
    bad = [d for d in dists if d not in DISTS]
    if bad:
        p.error(f"unknown distribution {bad[0]!r}; known: {', '.join(DISTS)}")
    capacity = args.max_prompt + args.max_output + args.block
    if args.budget // capacity < 1:
        p.error(f"--budget {args.budget} holds no fixed slot of capacity {capacity}")

    import subprocess

    import jax
    t_start = time.perf_counter()
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "dflash_jax"], cwd=here, capture_output=True,
                               text=True).stdout.strip()
        rev = f"{rev}{' + uncommitted dflash_jax changes' if dirty else ''}" if rev else "unknown"
    except OSError:
        rev = "unknown"
    target, draft = build(args)
    print(f"# bench_pages: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), {os.cpu_count()} CPU cores; "
          f"target {args.layers} layers hidden {args.hidden} heads {args.heads} kv heads {args.kv_heads} "
          f"head_dim {args.head_dim} vocab {args.vocab}, draft 1 layer "
          f"block {args.block}, float32, attention xla, steps {args.steps}")
    print(f"# KV budget {args.budget:,} token positions (target + draft K/V each); capacity {capacity} = "
          f"{args.max_prompt} + {args.max_output} + {args.block}; fixed-slot: {args.budget // capacity} slots "
          f"({'run' if args.fixed == 'run' else 'computed: its slot count while the queue is non-empty'}); "
          f"paged: {args.budget // args.page_size} pages of {args.page_size}, {args.paged_slots} slots, "
          f"prefix cache {'off' if args.no_prefix_cache else 'on'}; seed {args.seed}; commit {rev}", flush=True)
    rows, wl = [], {}
    for dist in dists:
        reqs = wl[dist] = workload(args, dist)
        if args.fixed == "run":
            rows.append(run_engine(args, target, draft, reqs, paged=False, dist=dist))
        else:
            rows.append(computed_fixed(args, reqs, dist))
        rows.append(run_engine(args, target, draft, reqs, paged=True, dist=dist))
        r = rows[-1]
        print(f"# {dist}: paged done in {r.wall_s:.1f} s ({r.samples} samples, {r.compiles} compiles so far, "
              f"{r.sat_s:.1f} s with a queue)", flush=True)
    print(table(args, rows, wl))
    print(f"\n# total {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
