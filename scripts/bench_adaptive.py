#!/usr/bin/env python
"""Adaptive verify width (issue 37): tokens/s of plain decoding, fixed block 16 and "auto" per batch.

    python scripts/bench_adaptive.py --out DIR --budget-s 400    # H200: Qwen3-8B shapes, random bf16
    python scripts/bench_adaptive.py --smoke                     # tiny shapes on CPU: proves it runs
    JAX_PLATFORMS=cpu python scripts/bench_adaptive.py --cpu-pair      # the embedded demo pair on CPU
    JAX_PLATFORMS=cpu python scripts/bench_adaptive.py --compile-only  # compile seconds, no weights

GPU mode: a random bf16 Qwen3-8B target (--preset: another TargetConfig preset, e.g. the MoE
qwen3-coder-30b-a3b at --taus 8.09) and a z-lab-shaped 5-layer draft (scripts/bench_gpu.py's
Settings), prompt 256, SIMULATED ACCEPTANCE: every row's accepted drafts are drawn from a geometric
survival profile s_p = r^(p+1) (r solved so 1 + sum s_p = tau; dflash_jax.width.geometric_profile),
at tau 4.24 (MT-Bench) and 6.54 (GSM8K) at block 16, so random weights pay every real cost at a
realistic tau (benchmark only: loop._simulated_acceptance, no user path reaches it). One compiled
program per batch (widths 0, 3, 15: width.program_widths) serves all three columns (the verify width
is a traced value): "plain" there is W = 0 (forced, so it retires at once: plain steps in the
adaptive program, no draft context; loop.run), measured once per batch, "fixed 16" W = 15, "auto" the loop's
choice from the costs it profiled; --fixed-widths 3,15 adds a column per forced width. "true plain" is
decoding without a draft (its own program), for --true-plain-batches only, after its batch's
adaptive rows. Each row also gives its in-loop ms per iteration (the N1/N2 difference over the
iteration difference: compare with the profiled costs) and auto's iterations by width. tokens/s = (tokens of an N2 run - tokens of an
N1 run) / (time difference): steady state, prefill and the auto warm-up cancel. (An auto call
starts from its program's last call's statistics, loop.width_history: every timed run follows an
untimed one, so none has a warm-up.)

Batches run in the order --batches gives, else in priority order (64, 1, 8, 32, 128). Programs compile ONE at a time, in that order, in
one background thread, so batch k+1's program compiles while batch k is measured (a pool of four
concurrent compiles was much slower per program: docs/perf-log.md, session 24). The run stops starting new work
when --budget-s is near, prints each row as it is measured and the table of what it has; JSON to
--out after every row (a killed run keeps its rows; SIGTERM prints the table).

CPU pair mode: the embedded demo pair (dflash_jax.assets, real acceptance, float32), B = 1, a few
GSM8K / HumanEval prompts: plain (no draft), W = 0, W = 15 and auto, tokens/s over whole runs in
interleaved rounds, and one step of plain vs W = 0 by the difference of two run lengths. Auto's
first, untimed call learns; the timed ones start from what the previous call ended with (the warm
start a library user's repeated calls get).

Compile-only mode: lower + compile (abstract parameters, no weights) of the one-width program and the
adaptive ones at the GPU mode's shapes, one at a time: wall and CPU seconds, ratios.
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

PRIORITY = (64, 1, 8, 32, 128)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def width_mix(acceptance_lengths, ws) -> dict:
    """Iterations of a call counted by the narrowest width of `ws` that covers the most tokens any
    row produced in that iteration (a plain step makes 1, a W-wide one at most W + 1): the widths
    the loop ran as seen from its output. A lower bound of the wide widths (an iteration whose rows
    all accepted few counts as narrower), exact where many rows make one likely to go far (B >= 8)."""
    n = max((len(r) for r in acceptance_lengths), default=0)
    out = {w: 0 for w in ws}
    for j in range(n):
        m = max(r[j] for r in acceptance_lengths if len(r) > j)
        out[min(w for w in ws if w + 1 >= m)] += 1
    return out


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
    s = Settings(a.smoke, a.preset)
    s.block = 16
    tcfg = s.target_config()
    dcfg = s.draft_config(tcfg)
    batches = [int(b) for b in a.batches.split(",")] if a.batches else (
        [1, 2, 4] if a.smoke else list(PRIORITY))
    # --batches runs in the order given (a call puts its most wanted batch first); else PRIORITY's
    order = batches if a.batches else [b for b in PRIORITY if b in batches] + [b for b in batches if b not in PRIORITY]
    taus = [float(t) for t in a.taus.split(",")]
    prompt = a.prompt_len or (32 if a.smoke else 256)
    n1, n2 = (4, 20) if a.smoke else (a.n1, a.n2)
    cap = -(-(prompt + n2 + 2 * s.block + 8) // 512) * 512
    ws = width.program_widths(16, per_row_cost=jax.default_backend() == "cpu")   # as loop.make_static's
    fixed = [int(w) for w in a.fixed_widths.split(",") if w]
    bad = [w for w in fixed if w not in ws or w == 0]
    if bad:
        raise SystemExit(f"--fixed-widths {bad}: not a non-zero width of the program {ws}")
    run.R["settings"] = dict(fixed_widths=fixed, preset=a.preset if not a.smoke else "tiny", block=16, prompt=prompt, n1=n1, n2=n2,
                             capacity=cap, taus=taus, reps=a.reps, batches=order, widths=ws,
                             true_plain_batches=a.true_plain_batches,
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
        t1, t2, tok, taus_seen, its, mix = [], [], None, [], [], []
        # a first run of a program is slower (buffers, first launches), and an auto program's
        # first call profiles its widths: one untimed call first
        gen(b, d, n1, **kw)
        for _ in range(a.reps):
            r1, r2 = gen(b, d, n1, **kw), gen(b, d, n2, **kw)
            t1.append(r1.run_time_s)
            t2.append(r2.run_time_s)
            tok = r2.num_new_tokens - r1.num_new_tokens
            taus_seen.append(r2.mean_tau)
            its.append(r2.num_iterations - r1.num_iterations)
            mix.append(width_mix(r2.acceptance_lengths, ws))
        dt = statistics.median(t2) - statistics.median(t1)
        it = statistics.median(its)
        out = dict(tok_s=tok / dt if dt > 0 else float("nan"), tokens=tok, dt_s=dt, mean_tau=statistics.median(taus_seen),
                   iterations=it, ms_per_iter=1e3 * dt / it if it > 0 else float("nan"), width_mix=mix[-1])
        log(f"  {key}: {out['tok_s']:.1f} tok/s (tau {out['mean_tau']:.2f}; {out['ms_per_iter']:.3f} ms an iteration "
            f"over {it} iterations; iterations by widest accepted run: {out['width_mix']})")
        return out

    sim0 = width.geometric_profile(taus[0])
    import concurrent.futures as cf
    with loop._simulated_acceptance(sim0):
        # ONE compile at a time (a single background thread, in priority order: the adaptive
        # program of each batch, then the true-plain ones), so the next batch's program compiles
        # while this one is measured; a pool of four concurrent compiles took 228-252 s per program,
        # 3x as long
        def compile_one(b, dfl):
            # the simulation context is module-wide: the outer one covers this thread (only its
            # being on matters to the compile key; the main thread's tau contexts nest inside it)
            if elapsed() > a.budget_s - 10:
                raise TimeoutError("budget spent before this compile started")
            dt = decode.precompile(target, draft if dfl else None, prompts[b], max_new_tokens=n2,
                                   capacity=cap, block_size=16 if dfl else None, seed=0,
                                   **({"verify_width": "auto"} if dfl else {}))
            log(f"compiled B={b} {'adaptive ' + str(ws) if dfl else 'plain'} in {dt:.1f}s")
            run.R.setdefault("compile_s", {})[f"B{b}_{'adaptive' if dfl else 'plain'}"] = dt
            return dt
        tp = [int(x) for x in a.true_plain_batches.split(",") if x] if a.true_plain_batches else []
        # each batch's true-plain program right after its adaptive one (a budget that runs out then
        # still has plain decoding next to the batches it measured)
        plan = [(b, dfl) for b in order for dfl in ((True, False) if b in tp else (True,))]
        ex = cf.ThreadPoolExecutor(max_workers=1)
        futs = {}
        if a.compile_ahead:
            futs = {it: ex.submit(compile_one, *it) for it in plan}

        def ready(b, dfl) -> bool:
            f = futs.get((b, dfl))
            try:
                if f is None:        # --no-compile-ahead: compile now, in this thread
                    compile_one(b, dfl)
                else:
                    f.result(timeout=max(1.0, a.budget_s - elapsed() - 5))
                return True
            except (cf.TimeoutError, TimeoutError):
                run.R["skipped"].append(f"B{b}_{'adaptive' if dfl else 'plain'} (not compiled within the budget)")
            except Exception as e:   # noqa: BLE001
                run.R["errors"][f"compile_B{b}_{dfl}"] = f"{type(e).__name__}: {e}"[:400]
                log(f"compile B={b} failed: {type(e).__name__}: {str(e)[:300]}")
            return False

        def measure(row, key, name, b, d, guess_s, **kw):
            try:
                r = rate(key, b, d, guess_s, **kw)
            except Exception as e:   # noqa: BLE001
                run.R["errors"][key] = f"{type(e).__name__}: {e}"[:400]
                log(f"  {key} failed: {traceback.format_exc()[-600:]}")
                r = None
            if r is not None:
                row[name] = r
                guess[b] = max(3.0, (1 + 2 * a.reps + 1) * r["dt_s"] * (n1 + n2) / max(n2 - n1, 1) + 2)
                run.save()
            return r
        guess = {}
        for b in order:
            row = run.R["rows"].setdefault(str(b), {})
            if not ready(b, True):
                continue
            g0 = 20.0 if not a.smoke else 2.0
            # W = 0 accepts nothing at any tau: measured once per batch
            measure(row, f"B{b}_plain_w0", "plain_w0", b, draft, guess.get(b, g0), verify_width=0)
            for tau in taus:
                with loop._simulated_acceptance(width.geometric_profile(tau)):
                    for name, vw in [(f"fixed{w + 1}", w) for w in fixed] + [("auto", "auto")]:
                        measure(row, f"B{b}_tau{tau}_{name}", f"tau{tau}_{name}", b, draft, guess.get(b, g0),
                                verify_width=vw)
            st_costs = [(k, v) for k, v in loop.WIDTH_COSTS.items() if k.batch == b and k.simulate]
            if st_costs:
                costs = st_costs[-1][1]
                run.R["costs_ms"][str(b)] = [round(1000 * float(c), 3) for c in costs]
                for tau in taus:
                    e = np.concatenate([[1.0], 1.0 + np.cumsum(width.geometric_profile(tau))])   # E(W)
                    score = [e[w] / costs[i] for i, w in enumerate(ws)]
                    row[f"tau{tau}_predicted_W"] = ws[int(np.argmax(score))]
                    # what choose() scores for a one-shot batch (its slowest row) with N2 tokens left:
                    # statistics of many iterations at full width drawn from the profile
                    sv = np.asarray(width.geometric_profile(tau), np.float32)
                    reach = np.concatenate([[1.0], sv[:-1]]) * 1e4
                    st = np.stack([reach, sv * 1e4])
                    bt = np.asarray(width.batch_tokens(st, ws, n2, b))
                    row[f"tau{tau}_batch_rule"] = dict(tokens=[round(float(x), 3) for x in bt],
                                                       W=ws[int(np.argmax(bt / np.asarray(costs)))])
            run.save()
            if b in tp and ready(b, False):   # true plain (no draft), after the batch's adaptive rows
                measure(row, f"B{b}_true_plain", "true_plain", b, None, guess.get(b, 20.0))
        ex.shutdown(wait=False, cancel_futures=True)
    table(run, order, taus)


# ------------------------------------------------------------------------------------- compile only
def compile_mode(run: Run):
    """Lower + compile (no weights: abstract parameters) the one-width program ("block") and the
    adaptive programs (the default width set, and every width of widths_for) at the GPU mode's
    shapes, one at a time; seconds and ratios to the one-width program."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from bench_gpu import Settings
    from dflash_jax import init_draft, init_target, loop, width
    from dflash_jax.kernel_config import KernelConfig
    a = run.args
    s = Settings(a.smoke, a.preset)
    s.block = 16
    tcfg = s.target_config()
    dcfg = s.draft_config(tcfg)
    tdef, tst = nnx.split(nnx.eval_shape(lambda: init_target(tcfg, seed=0, dtype="bfloat16")))
    ddef, dst = nnx.split(nnx.eval_shape(lambda: init_draft(dcfg, seed=0, dtype="bfloat16")))
    prompt = a.prompt_len or (32 if a.smoke else 256)
    cap = -(-(prompt + (20 if a.smoke else a.n2) + 2 * s.block + 8) // 512) * 512
    kern = KernelConfig().resolve()
    variants = a.variants.split(",")
    batches = [int(b) for b in a.batches.split(",")] if a.batches else [4 if a.smoke else 64]
    run.R["settings"] = dict(preset="qwen3-8b" if not a.smoke else "tiny", prompt=prompt, capacity=cap,
                             backend=jax.default_backend(), cpus=os.cpu_count(), variants=variants)
    for b in batches:
        row = run.R["rows"].setdefault(str(b), {})
        for v in variants:
            st = loop.make_static(tdef, ddef, dcfg, block_size=16, batch=b, prompt_bucket=prompt, capacity=cap,
                                  mode="greedy", kernels=kern, adaptive=v != "block")
            if v == "all":
                st = dataclasses.replace(st, widths=width.widths_for(16))
            elif v not in ("block", "auto"):
                st = dataclasses.replace(st, widths=tuple(int(x) for x in v.split("-")))
            p = loop.Params(prompt=jnp.zeros((b, prompt), jnp.int32), prompt_lens=jnp.full((b,), prompt, jnp.int32),
                            active=jnp.ones((b,), bool),
                            **loop.row_settings([dict(max_new=a.n2, temperature=0.0, top_k=0, top_p=1.0, stop_ids=[],
                                                      seed=0, rng_row=i) for i in range(b)]),
                            **loop.width_params(st, "auto"))
            c0, t0 = time.process_time(), time.perf_counter()
            low = jax.jit(loop.run, static_argnums=(0,)).lower(st, tst, dst, p)
            t1 = time.perf_counter()
            low.compile()
            t2, c2 = time.perf_counter(), time.process_time()
            # CPU seconds (every thread of this process): robust to a host shared with other work
            row[v] = dict(widths=st.widths, lower_s=t1 - t0, compile_s=t2 - t1, total_s=t2 - t0, cpu_s=c2 - c0)
            base = row.get("block", {})
            log(f"B={b} {v} widths={st.widths}: lower {t1 - t0:.1f}s compile {t2 - t1:.1f}s, CPU {c2 - c0:.1f}s"
                + (f" ({(t2 - t0) / base['total_s']:.2f}x the one-width program's wall, "
                   f"{(c2 - c0) / base['cpu_s']:.2f}x its CPU)" if base else ""))
            run.save()


def table(run: Run, order, taus):
    rows = run.R["rows"]
    fixed = run.R["settings"].get("fixed_widths", [15])
    print("\nSIMULATED ACCEPTANCE (geometric survival s_p = r^(p+1) fitted to tau at block 16); tokens/s, "
          "ratio to plain (W = 0 of the same program, measured once per B);\n"
          "true plain = no draft (its own program; only for --true-plain-batches); fixed N = verify width "
          "N - 1 forced; best = the best fixed width (W = 0 included)")
    fcols = [f"fixed{w + 1}" for w in fixed]
    head = f"{'B':>4} {'tau':>5} | {'plain W0':>9} " + " ".join(f"{c:>9}" for c in fcols) + \
        f" {'auto':>9} | {'auto/pl':>7} {'best':>7} {'auto/best':>9} | {'true plain':>10} {'auto/true':>9} | pred W"
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for b in sorted(order):
        row = rows.get(str(b), {})
        for tau in taus:
            g = lambda k: row.get(f"tau{tau}_{k}", {}).get("tok_s", nan)   # noqa: E731
            p0, au = row.get("plain_w0", {}).get("tok_s", nan), g("auto")
            fx = {c: g(c) for c in fcols}
            cand = {"fixed1": p0, **fx}
            best = max((k for k in cand if cand[k] == cand[k]), key=lambda k: cand[k], default=None)
            bv = cand[best] if best else nan
            tp = row.get("true_plain", {}).get("tok_s", nan)
            pb = row.get(f"tau{tau}_batch_rule", {}).get("W", "-")
            print(f"{b:>4} {tau:>5} | {p0:9.1f} " + " ".join(f"{fx[c]:9.1f}" for c in fcols) +
                  f" {au:9.1f} | {au / p0:7.2f} {(best or '-'):>7} {au / bv:9.3f} | {tp:10.1f} {au / tp:9.2f} | "
                  f"E {row.get(f'tau{tau}_predicted_W', '-')}, batch {pb}")
    print("\nin-loop ms per iteration (time difference / iteration difference of the N1 and N2 runs) and "
          "auto's iterations by width (widest accepted run; B >= 8 exact):")
    for b in sorted(order):
        row = rows.get(str(b), {})
        for k, v in sorted(row.items()):
            if isinstance(v, dict) and "ms_per_iter" in v:
                print(f"  B={b} {k:20s} {v['ms_per_iter']:8.3f} ms x {v['iterations']} its  tau {v['mean_tau']:.2f}"
                      + (f"  mix {v['width_mix']}" if k.endswith("auto") else ""))
    if run.R["costs_ms"]:
        ws = run.R["settings"].get("widths", "?")
        print(f"\nmeasured iteration cost (ms) at W = {ws} (the auto program's own profile):")
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
    cols = (("plain", None, {}), ("w0", draft, dict(verify_width=0)), ("fixed16", draft, dict(verify_width=15)),
            ("auto", draft, dict(verify_width="auto")))
    cols += tuple((f"w{w}", draft, dict(verify_width=w)) for w in (int(x) for x in a.cpu_widths.split(",") if x))
    gen = lambda d, p, n, kw, stop=stop: decode.generate(target, d, [p], max_new_tokens=n,   # noqa: E731
                                                         stop_token_ids=stop, **kw)
    for name, d, kw in cols:    # compile (and profile auto's widths) before any timing
        gen(d, prompts[0], max_new, kw)
    # rounds interleave the columns (a shared host's load hits them alike); a column's time is its
    # fastest round over all prompts
    secs = {c[0]: [] for c in cols}
    res = {}
    for rnd in range(a.cpu_rounds):
        if not run.fits(f"round {rnd}", 10.0):
            break
        for name, d, kw in cols:
            out = [gen(d, p, max_new, kw) for p in prompts]
            secs[name].append(sum(r.run_time_s for r in out))
            toks = sum(r.num_new_tokens for r in out)
            best = min(secs[name])
            res[name] = dict(tok_s=toks / best, tokens=toks, run_s=best, rounds=len(secs[name]),
                             mean_tau=statistics.mean(r.mean_tau for r in out))
        log(f"round {rnd}: " + ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in res.items()))
        run.R["rows"] = res
        run.save()
    # one step of plain and of W = 0 by the difference of a short and a long run (no stop token)
    n1, n2 = (4, 12) if a.smoke else (8, 72)
    step = {}
    for rnd in range(a.cpu_rounds):
        for name, d, kw in cols[:2]:
            r1, r2 = gen(d, prompts[0], n1, kw, []), gen(d, prompts[0], n2, kw, [])
            ms = 1000 * (r2.run_time_s - r1.run_time_s) / max(r2.num_iterations - r1.num_iterations, 1)
            step[name] = min(step.get(name, float("inf")), ms)
    run.R["step_ms"] = step
    print("\nCPU, embedded demo pair, float32, B = 1 (real acceptance): tokens/s (fastest of "
          f"{a.cpu_rounds} interleaved rounds)")
    base = res.get("plain", {}).get("tok_s", float("nan"))
    for k, v in res.items():
        print(f"  {k:8s} {v['tok_s']:8.1f} tok/s  {v['tok_s'] / base:5.2f}x plain  tau {v['mean_tau']:.2f}")
    if len(step) == 2:
        print(f"one step (difference of {n1}- and {n2}-token runs, fastest of {a.cpu_rounds}): plain "
              f"{step['plain']:.2f} ms, W = 0 of the adaptive program {step['w0']:.2f} ms "
              f"({step['w0'] / step['plain']:.2f} plain steps)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--cpu-pair", action="store_true", help="the embedded demo pair on CPU (real acceptance)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON ($OUT)")
    ap.add_argument("--json", default="bench_adaptive.json")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting measurements past this")
    ap.add_argument("--batches", default="", metavar="64,1,8,32,128")
    ap.add_argument("--preset", default="qwen3-8b", help="the target's shapes (TargetConfig.preset; e.g. "
                    "qwen3-coder-30b-a3b, the MoE issue's, at --taus 8.09)")
    ap.add_argument("--taus", default="4.24,6.54")
    ap.add_argument("--fixed-widths", default="15", metavar="3,15",
                    help="verify widths forced at each tau beside auto (columns 'fixed W+1'; widths of the program)")
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-compile-ahead", dest="compile_ahead", action="store_false",
                    help="compile each program in the main thread when its batch comes (default: one background "
                         "thread compiles the next program while this one is measured; never two at once)")
    ap.add_argument("--true-plain-batches", default="64,1", metavar="B,B",
                    help="batches that also run true plain decoding (no draft, its own program), after every "
                         "adaptive row; '' for none")
    ap.add_argument("--compile-only", action="store_true",
                    help="lower + compile only (abstract weights): the one-width vs the adaptive programs")
    ap.add_argument("--variants", default="block,auto,all", help="--compile-only: programs to compile: block "
                    "(one width), auto (the default width set), all (every width), or widths as 0-3-15")
    ap.add_argument("--cpu-prompts", type=int, default=2, help="prompts per dataset in --cpu-pair")
    ap.add_argument("--cpu-new", type=int, default=128)
    ap.add_argument("--cpu-rounds", type=int, default=3, help="interleaved rounds in --cpu-pair")
    ap.add_argument("--cpu-widths", default="", metavar="3,7", help="--cpu-pair: fixed verify widths timed "
                    "beside the default columns (each its own program)")
    args = ap.parse_args()
    run = Run(args)

    def on_term(*_):
        log("SIGTERM: the table of what was measured")
        if not args.cpu_pair and not args.compile_only:
            table(run, [int(b) for b in run.R["rows"]], [float(t) for t in args.taus.split(",")])
        run.save()
        os._exit(124)
    signal.signal(signal.SIGTERM, on_term)
    try:
        cpu_pair_mode(run) if args.cpu_pair else (compile_mode(run) if args.compile_only else gpu_mode(run))
    finally:
        run.save()
        log("done")


if __name__ == "__main__":
    main()
