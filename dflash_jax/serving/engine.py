"""Serving engines: the interface the HTTP server (`dflash_jax.serve`) drives, the step-wise slot
engine `SlotEngine` (over dflash_jax.serving.slots.Slots) and `SimpleEngine`.

The server only ever talks to an engine through this small interface:

    engine.check(request)                  # raises RequestError(field, message) for a request it cannot run
    handle = engine.submit(request)        # -> Handle; raises QueueFull / EngineClosed / RequestError
    for event in handle.events(): ...      # blocking consumer (threads)
    async for event in handle.aevents(): ...   # asyncio consumer (the server)
    engine.cancel(handle)                  # idempotent; the handle ends with finish_reason "cancelled"
    engine.stats()                         # -> EngineStats (queue depth, slots busy, compiles, ...)
    engine.shutdown(timeout=...)           # stop accepting; finish in-flight work or fail it at timeout

A handle yields `Tokens` events (the tokens the engine committed, in order, already cut at the
request's stop token and max_tokens) and exactly one final `Finished` event. Token order and content
are the engine's contract: for the same prompt and settings they equal one-shot
`dflash_jax.generate(target, draft, [prompt], ...)` (greedy; sampling with the same seed).

`SlotEngine` is continuous batching over `Slots` (dflash_jax.serving.slots: a fixed number of slots whose
loop state lives on the device in one pytree; insert, step, release). It dispatches step n+1 before
reading step n (`pipeline` = 1), so the host's bookkeeping, token pushing and prefill dispatch
overlap the device's work instead of stalling it. Each program compiles once per (slots, capacity,
block, sampling mode, and for insert the prompt bucket and insert width), never on a request's
arrival. A request's tokens do not depend on its slot or its batch-mates.

`SimpleEngine` runs one request at a time on a worker thread through `generate` (batch of one),
streaming each loop iteration's tokens through `on_commit` (tests inject faults through its
generate_fn).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Protocol, Sequence

from dflash_jax import decode, penalties, sampling, validation
from dflash_jax.loop import compile_count
from dflash_jax.serving.pages import pages_for
from dflash_jax.serving.slots import Pipeline, RowRequest, RowResult, Slots, parse_step_buckets

__all__ = ["Request", "Tokens", "Finished", "RequestStats", "EngineStats", "Handle", "Engine", "SimpleEngine",
           "Slots", "SlotEngine", "RowResult", "parse_step_buckets",
           "RequestError", "QueueFull", "EngineClosed", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length", "cancelled", "error")


# ----------------------------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True)
class Request:
    """One generation: prompt token ids and its own settings (nothing here is a compile key but the
    sampling mode temperature / top-k / top-p select)."""
    prompt: tuple[int, ...]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    seed: int = 0                        # the row's sampling seed (generate's `seed`)
    stop_token_ids: tuple[int, ...] = ()  # stop on these in addition to the engine's eos ids
    ignore_eos: bool = False             # do not stop on the engine's eos ids (stop_token_ids still stop)
    # dflash_jax.penalties (OpenAI / vLLM semantics; any set: the rows run a penalties program)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs
    min_tokens: int = 0                  # the stop ids (eos included) cannot end it before this many tokens
    # structured output: the request's grammar state (dflash_jax.serving.grammar.Constraint, from
    # Grammars.compile(...).new()); the engine advances it with every token it emits. Slot engine only.
    grammar: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class RequestStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    iterations: int = 0                  # loop iterations (draft-verify-accept) that produced its tokens
    acceptance_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens per iteration
    queued_s: float = 0.0                # submit -> the engine started it
    first_token_s: float | None = None   # submit -> first token (None: none came)
    total_s: float = 0.0                 # submit -> finished

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0


@dataclasses.dataclass(frozen=True)
class Tokens:
    ids: list[int]                       # newly committed tokens, in order


@dataclasses.dataclass(frozen=True)
class Finished:
    finish_reason: str                   # one of FINISH_REASONS
    tokens: list[int]                    # every token the handle yielded (stop token included)
    stats: RequestStats
    error: str | None = None             # finish_reason "error": what failed, one line


@dataclasses.dataclass(frozen=True)
class EngineStats:
    queue_depth: int                     # submitted, not yet started
    slots_busy: int                      # requests running now
    slots: int                           # how many can run at once
    max_queue: int
    compiles: int                        # programs compiled so far (the process's)
    capacity: int                        # KV entries per slot
    max_model_len: int                   # prompt + max_tokens must fit in this
    # speculative decoding, vLLM's semantics: draft-verify iterations, draft tokens proposed (S - 1
    # each), draft tokens accepted, and accepted per position (1 + accepted / drafts = tau)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_accepted_per_pos: tuple = ()
    # the paged KV cache (Slots(kv_pages=...)): prefix-cache queries and hits in tokens, pages
    # holding a live reference / in the pool, requests preempted for pages
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    # the draft's sliding layers' window pool (pages.WindowPages; 0 / 0 without one)
    kv_window_pages_used: int = 0
    kv_window_pages_total: int = 0
    preemptions: int = 0
    # the slot engine's thread (slots.PipelineCounters, cumulative): steps dispatched, their busy
    # slots summed, requests prefilled; seconds in the insert and step programs' dispatch, in reads
    # waiting for the device, and idle (no request to run). The rest of its time is host bookkeeping.
    engine_steps: int = 0
    engine_slot_steps: int = 0
    engine_inserts: int = 0
    engine_insert_dispatch_s: float = 0.0
    engine_step_dispatch_s: float = 0.0
    engine_read_wait_s: float = 0.0
    engine_idle_s: float = 0.0


class RequestError(ValueError):
    """A request this engine cannot run; `field` names the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class QueueFull(RuntimeError):
    """The bounded queue is full; try again later (the server answers 503 + Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


# ----------------------------------------------------------------------------------------- handles
class Handle:
    """One submitted request's event stream. Events come from the engine's threads; one consumer
    reads them, blocking (`events`, `next`) or from an asyncio loop (`aevents`, `anext`)."""

    _ids = itertools.count()

    def __init__(self, request: Request):
        self.id = next(Handle._ids)
        self.request = request
        self.submitted_at = time.perf_counter()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tokens: list[int] = []
        self._finished: Finished | None = None
        self.cancelled = False           # set by Engine.cancel; the engine stops it at its next chance

    @property
    def done(self) -> bool:
        return self._finished is not None

    # producer side (engine threads) -------------------------------------------------------------
    def _push(self, ev) -> bool:
        """Deliver one event; False (and nothing delivered) once the handle has finished."""
        with self._lock:
            if self._finished is not None:
                return False
            if isinstance(ev, Finished):
                self._finished = ev
            else:
                self._tokens.extend(ev.ids)
            self._q.put(ev)
            loop, wake = self._loop, self._wake
        if loop is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:         # the consumer's loop is closed: nobody is listening
                pass
        return True

    def _finish(self, reason: str, stats: RequestStats, error: str | None = None) -> bool:
        stats.completion_tokens = len(self._tokens)
        stats.total_s = time.perf_counter() - self.submitted_at
        return self._push(Finished(reason, list(self._tokens), stats, error))

    # consumer side -------------------------------------------------------------------------------
    def next(self, timeout: float | None = None):
        """The next event (blocking); raises queue.Empty after `timeout` seconds."""
        return self._q.get(timeout=timeout)

    def events(self) -> Iterator[Tokens | Finished]:
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, Finished):
                return

    async def anext(self):
        """The next event, awaited on the running loop without holding a thread."""
        with self._lock:
            if self._loop is None:
                self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            try:
                return self._q.get_nowait()
            except queue.Empty:
                pass
            self._wake.clear()
            if not self._q.empty():      # an event landed between get_nowait and clear
                continue
            await self._wake.wait()

    async def aevents(self) -> AsyncIterator[Tokens | Finished]:
        while True:
            ev = await self.anext()
            yield ev
            if isinstance(ev, Finished):
                return


# ----------------------------------------------------------------------------------------- interface
class Engine(Protocol):
    """What the server needs from an engine (see the module docstring)."""
    eos_token_ids: tuple[int, ...]
    block_size: int

    def check(self, request: Request) -> None: ...
    def submit(self, request: Request) -> Handle: ...
    def cancel(self, handle: Handle) -> None: ...
    def stats(self) -> EngineStats: ...
    def shutdown(self, timeout: float | None = None) -> None: ...


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _check_request(r: Request, vocab_size: int, max_model_len: int, stop_ids) -> None:
    """The one check of a request against an engine's vocabulary and context length."""
    n = len(r.prompt)
    if n == 0:
        raise RequestError("prompt", "is empty: a prompt needs at least one token")
    if any(not validation.is_int(t) or not 0 <= t < vocab_size for t in r.prompt):
        raise RequestError("prompt", f"has token ids outside the vocabulary [0, {vocab_size})")
    if n >= max_model_len:
        raise RequestError("prompt", f"{n} tokens, the model's context length is {max_model_len} "
                                     f"(prompt + max_tokens); shorten the prompt")
    if not validation.is_int(r.max_tokens) or r.max_tokens < 1:
        raise RequestError("max_tokens", f"must be an integer >= 1, got {r.max_tokens!r}")
    if n + r.max_tokens > max_model_len:
        raise RequestError("max_tokens", f"{r.max_tokens} with a prompt of {n} tokens exceeds the context "
                                         f"length {max_model_len}; at most {max_model_len - n}")
    for field, check in (("temperature", lambda: sampling.validate(r.temperature, 1.0, 0)),
                         ("top_p", lambda: sampling.validate(0.0, r.top_p, 0)),
                         ("top_k", lambda: sampling.validate(0.0, 1.0, r.top_k))):
        try:
            check()
        except ValueError as e:
            raise RequestError(field, _one_line(e).split(" ", 1)[1]) from None
    if validation.is_int(r.top_k) and r.top_k > vocab_size:
        raise RequestError("top_k", f"{r.top_k} is above the vocabulary size {vocab_size} (0 = off)")
    if not validation.is_int(r.seed) or not 0 <= r.seed < validation.SEED_LIMIT:
        raise RequestError("seed", f"must be an integer in [0, 2**32), got {r.seed!r}")
    try:
        validation.check_stop_ids(stop_ids, vocab_size)
    except ValueError as e:
        raise RequestError("stop_token_ids", _one_line(e)) from None
    bad = penalties.problem(r.presence_penalty, r.frequency_penalty, r.logit_bias, r.min_tokens, vocab_size,
                            r.max_tokens)
    if bad is not None:
        raise RequestError(*bad)


def _context(target, cache_len: int) -> int:
    """What a request may fill (prompt + max_tokens): the cache's room, never past the model's
    positions (max_position_embeddings)."""
    positions = getattr(target.config, "max_position_embeddings", None)
    return cache_len if positions is None else min(cache_len, int(positions))


class _EngineCore:
    """What both engines share: a request's stop ids (eos unless ignore_eos, plus its own) and its
    checks against the engine's vocabulary and context (RequestError naming the field); the bounded
    queue a worker thread drains, and submit / cancel / stats / shutdown over it. An engine sets the
    fields below, calls `_start` last in its constructor, and says when its queue is full and which
    handles run (`_queue_full`, `_running_handles`, both called under the lock)."""
    eos_token_ids: tuple
    vocab_size: int
    max_model_len: int
    max_queue: int
    capacity: int
    n_slots: int                         # requests that run at once
    structured_output = False            # serves Request.grammar (the slot engine on one host)
    _abort = False                       # set by shutdown after its timeout: the worker stops

    def _start(self, thread_name: str) -> None:
        self._queue: collections.deque[Handle] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._worker.start()

    def _work(self) -> None:
        raise NotImplementedError

    def _queue_full(self) -> bool:
        raise NotImplementedError

    def _running_handles(self) -> list[Handle]:
        raise NotImplementedError

    def stop_ids(self, request: Request) -> list[int]:
        eos = () if request.ignore_eos else self.eos_token_ids
        return sorted(set(eos) | set(request.stop_token_ids))

    def check(self, r: Request) -> None:
        _check_request(r, self.vocab_size, self.max_model_len, self.stop_ids(r))
        if r.grammar is not None and not self.structured_output:
            raise RequestError("response_format", "structured output (a JSON schema, json_object or a forced tool "
                                                  "call) is served by the slot engine on one host: serve with "
                                                  "--slots 2 or more")

    def submit(self, request: Request) -> Handle:
        self.check(request)
        h = Handle(request)
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            if self._queue_full():
                raise QueueFull(f"the queue is full ({self.max_queue} waiting)")
            self._queue.append(h)
            self._cv.notify()
        return h

    def cancel(self, handle: Handle) -> None:
        with self._cv:
            handle.cancelled = True
            try:
                self._queue.remove(handle)
            except ValueError:
                pass
            self._cv.notify()
        # The response ends now; the worker stops a running request at its next chance (SlotEngine:
        # its slot is released at the next step; SimpleEngine: a running generate stops at its next
        # iteration, on_commit returning True, or, where generate does not stop early, runs out).
        handle._finish("cancelled", self._stats_of(handle))

    def stats(self) -> EngineStats:
        with self._cv:
            spec = getattr(self, "_spec", None)
            extra = {} if spec is None else dict(spec_drafts=spec[0], spec_draft_tokens=spec[1], spec_accepted=spec[2],
                                                 spec_accepted_per_pos=tuple(spec[3]))
            return EngineStats(queue_depth=len(self._queue), slots_busy=len(self._running_handles()),
                               slots=self.n_slots, max_queue=self.max_queue, compiles=compile_count(),
                               capacity=self.capacity, max_model_len=self.max_model_len,
                               **extra, **self._page_stats(), **self._loop_stats())

    def _page_stats(self) -> dict:
        return {}

    def _loop_stats(self) -> dict:
        return {}

    def _count_iteration(self, produced: int) -> None:
        """One draft-verify iteration that produced `produced` tokens, into the speculative counters."""
        S = getattr(self, "block_size", None) or 1
        if S <= 1:
            return
        spec = self.__dict__.setdefault("_spec", [0, 0, 0, [0] * (S - 1)])
        spec[0] += 1
        spec[1] += S - 1
        spec[2] += produced - 1
        for i in range(min(produced - 1, S - 1)):
            spec[3][i] += 1

    def shutdown(self, timeout: float | None = None) -> None:
        """Take no new requests; let queued and running ones finish, failing what is left after
        `timeout` seconds (None: wait for all)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout)
        with self._cv:
            self._closed, self._abort = True, True
            left = list(self._queue) + self._running_handles()
            self._queue.clear()
        for h in left:
            h.cancelled = True           # a running request stops at its next chance
            h._finish("error", self._stats_of(h), "the server shut down before the request finished")

    def fail(self, message: str) -> None:
        """Stop now, without waiting for the worker: take no new requests and end every queued and
        running request with an error (`message`). For a device side that is gone (a worker process
        of a multi-host server died), where the worker thread may never come back from the device."""
        locked = self._cv.acquire(timeout=1.0)     # the worker may be stuck holding it: go on without
        try:
            self._closed, self._abort = True, True
            left = list(self._queue) + self._running_handles()
            self._queue.clear()
        finally:
            if locked:
                self._cv.notify_all()
                self._cv.release()
        for h in left:
            h.cancelled = True
            h._finish("error", self._stats_of(h), message)

    def _stats_of(self, h: Handle) -> RequestStats:
        return getattr(h, "_stats", None) or RequestStats(prompt_tokens=len(h.request.prompt))


class SimpleEngine(_EngineCore):
    """One request at a time through one-shot `generate` (batch of one) on a worker thread.

    capacity: KV entries of the compiled program (fixed, so programs are keyed only by the prompt
    bucket and the sampling mode); a request must satisfy prompt + max_tokens <= capacity - block.
    eos_token_ids: the model's stop ids; a request adds its own stop_token_ids, ignore_eos drops these.
    generate_fn: `dflash_jax.generate` or a stand-in with its signature (tests inject faults with it).
    """

    def __init__(self, target, draft, *, capacity: int = 4096, max_queue: int = 64,
                 eos_token_ids: Sequence[int] = (), block_size: int | None = None,
                 attention_impl: str = "auto", generate_fn: Callable[..., Any] | None = None):
        if not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"capacity must be an integer >= 2 (KV-cache entries), got {capacity!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.target, self.draft = target, draft
        self.vocab_size = target.config.vocab_size
        if draft is None:
            self.block_size = 1
        else:
            self.block_size = draft.config.block_size if block_size is None else block_size
        self.capacity = capacity
        self.max_model_len = _context(target, capacity - self.block_size)
        if self.max_model_len < 2:
            raise ValueError(f"capacity {capacity} leaves no room next to a block of {self.block_size}")
        self.max_queue = max_queue
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.attention_impl = attention_impl
        self._generate = generate_fn or decode.generate
        self.n_slots = 1
        self._running: Handle | None = None
        self._start("dflash-engine")

    def _queue_full(self) -> bool:
        return len(self._queue) >= self.max_queue and not (self._running is None and not self._queue)

    def _running_handles(self) -> list[Handle]:
        return [self._running] if self._running is not None else []

    # worker ------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                h = self._queue.popleft()
                self._running = h
            try:
                self._run(h)
            except Exception as e:  # one request's fault fails that request only
                h._finish("error", self._stats_of(h), _one_line(e))
            finally:
                with self._cv:
                    self._running = None

    def _run(self, h: Handle) -> None:
        r = h.request
        if h.cancelled:
            return
        stats = h._stats = RequestStats(prompt_tokens=len(r.prompt),
                                        queued_s=time.perf_counter() - h.submitted_at)
        stops = self.stop_ids(r)
        stop_set = set(stops)
        sent: list[int] = []
        ended = [False]

        def on_commit(rows) -> bool:
            # Cut at the stop token and max_tokens the same way generate's result is cut.
            if h.cancelled:
                return True
            if ended[0] or not rows:
                return False
            new = []
            for t in rows[0]:
                new.append(int(t))
                if new[-1] in stop_set or len(sent) + len(new) >= r.max_tokens:
                    ended[0] = True
                    break
            if new:
                if stats.first_token_s is None:
                    stats.first_token_s = time.perf_counter() - h.submitted_at
                sent.extend(new)
                h._push(Tokens(new))
            return h.cancelled

        res = self._generate(self.target, self.draft, [list(r.prompt)], max_new_tokens=r.max_tokens,
                             temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                             stop_token_ids=stops or None, block_size=self.block_size, seed=r.seed,
                             attention_impl=self.attention_impl, capacity=self.capacity, on_commit=on_commit,
                             presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                             logit_bias=dict(r.logit_bias), min_tokens=r.min_tokens,
                             verify_width="block")   # one slot verifies whole blocks (serve --verify-width)
        if h.cancelled:
            return
        final = [int(t) for t in res.tokens[0]]
        stats.acceptance_lengths = [int(a) for a in res.acceptance_lengths[0]]
        stats.iterations = len(stats.acceptance_lengths)
        if final[:len(sent)] != sent:
            h._finish("error", stats, "the streamed tokens differ from the generation's result")
            return
        if len(final) > len(sent):   # tokens the stream did not deliver (a generate without streaming)
            if stats.first_token_s is None:
                stats.first_token_s = time.perf_counter() - h.submitted_at
            h._push(Tokens(final[len(sent):]))
        reason = res.finish_reasons[0] if res.finish_reasons else "length"
        h._finish("stop" if reason == "stop" else "length", stats)


class SlotEngine(_EngineCore):
    """The Engine interface over `Slots`: continuous batching for the server.

    One thread owns the device: each turn it frees the slots of cancelled requests (released at
    that step), dispatches the prefills of waiting requests into free slots and one `step`, then
    reads back the step dispatched `pipeline` steps before (and the inserts before it; the same
    `slots.Pipeline` as the offline `Slots.run`), pushing
    first tokens and committed tokens into their Handles and finishing the requests whose rows
    are done. With pipeline 1 a finished slot is refilled one step later, but the device never
    waits for the host. Compiles happen in `warmup` (the constructor compiles the greedy
    programs for the prompt buckets up to `warmup_prompt_len`) or on a request of a mode or bucket
    not seen yet, never again after. verify_width: None (default) verifies the whole block in step
    programs of known trip count; "auto" or a width as generate's (slots.Slots): "auto" chooses per
    iteration from the step programs' costs that warmup profiles (a program not profiled verifies
    the whole block); those programs loop a trip count XLA:GPU does not know (docs/adaptive-width.md).
    wrap: a function of the Slots whose result the engine drives instead (a multi-host server's
    process 0 publishes each call to the other processes first: dflash_jax.serving.multihost_serve).
    """

    def __init__(self, target, draft, *, slots: int = 4, capacity: int = 4096, max_queue: int = 64,
                 eos_token_ids: Sequence[int] = (), block_size: int | None = None, attention_impl: str = "auto",
                 steps: int | str = 4, insert_width: int | None = None, kernels=None,
                 warmup_prompt_len: int | tuple[int, int] = 0, pipeline: int = 1, step_buckets="auto",
                 verify_width=None, kv_pages: int | None = None, page_size: int = 16, prefix_cache: bool = True,
                 window_pages: int | str = "auto",
                 wrap: Callable[[Slots], Any] | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.slots = Slots(target, draft, slots=slots, capacity=capacity, block_size=block_size, steps=steps,
                           insert_width=insert_width, kernels=kernels, attention_impl=attention_impl,
                           step_buckets=step_buckets, verify_width=verify_width, kv_pages=kv_pages,
                           page_size=page_size, prefix_cache=prefix_cache, window_pages=window_pages,
                           table_widths="full")   # (paged: the programs warmup compiles are all it runs)
        if wrap is not None:          # what the engine drives in the Slots' place (multihost_serve.LeaderSlots)
            self.slots = wrap(self.slots)
        # grammar masks are built on the host between steps; a multi-host server would have to
        # publish them to every process each step (not yet)
        self.structured_output = wrap is None
        if not validation.is_int(pipeline) or pipeline < 0:
            raise ValueError(f"pipeline must be an integer >= 0, got {pipeline!r}")
        self.pipeline = int(pipeline)
        self.block_size, self.capacity = self.slots.block_size, capacity
        self.max_model_len, self.max_queue = _context(target, self.slots.max_model_len), max_queue
        self.vocab_size = target.config.vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.n_slots = self.slots.slots
        if warmup_prompt_len:
            lo, hi = warmup_prompt_len if isinstance(warmup_prompt_len, tuple) else (1, warmup_prompt_len)
            hi = min(hi, self.max_model_len - 1)
            lengths = sorted({min(self.slots.prompt_bucket(n), hi) for n in range(max(1, lo), hi + 1)})
            self.slots.warmup(lengths, ("greedy",))
        self._running: dict[int, Handle] = {}          # slot -> handle
        self._admissions = itertools.count()           # admission order (the newest is preempted first)
        self._pipe: Pipeline | None = None             # the engine thread's (its counters: stats())
        self._idle_s = 0.0                             # the engine thread's time with nothing to run
        self._start("dflash-slot-engine")

    def _loop_stats(self) -> dict:
        c = self._pipe.counters if self._pipe is not None else None
        if c is None:
            return {}
        return dict(engine_steps=c.steps, engine_slot_steps=c.slot_steps, engine_inserts=c.inserts,
                    engine_insert_dispatch_s=c.insert_dispatch_s, engine_step_dispatch_s=c.step_dispatch_s,
                    engine_read_wait_s=c.read_wait_s, engine_idle_s=self._idle_s)

    def _page_stats(self) -> dict:
        sl = self.slots
        if not sl.paged:
            return {}
        ps = sl.pages.stats()
        ws = {} if getattr(sl, "wpages", None) is None else sl.wpages.stats()
        return dict(prefix_queries_tokens=ps["prefix_queries_tokens"], prefix_hits_tokens=ps["prefix_hits_tokens"],
                    kv_pages_used=ps["pages_used"], kv_pages_total=ps["pages_total"], preemptions=sl.preemptions,
                    kv_window_pages_used=ws.get("window_pages_used", 0),
                    kv_window_pages_total=ws.get("window_pages_total", 0))

    def check(self, r: Request) -> None:
        super().check(r)
        sl = self.slots
        if sl.paged:   # a request the whole pool could not hold would wait (or be preempted) forever
            need = pages_for(min(len(r.prompt) + int(r.max_tokens) + sl.block_size, sl.capacity), sl.page_size)
            if need > sl.pages.num_pages - 1:
                raise RequestError("max_tokens", f"a prompt of {len(r.prompt)} tokens + {r.max_tokens} needs {need} KV "
                                                 f"pages; the pool has {sl.pages.num_pages - 1} (raise --kv-pages)")

    def _queue_full(self) -> bool:
        free = self.slots.slots - len(self._running)
        return len(self._queue) >= self.max_queue + max(0, free)     # those go to free slots at once

    def _running_handles(self) -> list[Handle]:
        return list(self._running.values())

    # worker ------------------------------------------------------------------------------------
    def _row(self, h: Handle) -> RowRequest:
        """h's row: its prompt, or after a preemption its prompt and the tokens it has delivered
        (recomputed: greedy rows continue exactly; sampled ones stay exact in distribution)."""
        r = h.request
        done = list(h._tokens)
        return RowRequest(prompt=tuple(int(t) for t in r.prompt) + tuple(done), max_new=int(r.max_tokens) - len(done),
                          temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p),
                          stop_ids=tuple(self.stop_ids(r)), seed=int(r.seed), rng_row=0,
                          presence=float(r.presence_penalty), frequency=float(r.frequency_penalty),
                          logit_bias=tuple((int(k), float(v)) for k, v in r.logit_bias), min_tokens=int(r.min_tokens),
                          resumed=len(done), grammar=r.grammar)

    def _deliver(self, h: Handle, ids: list[int], accepted: int | None = None) -> None:
        st = h._stats
        if accepted is not None:
            st.acceptance_lengths.append(accepted)
            st.iterations += 1
            self._count_iteration(accepted)
        if ids:
            if h.request.grammar is not None:      # its grammar follows every token it emits
                h.request.grammar.consume(ids)
            if st.first_token_s is None:
                st.first_token_s = time.perf_counter() - h.submitted_at
            h._push(Tokens(ids))

    def _end(self, slot: int, h: Handle) -> None:
        del self._running[slot]
        if self.slots.paged:          # its pages back (full ones published for prefix hits)
            self.slots.release(slot)
        if h.done:
            return
        toks = h._tokens
        stops = set(self.stop_ids(h.request))
        h._finish("stop" if toks and toks[-1] in stops else "length", h._stats)

    def _fail_running(self, free: list, e: BaseException) -> None:
        """A failed program fails every running request; their slots are freed, the engine stays up."""
        with self._cv:
            failed = list(self._running.items())
            for slot, _ in failed:
                self.slots.release(slot)
                free.append(slot)
            self._running.clear()
        for _, h in failed:
            h._finish("error", self._stats_of(h), _one_line(e))

    def _first(self, free: list, slot: int, h: Handle, token: int, done: bool) -> None:
        """An insert's first token for its handle (if still in the slot it was dispatched for)."""
        if self._running.get(slot) is not h:
            return
        self._deliver(h, [token])
        if done:
            self._end(slot, h)
            free.append(slot)

    def _commits(self, free: list, slot: int, h: Handle, rows: list, done: bool) -> None:
        """A step's commits for its handle (if still in the slot it was dispatched for)."""
        if self._running.get(slot) is not h:
            return
        for ids in rows:
            if not h.done:
                self._deliver(h, ids, len(ids))
        if done:
            self._end(slot, h)
            free.append(slot)

    def _shares_a_new_prefix(self, h: Handle, admit: list) -> bool:
        """h's prompt is one admitted this same turn (a request's n choices, a batch's repeated
        prompt) and holds a full page, while the prefix cache is on: admitted together, each would
        prefill its own copy; one turn later the first's prefill has been dispatched and its full
        pages published, so h's prefill starts after them and shares them (and the draft context
        in them). Prompts that merely begin alike (a chat template's header) are admitted together:
        holding them back would prefill arrivals one at a time."""
        sl = self.slots
        if not admit or not sl.paged or not sl.pages.prefix_cache:
            return False
        p = tuple(h.request.prompt)
        return len(p) > sl.page_size and any(tuple(a.request.prompt) == p for _, a in admit)

    def _make_room(self, pipe: Pipeline, free: list) -> dict:
        """Paged: pages for every running request's next step. When the pool is short, read back
        everything in flight (exact lengths; requests that ended give their pages back), then
        preempt the newest running requests until the rest fit: each goes back to the front of the
        queue with what it has delivered and resumes by recomputing it. Returns the busy slots."""
        with self._cv:
            busy = dict(self._running)
        if not self.slots.grow(list(busy)):
            return busy
        pipe.drain()
        while True:
            with self._cv:
                busy = dict(self._running)
                if not busy or not self.slots.grow(list(busy)):
                    return busy
                if len(busy) == 1:        # check() keeps a request the pool cannot hold out
                    raise RuntimeError("the KV page pool cannot hold one request's next step")
                slot = max(busy, key=lambda b: busy[b]._admitted)
                h = self._running.pop(slot)
                self.slots.release(slot)
                self.slots.preemptions += 1
                free.append(slot)
                self._queue.appendleft(h)

    def _work(self) -> None:
        """The engine thread: admit, dispatch a step, read back the step dispatched `pipeline`
        steps ago (so the device is never idle while the host pushes tokens and prefills)."""
        free = list(range(self.slots.slots))
        pipe = self._pipe = Pipeline(self.slots, self.pipeline, functools.partial(self._first, free),
                                     functools.partial(self._commits, free), lock=self._cv)
        while True:
            with self._cv:
                if not self._running:
                    pipe.clear()                              # nobody waits for these results
                while not self._queue and not self._running and not self._closed:
                    t0 = time.perf_counter()
                    self._cv.wait()
                    self._idle_s += time.perf_counter() - t0
                if self._abort or (self._closed and not self._queue and not self._running):
                    return
                for slot, h in list(self._running.items()):     # cancelled: free at this step
                    if h.cancelled:
                        self.slots.release(slot)
                        del self._running[slot]
                        free.append(slot)
                admit = []
                free.sort()
                while self._queue and free:
                    h = self._queue[0]
                    slot = free[0]
                    if self._shares_a_new_prefix(h, admit):
                        break     # next turn: its prompt's pages are published by then (n choices share them)
                    if self.slots.paged and not self.slots.admit(slot, self._row(h)):
                        break                                   # waits for pages (a running request frees them)
                    self._queue.popleft()
                    free.pop(0)
                    self._running[slot] = h
                    h._admitted = next(self._admissions)
                    admit.append((slot, h))
            if admit:
                for slot, h in admit:
                    if getattr(h, "_stats", None) is None:      # (a preempted request keeps its own)
                        h._stats = RequestStats(prompt_tokens=len(h.request.prompt),
                                                queued_s=time.perf_counter() - h.submitted_at)
                try:
                    pipe.insert([(slot, self._row(h), h) for slot, h in admit])
                    if any(h.request.grammar is not None for _, h in admit):
                        pipe.drain()       # their first tokens reach their grammars before the step's masks
                except Exception as e:  # the inserted requests fail; the others keep running
                    with self._cv:
                        for slot, h in admit:
                            self._running.pop(slot, None)
                            free.append(slot)
                            self.slots.release(slot)
                    for _, h in admit:
                        h._finish("error", h._stats, _one_line(e))
                    continue
            with self._cv:
                busy = dict(self._running)
            try:
                if busy and self.slots.paged:
                    busy = self._make_room(pipe, free)
                if busy:
                    pipe.step(busy)
                if any(h.request.grammar is not None for h in busy.values()):
                    pipe.drain()           # the next step's masks need this one's commits and drafts
                else:
                    pipe.read(stepped=bool(busy))
            except Exception as e:  # noqa: BLE001  (a failed step: see _fail_running)
                pipe.clear()
                self._fail_running(free, e)
