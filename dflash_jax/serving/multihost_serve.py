"""One OpenAI endpoint over a mesh that spans several processes (multi-controller JAX, issue 58).

Every process runs `python -m dflash_jax.serve` with the same flags (jax.distributed named by the
environment, as `generate`'s multi-host runs: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID, or a TPU slice's own workers). Process 0 owns the HTTP port, the queue and every
scheduling decision; the others run `follow`, a loop with no port. Each call of process 0's engine
on its `Slots` that dispatches device work or changes host state a program reads (insert, step,
release, the paged admit / grow / reads, warmup) is published first as one small JSON op and then
run; every other process runs the same call on its own `Slots` in the same order, so each launches
the same SPMD program over the same global mesh with the same inputs. Results (first tokens,
commits) are replicated on the mesh inside the program's dispatch order and read by process 0 from
its own devices; the others drop them. A single controller (Pathways: one process sees every
device) has one process and needs none of this.

The ops travel through the jax.distributed coordination service's key-value store (the transport
jax-llm-examples' serving loop uses), not `multihost_utils.broadcast_one_to_all`: that is a device
collective, which queues behind the steps already dispatched, so process 0 would wait for the
device before every dispatch and the engine's pipelining (step n+1 runs while step n is read)
would be lost; and a collective with a dead peer blocks without a timeout. The store is host-side
RPC to process 0's coordination service, has timeouts, and also carries the start-up check of the
flags and each worker's heartbeat and progress, which `Watch` reads to fail the server in bounded
time when a worker dies or hangs. JAX exposes the store only as
`jax._src.distributed.global_state.client` (no public name as of JAX 0.10); `_client` is the one
place that reaches for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from dflash_jax.serving.slots import RowRequest

__all__ = ["KEY", "Channel", "LeaderSlots", "Watch", "Hosts", "follow", "flags_digest", "check_flags",
           "publish_verdict", "readable", "row_json", "row_from_json", "process_count", "process_index",
           "add_args", "real_stderr", "heartbeat", "DEFAULT_WORKER_TIMEOUT", "FAULT_EXIT", "FAULT_GRACE_S",
           "HANG_FACTOR"]

KEY = "dflash/serve"               # every key of this module's traffic starts here
DEFAULT_WORKER_TIMEOUT = 10.0      # seconds without a worker's heartbeat before the server fails
HANG_FACTOR = 30                   # a worker behind process 0's ops without progress this x longer: hung
_POLL_S = 0.5                      # worker: wait this long for an op before asking again
FAULT_EXIT = 3                     # process 0's exit status after a worker fault
FAULT_GRACE_S = 2.0                # process 0: seconds the failed streams get to flush before it exits


def process_count() -> int:
    import jax
    return jax.process_count()


def process_index() -> int:
    import jax
    return jax.process_index()


def _client():
    """The coordination service's client of this process (jax.distributed.initialize made it)."""
    from jax._src import distributed
    c = distributed.global_state.client
    if c is None:
        raise RuntimeError("jax.distributed is not initialized: a multi-process server needs it")
    return c


# ------------------------------------------------------------------------------------- start-up
# flags each process may set for itself: where process 0 listens, where a process keeps compiled programs
LOCAL_FLAGS = ("host", "port", "compile_cache", "compile_workers")


def flags_digest(flags: dict) -> str:
    """A hash of the settings that shape the programs: every flag but LOCAL_FLAGS."""
    kept = {k: v for k, v in sorted(flags.items()) if k not in LOCAL_FLAGS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_flags(flags: dict, timeout_s: float = 300.0) -> str | None:
    """Every process's flags against process 0's, through the store: None when they agree, else
    one line naming the flags that differ (the same line on every process). Process 0 publishes
    the digest of its flags (flags_digest) and the flags; each worker compares digests, names the
    flags that differ when they do, and publishes its verdict; process 0 waits for all of them."""
    c, me, n = _client(), process_index(), process_count()
    kept = {k: v for k, v in flags.items() if k not in LOCAL_FLAGS}
    mine = json.loads(json.dumps(kept, sort_keys=True, default=str))
    ms = int(timeout_s * 1000)
    if me == 0:
        c.key_value_set(f"{KEY}/flags", json.dumps(dict(digest=flags_digest(flags), flags=mine), sort_keys=True))
        bad = [c.blocking_key_value_get(f"{KEY}/flags_ok/{i}", ms) for i in range(1, n)]
        bad = [b for b in bad if b != "ok"]
        return bad[0] if bad else None
    got = json.loads(c.blocking_key_value_get(f"{KEY}/flags", ms))
    theirs = got["flags"]
    verdict = "ok"
    if got["digest"] != flags_digest(flags):
        differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        named = "" if not differ else (
            f" ({', '.join('--' + k.replace('_', '-') for k in differ)}: process {me} has "
            f"{', '.join(repr(mine.get(k)) for k in differ)}, process 0 "
            f"{', '.join(repr(theirs.get(k)) for k in differ)})")
        verdict = f"the processes' flags differ{named}; start every process with the same flags"
    c.key_value_set(f"{KEY}/flags_ok/{me}", verdict)
    if verdict != "ok":
        return verdict
    # a worker whose own flags agree still stops when another's differ: process 0 says so
    return None if c.blocking_key_value_get(f"{KEY}/flags_verdict", ms) == "ok" else "another process's flags differ"


def publish_verdict(problem: str | None) -> None:
    """Process 0: the start-up check's outcome for the workers whose own flags agreed."""
    _client().key_value_set(f"{KEY}/flags_verdict", "ok" if problem is None else problem)


# ------------------------------------------------------------------------------------- the ops
def row_json(r: RowRequest) -> dict:
    """A RowRequest as JSON's types (an op's payload)."""
    return dataclasses.asdict(r)


def _tuples(x):
    """JSON's lists back to the tuples a RowRequest holds (prompt, stop ids, pairs of them)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def row_from_json(d: dict) -> RowRequest:
    return RowRequest(**{k: _tuples(v) for k, v in d.items()})


class Channel:
    """The ordered op log in the store: process 0 publishes op n under `{KEY}/op/n`; a worker
    reads them in order, acknowledges each (`ack/<process>`) and beats (`hb/<process>`) from a
    thread of its own. Process 0 deletes ops every worker has acknowledged (Watch)."""

    def __init__(self, client=None):
        self.client = client if client is not None else _client()
        self.sent = 0                    # process 0: ops published
        self.lock = threading.Lock()

    def publish(self, op: list) -> None:
        with self.lock:
            self.client.key_value_set(f"{KEY}/op/{self.sent}", json.dumps(op))
            self.sent += 1

    def receive(self, n: int, timeout_s: float) -> list | None:
        """Op n, or None when none came within timeout_s."""
        try:
            return json.loads(self.client.blocking_key_value_get(f"{KEY}/op/{n}", int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001  (the client raises one error type for every status)
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                return None
            raise


# ------------------------------------------------------------------------------------- results
_REPLICATE: dict = {}


def readable(x):
    """A program's output as process 0 can read it: an array over other processes' devices is
    replicated by a small program every process runs (the same call on each: the workers run it
    too and drop the result), then its local copy is returned. As is on one process."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    if not x.is_fully_replicated:
        mesh = x.sharding.mesh
        prog = _REPLICATE.get(mesh)
        if prog is None:
            prog = _REPLICATE[mesh] = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))
        x = prog(x)
    return x.addressable_data(0)


def _readable_inserts(out):
    return [(rows, readable(first), readable(done)) for rows, first, done in out]


def _run_op(slots, op: list):
    """One published op on this process's Slots (the call process 0 made), its results readable."""
    kind, args = op[0], op[1:]
    if kind == "insert":
        return _readable_inserts(slots.insert_async([(int(s), row_from_json(r)) for s, r in args[0]]))
    if kind == "step":
        return tuple(readable(x) for x in slots.step_async(args[0]))
    if kind == "release":
        return slots.release(int(args[0]))
    if kind == "admit":
        return slots.admit(int(args[0]), row_from_json(args[1]))
    if kind == "grow":
        return slots.grow(args[0])
    if kind == "note_insert":
        return slots.note_insert(*args)
    if kind == "note_step":
        return slots.note_step(*args)
    if kind == "warmup":
        return slots.warmup(tuple(args[0]), tuple(args[1]))
    if kind == "profile_widths":
        return slots.profile_widths(*args)
    if kind == "noop":                  # scripts/bench_multihost_serve.py: the channel's round trip
        return None
    if kind == "preempted":
        slots.preemptions += 1
        return None
    raise ValueError(f"unknown op {kind!r}")


class LeaderSlots:
    """Process 0's `Slots` (SlotEngine's `wrap`): each call that dispatches device work or changes
    host state a program reads is published to the other processes, then run here; every other
    attribute is the wrapped Slots'. Outputs come back readable on this process (`readable`).
    `target` is None: a scoring pass (logprobs, echo) would run on this process's devices alone,
    so the server refuses those requests across hosts."""

    target = None

    def __init__(self, slots, channel: Channel):
        object.__setattr__(self, "inner", slots)
        object.__setattr__(self, "channel", channel)
        object.__setattr__(self, "lock", threading.RLock())   # publish order = run order, whoever calls

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        with self.lock:
            if name == "preemptions":
                self.channel.publish(["preempted"])
            setattr(self.inner, name, value)

    def _call(self, op: list):
        with self.lock:
            self.channel.publish(op)
            return _run_op(self.inner, op)

    def insert_async(self, items):
        return self._call(["insert", [[int(s), row_json(r)] for s, r in items]])

    def insert(self, items):
        out = {}
        for slots, first, done in self.insert_async(items):
            first, done = np.asarray(first), np.asarray(done)
            for i, slot in enumerate(slots):
                out[slot] = (int(first[i]), bool(done[i]))
        return out

    def step_async(self, busy=None):
        return self._call(["step", None if busy is None else sorted({int(b) for b in busy})])

    def step(self, busy=None):
        return tuple(np.asarray(x) for x in self.step_async(busy))

    def release(self, slot: int) -> None:
        return self._call(["release", int(slot)])

    def admit(self, slot: int, r: RowRequest) -> bool:
        return self._call(["admit", int(slot), row_json(r)])

    def grow(self, busy) -> list[int]:
        return self._call(["grow", [int(b) for b in busy]])

    def note_insert(self, slot: int, epoch: int, first: int) -> None:
        return self._call(["note_insert", int(slot), int(epoch), int(first)])

    def note_step(self, slot: int, epoch: int, iters: int, rows: list) -> None:
        return self._call(["note_step", int(slot), int(epoch), int(iters), [[int(t) for t in r] for r in rows]])

    def warmup(self, prompt_lengths=(1,), modes=("greedy",), workers: int | None = None) -> None:
        """Every process compiles the same programs; `workers` (threads) is this process's own
        (--compile-workers is local to each host: the others use their default)."""
        op = ["warmup", [int(n) for n in prompt_lengths], list(modes)]
        with self.lock:
            self.channel.publish(op)
            return self.inner.warmup(tuple(op[1]), tuple(op[2]), workers=workers)

    def profile_widths(self, mode: str = "greedy", rows: int | None = None) -> None:
        return self._call(["profile_widths", mode, rows])

    def run(self, *args, **kwargs):
        """Slots.run would call the wrapped Slots past the ops; offline work across processes is
        `generate`'s (every process makes the same calls itself)."""
        raise NotImplementedError("Slots.run across processes: use generate, which every process runs itself")

    def stop(self) -> None:
        """End the workers' loops (`follow` returns)."""
        self.channel.publish(["shutdown"])


# ------------------------------------------------------------------------------------- workers
def heartbeat(client, interval_s: float = 1.0) -> threading.Event:
    """Beat (`hb/<process>`, a new value each time) from a thread until the returned event is set:
    a thread, so that a long compile or a wait on the device is no silence."""
    stop, me = threading.Event(), process_index()

    def beat():
        while not stop.is_set():
            try:
                client.key_value_set(f"{KEY}/hb/{me}", repr(time.monotonic()), allow_overwrite=True)
            except Exception:  # noqa: BLE001  (process 0 is gone: the main loop finds out too)
                return
            stop.wait(interval_s)

    threading.Thread(target=beat, name="dflash-heartbeat", daemon=True).start()
    return stop


def follow(slots, channel: Channel | None = None, *, heartbeat_s: float | None = 1.0) -> int:
    """A worker's loop: run process 0's ops on this process's `slots` in order until `shutdown`,
    acknowledging each; beats every heartbeat_s (None: the caller beats already). Returns 0 after
    shutdown; raises when the store fails (process 0 is gone)."""
    channel = channel or Channel()
    c, me = channel.client, process_index()
    stop = heartbeat(c, heartbeat_s) if heartbeat_s else threading.Event()
    n = 0
    try:
        while True:
            op = channel.receive(n, _POLL_S)
            if op is None:
                continue
            if op[0] == "shutdown":
                c.key_value_set(f"{KEY}/bye/{me}", "1")
                return 0
            _run_op(slots, op)
            n += 1
            c.key_value_set(f"{KEY}/ack/{me}", str(n), allow_overwrite=True)
    finally:
        stop.set()


class Watch:
    """Process 0's watch over the workers, on a thread: a worker whose heartbeat stops for
    `timeout_s`, or that stays behind the ops published without acknowledging one for
    HANG_FACTOR x that, makes `on_fault(message)` run once. Behind means an op older than the last
    one published: process 0 has moved past it, so no compile both sides run (the last op's) counts.
    It also deletes the ops every worker has acknowledged."""

    def __init__(self, channel: Channel, on_fault: Callable[[str], Any], timeout_s: float = DEFAULT_WORKER_TIMEOUT):
        self.channel, self.on_fault, self.timeout_s = channel, on_fault, float(timeout_s)
        self.workers = list(range(1, process_count()))
        self.faulted: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-watch", daemon=True)

    def start(self) -> "Watch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _get(self, key: str) -> str | None:
        try:
            return self.channel.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001  (not set yet)
            return None

    def _run(self) -> None:
        now = time.monotonic()
        beats = {w: (None, now) for w in self.workers}     # last value seen, when it changed
        acks = {w: (0, now) for w in self.workers}
        deleted = 0
        while not self._stop.wait(min(0.5, self.timeout_s / 4)):
            now = time.monotonic()
            problem = None
            for w in self.workers:
                hb = self._get(f"{KEY}/hb/{w}")
                if hb != beats[w][0]:
                    beats[w] = (hb, now)
                elif now - beats[w][1] > self.timeout_s:
                    problem = f"worker process {w} stopped (no heartbeat for {now - beats[w][1]:.0f} s)"
                ack = int(self._get(f"{KEY}/ack/{w}") or 0)
                if ack != acks[w][0]:
                    acks[w] = (ack, now)
                elif ack >= self.channel.sent - 1:
                    acks[w] = (ack, now)                # at most on the last op, as process 0 is
                elif now - acks[w][1] > HANG_FACTOR * self.timeout_s:
                    problem = (f"worker process {w} hangs ({self.channel.sent - ack} engine calls behind, none "
                               f"done for {now - acks[w][1]:.0f} s)")
            if problem is not None:
                self.faulted = problem
                self.on_fault(problem)
                return
            low = min((a for a, _ in acks.values()), default=0)
            for i in range(deleted, low):
                try:
                    self.channel.client.key_value_delete(f"{KEY}/op/{i}")
                except Exception:  # noqa: BLE001
                    break
                deleted = i + 1

    def wait_for_workers(self, timeout_s: float) -> bool:
        """After `stop` was published: True when every worker said goodbye within timeout_s."""
        ms = int(timeout_s * 1000)
        try:
            for w in self.workers:
                self.channel.client.blocking_key_value_get(f"{KEY}/bye/{w}", ms)
        except Exception:  # noqa: BLE001
            return False
        return True


def add_args(group) -> None:
    """The server's flag for serving across processes."""
    group.add_argument("--worker-timeout", type=float, default=DEFAULT_WORKER_TIMEOUT, metavar="SECONDS",
                       help="over several processes (jax.distributed): a worker process silent this long (or "
                            f"{HANG_FACTOR}x this long behind process 0's engine calls) fails the server: open "
                            "streams end with an error event, new requests get 503, every process exits")


class Hosts:
    """This process's part of a server over several processes: process 0 (`leader`) serves and
    wraps its engine's Slots (`wrap`, then `watch`, and `stop` at the end); every other process
    builds the same engine and runs `follow` instead of serving. `join` makes one, or None on one
    process (a single controller, Pathways included, needs nothing of this)."""

    def __init__(self, worker_timeout: float = DEFAULT_WORKER_TIMEOUT):
        self.leader = process_index() == 0
        self.channel = Channel()
        self.worker_timeout = float(worker_timeout)
        self.slots = None                # this process's Slots (a worker's: the ops run on it)
        self.serving = None              # process 0: (engine, app) once it serves (watch)
        # from the start, so that a worker lost while the models load or compile is noticed too
        if self.leader:
            self.watcher: Watch | None = Watch(self.channel, self._fault, self.worker_timeout).start()
        else:
            self.watcher, self.beating = None, heartbeat(self.channel.client)

    @classmethod
    def join(cls, parser, args, flags: dict) -> "Hosts | None":
        """jax.distributed from the environment (loading.init_distributed), then the start-up
        check: every process's flags (`flags`: as parsed, before defaults are filled in) must be
        process 0's, a mesh must span every process's devices and the slot engine must run; a
        problem is one line and exit status 2 on every process."""
        from dflash_jax import loading
        loading.init_distributed()
        if process_count() == 1:
            return None
        import jax
        problem = check_flags(flags)
        if process_index() == 0:
            publish_verdict(problem)
        if problem is not None:
            print(f"python -m dflash_jax.serve: error: {problem}", file=real_stderr(), flush=True)
            raise SystemExit(2)
        n, devices = process_count(), jax.device_count()
        if getattr(args, "mesh", None) is None or args.slots < 2:
            parser.error(f"a server over {n} processes needs --mesh over all {devices} devices and the slot engine "
                         f"(--slots > 1)")
        from dflash_jax import sharding
        try:
            data, model = sharding.parse_mesh(args.mesh)
        except ValueError as e:
            parser.error(f"--mesh {args.mesh}: {loading.one_line(e)}")
        if data * model != devices:   # a mesh on some processes' devices only: the rest would wait forever
            parser.error(f"--mesh {args.mesh} has {data * model} devices; a server over {n} processes needs a mesh "
                         f"over all {devices} of their devices")
        if not args.worker_timeout > 0:
            parser.error(f"--worker-timeout must be > 0 seconds, got {args.worker_timeout}")
        return cls(args.worker_timeout)

    def wrap(self, slots):
        """SlotEngine's `wrap`: process 0 drives a LeaderSlots; a worker keeps its Slots for follow."""
        self.slots = slots
        return LeaderSlots(slots, self.channel) if self.leader else slots

    def follow(self) -> int:
        """A worker: run process 0's engine calls until it stops (0), or fail when it is gone."""
        return follow(self.slots, self.channel, heartbeat_s=None)

    def watch(self, engine, app) -> None:
        """Process 0, serving from now: a worker fault also ends every request with an error event
        and makes the server answer 503 (_fault)."""
        self.serving = (engine, app)

    def _fault(self, message: str) -> None:
        """A worker died or hangs: fail what runs (serving), then exit FAULT_EXIT after
        FAULT_GRACE_S (the streams' error events and [DONE] go out meanwhile)."""
        print(f"[dflash] {message}: failing every request and stopping", file=sys.stderr, flush=True)
        if self.serving is not None:
            engine, app = self.serving
            app.state.draining = True
            engine.fail(f"a process of this multi-host server failed: {message}")
            time.sleep(FAULT_GRACE_S)
        os._exit(FAULT_EXIT)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Process 0, done serving: end the workers' loops and wait for them to leave."""
        if self.watcher is not None:
            self.watcher.stop()
        self.channel.publish(["shutdown"])
        if not self.watcher.wait_for_workers(timeout_s):
            print("[dflash] a worker process did not stop in time", file=sys.stderr, flush=True)


def real_stderr():
    """The process's own stderr (a worker's sys.stderr goes to /dev/null: loading.init_distributed)."""
    return sys.__stderr__ if sys.__stderr__ is not None else open(os.devnull, "w")
