"""The slot engine's host side (continuous batching): `Slots`, a fixed number of rows of loop
state on the device, each a request or free, scheduled from the host (which rows run which program
when, their settings, grammars and KV pages); `RowRequest` / `RowResult`, one row's request and
result; `offline_defaults`, an offline job's settings by platform. The device programs it runs
live in dflash_jax.serving.slot_programs, asked for through that module's one interface, `SlotPrograms`.

`insert` prefills a bucket of requests (up to `insert_width` arrivals of one prompt bucket in one
prefill of a power-of-two width) and writes their rows into free slots, `step` runs K
draft-verify-accept iterations over the busy slots (a loop of fixed trip count, so launching it does
not hold the host thread: see slot_programs._slots_step_body) and returns each slot's commits,
`release` frees a slot at the next step. Both have `_async` forms returning device arrays.
`Pipeline` dispatches them ahead of the reads (step n+1 runs while the host reads step n); it drives
`Slots.run` offline (generate(..., slots=N)) and dflash_jax.serving.engine.SlotEngine for the server. On a
mesh (the models' own) slots are split over 'data' and the model over 'model'. A request's tokens
do not depend on its slot or its batch-mates: rows are independent, and its randomness is keyed by
its own seed, stream and position.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import penalties, sampling, sharding, validation
from dflash_jax.serving.pages import PageAllocator, WindowPages, pages_for
from dflash_jax.attention import reads_pages
from dflash_jax.kernel_config import kernels_from
from dflash_jax import width
from dflash_jax.serving.slot_programs import SlotPrograms

__all__ = ["Slots", "Pipeline", "PagesShort", "RowRequest", "RowResult", "union_mode", "split_mode",
           "parse_step_buckets", "platform_of", "offline_defaults"]


class PagesShort(RuntimeError):
    """The paged pool has too few free pages for what was asked (a caller that admits and grows
    first never sees it)."""


# ----------------------------------------------------------------------------------------- rows
@dataclasses.dataclass(frozen=True)
class RowRequest:
    """One row for `Slots`: a prompt and its own settings (stop_ids already merged with eos)."""
    prompt: tuple[int, ...]
    max_new: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    rng_row: int = 0          # the stream its randomness is keyed by (generate: the prompt's index)
    # dflash_jax.penalties: over its generated tokens; logit_bias as (id, bias) pairs
    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    resumed: int = 0          # tokens at the prompt's end it generated before (a preempted row)
    # structured output: its grammar's state (dflash_jax.serving.grammar.Constraint: mask(), walk(drafts)),
    # advanced by the caller with every token the row commits; None: unconstrained
    grammar: Any = dataclasses.field(default=None, compare=False)

    @property
    def mode(self) -> str:
        """Its program's mode: the sampling mode, with PENALTIES appended when it adjusts the
        distribution (a program of its own, loop.Static.penalties) and GRAMMAR when it is constrained."""
        m = sampling.mode_for(self.temperature, self.top_p, self.top_k)
        adjusted = not penalties.is_default(self.presence, self.frequency, self.logit_bias, self.min_tokens)
        return m + (PENALTIES if adjusted else "") + (GRAMMAR if self.grammar is not None else "")

    def settings(self) -> dict:
        """Its loop.row_settings row."""
        return dict(max_new=self.max_new, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    stop_ids=list(self.stop_ids), seed=self.seed, rng_row=self.rng_row, presence=self.presence,
                    frequency=self.frequency, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
                    resumed=self.resumed)


@dataclasses.dataclass
class RowResult:
    tokens: list[int]
    acceptance_lengths: list[int]
    finish_reason: str        # "stop", "length" or "capacity", as GenerateResult's


_MODE_FILTERS = {"greedy": None, "sample": frozenset(), "topk": frozenset("k"), "topp": frozenset("p"),
                 "filtered": frozenset("kp")}


# A program mode's suffix: the program adjusts its rows' distributions (penalties; a row without
# any has zero penalties, no bias and min_tokens 0 there, so it samples as in the plain program)
PENALTIES = "+penalties"
# ... and its rows' tokens are masked by their grammars (loop.Static.grammar: one iteration a step,
# the host walking each constrained row's grammar along its drafts between steps)
GRAMMAR = "+grammar"


def split_mode(mode: str) -> tuple[str, bool]:
    """(sampling mode, penalties) of a program mode (RowRequest.mode, union_mode)."""
    mode = mode[:-len(GRAMMAR)] if mode.endswith(GRAMMAR) else mode
    return (mode[:-len(PENALTIES)], True) if mode.endswith(PENALTIES) else (mode, False)


def is_grammar(mode: str) -> bool:
    return mode.endswith(GRAMMAR)


def union_mode(modes) -> str:
    """The program mode that serves rows of all these modes: greedy rows stay argmax in any mode,
    a filter a row does not use keeps its whole distribution, and the penalties program serves
    rows without penalties too."""
    modes = list(modes)
    split = [split_mode(m) for m in modes]
    filters = [_MODE_FILTERS[m] for m, _ in split if _MODE_FILTERS[m] is not None]
    adjusted = (PENALTIES if any(pen for _, pen in split) else "") + (GRAMMAR if any(map(is_grammar, modes)) else "")
    if not filters:
        return "greedy" + adjusted
    u = frozenset().union(*filters)
    return {frozenset(): "sample", frozenset("k"): "topk", frozenset("p"): "topp"}.get(u, "filtered") + adjusted


def parse_step_buckets(text: str):
    """A command line's step-bucket setting as Slots' step_buckets: "auto", None ("none" / "off") or
    a tuple of ints ("1,2,4,8")."""
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    if t in ("none", "off", ""):
        return None
    try:
        return tuple(int(x) for x in t.split(","))
    except ValueError:
        raise ValueError(f"expected auto, none or comma-separated row counts, got {text!r}") from None


def platform_of(tree) -> str:
    """The platform ("cpu", "gpu", "tpu") of the first array in a pytree (model state, slot state)."""
    return next(iter(jax.tree.leaves(tree)[0].devices())).platform


# steps="auto": iterations per step by the step program's row count. Served on the H200 (Qwen3-8B
# shapes, simulated acceptance), one busy row ran fastest at K = 4 and 32 concurrent requests at
# K = 2 (6,606 tok/s over 256 requests, +12.8% over K = 4): with many rows a row that ends mid-step idles, and
# an arrival waits, for the rest of it.
STEPS_AUTO_WIDE = 16     # step programs over this many rows or more run 2 iterations a step, others 4


def steps_for_rows(steps, rows: int) -> int:
    """Iterations per step of a step program over `rows` rows: `steps` itself, or for "auto" 4
    below STEPS_AUTO_WIDE rows and 2 from it up."""
    if steps == "auto":
        return 2 if rows >= STEPS_AUTO_WIDE else 4
    return int(steps)


def offline_defaults(platform: str) -> dict:
    """An offline job's engine settings by platform, measured (BENCHMARKS.md): K (iterations per
    step) 8 and refills of >= 3 slots on an accelerator, K 4 and immediate refills on CPU."""
    return dict(steps=4, refill_min=1) if platform == "cpu" else dict(steps=8, refill_min=3)


def compile_workers() -> int:
    """Threads for compiling a warm-up's programs: half the host's cores, 1 to 8 (each compile of a
    large model holds a few GB of host memory)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def run_in_threads(jobs: Sequence[Callable[[], Any]], workers: int) -> None:
    """Run every job, `workers` at a time in threads (one: in this thread, in order); the first
    job's exception is raised once all have ended."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="dflash-compile") as ex:
        futures = [ex.submit(job) for job in jobs]
    for f in futures:
        f.result()


class Slots:
    """The device side of continuous batching: `slots` rows of loop state, each a request or free.

    insert(items) prefills requests into free slots (grouped by prompt bucket, up to `insert_width`
    rows per prefill program, default min(slots, 8)), step() runs `steps` iterations over all slots ("auto": 4 in a step over
    fewer than STEPS_AUTO_WIDE rows, 2 over more; steps_for), release(slot) frees
    a slot at the next step. Every program is compiled once per (slots, capacity, block, sampling
    mode, prompt bucket / insert width, step bucket) and cached with generate's programs
    (compile_count counts them). capacity: KV entries per slot; a request needs prompt + max_new
    <= capacity - block.

    step_buckets: the row counts a step may run over (an iteration's cost grows with its rows, so
    few busy slots should not pay for all of them). step(busy) runs the smallest bucket >=
    len(busy): the busy slots' rows (padded with free ones) are gathered, stepped by that bucket's
    program and written back; the full width (`slots`) is always one of them and needs no gather.
    "auto" (default): every power of two below `slots`, and `slots`; None or (): off, every step
    over all slots. On a mesh whose data axis is > 1 the rows of a bucket would cross data shards,
    so "auto" is off there and explicit buckets are refused.
    """

    def __init__(self, target, draft, *, slots: int, capacity: int, block_size: int | None = None,
                 steps: int | str = 4, insert_width: int | None = None, kernels=None, attention_impl=None,
                 step_buckets="auto", verify_width=None, kv_pages: int | None = None, page_size: int = 16,
                 prefix_cache: bool = True, window_pages: int | str = "auto", table_widths: str = "auto"):
        if table_widths not in ("auto", "pow2", "full"):
            raise ValueError(f"table_widths must be 'auto', 'pow2' or 'full', got {table_widths!r}")
        # paged programs' page-table width: "pow2" as wide as the busy rows' pages, rounded up to a
        # power of two (one program per width, compiled when first needed: cheaper gathers for short
        # rows where layers gather their pages: XLA, a mesh); "full" every page of a row in every
        # program (the server's: the programs warmup compiles are all it runs; where the Pallas
        # kernels read the pages they stop at each row's length, so the width costs them little);
        # "auto": "full" where the kernels read pages, else "pow2" (resolved below, with the kernels)
        self.table_widths = table_widths
        if insert_width is None:      # prefill up to 8 arrivals of a bucket at once
            insert_width = min(slots, 8) if validation.is_int(slots) else 1
        if steps != "auto" and (not validation.is_int(steps) or steps < 1):
            raise ValueError(f"steps must be an integer >= 1 or 'auto', got {steps!r}")
        for name, v, lo in (("slots", slots, 1), ("capacity", capacity, 2),
                            ("insert_width", insert_width, 1)):
            if not validation.is_int(v) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        S = 1 if draft is None else (draft.config.block_size if block_size is None else block_size)
        if draft is not None and not 1 <= S <= draft.config.block_size:
            raise ValueError(f"block_size={block_size!r} must be in [1, {draft.config.block_size}]")
        if S == 1:
            draft = None
        if capacity - S < 2:
            raise ValueError(f"capacity {capacity} leaves no room next to a block of {S}")
        self.paged = kv_pages is not None
        if self.paged:
            for name, v, lo in (("kv_pages", kv_pages, 2), ("page_size", page_size, 1)):
                if not validation.is_int(v) or v < lo:
                    raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
            if not hasattr(target, "new_paged_cache") or getattr(target, "commit", None) is not None:
                raise ValueError(f"a paged KV cache is not supported for the {target.config.model_type} target "
                                 f"(its recurrent layers keep per-row state): use the fixed-slot engine (no kv_pages)")
            capacity = -(-int(capacity) // page_size) * page_size      # positions per row: whole pages
        # a draft with sliding layers: their context in a window pool of its own (pages.WindowPages),
        # unless window_pages=0 (they keep every row in the main pages, the window a mask)
        window = draft.window() if self.paged and S > 1 and hasattr(draft, "window") else None
        if window_pages != "auto" and (not validation.is_int(window_pages) or window_pages == 1 or window_pages < 0):
            raise ValueError(f"window_pages must be 'auto', 0 (off) or an integer >= 2, got {window_pages!r}")
        if window is not None and window_pages != 0:
            if window_pages == "auto":
                window_pages = min(int(kv_pages), WindowPages.default_pages(
                    int(slots), window, S, page_size, steps_for_rows(steps, 1), int(capacity) // page_size))
            live = WindowPages.live_pages(window, S, page_size, (2 * steps_for_rows(steps, 1) + 1) * S)
            # a row's window pages are a subset of its main pages: a window pool as large as the main
            # pool always holds one row (auto sizes it so when the main pool is small)
            if window_pages - 1 < min(live, int(capacity) // page_size, int(kv_pages) - 1):
                raise ValueError(f"window_pages={window_pages} cannot hold one row's window ({live} pages of "
                                 f"{page_size} for window {window}, block {S}): give more, or 0 (no window pool)")
        else:
            window_pages = None
        # verify_width None: the whole block in a step program of known trip count (the default);
        # "auto" or a width: the adaptive program, whose per-width loops XLA:GPU waits on
        # (docs/adaptive-width.md)
        if draft is None and verify_width not in (None, "auto", 0):
            raise ValueError(f"verify_width={verify_width!r} needs a draft and a block size above 1")
        if draft is not None and verify_width is not None:
            width.width_index(width.widths_for(S), verify_width)
        self.verify_width = verify_width if draft is not None else None
        self.target, self.draft = target, draft
        self.slots, self.capacity, self.block_size = int(slots), int(capacity), S
        self.steps = steps if steps == "auto" else int(steps)   # iterations per step (steps_for)
        self.insert_width = int(insert_width)
        self.max_model_len = self.capacity - S
        self.kernels = kernels_from(kernels, attention_impl).resolve()
        # the device programs (dflash_jax.serving.slot_programs); slots on the models' mesh's 'data' axis
        self.programs = SlotPrograms(target, draft, slots=self.slots, capacity=self.capacity, block_size=S,
                                     kernels=self.kernels, verify_width=self.verify_width,
                                     pages=(int(kv_pages), int(page_size), window_pages) if self.paged else None)
        self.mesh = self.programs.mesh
        if self.table_widths == "auto":
            self.table_widths = "full" if reads_pages(self.kernels, self.mesh) else "pow2"
        self._data = 1 if self.mesh is None else sharding.data_axis_size(self.mesh)
        if self.slots % self._data:
            raise ValueError(f"slots={slots} must be a multiple of the mesh's data axis ({self._data})")
        self.step_buckets = self._check_buckets(step_buckets)
        self.bucket_steps: collections.Counter = collections.Counter()   # steps dispatched per row count
        self._tstate, self._dstate = self.programs.tstate, self.programs.dstate
        if self.paged:
            self.page_size, self.pages_per_row = int(page_size), self.capacity // int(page_size)
            self.pages = PageAllocator(int(kv_pages), self.page_size, prefix_cache=bool(prefix_cache))
            # the draft's sliding layers' pages: a second pool and table (None: they use the main ones)
            self.wpages = None if window_pages is None else WindowPages(
                window_pages, self.page_size, window=window, block_size=S, slots=self.slots,
                pages_per_row=self.pages_per_row, prefix_cache=bool(prefix_cache))
            self.table = np.zeros((self.slots, self.pages_per_row), np.int32)
            self._row_pages: list[list[int]] = [[] for _ in range(self.slots)]
            self._row_tokens: list[list[int]] = [[] for _ in range(self.slots)]   # prompt + committed
            self._known = np.zeros((self.slots,), np.int64)      # committed length the host has read
            self._limit = np.zeros((self.slots,), np.int64)      # prompt + max_new
            self._inflight = np.zeros((self.slots,), np.int64)   # iterations dispatched, not read
            self.epoch = np.zeros((self.slots,), np.int64)       # inserts into the slot so far
            self._admitted: dict[int, tuple] = {}   # slot -> (pages, prefix hit, window row) before insert
            self.preemptions = 0
        self.state = self.programs.empty()
        self._release = np.zeros((self.slots,), bool)
        self._programs: dict = {}     # (mode, rows) -> step program, ("insert", ...) -> insert program
        self._warm_modes: list = []   # the modes warmup compiled (_served_mode runs others in them)
        self._wps: dict = {}          # (mode, rows) -> the step's verify-width fields (_width_params)
        self._small: dict = {}        # small host arrays -> their device copies (_put_cached)
        self.modes = ["greedy"] * self.slots       # the mode of each slot's request (free: greedy)
        # structured output: each slot's grammar (RowRequest.grammar) and the drafts its next
        # iteration verifies (a grammar step's proposal, read back with its commits)
        self.grammars: list = [None] * self.slots
        self.next_drafts = np.zeros((self.slots, max(self.block_size - 1, 1)), np.int32)
        self._has_drafts = np.zeros((self.slots,), bool)
        self._insert_drafts: list = []    # grammar inserts' first drafts, not read yet: ([(slot, grammar)], [W, S-1])
        self.platform = platform_of(self.state)

    def _static(self, *, prompt_bucket: int, batch: int, mode: str):
        """The compile key of a program in program mode `mode` (SlotPrograms.static)."""
        grammar = is_grammar(mode)
        mode, adjusted = split_mode(mode)
        return self.programs.static(prompt_bucket=prompt_bucket, batch=batch, mode=mode, penalties=adjusted,
                                    grammar=grammar)

    def _check_buckets(self, buckets) -> tuple[int, ...]:
        """The step buckets in use, ascending, `slots` last; () when off (see the class docstring)."""
        if buckets is None or (isinstance(buckets, (tuple, list)) and not buckets):
            return ()
        if isinstance(buckets, str):
            if buckets != "auto":
                raise ValueError(f"step_buckets must be 'auto', None or a sequence of row counts, got {buckets!r}")
            if self._data > 1:
                return ()
            return tuple(1 << i for i in range(self.slots.bit_length()) if 1 << i < self.slots) + (self.slots,)
        try:
            values = list(buckets)
        except TypeError:
            raise ValueError(f"step_buckets must be 'auto', None or a sequence of row counts, got {buckets!r}") from None
        bad = [b for b in values if not validation.is_int(b) or not 1 <= b <= self.slots]
        if bad:
            raise ValueError(f"step_buckets entries must be integers in [1, slots={self.slots}], got {bad[0]!r}")
        if len(set(values)) != len(values):
            raise ValueError(f"step_buckets has repeated entries: {list(values)}")
        if self._data > 1:
            raise ValueError(f"step_buckets on a mesh with a data axis of {self._data}: a bucket's rows would be "
                             f"gathered across data shards; pass step_buckets=None there")
        return tuple(sorted({int(b) for b in values} | {self.slots}))

    def steps_for(self, rows: int, mode: str = "") -> int:
        """Iterations one step over `rows` rows (a step bucket) runs (steps_for_rows); a grammar
        step runs one (the host walks the grammars along the next drafts between steps)."""
        return 1 if is_grammar(mode) else steps_for_rows(self.steps, rows)

    def step_bucket(self, n_busy: int) -> int:
        """The row count a step over n_busy busy slots runs (the smallest bucket >= n_busy)."""
        return next((b for b in self.step_buckets if b >= n_busy), self.slots)

    def prompt_bucket(self, n: int) -> int:
        return self.programs.prompt_bucket(n)

    def check(self, r: RowRequest) -> None:
        if not r.prompt or len(r.prompt) + r.max_new > self.max_model_len:
            raise ValueError(f"prompt of {len(r.prompt)} tokens + max_new {r.max_new} exceeds the context "
                             f"length {self.max_model_len} (capacity {self.capacity} - block {self.block_size})")

    # programs ----------------------------------------------------------------------------------
    def insert_widths(self) -> list[int]:
        """The prefill widths insert uses: powers of two up to insert_width (a bucket of n arrivals
        runs as few prefills as their binary digits, none padded beyond the next power of two)."""
        d = self._data       # on a mesh a prefill's rows are split over 'data': whole rows per shard
        return [d << i for i in range(max(self.insert_width, d).bit_length()) if d << i <= max(self.insert_width, d)]

    def _put(self, x, spec=None):
        """x on the slots' mesh (rows on 'data' by default; spec () replicates); as is without one.
        Always from a copy: on CPU a large enough aligned numpy array is aliased, not copied, by
        jnp.asarray / device_put, and the host's own arrays (the page table, the release flags)
        change while the program dispatched with them has not run yet."""
        x = np.array(x, copy=True)
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, P() if spec is None else spec))

    def _insert_program(self, bucket: int, mode: str, width: int, pages: int | None = None):
        """The prefill program of `width` requests of prompt bucket `bucket` (kept on the engine as
        _step_program's: a request's first token must not wait for host work). pages: paged, the
        table's width (default every page of a row)."""
        pages = self._pages_bucket(pages)
        prog = self._programs.get(("insert", bucket, mode, width, pages))
        if prog is None:
            st = self._static(prompt_bucket=bucket, batch=width, mode=mode)
            p = self.programs.idle_params(width, bucket, **self._first_masks(mode, [], width))
            rows = self._put(np.full((width,), self.slots, np.int32))
            if self.paged:
                p = p.replace(prompt_start=self._put(np.zeros((width,), np.int32), P("data")))
                table = self._tables(np.zeros((width, pages), np.int32), np.zeros((width, pages), np.int32))
                prog = self.programs.insert(st, (self.state, p, rows, table), pages)
            else:
                prog = self.programs.insert(st, (self.state, p, rows))
            self._programs[("insert", bucket, mode, width, pages)] = prog
        return prog

    def _first_masks(self, mode: str, rows: list, width: int) -> dict:
        """An insert's grammar field: [width, 1, words] each row's mask for its first token (all
        ones for unconstrained rows and padding); {} without grammar."""
        if not is_grammar(mode):
            return {}
        masks = np.full((width, 1, -(-self.target.config.vocab_size // 32)), -1, np.int32)
        for i, r in enumerate(rows):
            if r.grammar is not None:
                masks[i, 0] = r.grammar.mask()
        return dict(grammar_mask=jnp.asarray(masks))

    def note_drafts(self, slot: int, drafts) -> None:
        """A grammar step's proposal for `slot` (read back with its commits): the drafts its next
        step verifies, which the host walks its grammar along first."""
        self.next_drafts[slot] = drafts
        self._has_drafts[slot] = True

    def _table_arg(self, table: np.ndarray):
        """Page-table rows as a program argument (on a mesh: rows on 'data', as the slots')."""
        return self._put(table, None if self.mesh is None else P("data", None))

    def _tables(self, main: np.ndarray, window: np.ndarray):
        """A program's table argument: the main table rows, or with a window pool the pair (main,
        window rows: WindowPages.table)."""
        if self.wpages is None:
            return self._table_arg(main)
        return self._table_arg(main), self._table_arg(window)

    def _step_tables(self, pages: int):
        """Every slot's table rows, `pages` wide, as a step's argument."""
        return self._tables(self.table[:, :pages], None if self.wpages is None else self.wpages.table[:, :pages])

    def _served_mode(self, mode: str, key: Callable[[str], Any]) -> str:
        """The mode whose program runs rows of `mode`: `mode` itself when its program (`key(mode)` in
        the kept programs) is compiled or warmup compiled nothing, else the lightest warmed mode whose
        compiled program serves it (union_mode([mode, m]) == m, grammar the same: a filter a row does
        not use keeps its distribution and its draws, and the penalties program serves rows without
        penalties), so a served request of a mode the warm-up left out runs at once in a warmed
        program instead of compiling one (`serve --warmup-modes greedy,filtered` covers every
        sampling request without penalties or grammar)."""
        if key(mode) in self._programs:
            return mode
        serving = [m for m in self._warm_modes
                   if is_grammar(m) == is_grammar(mode) and union_mode([mode, m]) == m and key(m) in self._programs]
        # the lightest that serves: no penalties before penalties, fewer filters before more
        cost = lambda m: (split_mode(m)[1], len(_MODE_FILTERS[split_mode(m)[0]] or ()))  # noqa: E731
        return min(serving, key=cost, default=mode)

    def _pages_bucket(self, pages: int | None) -> int | None:
        """A paged program's table width for rows holding up to `pages` pages: the next power of two,
        at most a row's every page (None, or table_widths "full": that); None without pages."""
        return self.programs.table_width(None if self.table_widths == "full" else pages)

    def _rows_pages(self, slots) -> int:
        """The most pages any of these slots holds."""
        return max([len(self._row_pages[s]) for s in slots] + [1])

    def _step_static(self, mode: str, rows: int | None):
        """(compile key, iterations, rows) of the step program of `mode` over `rows` slots (None: all)."""
        rows = self.slots if rows is None else int(rows)
        return self._static(prompt_bucket=0, batch=self.slots, mode=mode), self.steps_for(rows, mode), rows

    def _step_program(self, mode: str, rows: int | None = None, pages: int | None = None):
        """The step program of `mode` over `rows` slots (a step bucket; None or slots: all of them).
        Kept per (mode, rows) on the engine as well: finding it in the shared cache hashes its
        Static (the models' graph definitions), a few ms of host time per step on the hot path.
        pages: paged, the table's width (_pages_bucket)."""
        rows = self.slots if rows is None else int(rows)
        pages = self._pages_bucket(pages)
        prog = self._programs.get((mode, rows, pages))
        if prog is not None:
            return prog
        st, K, rows = self._step_static(mode, rows)
        wp = dict(self.programs.width_fields(st, K, rows), **self._grammar_fields(mode, list(range(rows))))
        idx = () if rows == self.slots else (self._put(np.arange(rows, dtype=np.int32)),)
        table = (self._step_tables(pages),) if self.paged else ()
        prog = self.programs.step(st, K, rows, (self.state, self._put(self._release), wp, *idx, *table), pages)
        self._programs[(mode, rows, pages)] = prog
        return prog

    def _grammar_fields(self, mode: str, rows: list[int]) -> dict:
        """A grammar step's Params fields for the slots `rows` (in the program's row order): each
        constrained slot's masks along the drafts it will verify (its grammar walked along the last
        step's proposal, or along zeros before it has one: refused drafts are simply rejected), all
        ones for the others; {} for a step without grammar."""
        if not is_grammar(mode):
            return {}
        for owners, arr in self._insert_drafts:        # (the engine has read those inserts: no wait)
            host = np.asarray(jax.device_get(arr))
            for i, (slot, g) in enumerate(owners):
                if self.grammars[slot] is g and not self._has_drafts[slot]:   # that request's, none newer
                    self.note_drafts(slot, host[i])
        self._insert_drafts.clear()
        S, words = self.block_size, -(-self.target.config.vocab_size // 32)
        drafts = np.zeros((len(rows), max(S - 1, 1)), np.int32)
        masks = np.full((len(rows), S, words), -1, np.int32)
        groups: dict = {}           # rows by the object that walks them together (Grammars.walk)
        for i, slot in enumerate(rows):
            if self._has_drafts[slot]:
                drafts[i] = self.next_drafts[slot]
            g = self.grammars[slot]
            if g is not None:
                groups.setdefault(getattr(g, "grammars", None), []).append(i)
        for walker, idx in groups.items():
            if walker is not None and hasattr(walker, "walk"):   # the rows at once, on the library's threads
                masks[idx] = walker.walk([self.grammars[rows[i]] for i in idx], drafts[idx, :S - 1])
            else:
                for i in idx:
                    masks[i] = self.grammars[rows[i]].walk(drafts[i, :S - 1])
        spec = lambda x: P("data", *([None] * (x.ndim - 1)))                            # noqa: E731
        return dict(grammar_mask=self._put(masks, spec(masks)), grammar_drafts=self._put(drafts, spec(drafts)))

    def _width_params(self, mode: str, rows: int | None, profile_width: int | None = None) -> dict:
        """The verify-width fields of a step's Params: this engine's verify_width, the costs profiled
        for that step program (warmup; none yet: ones, so "auto" keeps the whole block), or a
        profiling step forced to width index profile_width with nothing accepted. The step's own
        (profile_width None) are built once per program and kept until profile_widths measures its
        costs: building them is ~10 small device arrays, which a step must not pay each time."""
        rows = self.slots if rows is None else int(rows)
        if profile_width is None and (mode, rows) in self._wps:
            return self._wps[(mode, rows)]
        wp = self.programs.width_fields(*self._step_static(mode, rows), profile_width)
        if profile_width is None:
            self._wps[(mode, rows)] = wp
        return wp

    def _put_cached(self, x: np.ndarray):
        """A small host array on the device, the same device array for equal contents (a step's
        release flags are almost always all clear and its rows the same busy set)."""
        k = (x.dtype.str, x.shape, x.tobytes())
        out = self._small.get(k)
        if out is None:
            if len(self._small) >= 256:
                self._small.clear()
            out = self._small[k] = self._put(x)
        return out

    def profile_widths(self, mode: str = "greedy", rows: int | None = None) -> None:
        """Measure the step program's iteration cost at each verify width (for "auto"), once per
        program: steps over the current state forced to each width with nothing accepted. Every
        slot must be free (a free row's iteration costs what a busy one's does: fixed shapes)."""
        st, K, n = self._step_static(mode, rows)
        if self.verify_width != "auto" or not bool(np.all(self.programs.done(self.state))):
            return
        prog = self._step_program(mode, n)
        idx = () if n == self.slots else (self._put(np.arange(n, dtype=np.int32)),)

        def time_width(i):
            t0 = time.perf_counter()
            table = (self._step_tables(self.pages_per_row),) if self.paged else ()
            self.state, commits, _, _ = prog(self._tstate, self._dstate, self.state, self._put(self._release),
                                             self._width_params(mode, n, i), *idx, *table)
            jax.block_until_ready(commits)
            return time.perf_counter() - t0, 0.0, self.steps_for(n)
        self.programs.profile_widths(st, K, n, time_width)
        self._wps.pop((mode, n), None)            # the step's width fields now carry these costs

    def warmup(self, prompt_lengths=(1,), modes=("greedy",), workers: int | None = None) -> None:
        """Compile the insert programs of these prompt lengths' buckets (every insert width) and the
        step programs of these modes (every step bucket) now, so no request waits for a compile;
        with verify_width "auto", profile each step program's widths (profile_widths) while every
        slot is free. The programs compile in `workers` threads (default compile_workers(); XLA's
        compiles release the GIL): a Qwen3-8B server's ten programs took 265-420 s one after the
        other on an H100. The profiling runs after, one program at a time."""
        self._warm_modes += [m for m in modes if m not in self._warm_modes]
        jobs = [functools.partial(self._step_program, m, n) for m in modes for n in self.step_buckets or (self.slots,)]
        jobs += [functools.partial(self._insert_program, b, m, w) for m in modes
                 for b in sorted({self.prompt_bucket(n) for n in prompt_lengths}) for w in self.insert_widths()]
        run_in_threads(jobs, compile_workers() if workers is None else workers)
        for m in modes:
            for n in self.step_buckets or (self.slots,):
                self.profile_widths(m, n)
                self._width_params(m, n)          # built now, not on a request's first step

    # operations ----------------------------------------------------------------------------------
    def insert_async(self, items: Sequence[tuple[int, RowRequest]]) -> list[tuple[list[int], Any, Any]]:
        """Dispatch the prefills of each (slot, request) into its slot (the slots must be free)
        without waiting for them: requests of one prompt bucket share a prefill of a power-of-two
        width. Returns [(slots, first [W] device array, done [W] device array)], one per prefill;
        entry i of first/done belongs to slots[i]."""
        groups: dict[int, list] = {}
        for slot, r in items:
            self.check(r)
            hit = 0
            if self.paged:
                if slot not in self._admitted and not self.admit(slot, r):
                    raise PagesShort(f"no KV pages for a prompt of {len(r.prompt)} tokens "
                                     f"({self.pages.available()} of {self.pages.num_pages - 1} pages free)")
                hit = self._admitted[slot][1]
            groups.setdefault(self.prompt_bucket(len(r.prompt) - hit), []).append((slot, r))
        widths = self.insert_widths()
        out = []
        for bucket, group in sorted(groups.items()):
            at = 0
            while at < len(group):
                W = max([w for w in widths if w <= len(group) - at] or widths[:1])
                chunk = group[at:at + W]
                at += len(chunk)
                mode = union_mode(r.mode for _, r in chunk)
                pages = self._pages_bucket(max(len(self._admitted[slot][0]) for slot, _ in chunk)) if self.paged else None
                mode = self._served_mode(mode, lambda m: ("insert", bucket, m, W, self._pages_bucket(pages)))
                prompt = np.zeros((W, bucket), np.int32)
                lens = np.ones((W,), np.int32)
                rows = np.full((W,), self.slots, np.int32)
                starts = np.zeros((W,), np.int32)
                table = np.zeros((W, pages), np.int32) if self.paged else None
                wtable = np.zeros((W, pages), np.int32) if self.paged else None
                settings = [RowRequest(prompt=(0,), max_new=1).settings()] * W
                for i, (slot, r) in enumerate(chunk):
                    if self.paged:
                        starts[i] = self._start_row(slot, r)
                        table[i] = self.table[slot, :pages]
                        if self.wpages is not None:
                            wtable[i] = self.wpages.table[slot, :pages]
                    prompt[i, :len(r.prompt) - starts[i]] = r.prompt[starts[i]:]
                    lens[i], rows[i] = len(r.prompt), slot
                    settings[i] = r.settings()
                    self.modes[slot] = r.mode
                    self.grammars[slot] = r.grammar
                    self._has_drafts[slot] = False
                    self._release[slot] = False
                p = self.programs.params(prompt, lens, np.arange(W) < len(chunk), settings,
                                         **self._first_masks(mode, [r for _, r in chunk], W))
                prog = self._insert_program(bucket, mode, W, pages)
                if self.paged:
                    p = p.replace(prompt_start=self._put(starts, P("data")))
                    self.state, first, done, *drafts = prog(self._tstate, self._dstate, self.state, p, self._put(rows),
                                                   self._tables(table, wtable))
                    for slot, r in chunk:   # both caches hold the prompt once the prefill runs (dispatch order)
                        self._known[slot] = len(r.prompt)
                        self.pages.publish(r.prompt, self._row_pages[slot])
                        if self.wpages is not None:   # its window pages too; then those behind its window go
                            self.wpages.publish(slot, r.prompt)
                            self.wpages.trim(slot, len(r.prompt))
                else:
                    self.state, first, done, *drafts = prog(self._tstate, self._dstate, self.state, p, self._put(rows))
                if drafts:     # read when the first step's masks are built (_grammar_fields)
                    self._insert_drafts.append(([(slot, r.grammar) for slot, r in chunk], drafts[0]))
                out.append(([slot for slot, _ in chunk], first, done))
        return out

    def insert(self, items: Sequence[tuple[int, RowRequest]]) -> dict[int, tuple[int, bool]]:
        """Prefill each (slot, request) into its slot (the slots must be free). Returns
        {slot: (first token, done)}."""
        out = {}
        for slots, first, done in self.insert_async(items):
            first, done = np.asarray(first), np.asarray(done)
            for i, slot in enumerate(slots):
                out[slot] = (int(first[i]), bool(done[i]))
        return out

    def release(self, slot: int) -> None:
        """Free `slot` at the next step (its row is marked done there). Paged: its full pages whose
        target and draft K/V are final are published for prefix hits, and its pages are released."""
        self._release[slot] = True
        self.modes[slot] = "greedy"
        self.grammars[slot] = None
        self._has_drafts[slot] = False
        if self.paged:
            if slot in self._admitted:                      # admitted, never inserted
                pages, _, wrow = self._admitted.pop(slot)
                self.pages.release(pages)
                if self.wpages is not None:
                    self.wpages.release_row(wrow)
                return
            pages = self._row_pages[slot]
            if pages:
                # rows below known - S are final in both caches: the draft's context trails the
                # target by the pending taps (<= S), and every later write lands at or past them
                final = max(0, int(self._known[slot]) - self.block_size)
                self.pages.publish(self._row_tokens[slot][:final], pages)
                self.pages.release(pages)
                if self.wpages is not None:
                    self.wpages.publish(slot, self._row_tokens[slot][:final])
                    self.wpages.release(slot)
            self._row_pages[slot], self._row_tokens[slot] = [], []
            self.table[slot] = 0
            self.epoch[slot] += 1

    # pages ---------------------------------------------------------------------------------------
    def _reach(self, slot: int, extra_iters: int) -> int:
        """Positions slot's row may write before the host reads `extra_iters` more iterations than
        it has dispatched: each iteration commits at most a block and writes a block past its length."""
        S = self.block_size
        reach = int(self._known[slot]) + (int(self._inflight[slot]) + extra_iters) * S + S
        return min(reach, int(self._limit[slot]) + S, self.capacity)

    def _give(self, slot: int, positions: int) -> bool:
        """Pages for `slot` to cover `positions` (main and window ones), allocated now; False
        (nothing allocated) when either pool is short."""
        n = pages_for(positions, self.page_size)
        need = n - len(self._row_pages[slot])
        if need <= 0:
            return True
        if need > self.pages.available() or (
                self.wpages is not None and n - len(self.wpages.rows[slot]) > self.wpages.alloc.available()):
            return False
        new = self.pages.allocate(need)
        m = len(self._row_pages[slot])
        self._row_pages[slot].extend(new)
        self.table[slot, m:m + len(new)] = new
        if self.wpages is not None:
            self.wpages.grow(slot, n)
        return True

    def admit(self, slot: int, r: RowRequest) -> bool:
        """Paged: take `slot`'s pages for r (its prefix hit, the rest of its prompt and its first
        step's reach) before insert; False (nothing taken) when the pool is short: the request waits."""
        self.check(r)
        # a resumed row's generated tail must reach its token buffer (the penalties count it there):
        # its hit stops before it
        lookup = r.prompt[:len(r.prompt) - r.resumed] if r.mode.endswith(PENALTIES) else r.prompt
        hit_pages, hit = self.pages.match(lookup, count=False)     # counted once admitted: a queue head
        wrow = []                                                  # retried every turn counts once
        if self.wpages is not None:   # the hit capped where the window pages behind it are gone
            hit_pages, hit, wrow = self.wpages.match(self.pages, lookup, hit_pages, hit)
        S, K = self.block_size, self.steps_for(1)
        reach = min(len(r.prompt) + K * S + S, len(r.prompt) + r.max_new + S, self.capacity)
        n = pages_for(reach, self.page_size)
        new = self.pages.allocate(max(0, n - len(hit_pages)))
        row = None
        if new is not None and self.wpages is not None:
            row = self.wpages.admit(wrow, len(r.prompt), len(hit_pages) + len(new))
            if row is None:
                self.pages.release(new)
                new = None
        if new is None:
            self.pages.release(hit_pages)
            if self.wpages is not None:
                self.wpages.release_row(wrow)
            return False
        self.pages.count(len(r.prompt), hit)
        self._admitted[slot] = (hit_pages + new, hit, row)
        return True

    def _start_row(self, slot: int, r: RowRequest) -> int:
        """The admitted slot's row state on the host; returns its prefix hit (the prefill's start)."""
        pages, hit, wrow = self._admitted.pop(slot)
        self._row_pages[slot] = pages
        self.table[slot] = 0
        self.table[slot, :len(pages)] = pages
        if self.wpages is not None:
            self.wpages.start(slot, wrow)
        self._row_tokens[slot] = list(r.prompt)
        # known: only the hit until the prefill is dispatched (insert_async sets the prompt's length
        # then), so a release after a failed insert publishes no page the prefill never wrote
        self._known[slot], self._limit[slot] = hit, len(r.prompt) + r.max_new
        self._inflight[slot] = 0
        self.epoch[slot] += 1
        return hit

    def grow(self, busy: Sequence[int]) -> list[int]:
        """Paged: pages for each busy slot to cover what its next step may write (see _reach).
        Returns the slots that could not get them (they got nothing); the caller frees pages
        (preempting a request) and asks again, or stops stepping them."""
        K = self.steps_for(self.step_bucket(len(busy)))
        if self.wpages is not None:   # first the window pages no program run from now on can touch
            for b in busy:
                self.wpages.trim(b, int(self._known[b]))
        return [b for b in busy if not self._give(b, self._reach(b, K))]

    def note_insert(self, slot: int, epoch: int, first: int) -> None:
        """Paged: an insert's first token read back (for slot's occupant of `epoch`)."""
        if self.epoch[slot] == epoch:
            self._row_tokens[slot].append(first)

    def note_step(self, slot: int, epoch: int, iters: int, rows: list) -> None:
        """Paged: a step's commits read back: rows, the token lists of its `iters` iterations."""
        if self.epoch[slot] != epoch:
            return
        self._inflight[slot] -= iters
        for ids in rows:
            self._row_tokens[slot].extend(ids)
            self._known[slot] += len(ids)

    def page_stats(self) -> dict:
        if not self.paged:
            return {}
        return dict(self.pages.stats(), preemptions=self.preemptions,
                    **({} if self.wpages is None else self.wpages.stats()))

    def step_async(self, busy: Sequence[int] | None = None):
        """Dispatch `steps` iterations over the busy slots (None: every slot), in the program
        of the union of their modes and of the smallest step bucket holding them, without waiting:
        returns device arrays over every slot (commits [K, B, S], produced [K, B], done [B]; zeros
        for slots outside the bucket; a grammar step also drafts [B, S-1], its rows' next drafts,
        which the reader hands to `note_drafts`). Slots outside `busy` may not advance: pass every slot whose
        request runs. The host may dispatch the next insert or step before reading them (JAX runs
        them in order), so its bookkeeping overlaps the device's work."""
        busy = list(range(self.slots)) if busy is None else sorted({int(b) for b in busy})
        if busy and not 0 <= busy[0] <= busy[-1] < self.slots:
            raise ValueError(f"busy slots must be in [0, {self.slots}), got {busy}")
        n = self.step_bucket(len(busy))
        mode = union_mode(self.modes[b] for b in busy)
        pages = self._pages_bucket(self._rows_pages(busy)) if self.paged else None
        mode = self._served_mode(mode, lambda m: (m, int(n), self._pages_bucket(pages)))
        prog = self._step_program(mode, n, pages)
        self.bucket_steps[n] += 1
        wp = self._width_params(mode, n)
        release = self._put_cached(self._release)
        table = ()
        if self.paged:
            K = self.steps_for(n, mode)
            short = [b for b in busy if pages_for(self._reach(b, K), self.page_size) > len(self._row_pages[b])
                     or (self.wpages is not None and len(self.wpages.rows[b]) < len(self._row_pages[b]))]
            if short:
                raise PagesShort(f"slots {short} have no pages for their next step: call grow() first")
            self._inflight[busy] += K
            table = (self._step_tables(pages),)
        if n == self.slots:
            wp = dict(wp, **self._grammar_fields(mode, list(range(n))))
            self.state, *out = prog(self._tstate, self._dstate, self.state, release, wp, *table)
        else:
            taken = set(busy)
            idx = busy + [b for b in range(self.slots) if b not in taken][:n - len(busy)]
            wp = dict(wp, **self._grammar_fields(mode, idx))
            self.state, *out = prog(self._tstate, self._dstate, self.state, release, wp,
                                    self._put_cached(np.asarray(idx, np.int32)), *table)
        self._release[:] = False
        return tuple(out)

    def step(self, busy: Sequence[int] | None = None):
        """step_async, waited for: numpy (commits [K, B, S], produced [K, B], done [B])."""
        return tuple(np.asarray(x) for x in jax.device_get(self.step_async(busy)))

    # offline -------------------------------------------------------------------------------------
    def run(self, requests: Sequence[RowRequest], on_finish: Callable[[int, RowResult], None] | None = None,
            *, pipeline: int = 1, refill_ahead: bool = True, refill_min: int | None = None) -> list[RowResult]:
        """Run every request to its end, refilling slots as rows finish (arrival order).

        pipeline: steps dispatched ahead of the one whose results the host reads (0: wait for
        each step). With 1 the device runs step n+1 while the host reads step n and prepares the
        next inserts, so the host's work no longer stalls the device; a slot whose row finished in
        step n is refilled after step n+1 (it idles one step).
        refill_ahead: a slot whose request must end within the steps already dispatched (it has
        at most steps x those steps tokens left: every iteration commits at least one) is refilled
        right behind them instead, as if the host had read them; its last tokens are still read
        from those steps. Only rows ending on a stop token idle then.
        refill_min: wait for this many free slots (or as many as requests wait) before a refill,
        so a prefill serves several arrivals; 1: at once; None: offline_defaults' (3 on an
        accelerator, where a small prefill's cost is mostly its weight reads; 1 on CPU, where it is
        compute and scales with the rows). Each was measured (BENCHMARKS.md, docs/perf-log.md): they
        gain on the H200; on CPU refill_min 3 and steps 8 lose."""
        for r in requests:
            self.check(r)
        if not validation.is_int(pipeline) or pipeline < 0:
            raise ValueError(f"pipeline must be an integer >= 0, got {pipeline!r}")
        if refill_min is None:
            refill_min = offline_defaults(self.platform)["refill_min"]
        if not validation.is_int(refill_min) or refill_min < 1:
            raise ValueError(f"refill_min must be an integer >= 1, got {refill_min!r}")
        if self.paged:                       # a slot's pages go back when its request ends, not ahead
            refill_ahead = False
        waiting = collections.deque(range(len(requests)))
        free = list(range(self.slots))
        owner: dict[int, int] = {}           # slot -> request, as the host last dispatched it
        toks: dict[int, list] = {}
        accs: dict[int, list] = {}
        results: list[RowResult | None] = [None] * len(requests)
        self.last_run_times: dict[int, list[float]] = {}   # request -> [first token, finished] (perf_counter)

        def finish(slot, i):
            self.last_run_times[i].append(time.perf_counter())
            r = requests[i]
            t = toks.pop(i)
            reason = "stop" if t and t[-1] in r.stop_ids else "length" if len(t) >= r.max_new else "capacity"
            results[i] = RowResult(tokens=t, acceptance_lengths=accs.pop(i), finish_reason=reason)
            if owner.get(slot) == i:         # not refilled ahead: the slot is free now
                del owner[slot]
                if self.paged:               # its pages back (full ones published)
                    self.release(slot)
                if slot not in free:         # (already there when it ended ahead, unfilled)
                    free.append(slot)
            if on_finish is not None:
                on_finish(i, results[i])

        def first(slot, i, token, done):
            toks[i].append(token)
            self.last_run_times[i] = [time.perf_counter()]
            if done:
                finish(slot, i)

        def commits(slot, i, rows, done):
            if results[i] is not None:       # finished at its insert, or earlier
                return
            for ids in rows:
                toks[i].extend(ids)
                accs[i].append(len(ids))
            if done:
                finish(slot, i)
            elif owner.get(slot) != i and not pipe.steps_in_flight(slot, i):
                # refilled ahead, yet not ended by the last step dispatched for it
                raise RuntimeError(f"request {i} in slot {slot} did not end within the steps dispatched "
                                   f"for it ({len(toks[i])} of {requests[i].max_new} tokens)")

        pipe = Pipeline(self, pipeline, first, commits)
        self.last_run_counters = pipe.counters      # where this run's thread spent its time (bench_engine)

        def ending_ahead():
            """Slots whose request ends within the steps in flight: free for the next insert."""
            for slot, i in list(owner.items()):
                if slot in free or i not in toks or len(free) >= len(waiting):
                    continue
                if toks[i] and requests[i].max_new - len(toks[i]) <= pipe.iterations_in_flight(slot, i):
                    free.append(slot)

        while waiting or owner or pipe:
            if refill_ahead and waiting and pipe:
                ending_ahead()
            running = [s for s in owner if s not in free]
            if waiting and free and (len(free) >= min(refill_min, len(waiting)) or not running):
                items = []
                free.sort()
                while waiting and free:
                    if self.paged and not self.admit(free[0], requests[waiting[0]]):
                        if not owner:
                            raise PagesShort(f"kv_pages={self.pages.num_pages} cannot hold request {waiting[0]}")
                        break                # waits for a running request's pages (no preemption offline)
                    i, slot = waiting.popleft(), free.pop(0)
                    owner[slot], toks[i], accs[i] = i, [], []
                    items.append((slot, requests[i], i))
                if items:
                    pipe.insert(items)
            stepped = bool(owner)
            if stepped and self.paged and self.grow([s for s in owner]):
                pipe.drain()                 # exact lengths, ended rows' pages back; then it must fit
                if self.grow([s for s in owner]):
                    raise PagesShort(f"kv_pages={self.pages.num_pages} is too small for the requests running "
                                     "(the offline run does not preempt: the server does)")
                stepped = bool(owner)
            if stepped:
                pipe.step(owner)
            pipe.read(stepped)
        return results


@dataclasses.dataclass
class PipelineCounters:
    """Where a Pipeline's driving thread spends its time, cumulative: the serving engine's
    /metrics (dflash_engine_*), so two scrapes tell a device-bound server (its thread waits in
    reads) from a host-bound one (dispatch and bookkeeping fill the step). steps: steps dispatched;
    slot_steps: their busy slots summed (/ steps: the mean rows a step ran); inserts: requests
    prefilled; insert_dispatch_s / step_dispatch_s: in the insert and step program calls (a call
    returns once the program is queued, or once the runtime lets it be); read_wait_s: bringing
    dispatched results to the host (waiting for the device)."""
    steps: int = 0
    slot_steps: int = 0
    inserts: int = 0
    insert_dispatch_s: float = 0.0
    step_dispatch_s: float = 0.0
    read_wait_s: float = 0.0


class Pipeline:
    """The one dispatch-ahead driver of `Slots`, for the offline run (`Slots.run`) and the server
    (engine.SlotEngine). Inserts and steps are dispatched without waiting; each is read back (its
    device arrays brought to the host) once `depth` later steps have been dispatched, so the host's
    reading, bookkeeping and next prefills overlap the device's work instead of stalling it (JAX
    runs the programs in dispatch order).

    Every dispatch records, per slot, the owner it ran for (a request index, a handle), and the
    reader gets that owner back with the slot's results, so a slot refilled since is told apart:
    `first(slot, owner, token, done)` for each row of an insert, `commits(slot, owner, rows, done)`
    for each slot of a step (rows: the token lists of its iterations that committed any). The
    readers run under `lock` (a context manager; none by default)."""

    def __init__(self, slots: Slots, depth: int, first: Callable, commits: Callable, lock=None):
        self.slots, self.depth = slots, int(depth)
        self._first, self._commits = first, commits
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._inflight: collections.deque = collections.deque()   # dispatched, not read: in dispatch order
        self.counters = PipelineCounters()

    def __len__(self) -> int:
        return len(self._inflight)

    def insert(self, items: Sequence[tuple[int, RowRequest, Any]]) -> None:
        """Dispatch the prefills of (slot, request, owner) items (Slots.insert_async)."""
        owners = {slot: who for slot, _, who in items}
        t0 = time.perf_counter()
        for rows, first, done in self.slots.insert_async([(slot, r) for slot, r, _ in items]):
            self._inflight.append(("insert", (first, done), [(slot, owners[slot]) for slot in rows],
                                   self._epochs(rows)))
        c = self.counters
        c.inserts += len(items)
        c.insert_dispatch_s += time.perf_counter() - t0

    def step(self, owners: dict[int, Any]) -> None:
        """Dispatch one step over the slots of `owners` ({slot: owner}, the busy slots)."""
        t0 = time.perf_counter()
        self._inflight.append(("step", self.slots.step_async(list(owners)), dict(owners), self._epochs(owners)))
        c = self.counters
        c.steps += 1
        c.slot_steps += len(owners)
        c.step_dispatch_s += time.perf_counter() - t0

    def _epochs(self, slots) -> dict | None:
        """The paged Slots' occupant of each slot (its insert count), for the page bookkeeping of reads."""
        return {s: int(self.slots.epoch[s]) for s in slots} if getattr(self.slots, "paged", False) else None

    def read(self, stepped: bool) -> None:
        """Read back what is due: after a step was dispatched, everything but the last `depth`
        steps, and the inserts before the first of those (a request's first token as soon as its
        prefill is done: the device has the dispatched step to run meanwhile); when none was, the
        oldest dispatch alone."""
        n_steps = sum(e[0] == "step" for e in self._inflight)
        while self._inflight and (n_steps > self.depth or not stepped):
            entry = self._inflight.popleft()
            n_steps -= entry[0] == "step"
            self._read(entry)
            if not stepped:
                return
        while self._inflight and self._inflight[0][0] == "insert":
            self._read(self._inflight.popleft())

    def steps_in_flight(self, slot: int, owner) -> int:
        """Steps dispatched for `owner` in `slot` and not read yet."""
        return sum(1 for kind, _, who, _ in self._inflight if kind == "step" and who.get(slot) == owner)

    def iterations_in_flight(self, slot: int, owner) -> int:
        """Iterations of those steps (each step's own K: its commits' first dimension)."""
        return sum(arrays[0].shape[0] for kind, arrays, who, _ in self._inflight
                   if kind == "step" and who.get(slot) == owner)

    def drain(self) -> None:
        """Read back everything in flight (the paged engine, before it preempts: exact lengths)."""
        while self._inflight:
            self._read(self._inflight.popleft())

    def clear(self) -> None:
        """Forget what is in flight (nobody waits for it, or a program failed)."""
        self._inflight.clear()

    def _read(self, entry) -> None:
        kind, arrays, who, epochs = entry
        t0 = time.perf_counter()
        host = [np.asarray(x) for x in jax.device_get(arrays)]
        self.counters.read_wait_s += time.perf_counter() - t0
        with self._lock:
            if kind == "insert":
                first, done = host
                for k, (slot, owner) in enumerate(who):
                    if epochs is not None:
                        self.slots.note_insert(slot, epochs[slot], int(first[k]))
                    self._first(slot, owner, int(first[k]), bool(done[k]))
                return
            commits, produced, done, *drafts = host
            for slot, owner in who.items():
                if drafts:
                    self.slots.note_drafts(slot, drafts[0][slot])
                rows = [commits[k, slot, :n].tolist() for k in range(produced.shape[0])
                        if (n := int(produced[k, slot]))]
                if epochs is not None:
                    self.slots.note_step(slot, epochs[slot], produced.shape[0], rows)
                self._commits(slot, owner, rows, bool(done[slot]))
