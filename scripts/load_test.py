"""Load test of the OpenAI-compatible server (`python -m dflash_jax.serve`): a fixed number of
streamed /v1/completions requests at fixed concurrencies and at Poisson arrival rates, reporting
TTFT and TPOT p50/p99, output tokens/s, tau (tokens per draft-verify-accept iteration), errors and
the compiles the server did during each run (must be 0). Standard library only on the client side.

The server: started here on 127.0.0.1 (a free port) from the model flags below, or an existing one
with --url. Every request is greedy (temperature 0) with ignore_eos, so it runs to its max_tokens;
prompts are token ids (GSM8K questions through the model's tokenizer when it has one, the embedded
pair's when it serves, else random ids). --check compares every response with its one-shot
`dflash_jax.generate` output (batch of one, the server's capacity and block size; the models built
from the same flags in this process, after the server has stopped) and fails on any difference or
error: nothing lost.

  python scripts/load_test.py --requests 40 --concurrency 8 --check          # the embedded pair, CPU
  python scripts/load_test.py --preset qwen3-8b --random --compare-plain     # H200, Qwen3-8B shapes

--preset NAME --random serves random weights of that shape (and a random draft of the z-lab
shape; --compare-plain runs the same sweep again with --draft none) with the preset's workload:
`--preset qwen3-8b` = 96 requests a run (24 at concurrency 1), concurrency 1,8,32, Poisson rates
8,24 requests/s, prompts of 65..128 tokens, max_tokens 64..128, 32 slots, capacity 1024.
Prints one table per server; --json PATH writes every run's numbers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    "qwen3-8b": dict(requests=96, requests_at_1=24, concurrency="1,8,32", rates="8,24", prompt_len="65,128",
                     max_tokens="64,128", slots=32, capacity=1024, engine_steps="auto"),
}


# ----------------------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(args, draft_none: bool = False) -> list[str]:
    """The `python -m dflash_jax.serve` flags (model and engine) for this run."""
    out = []
    if args.random:
        out += ["--random-init", args.random]
    elif args.model:
        out += ["--model", args.model]
    if args.draft or draft_none:
        out += ["--draft", "none" if draft_none else args.draft]
    out += ["--dtype", args.dtype, "--attention", args.attention, "--slots", str(args.slots),
            "--capacity", str(args.capacity), "--engine-steps", str(args.engine_steps),
            "--max-queue", str(max(64, args.requests)),
            "--warmup-prompt-len", f"{args.prompt_lo}:{args.prompt_hi}"]
    if args.block_size:
        out += ["--block-size", str(args.block_size)]
    if args.insert_width:
        out += ["--insert-width", str(args.insert_width)]
    if args.step_buckets:
        out += ["--step-buckets", args.step_buckets]
    if args.mesh:
        out += ["--mesh", args.mesh]
    return out + list(args.server_arg or [])


class Server:
    """`python -m dflash_jax.serve` in a subprocess on 127.0.0.1; stopped with SIGTERM. cmd: another
    command taking serve's --host / --port instead (the interpreter's arguments: a script and its
    flags), which must answer /health as the server does."""

    def __init__(self, argv: list[str], startup_timeout: float, log_path: str | None, simulated_tau=None,
                 cmd: list[str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        # benchmark only: scripts/serve_simulated.py (the server with a simulated acceptance)
        if cmd is None:
            cmd = (["-m", "dflash_jax.serve"] if simulated_tau is None else
                   [os.path.join(REPO, "scripts", "serve_simulated.py"), "--tau", str(simulated_tau)])
        self.proc = subprocess.Popen([sys.executable, *cmd, *argv, "--host", "127.0.0.1",
                                      "--port", str(self.port)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode} before it was ready"
                                 + (f" (log: {log_path})" if log_path else "; give --server-log PATH to see why"))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > startup_timeout:
                self.stop()
                raise SystemExit(f"the server was not ready after {startup_timeout:.0f} s")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        self.returncode = self.proc.returncode
        print(f"[load_test] server exited with {self.returncode}", file=sys.stderr, flush=True)


def _get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


def _metrics(url: str) -> dict[str, float]:
    """One scrape of the server's /metrics: {sample name with its labels: value} (empty if unreachable)."""
    try:
        text = _get(url, "/metrics")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def _compiles(m: dict) -> float | None:
    """The server's dflash_compiles gauge from a scrape (None when it has no such metric)."""
    return m.get("dflash_compiles")


ENGINE_COUNTERS = ("dflash_engine_steps_total", "dflash_engine_slot_steps_total", "dflash_engine_inserts_total",
                   'dflash_engine_seconds_total{phase="insert_dispatch"}',
                   'dflash_engine_seconds_total{phase="step_dispatch"}',
                   'dflash_engine_seconds_total{phase="read_wait"}', 'dflash_engine_seconds_total{phase="idle"}')


def _engine_counters(m: dict) -> dict | None:
    """The slot engine's thread counters from a scrape (None: a server without them)."""
    found = {k: m[k] for k in ENGINE_COUNTERS if k in m}
    return found if len(found) == len(ENGINE_COUNTERS) else None


def engine_summary(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """What the engine thread did during a run, from two scrapes: steps, the wall time per step,
    the busy rows a step ran, prefills, and the fractions of the run's wall it spent dispatching
    programs, waiting in reads for the device, idle, and on the rest (host bookkeeping). A
    device-bound server waits in reads; a host-bound one dispatches and books through the step."""
    if not before or not after or wall <= 0:
        return None
    d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
    return engine_shares(*(d[k] for k in ENGINE_COUNTERS), wall=wall)


def engine_shares(steps, slot_steps, inserts, insert_dispatch_s, step_dispatch_s, read_wait_s, idle_s, *,
                  wall: float) -> dict:
    """Steps, ms and rows a step, prefills, and each phase's share of `wall` (the rest: host
    bookkeeping) from a PipelineCounters' fields over a run (the served delta, or bench_engine's run)."""
    phases = dict(insert_dispatch_frac=insert_dispatch_s / wall, step_dispatch_frac=step_dispatch_s / wall,
                  read_wait_frac=read_wait_s / wall, idle_frac=idle_s / wall)
    return dict(steps=int(steps), step_ms=wall * 1e3 / steps if steps else None,
                rows_per_step=slot_steps / steps if steps else None, inserts=int(inserts), **phases,
                host_frac=max(0.0, 1.0 - sum(phases.values())))


def print_engine_table(rows: list[tuple[str, dict]], what: str = "run") -> None:
    """The engine thread's table: (label, engine_shares dict) per run."""
    if not rows:
        return
    print(f"\nthe engine thread over each {what} (slots.PipelineCounters, as /metrics dflash_engine_*; fractions of "
          f"the wall):")
    print("| load | steps | ms / step | rows / step | prefills | insert dispatch | step dispatch | read wait (device) "
          "| idle | host rest |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, e in rows:
        ms = "-" if e["step_ms"] is None else f"{e['step_ms']:.2f}"
        rps = "-" if e["rows_per_step"] is None else f"{e['rows_per_step']:.1f}"
        print(f"| {label} | {e['steps']} | {ms} | {rps} | {e['inserts']} | {e['insert_dispatch_frac']:.1%} "
              f"| {e['step_dispatch_frac']:.1%} | {e['read_wait_frac']:.1%} | {e['idle_frac']:.1%} "
              f"| {e['host_frac']:.1%} |")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------- requests
def make_prompts(args, n: int) -> list[list[int]]:
    """n prompts of prompt_lo..prompt_hi token ids: GSM8K questions (each prompt starts at a
    question; a short one runs on into the next) through the tokenizer of --model, or of the
    embedded pair when it serves, else random ids below 1000 (valid for any vocabulary of the
    presets)."""
    rng = np.random.RandomState(args.seed)
    lengths = rng.randint(args.prompt_lo, args.prompt_hi + 1, size=n)
    model_dir = args.model
    if model_dir is None and args.random is None:
        try:
            from dflash_jax.assets import default_pair
        except ImportError:           # a slim copy of the package without its embedded pair: random ids
            default_pair = lambda: None  # noqa: E731
        model_dir = (default_pair() or (None,))[0]
    if not (model_dir and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))):
        return [rng.randint(0, 1000, size=int(m)).tolist() for m in lengths]
    from transformers import AutoTokenizer

    from dflash_jax.data import load_prompts
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = [tok.encode(r["turns"][0] + "\n") for r in load_prompts("gsm8k")]
    out = []
    for i, m in enumerate(lengths):
        ids, q = [], i
        while len(ids) < m:
            ids += questions[q % len(questions)]
            q += 1
        out.append(ids[:int(m)])
    return out


def one_request(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed completion: its tokens, send / first-token / end times, tau stats, error."""
    u = urllib.parse.urlparse(url)
    body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                           return_token_ids=True, stream=True)).encode()
    rec = dict(tokens=[], t_send=time.perf_counter(), t_first=None, t_end=None, error=None, iterations=0,
               tau=0.0, max_tokens=max_tokens)
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            rec["error"] = f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}"
            return rec
        done = False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                rec["error"] = ev["error"].get("message", "error event")
                continue
            for c in ev.get("choices", []):
                ids = c.get("token_ids") or []
                if ids and rec["t_first"] is None:
                    rec["t_first"] = time.perf_counter()
                rec["tokens"].extend(ids)
            if "dflash" in ev:
                rec["iterations"] = ev["dflash"].get("iterations", 0)
                rec["tau"] = ev["dflash"].get("mean_acceptance_length", 0.0)
        conn.close()
        if not done and rec["error"] is None:
            rec["error"] = "the stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001  (a failed request is counted, the run goes on)
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["t_end"] = time.perf_counter()
    if rec["error"] is None and len(rec["tokens"]) != max_tokens:
        rec["error"] = f"{len(rec['tokens'])} tokens, asked for {max_tokens}"
    return rec


def run_load(url, model, jobs, *, concurrency=None, rate=None, seed=0, timeout=600.0) -> tuple[list[dict], float]:
    """Every job (prompt, max_tokens) once: `concurrency` requests in flight at all times, or
    arrivals at a Poisson `rate` (requests/s). Returns (records in job order, wall seconds)."""
    recs: list[dict | None] = [None] * len(jobs)
    t0 = time.perf_counter()
    if concurrency is not None:
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(len(jobs)):
            todo.put(i)

        def worker():
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                recs[i] = one_request(url, model, *jobs[i], timeout)
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    else:
        gaps = np.random.RandomState(seed + 1).exponential(1.0 / rate, size=len(jobs))
        arrivals = np.cumsum(gaps) - gaps[0]

        def launch(i):
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            recs[i] = one_request(url, model, *jobs[i], timeout)
        threads = [threading.Thread(target=launch, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return recs, time.perf_counter() - t0


def summarize(recs: list[dict], wall: float) -> dict:
    ok = [r for r in recs if r["error"] is None]
    ttft = [r["t_first"] - r["t_send"] for r in ok if r["t_first"] is not None]
    tpot = [(r["t_end"] - r["t_first"]) / (len(r["tokens"]) - 1) for r in ok
            if r["t_first"] is not None and len(r["tokens"]) > 1]
    e2e = [r["t_end"] - r["t_send"] for r in ok]
    iters = sum(r["iterations"] for r in ok)
    produced = sum(r["tau"] * r["iterations"] for r in ok)
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")    # noqa: E731
    tokens = sum(len(r["tokens"]) for r in ok)
    return dict(requests=len(recs), errors=len(recs) - len(ok), wall_s=wall, output_tokens=tokens,
                tokens_per_s=tokens / wall if wall else 0.0, requests_per_s=len(ok) / wall if wall else 0.0,
                ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), tpot_p50_ms=pct(tpot, 50),
                tpot_p99_ms=pct(tpot, 99), e2e_p50_ms=pct(e2e, 50), tau=produced / iters if iters else 0.0,
                first_errors=[r["error"] for r in recs if r["error"] is not None][:3])


def print_table(title: str, runs: list[dict]) -> None:
    print(f"\n{title}")
    print("| load | requests | errors | tokens/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
          "TPOT p99 ms | tau | compiles |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['load']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
              f"| {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} "
              f"| {r['tau']:.2f} | {r['compiles']} |")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------- check
def check(args, argv: list[str], jobs, all_recs: list[list[dict]]) -> list[str]:
    """Each response's tokens against one-shot generate (batch of one) of the same models, built
    from the server's own flags. Returns the problems found (empty: nothing lost)."""
    from dflash_jax import generate
    from dflash_jax.serving import server as serve

    sp = serve.build_parser()
    a = sp.parse_args(argv)
    serve._check(sp, a)
    target, draft, _, _, _ = serve._load(sp, a)
    problems = []
    want = [generate(target, draft, [p], max_new_tokens=n, capacity=a.capacity, block_size=a.block_size,
                     attention_impl=a.attention, verify_width="block").tokens[0] for p, n in jobs]
    for recs in all_recs:
        for i, r in enumerate(recs):
            if r["error"] is not None:
                problems.append(f"request {i}: {r['error']}")
            elif r["tokens"] != want[i]:
                k = next((j for j, (x, y) in enumerate(zip(r["tokens"], want[i])) if x != y),
                         min(len(r["tokens"]), len(want[i])))
                problems.append(f"request {i}: differs from one-shot generate at token {k}")
    return problems


# ----------------------------------------------------------------------------------------- main
def _pair(s: str) -> tuple[int, int]:
    a, _, b = s.partition(",")
    return int(a), int(b or a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_argument_group("server (started here unless --url)")
    g.add_argument("--url", help="an already running server (no --check: its models are unknown here)")
    g.add_argument("--model", help="target directory or hub id (default: the embedded pair)")
    g.add_argument("--draft", help="draft directory / hub id, or none")
    g.add_argument("--preset", choices=sorted(PRESETS), help="the preset's workload (with --random: its shapes)")
    g.add_argument("--random", nargs="?", const="", default=None, metavar="SHAPE",
                   help="random weights of --preset's shape (or SHAPE)")
    g.add_argument("--compare-plain", action="store_true", help="run the sweep again with --draft none")
    g.add_argument("--dtype", default=None, help="default: float32 for the embedded pair, else bfloat16")
    g.add_argument("--attention", default="auto")
    g.add_argument("--block-size", type=int)
    g.add_argument("--mesh")
    g.add_argument("--slots", type=int, default=None, help="default 8 (preset: its own)")
    g.add_argument("--capacity", type=int, default=None, help="default 512 (preset: its own)")
    g.add_argument("--engine-steps", default=None, help="iterations per engine step: N or auto (the server's default)")
    g.add_argument("--insert-width", type=int, default=None, help="most arrivals per prefill (server default)")
    g.add_argument("--step-buckets", help="the server's --step-buckets (auto, none, 1,2,4,...; server default)")
    g.add_argument("--server-arg", action="append", help="one more flag for the server (repeatable)")
    g.add_argument("--server-log", help="write the server's output here (the plain server's: PATH.plain)")
    g.add_argument("--startup-timeout", type=float, default=900.0)
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=None, help="requests per run (default 200)")
    w.add_argument("--requests-at-1", type=int, default=None, help="requests of the concurrency-1 run")
    w.add_argument("--concurrency", default=None,
                   help="comma list of C (default 1,8,16,32), or CxN for C concurrent over N requests (default --requests)")
    w.add_argument("--rates", default=None, help="comma list of Poisson arrival rates, requests/s (default none)")
    w.add_argument("--prompt-len", default=None, help="MIN,MAX prompt tokens (default 16,60)")
    w.add_argument("--max-tokens", default=None, help="MIN,MAX per request, uniform (default 8,48)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--simulated-tau", type=float, default=None, metavar="TAU",
                   help="BENCHMARK ONLY: start the server through scripts/serve_simulated.py, whose adaptive "
                        "programs draw each row's acceptance at this tau (random weights at real shapes; a "
                        "--draft none server decodes plainly as ever); tables say SIMULATED ACCEPTANCE")
    p.add_argument("--check", action="store_true", help="compare every response with one-shot generate")
    p.add_argument("--json", help="write every run's numbers here")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    pre = PRESETS.get(args.preset, {})
    d = dict(requests=200, requests_at_1=None, concurrency="1,8,16,32", rates="", prompt_len="16,60",
             max_tokens="8,48", slots=8, capacity=512, engine_steps="auto", **{})
    for k, v in {**d, **pre}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.random == "":
        if not args.preset:
            p.error("--random needs --preset (its shapes) or --random SHAPE")
        args.random = args.preset
    if args.simulated_tau is not None and (args.url or args.check):
        p.error("--simulated-tau starts its own server and cannot --check (its acceptance is drawn)")
    if args.url and args.check:
        p.error("--check needs the server started here (its models are built from the same flags)")
    if not (args.url or args.random or args.model):
        from dflash_jax.assets import default_pair
        pair = default_pair()
        if pair is None:
            p.error("give --model, --random or --url (this package ships no default pair)")
        args.model, args.draft = pair[0], args.draft or pair[1]
    args.dtype = args.dtype or ("bfloat16" if args.random or args.preset else "float32")
    args.prompt_lo, args.prompt_hi = _pair(args.prompt_len)
    lo, hi = _pair(args.max_tokens)
    try:     # C, or CxN: concurrency C over N requests (a longer run beside a short one on one server)
        conc = [tuple(int(y) for y in x.split("x")) if "x" in x else (int(x),)
                for x in str(args.concurrency).split(",") if x]
    except ValueError:
        p.error(f"--concurrency: give a comma list of C or CxN (N requests), got {args.concurrency!r}")
    if any(len(c) not in (1, 2) or min(c) < 1 for c in conc):
        p.error(f"--concurrency: give a comma list of C or CxN with C, N >= 1, got {args.concurrency!r}")
    rates = [float(x) for x in str(args.rates).split(",") if x]
    if not 1 <= args.prompt_lo <= args.prompt_hi or not 1 <= lo <= hi or args.requests < 1:
        p.error("--prompt-len and --max-tokens need 1 <= MIN <= MAX, --requests >= 1")

    n_jobs = max([args.requests] + [c[1] for c in conc if len(c) == 2])
    prompts = make_prompts(args, n_jobs)
    rng = np.random.RandomState(args.seed + 2)
    jobs = [(pr, int(n)) for pr, n in zip(prompts, rng.randint(lo, hi + 1, size=n_jobs))]
    report = dict(settings={k: v for k, v in vars(args).items() if k != "server_arg"}, servers=[])
    failed = False
    for plain in ([False, True] if args.compare_plain else [False]):
        argv_s = server_argv(args, draft_none=plain)
        log = args.server_log and args.server_log + (".plain" if plain else "")
        server = None if args.url else Server(argv_s, args.startup_timeout, log,
                                              None if plain else args.simulated_tau)
        url = args.url or server.url
        no_draft = plain or (args.draft or "").lower() == "none"
        sim = "" if no_draft or args.simulated_tau is None else \
            f" (SIMULATED ACCEPTANCE: geometric survival at tau {args.simulated_tau})"
        title = ("plain decoding" if no_draft else "DFlash" + sim) + f": {args.requests} requests a run, prompts " \
                f"{args.prompt_lo}..{args.prompt_hi} tokens, max_tokens {lo}..{hi}, " \
                f"{args.slots} slots, capacity {args.capacity}, K {args.engine_steps}"
        runs, all_recs = [], []
        try:
            model = json.loads(_get(url, "/v1/models"))["data"][0]["id"]
            one_request(url, model, jobs[0][0], min(jobs[0][1], 4), args.timeout)     # warm the HTTP path
            loads = [("concurrency", c) for c in conc] + [("rate", (r,)) for r in rates]
            for kind, (v, *given) in loads:
                n = given[0] if given else (
                    args.requests_at_1 if kind == "concurrency" and v == 1 and args.requests_at_1 else args.requests)
                m0 = _metrics(url)
                recs, wall = run_load(url, model, jobs[:n], concurrency=int(v) if kind == "concurrency" else None,
                                      rate=v if kind == "rate" else None, seed=args.seed, timeout=args.timeout)
                m1 = _metrics(url)
                c0, c1, e0, e1 = _compiles(m0), _compiles(m1), _engine_counters(m0), _engine_counters(m1)
                s = summarize(recs, wall)
                s.update(load=(f"concurrency {int(v)}" + (f", {n} requests" if given else "")) if kind == "concurrency"
                         else f"Poisson {v:g}/s",
                         compiles=None if c0 is None else int(c1 - c0), engine=engine_summary(e0, e1, wall))
                runs.append(s)
                all_recs.append(recs)
                print(f"[load_test] {s['load']}: {s['tokens_per_s']:.1f} tok/s, {s['errors']} errors",
                      file=sys.stderr, flush=True)
                failed |= s["errors"] > 0
        finally:
            if server is not None:
                server.stop()
        print_table(title + (f" (server ready in {server.startup_s:.0f} s)" if server else ""), runs)
        print_engine_table([(r["load"], r["engine"]) for r in runs if r.get("engine")])
        entry = dict(plain=plain, server_argv=argv_s, runs=runs,
                     server_exit=None if server is None else server.returncode)
        failed |= server is not None and server.returncode != 0
        if args.check:
            problems = check(args, argv_s, jobs, all_recs)
            entry["check"] = dict(responses=sum(len(r) for r in all_recs), problems=problems)
            print(f"check: {sum(len(r) for r in all_recs)} responses against one-shot generate: "
                  + ("all identical" if not problems else f"{len(problems)} problems, e.g. {problems[:3]}"))
            failed |= bool(problems)
        report["servers"].append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
