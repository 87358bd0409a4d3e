#!/usr/bin/env python
"""Adaptive verify width (issue 37): tokens/s of plain decoding, fixed block 16 and "auto" per batch.

    python scripts/bench_adaptive.py --out DIR              # H200: Qwen3-8B shapes, random bf16 weights
    python scripts/bench_adaptive.py --smoke                # tiny shapes on CPU: proves it runs
    JAX_PLATFORMS=cpu python scripts/bench_adaptive.py --cpu-pair   # the embedded demo pair on CPU

GPU mode: a random bf16 Qwen3-8B target and a z-lab-shaped 5-layer draft (scripts/bench_gpu.py's
Settings), prompt 256, SIMULATED ACCEPTANCE: every row's accepted drafts are drawn from a geometric
survival profile s_p = r^(p+1) (r solved so 1 + sum s_p = tau; dflash_jax.width.geometric_profile),
at tau 4.24 (MT-Bench) and 6.54 (GSM8K) at block 16, so random weights pay every real cost at a
realistic tau (benchmark only: loop._simulated_acceptance, no user path reaches it). One compiled
program per batch serves all three columns (the verify width is a traced value): "plain" there is
W = 0 (no draft pass; the draft context is still written), "fixed" W = 15, "auto" the loop's choice
from the costs it profiled. "true plain" is decoding without a draft (its own program), when the
budget allows. tokens/s = (tokens of an N2 run - tokens of an N1 run) / (time difference): steady
state, prefill and the auto warm-up cancel.

Batches run in priority order (64, 1, 32, 128, 8: the issue's goals first) and the run stops
starting new measurements when --budget-s is near; the table prints what it has. JSON to --out.

CPU pair mode: the embedded demo pair (dflash_jax.assets, real acceptance, float32), B = 1, a few
GSM8K / HumanEval prompts: plain (no draft) vs verify width 15 vs auto, tokens/s over the whole runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback

T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for d in (REPO, HERE):
    if d not in sys.path:
        sys.path.insert(0, d)

PRIORITY = (64, 1, 32, 128, 8)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


class Run:
    def __init__(self, args):
        self.args = args
        self.R = {"mode": "cpu-pair" if args.cpu_pair else ("smoke" if args.smoke else "gpu"), "rows": {},
                  "errors": {}, "skipped": [], "costs_ms": {}, "settings": {}}

    def save(self):
        out = self.args.out
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        self.R["elapsed_s"] = elapsed()
        with open(os.path.join(out, self.args.json), "w") as f:
            json.dump(self.R, f, indent=1, default=str)

    def fits(self, what: str, est_s: float) -> bool:
        left = self.args.budget_s - elapsed()
        if est_s > left:
            log(f"SKIP {what}: needs ~{est_s:.0f}s, {left:.0f}s left")
            self.R["skipped"].append(what)
            return False
        return True


# ------------------------------------------------------------------------------------------ GPU mode
def gpu_mode(run: Run):
    import jax
    import numpy as np
    from bench_gpu import Settings
    from dflash_jax import decode, init_draft, init_target, loop, width
    a = run.args
    s = Settings(a.smoke)
    s.block = 16
    tcfg = s.target_config()
    dcfg = s.draft_config(tcfg)
    batches = [int(b) for b in a.batches.split(",")] if a.batches else (
        [1, 2, 4] if a.smoke else list(PRIORITY))
    order = [b for b in PRIORITY if b in batches] + [b for b in batches if b not in PRIORITY]
    taus = [float(t) for t in a.taus.split(",")]
    prompt = a.prompt_len or (32 if a.smoke else 256)
    n1, n2 = (4, 20) if a.smoke else (a.n1, a.n2)
    cap = -(-(prompt + n2 + 2 * s.block + 8) // 512) * 512
    run.R["settings"] = dict(preset="qwen3-8b" if not a.smoke else "tiny", block=16, prompt=prompt, n1=n1, n2=n2,
                             capacity=cap, taus=taus, reps=a.reps, batches=order,
                             profiles={t: width.geometric_profile(t) for t in taus},
                             acceptance="simulated (geometric survival, r^(p+1))")
    t = time.perf_counter()
    target = init_target(tcfg, seed=0, dtype="bfloat16")
    draft = init_draft(dcfg, seed=0, dtype="bfloat16")
    jax.block_until_ready(jax.tree.leaves(target) + jax.tree.leaves(draft))
    log(f"models built in {time.perf_counter() - t:.1f}s on {jax.devices()[0]}")
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, min(tcfg.vocab_size - 2, 150000), size=(b, prompt)).tolist() for b in batches}

    def gen(b, d, n, **kw):
        return decode.generate(target, d, prompts[b], max_new_tokens=n, capacity=cap, seed=0,
                               block_size=16 if d is not None else None, **kw)

    def rate(key, b, d, guess_s, **kw) -> dict | None:
        """Tokens/s by the N1/N2 difference (median of reps)."""
        if not run.fits(key, guess_s):
            return None
        t1, t2, tok, taus_seen = [], [], None, []
        if kw.get("verify_width") == "auto":
            gen(b, d, n1, **kw)   # the first call of an auto program profiles its widths
        for _ in range(a.reps):
            r1, r2 = gen(b, d, n1, **kw), gen(b, d, n2, **kw)
            t1.append(r1.run_time_s)
            t2.append(r2.run_time_s)
            tok = r2.num_new_tokens - r1.num_new_tokens
            taus_seen.append(r2.mean_tau)
        dt = statistics.median(t2) - statistics.median(t1)
        out = dict(tok_s=tok / dt if dt > 0 else float("nan"), tokens=tok, dt_s=dt, mean_tau=statistics.median(taus_seen))
        log(f"  {key}: {out['tok_s']:.1f} tok/s (tau {out['mean_tau']:.2f})")
        return out

    sim0 = width.geometric_profile(taus[0])
    import concurrent.futures as cf
    with loop._simulated_acceptance(sim0):
        # compile in the background, in priority order (one adaptive program per batch, then the
        # true-plain ones), while the main thread measures what is compiled
        def compile_one(b, dfl):
            # the simulation context is module-wide: the outer one covers these threads (only its
            # being on matters to the compile key; the main thread's tau contexts nest inside it)
            dt = decode.precompile(target, draft if dfl else None, prompts[b], max_new_tokens=n2,
                                   capacity=cap, block_size=16 if dfl else None, seed=0)
            log(f"compiled B={b} {'adaptive' if dfl else 'plain'} in {dt:.1f}s")
            run.R.setdefault("compile_s", {})[f"B{b}_{'adaptive' if dfl else 'plain'}"] = dt
            return dt
        plan = [(b, True) for b in order] + ([(b, False) for b in order] if a.true_plain else [])
        ex = cf.ThreadPoolExecutor(max_workers=max(1, a.compile_workers))
        futs = {it: ex.submit(compile_one, *it) for it in plan}

        def ready(b, dfl) -> bool:
            f = futs[(b, dfl)]
            try:
                f.result(timeout=max(1.0, a.budget_s - elapsed() - 20))
                return True
            except cf.TimeoutError:
                run.R["skipped"].append(f"B{b}_{'adaptive' if dfl else 'plain'} (not compiled within the budget)")
            except Exception as e:   # noqa: BLE001
                run.R["errors"][f"compile_B{b}_{dfl}"] = f"{type(e).__name__}: {e}"[:400]
                log(f"compile B={b} failed: {type(e).__name__}: {str(e)[:300]}")
            return False
        guess = {}
        for b in order:
            row = run.R["rows"].setdefault(str(b), {})
            if not ready(b, True):
                continue
            for tau in taus:
                with loop._simulated_acceptance(width.geometric_profile(tau)):
                    for name, vw in (("plain_w0", 0), ("fixed16", 15), ("auto", "auto")):
                        key = f"B{b}_tau{tau}_{name}"
                        try:
                            r = rate(key, b, draft, guess.get(b, 20.0 if not a.smoke else 2.0), verify_width=vw)
                        except Exception as e:   # noqa: BLE001
                            run.R["errors"][key] = f"{type(e).__name__}: {e}"[:400]
                            log(f"  {key} failed: {traceback.format_exc()[-600:]}")
                            r = None
                        if r is not None:
                            row[f"tau{tau}_{name}"] = r
                            guess[b] = max(5.0, (1 + 2 * a.reps + 1) * r["dt_s"] * (n1 + n2) / max(n2 - n1, 1) + 3)
                            run.save()
            st_costs = [(k, v) for k, v in loop._WIDTH_COSTS.items() if k.batch == b and k.simulate]
            if st_costs:
                costs = st_costs[-1][1]
                run.R["costs_ms"][str(b)] = [round(1000 * float(c), 3) for c in costs]
                for tau in taus:
                    e = np.concatenate([[1.0], 1.0 + np.cumsum(width.geometric_profile(tau))])   # E(W)
                    ws = width.widths_for(16)
                    score = [e[w] / costs[i] for i, w in enumerate(ws)]
                    row[f"tau{tau}_predicted_W"] = ws[int(np.argmax(score))]
            if a.true_plain and ready(b, False):
                try:
                    r = rate(f"B{b}_true_plain", b, None, guess.get(b, 20.0))
                    if r is not None:
                        row["true_plain"] = r
                except Exception as e:   # noqa: BLE001
                    run.R["errors"][f"B{b}_true_plain"] = f"{type(e).__name__}: {e}"[:400]
            run.save()
        ex.shutdown(wait=False, cancel_futures=True)
    table(run, order, taus)


def table(run: Run, order, taus):
    rows = run.R["rows"]
    print("\nSIMULATED ACCEPTANCE (geometric survival s_p = r^(p+1) fitted to tau at block 16); tokens/s, "
          "ratio to plain (W = 0 of the same program); true plain = no draft")
    head = f"{'B':>4} {'tau':>5} | {'plain W0':>9} {'fixed 16':>9} {'auto':>9} | {'fixed/pl':>8} {'auto/pl':>8} " \
           f"{'auto/fix':>8} | {'true plain':>10} {'auto/true':>9} | pred W"
    print(head)
    print("-" * len(head))
    for b in sorted(order):
        row = rows.get(str(b), {})
        for tau in taus:
            g = lambda k: row.get(f"tau{tau}_{k}", {}).get("tok_s", float("nan"))   # noqa: E731
            p0, f16, au = g("plain_w0"), g("fixed16"), g("auto")
            tp = row.get("true_plain", {}).get("tok_s", float("nan"))
            print(f"{b:>4} {tau:>5} | {p0:9.1f} {f16:9.1f} {au:9.1f} | {f16 / p0:8.2f} {au / p0:8.2f} {au / f16:8.2f} | "
                  f"{tp:10.1f} {au / tp:9.2f} | {row.get(f'tau{tau}_predicted_W', '-')}")
    if run.R["costs_ms"]:
        print("\nmeasured iteration cost (ms) at W = 0, 1, 3, 7, 15 (the auto program's own profile):")
        for b, c in sorted(run.R["costs_ms"].items(), key=lambda x: int(x[0])):
            print(f"  B={b}: {c}")
    if run.R["skipped"]:
        print("skipped (budget):", ", ".join(run.R["skipped"]))
    if run.R["errors"]:
        print("errors:", json.dumps(run.R["errors"], indent=1))


# ------------------------------------------------------------------------------------------ CPU pair
def cpu_pair_mode(run: Run):
    from transformers import AutoTokenizer
    import dflash_jax as dj
    from dflash_jax import decode
    from dflash_jax.assets import default_pair
    from dflash_jax.data import apply_chat_template, load_prompts
    a = run.args
    tdir, ddir = default_pair()
    target = dj.load_target(tdir, dtype="float32")
    draft = dj.load_draft(ddir, target=target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(tdir)
    n = 1 if a.smoke else a.cpu_prompts
    rows = load_prompts("gsm8k", None, n) + load_prompts("humaneval", None, n)
    prompts = [apply_chat_template(tok, r["turns"][0]) for r in rows]
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    max_new = 24 if a.smoke else a.cpu_new
    run.R["settings"] = dict(pair=os.path.basename(tdir), prompts=[r["id"] for r in rows], max_new=max_new,
                             acceptance="real (the demo pair, greedy)")
    res = {}
    for name, d, kw in (("plain", None, {}), ("fixed16", draft, dict(verify_width=15)), ("auto", draft, dict(verify_width="auto"))):
        if not run.fits(name, 5.0):
            break
        toks = secs = 0.0
        taus = []
        for p in prompts:
            decode.generate(target, d, [p], max_new_tokens=max_new, stop_token_ids=stop, **kw)   # compile, profile
            r = decode.generate(target, d, [p], max_new_tokens=max_new, stop_token_ids=stop, **kw)
            toks += r.num_new_tokens
            secs += r.run_time_s
            taus.append(r.mean_tau)
        res[name] = dict(tok_s=toks / secs, tokens=toks, run_s=secs, mean_tau=statistics.mean(taus))
        log(f"  {name}: {res[name]['tok_s']:.1f} tok/s, tau {res[name]['mean_tau']:.2f}")
        run.R["rows"] = res
        run.save()
    print("\nCPU, embedded demo pair, float32, B = 1 (real acceptance): tokens/s")
    base = res.get("plain", {}).get("tok_s", float("nan"))
    for k, v in res.items():
        print(f"  {k:8s} {v['tok_s']:8.1f} tok/s  {v['tok_s'] / base:5.2f}x plain  tau {v['mean_tau']:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--cpu-pair", action="store_true", help="the embedded demo pair on CPU (real acceptance)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON ($OUT)")
    ap.add_argument("--json", default="bench_adaptive.json")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting measurements past this")
    ap.add_argument("--batches", default="", metavar="64,1,32,128,8")
    ap.add_argument("--taus", default="4.24,6.54")
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--compile-workers", type=int, default=4)
    ap.add_argument("--no-true-plain", dest="true_plain", action="store_false")
    ap.add_argument("--cpu-prompts", type=int, default=2, help="prompts per dataset in --cpu-pair")
    ap.add_argument("--cpu-new", type=int, default=128)
    args = ap.parse_args()
    run = Run(args)

    def on_term(*_):
        log("SIGTERM: the table of what was measured")
        if not args.cpu_pair:
            table(run, [int(b) for b in run.R["rows"]], [float(t) for t in args.taus.split(",")])
        run.save()
        os._exit(124)
    signal.signal(signal.SIGTERM, on_term)
    try:
        cpu_pair_mode(run) if args.cpu_pair else gpu_mode(run)
    finally:
        run.save()
        log("done")


if __name__ == "__main__":
    main()
