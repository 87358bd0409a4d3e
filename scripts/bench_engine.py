"""Offline throughput: the slot engine (continuous batching) against one-shot static batches, on
prompts with mixed output lengths.

Prompts: GSM8K questions (the copy bundled with dflash_jax.data), as token ids (the tokenizer's
when the target directory has one, else the question's bytes), max_new_tokens drawn uniformly in
[--min-new, --max-new] per prompt. Static batches: `--slots` prompts per generate call, run until
the batch's longest row ends (useful tokens = each row's own max_new). Engine: the same prompts
through Slots(slots=--slots), refilling slots as rows finish. Compiles are excluded (both warm up
first). Prints one table: tokens/s, wall time, speed-up; the engine's mean TTFT (from the run's
start: queueing included) and TPOT (per request, after its first token).

--steps, --pipeline, --insert-width and --step-buckets take comma lists: one engine row per
combination, so one command picks K (iterations per step) by measurement and compares step buckets
off and on (a step-bucket setting is off, auto, or row counts joined by '/': 1/2/4/8/16).

CPU, tiny random pair (seconds) or the embedded default pair:
  python scripts/bench_engine.py --tiny
  python scripts/bench_engine.py --default --prompts 32 --slots 8 --steps 2,4,8 --pipeline 0,1
H200, Qwen3-8B shapes, random weights (one command):
  python scripts/bench_engine.py --preset qwen3-8b --random-init --prompts 128 --slots 32 --steps 4 \
      --step-buckets off,auto
Trained pair: --model DIR --draft DIR [--dtype bfloat16].

--breakdown: instead, the engine's programs timed alone against generate's loop at the same
rows and context (ms per iteration, two lengths differenced so fixed costs cancel): the full-width
step, a step bucket of half the slots, that half run by the full-width step, and the insert
prefills of 1 and --insert-width requests.

--kv-pages off,auto: one engine row per KV cache, the fixed rows and a paged pool (issue 56) of the same
positions (auto), tokens compared across rows; with --trace each is traced, so the paged engine's
admissions and steps sit beside the fixed engine's on one device.

--trace DIR: after the table, one static run and one engine run (the last setting; every --kv-pages
row) again under jax.profiler (traces under DIR), and a table of where the device's time went: busy,
idle between program launches and inside programs (by program), per program's kernel time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def build(args):
    import dflash_jax as dj
    from dflash_jax.config import TargetConfig

    if args.tiny:
        cfg = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=args.tiny_layers,
                           num_heads=4, num_kv_heads=2, head_dim=16)
        target = dj.init_target(cfg, seed=0, dtype=args.dtype)
        draft = dj.init_draft(dj.DraftConfig.for_target(cfg, num_layers=1, block_size=args.block or 8), seed=1,
                              dtype=args.dtype)
        return target, draft, None
    if args.default:
        from dflash_jax.assets import default_pair
        pair = default_pair()
        if pair is None:
            sys.exit("this package ships no default pair")
        args.model, args.draft = pair
    if args.random_init:
        target = dj.init_target(args.preset, seed=0, dtype=args.dtype)
        draft = dj.init_draft(dj.DraftConfig.for_target(target.config, num_layers=5, block_size=args.block or 16),
                              seed=1, dtype=args.dtype)
        return target, draft, None
    target = dj.load_target(args.model, dtype=args.dtype)
    draft = None if args.draft == "none" else dj.load_draft(args.draft, target=target, dtype=args.dtype)
    tok = None
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # noqa: BLE001  (no tokenizer: byte prompts)
        pass
    return target, draft, tok


def prompts(args, vocab: int, tok):
    from dflash_jax.data import load_prompts

    rows = load_prompts("gsm8k", max_samples=args.prompts)
    out = []
    for r in rows:
        text = r["turns"][0]
        ids = tok.encode(text) if tok is not None else [b % vocab for b in text.encode()]
        out.append(ids[:args.max_prompt])
    while len(out) < args.prompts:          # fewer bundled rows than asked: repeat them
        out.append(out[len(out) % len(rows)])
    rng = np.random.RandomState(args.seed)
    max_new = rng.randint(args.min_new, args.max_new + 1, size=len(out)).tolist()
    return out, max_new


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random pair (CPU smoke run)")
    p.add_argument("--tiny-layers", type=int, default=4,
                   help="--tiny: the target's layers (default 4; the test suite's smoke run uses 1: less to trace "
                        "and compile in every program)")
    p.add_argument("--default", action="store_true", help="the embedded default pair (dflash_jax.assets)")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--random-init", action="store_true", help="random weights of --preset's shapes")
    p.add_argument("--model"), p.add_argument("--draft", default="none")
    p.add_argument("--dtype", default=None, help="default: float32 with --tiny, else bfloat16")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--steps", default="", help="iterations per engine step (comma list; default: offline_defaults)")
    p.add_argument("--pipeline", default="1", help="steps dispatched ahead of the one read (comma list)")
    p.add_argument("--insert-width", default="8", help="most requests per prefill (comma list)")
    p.add_argument("--step-buckets", default="auto",
                   help="step row buckets, comma list of settings: off, auto, or counts joined by / (1/2/4/8)")
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--refill-ahead", default="on", help="Slots.run refill_ahead: on, off or on,off")
    p.add_argument("--refill-min", default="", help="Slots.run refill_min: free slots a refill waits for (comma list; default: offline_defaults)")
    p.add_argument("--breakdown", action="store_true",
                   help="time the engine's step and insert programs against generate's loop instead")
    p.add_argument("--breakdown-rows", type=int, default=None,
                   help="--breakdown: the step bucket timed against generate at that many rows (default slots / 2); "
                        "with --trace, that bucket and generate at its rows are traced instead of the full width")
    p.add_argument("--kv-pages", default="off",
                   help="the engine's KV cache, a comma list (one engine row each): off (fixed rows), auto (a paged "
                        "pool of the fixed rows' positions: slots x capacity / page size + 1 pages) or a page count")
    p.add_argument("--page-size", type=int, default=16, help="positions per KV page (--kv-pages)")
    p.add_argument("--prefix-cache", choices=("on", "off"), default="off",
                   help="the paged engine's prefix cache (off: the random prompts share nothing)")
    p.add_argument("--trace", metavar="DIR", help="trace a static and an engine run into DIR and print the device timeline")
    p.add_argument("--verify-width", default="block",
                   help="block (default: the whole block, the engine's fixed-trip step), auto, or a width (0, 1, 3, 7, 15): "
                        "generate's verify_width and the engine's (the adaptive programs)")
    p.add_argument("--simulated-tau", type=float, default=None, metavar="TAU",
                   help="BENCHMARK ONLY: each row's acceptance drawn from a geometric survival profile at TAU "
                        "(adaptive programs: a --verify-width other than block); tables say SIMULATED ACCEPTANCE")
    args = p.parse_args(argv)
    if not (args.tiny or args.default or args.random_init or args.model):
        p.error("give --tiny, --default, --random-init (with --preset) or --model/--draft")
    if args.tiny_layers < 1:
        p.error(f"--tiny-layers must be >= 1, got {args.tiny_layers}")
    if not 1 <= args.min_new <= args.max_new:
        p.error(f"--min-new {args.min_new} must be in [1, --max-new {args.max_new}]")
    args.dtype = args.dtype or ("float32" if args.tiny or args.default else "bfloat16")
    vw = args.verify_width
    if vw not in ("block", "auto"):
        try:
            vw = int(vw)
        except ValueError:
            p.error(f"--verify-width: give block, auto or a width, got {vw!r}")
    args.verify_width = vw
    if args.simulated_tau is not None and vw == "block":
        p.error("--simulated-tau needs --verify-width auto or a width (only the adaptive programs simulate)")
    if args.simulated_tau is not None and args.breakdown:
        p.error("--breakdown counts iterations: it accepts nothing (tau 1) in the adaptive programs; drop --simulated-tau")
    from dflash_jax import loop, width
    if args.breakdown and vw != "block":
        # the adaptive programs accept no draft: every iteration verifies the width and commits one
        # token, so the two lengths differenced run exactly the iterations asked for
        profile = (0.0,) * ((args.block or 16) - 1)
    elif args.simulated_tau is not None:
        try:
            profile = width.geometric_profile(args.simulated_tau)
        except ValueError as e:
            p.error(f"--simulated-tau: {e}")
        print(f"[bench_engine] SIMULATED ACCEPTANCE: geometric survival at tau {args.simulated_tau} (block 16)",
              file=sys.stderr, flush=True)
    else:
        return run(p, args)
    with loop._simulated_acceptance(profile):
        return run(p, args)


def run(p, args) -> int:
    ints = lambda s: [int(x) for x in str(s).split(",") if x]             # noqa: E731
    steps, pipelines, widths = ints(args.steps), ints(args.pipeline), ints(args.insert_width)
    mins = ints(args.refill_min)
    kvs = []
    for x in args.kv_pages.split(","):
        if x in ("off", "auto") or (x.isdigit() and int(x) >= 2):
            kvs.append(x)
        else:
            p.error(f"--kv-pages: give off, auto or a page count >= 2 (comma list), got {x!r}")
    if args.page_size < 1:
        p.error(f"--page-size must be >= 1, got {args.page_size}")
    aheads = [{"on": True, "off": False}.get(x) for x in args.refill_ahead.split(",")]
    if None in aheads:
        p.error(f"--refill-ahead: give on, off or on,off, got {args.refill_ahead!r}")
    from dflash_jax.serving.slots import parse_step_buckets
    try:
        buckets = [parse_step_buckets(b.replace("/", ",")) for b in args.step_buckets.split(",")]
    except ValueError as e:
        p.error(f"--step-buckets: {e}")

    import jax

    from dflash_jax import generate, loop
    from dflash_jax.serving.slots import RowRequest, Slots, offline_defaults

    target, draft, tok = build(args)
    defaults = offline_defaults(jax.devices()[0].platform)
    steps, mins = steps or [defaults["steps"]], mins or [defaults["refill_min"]]
    ps, ns = prompts(args, target.config.vocab_size, tok)
    S = 1 if draft is None else (args.block or draft.config.block_size)
    _, C = loop.buckets(max(len(x) for x in ps), max(ns), S, None)
    if args.breakdown:
        return breakdown(args, target, draft, ps, S, steps[0], widths[0], buckets[0])
    print(f"[bench_engine] {jax.devices()[0].device_kind}: {len(ps)} prompts ({min(map(len, ps))}..{max(map(len, ps))} "
          f"tokens), max_new {args.min_new}..{args.max_new}, slots {args.slots}, capacity {C}, block {S}",
          file=sys.stderr, flush=True)

    # static batches: each call runs until its longest row
    batches = [list(range(i, min(i + args.slots, len(ps)))) for i in range(0, len(ps), args.slots)]
    kw = dict(capacity=C, block_size=S, verify_width=args.verify_width if draft is not None else "block")
    for b in batches:                           # warm-up: every program the timed run uses
        generate(target, draft, [ps[i] for i in b], max_new_tokens=max(ns[i] for i in b), **kw)
    t0 = time.perf_counter()
    useful = 0
    for b in batches:
        res = generate(target, draft, [ps[i] for i in b], max_new_tokens=max(ns[i] for i in b), **kw)
        useful += sum(min(len(t), ns[i]) for t, i in zip(res.tokens, b))
    static_s = time.perf_counter() - t0
    timelines = []
    if args.trace:
        timelines.append(("static batches", traced(args.trace, "static", lambda: [
            generate(target, draft, [ps[i] for i in b], max_new_tokens=max(ns[i] for i in b), **kw) for b in batches])))

    if args.simulated_tau is not None:
        print(f"SIMULATED ACCEPTANCE (geometric survival at tau {args.simulated_tau}), verify width {args.verify_width}")
    print(f"| run | tokens | wall s | tokens/s | speed-up | mean TTFT ms | mean TPOT ms | tau | compiles |")
    print(f"|---|---|---|---|---|---|---|---|---|")
    base = useful / static_s
    print(f"| static batches of {args.slots} | {useful} | {static_s:.2f} | {base:.1f} | 1.00x | | | | |", flush=True)
    reqs = [RowRequest(prompt=tuple(x), max_new=n, rng_row=i) for i, (x, n) in enumerate(zip(ps, ns))]
    first = None
    threads = []           # (engine row, its PipelineCounters, wall s): the thread table after the run table
    for K, W, sb, kv in ((K, W, sb, kv) for K in steps for W in widths for sb in buckets for kv in kvs):
        n0 = loop.compile_count()
        t0 = time.perf_counter()
        pages = None if kv == "off" else (args.slots * -(-C // args.page_size) + 1 if kv == "auto" else int(kv))
        eng = Slots(target, draft, slots=args.slots, capacity=C, block_size=S, steps=K,
                    insert_width=min(W, args.slots), step_buckets=sb, verify_width=engine_width(args, draft),
                    **({} if pages is None else dict(kv_pages=pages, page_size=args.page_size,
                                                     prefix_cache=args.prefix_cache == "on",
                                                     table_widths="full")))   # the server's: no compile in a run
        eng.warmup([len(x) for x in ps], ["greedy"])
        sb_name = "/".join(map(str, eng.step_buckets)) or "off"
        kv_name = "fixed rows" if pages is None else (f"paged {pages} pages of {args.page_size}"
                                                      f"{', prefix cache' if args.prefix_cache == 'on' else ''}")
        print(f"[bench_engine] engine K={K}, insert width {eng.insert_width}, step buckets {sb_name}, KV {kv_name}: "
              f"{loop.compile_count() - n0} programs compiled in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        for pipe, ahead, rmin in ((p_, a, m) for p_ in pipelines for a in aheads for m in mins):
            eng.run(reqs[:args.slots], pipeline=pipe)       # warm the host path
            n0 = loop.compile_count()
            eng.bucket_steps.clear()
            t0 = time.perf_counter()
            out = eng.run(reqs, pipeline=pipe, refill_ahead=ahead, refill_min=rmin)
            engine_s = time.perf_counter() - t0
            threads.append((f"K={K}, pipeline {pipe}, refill ahead {'on' if ahead else 'off'}, refill min {rmin}"
                            f"{'' if pages is None else ', KV ' + kv_name}", eng.last_run_counters, engine_s))
            tokens = sum(len(o.tokens) for o in out)
            times = eng.last_run_times
            ttft = np.mean([times[i][0] - t0 for i in range(len(out))])
            tpot = np.mean([(times[i][1] - times[i][0]) / max(1, len(out[i].tokens) - 1)
                            for i in range(len(out))])
            tau = np.mean([a for o in out for a in o.acceptance_lengths]) if draft is not None else 1.0
            first = first or [o.tokens for o in out]
            same = "" if [o.tokens for o in out] == first else (
                " (tokens DIFFER from the first engine row" + (": in bfloat16 a row's numerics depend on the program's "
                "batch; float32 must match)" if args.dtype == "bfloat16" else ")"))
            used = " ".join(f"{n}:{c}" for n, c in sorted(eng.bucket_steps.items()))
            print(f"| engine, K={K}, pipeline {pipe}, refill ahead {'on' if ahead else 'off'}, refill min {rmin}, insert width {eng.insert_width}, step buckets {sb_name}"
                  f"{'' if pages is None else ', KV ' + kv_name} "
                  f"(steps per rows {used}){same} | {tokens} | {engine_s:.2f} | {tokens / engine_s:.1f} | "
                  f"{(tokens / engine_s) / base:.2f}x | {ttft * 1e3:.1f} | {tpot * 1e3:.2f} | {tau:.2f} | "
                  f"{loop.compile_count() - n0} |", flush=True)
        if args.trace and (K, W, sb) == (steps[-1], widths[-1], buckets[-1]):    # (every --kv-pages row)
            timelines.append((f"engine K={K}, pipeline {pipe}, refill ahead {'on' if ahead else 'off'}, refill min {rmin}"
                              f"{'' if pages is None else ', KV ' + kv_name}",
                              traced(args.trace, f"engine_{kv}", lambda: eng.run(reqs, pipeline=pipe, refill_ahead=ahead,
                                                                            refill_min=rmin))))
        del eng                                 # its slot state before the next one's
    print(f"(TTFT from the run's start: all {len(ps)} requests arrive at t=0; TPOT per request after its "
          f"first token; compiles: during the timed run, must be 0)")
    print_threads(threads)
    if timelines:
        print_timelines(timelines)
    return 0


def print_threads(threads) -> None:
    """The driving thread of each engine row (Slots.run's PipelineCounters) in load_test's table."""
    from load_test import engine_shares, print_engine_table   # scripts/ is on sys.path
    print_engine_table([(name, engine_shares(c.steps, c.slot_steps, c.inserts, c.insert_dispatch_s, c.step_dispatch_s,
                                             c.read_wait_s, 0.0, wall=wall)) for name, c, wall in threads],
                       "engine row")


def engine_width(args, draft):
    """Slots' verify_width for --verify-width: None (the fixed-trip step) for block or no draft."""
    return None if draft is None or args.verify_width == "block" else args.verify_width


def traced(root: str, name: str, fn) -> dict:
    """fn() under jax.profiler into root/name; its device timeline (bench_gpu.trace_timeline)."""
    import os

    import jax
    from bench_gpu import _device_events, _find_trace, summarize_trace, trace_timeline   # scripts/ is on sys.path

    d = os.path.join(root, name)
    t0 = time.perf_counter()
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0          # no Python call events: a long run's trace stays small and quick
    with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=opts):
        jax.block_until_ready(fn())
    wall = time.perf_counter() - t0
    path = _find_trace(d)
    if path is None:
        raise RuntimeError(f"jax.profiler wrote no trace under {d}")
    loaded = _device_events(path)          # one read of a trace that may be hundreds of MB
    out = trace_timeline(path, loaded=loaded)
    out["wall_ms"], out["by_name"] = wall * 1e3, summarize_trace(path, loaded=loaded)["by_name"]
    out["path"] = os.path.relpath(path, root)
    return out


def print_timelines(timelines, top: int = 8) -> None:
    """The device timeline of each traced run: busy and idle, the largest idle gaps by the programs
    around them, and each program's kernel time."""
    print()
    print("| traced run | wall ms (traced) | device span ms | busy ms | idle ms | idle between programs ms | idle inside programs ms |")
    print("|---|---|---|---|---|---|---|")
    for label, t in timelines:
        between = sum(ms for k, (ms, _) in t["gaps"].items() if " -> " in k)
        print(f"| {label} | {t['wall_ms']:.1f} | {t['span_ms']:.1f} | {t['busy_ms']:.1f} | {t['idle_ms']:.1f} | "
              f"{between:.1f} | {t['idle_ms'] - between:.1f} |")
    for label, t in timelines:
        print(f"\n{label} ({t['source']}; trace under --trace DIR: {t['path']}):")
        print("| idle gap (program, or before -> after) | ms | gaps |")
        print("|---|---|---|")
        for k, (ms, c) in sorted(t["gaps"].items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"| {k} | {ms:.1f} | {c} |")
        print("| program | kernel ms | kernels |")
        print("|---|---|---|")
        for k, (ms, c) in sorted(t["busy_by_module"].items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"| {k} | {ms:.1f} | {c} |")


def breakdown(args, target, draft, ps, S, K, W, sb) -> int:
    """The engine's programs alone against generate's loop (see the module docstring)."""
    import jax

    from dflash_jax import generate, loop
    from dflash_jax.serving.slots import RowRequest, Slots

    B, L = args.slots, max(len(x) for x in ps)
    n1, n2 = 32, 32 + 32 * K                      # iterations: the same context range for both
    _, C = loop.buckets(L, n2 + 8 * K, S, None)
    P = ps[:B] + [ps[0]] * (B - len(ps[:B]))

    def per_iter(fn):
        fn(n1), fn(n2)                            # warm-up (compiles)
        t = [min(fn(n) for _ in range(2)) for n in (n1, n2)]
        return (t[1] - t[0]) / (n2 - n1) * 1e3

    def gen(rows):
        def fn(n):
            t0 = time.perf_counter()
            r = generate(target, draft, P[:rows], max_new_tokens=n + 1, capacity=C, block_size=S, stop_token_ids=[],
                         verify_width=args.verify_width if draft is not None else "block")
            assert r.num_iterations == n, (r.num_iterations, n)
            return time.perf_counter() - t0
        return fn

    eng = Slots(target, draft, slots=B, capacity=C, block_size=S, steps=K, insert_width=min(W, B), step_buckets=sb,
                verify_width=engine_width(args, draft))
    half = eng.step_bucket(args.breakdown_rows or B // 2)

    def step(rows, bucketed=True):
        def fn(n):
            for s in range(B):
                eng.release(s)
            eng.insert([(s, RowRequest(prompt=tuple(P[s]), max_new=C - L - S - 1)) for s in range(rows)])
            busy = list(range(rows)) if bucketed else None
            jax.block_until_ready(eng.step_async(busy))
            t0 = time.perf_counter()
            for _ in range(n // K):
                out = eng.step_async(busy)
            jax.block_until_ready(out)
            return time.perf_counter() - t0
        return fn

    def insert(w):
        reps = 8
        req = RowRequest(prompt=tuple(P[0]), max_new=8)
        eng.insert([(s, req) for s in range(w)])
        t0 = time.perf_counter()
        for _ in range(reps):
            out = eng.insert_async([(s, req) for s in range(w)])
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / reps * 1e3

    print(f"[bench_engine] breakdown on {jax.devices()[0].device_kind}: slots {B}, K {K}, capacity {C}, "
          f"prompt {L}, iterations {n1}..{n2}, verify width {args.verify_width}", file=sys.stderr, flush=True)
    g_full, g_half = per_iter(gen(B)), per_iter(gen(half))
    e_full, e_half, e_half_full = per_iter(step(B)), per_iter(step(half)), per_iter(step(half, bucketed=False))
    print("| program | rows | ms per iteration | / generate's |")
    print("|---|---|---|---|")
    print(f"| generate's loop | {B} | {g_full:.3f} | 1.00 |")
    print(f"| engine step, full width | {B} | {e_full:.3f} | {e_full / g_full:.2f} |")
    print(f"| generate's loop | {half} | {g_half:.3f} | 1.00 |")
    print(f"| engine step, bucket {half} | {half} | {e_half:.3f} | {e_half / g_half:.2f} |")
    print(f"| engine step, full width, {half} busy | {half} | {e_half_full:.3f} | {e_half_full / g_half:.2f} |")
    for w in sorted({1, eng.insert_width}):
        print(f"| insert (prefill of {w}, prompt bucket {eng.prompt_bucket(L)}) | {w} | {insert(w):.3f} ms per call | |")
    if args.trace:       # the same n2 iterations of generate's loop and of full-width steps, traced
        from bench_gpu import _family                       # kernel name, digits as '#'
        if args.breakdown_rows:      # the bucket against generate at its rows
            runs = [(f"generate's loop, {half} rows", traced(args.trace, "generate", lambda: gen(half)(n2))),
                    (f"engine step, bucket {half}", traced(args.trace, "step", lambda: step(half)(n2)))]
        else:
            runs = [("generate's loop", traced(args.trace, "generate", lambda: gen(B)(n2))),
                    ("engine step, full width", traced(args.trace, "step", lambda: step(B)(n2)))]
        print_timelines(runs)
        print(f"\nkernels whose time differs most, ms per iteration ({n2} iterations traced each):")
        print("| kernel (digits as #) | generate's loop | engine step | difference | launches per iteration (gen / step) |")
        print("|---|---|---|---|---|")
        fam = {}
        for j, (_, t) in enumerate(runs):
            for name, (us, c) in t["by_name"].items():
                f = fam.setdefault(_family(name), [0.0, 0.0, 0, 0])
                f[j] += us / 1e3 / n2
                f[2 + j] += c
        for k, (a, b, ca, cb) in sorted(fam.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:16]:
            print(f"| {k[:90]} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {ca / n2:.1f} / {cb / n2:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
