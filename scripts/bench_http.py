"""The serving path's host ceiling: tokens/s the OpenAI server's HTTP side sustains with no device.

A null engine (the engine interface, dflash_jax.serving.engine) stands in for the slot engine: its
thread "steps" every --step-ms, handing each running request --tokens-per-step tokens (K iterations
x tau: 12 is K = 2 at tau 6), as the slot engine's reads do, and admits queued requests into free
slots. The app is the server's own (server.build_app, no tokenizer: token-id prompts, as
load_test.py's random-weight runs) behind uvicorn, in a child process; the client is
load_test.run_load in this one (c streaming clients, one thread each). Per setting it prints
tokens/s, SSE chunks/s, and the server process's CPU seconds per 1,000 tokens (all its threads:
with no device, that is the host cost of admitting, streaming and finishing the requests).

Why: served, the H200 made fewer tokens/s than the H100 at c = 32 and 48 (docs/perf-log.md, session
52), as a host-bound server would; this measures the bound on the host at hand.

    python scripts/bench_http.py                                   # http h11,httptools x loop asyncio,uvloop
    python scripts/bench_http.py --http h11 --loop asyncio --concurrency 32,64 --step-ms 0
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)


def null_engine(slots: int, tokens_per_step: int, step_ms: float, vocab: int = 151936):
    from dflash_jax.serving import engine as E

    class NullEngine(E._EngineCore):
        """Serves every request its max_tokens in steps of tokens_per_step, no device."""
        eos_token_ids, block_size = (), 16

        def __init__(self):
            self.vocab_size, self.max_model_len, self.capacity = vocab, 1 << 20, 1 << 20
            self.max_queue, self.n_slots = 4096, slots
            self._running: dict[int, E.Handle] = {}
            self._sent: dict[int, int] = {}
            self._start("null-engine")

        def _queue_full(self) -> bool:
            return len(self._queue) >= self.max_queue

        def _running_handles(self):
            return list(self._running.values())

        def _work(self) -> None:
            n = 0
            while True:
                with self._cv:
                    while not self._queue and not self._running and not self._closed:
                        self._cv.wait()
                    if self._closed and not self._queue and not self._running:
                        return
                    while self._queue and len(self._running) < slots:
                        h = self._queue.popleft()
                        h._stats = E.RequestStats(prompt_tokens=len(h.request.prompt))
                        self._running[h.id], self._sent[h.id] = h, 0
                    running = list(self._running.values())
                for h in running:
                    k = min(tokens_per_step, h.request.max_tokens - self._sent[h.id])
                    if h.cancelled:
                        k = 0
                    else:
                        h._push(E.Tokens([(n + i) % 1000 + 1 for i in range(k)]))
                        n += k
                        self._sent[h.id] += k
                        h._stats.iterations += 1
                        h._stats.acceptance_lengths.append(k)
                    if h.cancelled or self._sent[h.id] >= h.request.max_tokens:
                        with self._cv:
                            del self._running[h.id], self._sent[h.id]
                        if not h.cancelled:
                            h._finish("length", h._stats)
                if step_ms > 0:
                    time.sleep(step_ms / 1e3)

    return NullEngine()


def serve(args) -> int:
    """The child: the server's app over a null engine, until killed."""
    import uvicorn

    from dflash_jax.serving.server import build_app
    app = build_app(null_engine(args.slots, args.tokens_per_step, args.step_ms), None, model_name="null")
    for sig in (signal.SIGTERM, signal.SIGINT):     # uvicorn re-raises the signal that stopped it: exit 0
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=args.http,
                                  loop=args.loop, lifespan="off")).run()
    return 0


def _cpu_model() -> str:
    """The host CPU's model name (Linux /proc/cpuinfo; else platform's word for it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


def _cpu_s(pid: int) -> float:
    """utime + stime of every thread of process pid, seconds (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", default="h11,httptools", help="uvicorn HTTP implementations (comma list)")
    p.add_argument("--loop", default="asyncio,uvloop", help="uvicorn event loops (comma list)")
    p.add_argument("--concurrency", default="32", help="streaming clients (comma list)")
    p.add_argument("--requests", type=int, default=256, help="requests per run")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per request")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--tokens-per-step", type=int, default=12, help="tokens a request gets per step (K x tau)")
    p.add_argument("--step-ms", type=float, default=0.0, help="step period (0: as fast as the host goes)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)   # the child (load_test.Server's)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args)

    import numpy as np
    from load_test import Server, run_load
    rng = np.random.default_rng(0)
    jobs = [([int(t) for t in rng.integers(1, 1000, args.prompt_len)], args.max_tokens) for _ in range(args.requests)]
    print(f"[bench_http] null engine: {args.slots} slots, {args.tokens_per_step} tokens a request a step, step "
          f"period {args.step_ms} ms; {args.requests} requests of {args.prompt_len} prompt tokens, "
          f"{args.max_tokens} tokens each; host: {_cpu_model()}, {os.cpu_count()} CPUs", flush=True)
    print("| http | loop | clients | tokens/s | chunks/s | server CPU s / 1k tokens | server CPU % |")
    print("|---|---|---|---|---|---|---|")
    for http in args.http.split(","):
        for loop in args.loop.split(","):
            server = Server(["--http", http, "--loop", loop, "--slots", str(args.slots), "--tokens-per-step",
                             str(args.tokens_per_step), "--step-ms", str(args.step_ms)], 60.0, None,
                            cmd=[os.path.abspath(__file__), "--serve"])
            try:
                run_load(server.url, "null", jobs[:8], concurrency=8)                 # warm-up
                for c in [int(x) for x in args.concurrency.split(",")]:
                    cpu0 = _cpu_s(server.proc.pid)
                    recs, wall = run_load(server.url, "null", jobs, concurrency=c)
                    cpu = _cpu_s(server.proc.pid) - cpu0
                    bad = [r["error"] for r in recs if r["error"] is not None]
                    if bad:
                        raise SystemExit(f"{len(bad)} requests failed ({http}, {loop}): {bad[0]}")
                    tokens = sum(len(r["tokens"]) for r in recs)
                    chunks = sum(-(-r["max_tokens"] // args.tokens_per_step) for r in recs)
                    print(f"| {http} | {loop} | {c} | {tokens / wall:,.0f} | {chunks / wall:,.0f} | "
                          f"{cpu / tokens * 1e3:.3f} | {100 * cpu / wall:.0f} |", flush=True)
            finally:
                server.stop()
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench_http"
    sys.exit(main())
