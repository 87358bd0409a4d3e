"""The slot engine's device side (continuous batching): `Slots`, a fixed number of rows of loop
state on the device, each a request or free, and the programs that drive them over the loop's own
`prefill` and `iterate` (dflash_jax.loop); `RowRequest` / `RowResult`, one row's request and result;
`offline_defaults`, an offline job's settings by platform.

`insert` prefills a bucket of requests (up to `insert_width` arrivals of one prompt bucket in one
prefill of a power-of-two width) and writes their rows into free slots, `step` runs K
draft-verify-accept iterations over the busy slots (a loop of fixed trip count, so launching it does
not hold the host thread: see _slots_step_body) and returns each slot's commits, `release` frees a
slot at the next step. Both have `_async` forms returning device arrays. `Pipeline` dispatches
them ahead of the reads (step n+1 runs while the host reads step n); it drives `Slots.run` offline
(generate(..., slots=N)) and dflash_jax.engine.SlotEngine for the server. On a mesh
(the models' own) slots are split over 'data' and the model over 'model'. A request's tokens do not
depend on its slot or its batch-mates: rows are independent, and its randomness is keyed by its own
seed, stream and position.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import penalties, sampling, sharding, validation
from dflash_jax.cache import is_paged
from dflash_jax.pages import PageAllocator, pages_for
from dflash_jax.kernel_config import kernels_from
from dflash_jax import width
from dflash_jax.loop import (LoopState, Params, Static, cached_program, idle_params, iterate, loop_specs, make_static,
                             merge_models, param_specs, params_on_mesh, pow2, prefill, resolve_mesh, row_settings,
                             pick_width, rows_only, width_costs, width_params, with_globals,
                             flush_pending, pending_room, propose_next, to_host)

__all__ = ["Slots", "Pipeline", "step_functions", "PagesShort", "SlotState", "RowRequest", "RowResult", "union_mode", "split_mode", "parse_step_buckets", "platform_of",
           "offline_defaults"]


# ----------------------------------------------------------------------------------------- programs
# The slot engine keeps one loop row per slot on the device and drives it with three
# programs over the same prefill and iterate as the one-shot loop: `_slots_empty` (allocation),
# `_slots_insert` (prefill a bucket of requests, write their rows into free slots) and `_slots_step`
# (up to n iterations, the commits returned), or `_slots_step_rows` (the same over a power-of-two
# bucket of the slots: their rows gathered, stepped by a program of that batch, written back).
# Slot state is donated to insert and step.

@struct.dataclass
class SlotState:
    """The engine's device state: one LoopState row per slot and that slot's request settings
    (Params with prompt None: a slot keeps only its prompt length)."""
    loop: LoopState
    params: Params


def _slots_empty(st: Static, tstate, dstate) -> SlotState:
    """Every slot free: done, length 0 (its verify writes land in its own rows, never read)."""
    def init(ts, ds):
        loop = prefill(dataclasses.replace(st, prompt_bucket=16), *merge_models(st, ts, ds), idle_params(st.batch, 16))
        return SlotState(loop=loop, params=idle_params(st.batch, 16).replace(prompt=None))
    shapes = jax.eval_shape(init, tstate, dstate)
    s = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    params = s.params.replace(stop_ids=jnp.full(s.params.stop_ids.shape, -1, jnp.int32))
    return SlotState(loop=s.loop.replace(done=jnp.ones((st.batch,), bool)), params=params)


def _slots_insert(st: Static, tstate, dstate, slots: SlotState, p: Params, rows):
    """Prefill the requests of p ([Bp] rows, prompt bucket st.prompt_bucket) and write each into
    slot rows[i] (rows [Bp] int32; a row >= the slot count drops that request: bucket padding).
    Other slots are untouched. Returns (slots, first token [Bp], done [Bp]), and a grammar insert
    also each row's first drafts [Bp, S-1] (_next_drafts: its first step verifies real drafts)."""
    with sharding.active(st.mesh):
        target, draft = merge_models(st, tstate, dstate)
        new = prefill(st, target, draft, p)
        put = lambda old, x: old.at[rows].set(x, mode="drop")                          # noqa: E731
        loop = with_globals(jax.tree.map(put, rows_only(slots.loop), rows_only(new)), slots.loop)
        params = jax.tree.map(put, slots.params, p.replace(prompt=None, stream_id=None, grammar_mask=None))
        first = jnp.take_along_axis(new.tokens, p.prompt_lens[:, None], axis=1)[:, 0]
        return ((_slots_placed(st, SlotState(loop=loop, params=params)), first, new.done)
                + _next_drafts(st, target, draft, p, new))


# ---------------------------------------------------------------------------------- paged programs
# With a paged KV cache (Slots(kv_pages=...)) the state's target and draft caches are
# dflash_jax.cache.PagedKVCache: pools every slot shares and a per-slot page table. The host owns
# the table (dflash_jax.pages allocates and matches prefixes): each insert and step takes the table
# rows it runs with as an argument and only reads them. Row gathers and scatters (an insert's rows,
# a step bucket's) move the per-row part and leave the pools whole.

def _split_pools(loop: LoopState):
    """(loop with its caches' pools taken out, the pools): the per-row part for row maps (a dense
    cache is per-row whole: pools None)."""
    tc, dc = loop.target_cache, loop.draft_cache
    if not is_paged(tc):
        return loop, None
    pools = (tc.pools(), None if dc is None else dc.pools())
    return loop.replace(target_cache=tc.rows_part(), draft_cache=None if dc is None else dc.rows_part()), pools


def _join_pools(loop: LoopState, pools) -> LoopState:
    if pools is None:
        return loop
    dc = loop.draft_cache
    return loop.replace(target_cache=loop.target_cache.with_pools(pools[0]),
                        draft_cache=None if dc is None else dc.with_pools(pools[1]))


def _with_table(loop: LoopState, table) -> LoopState:
    """loop's paged caches with the page table `table` [B, P] (the host's, this program's)."""
    dc = loop.draft_cache
    return loop.replace(target_cache=loop.target_cache.replace(table=table),
                        draft_cache=None if dc is None else dc.replace(table=table))


def _paged_empty(st: Static, tstate, dstate, num_pages: int, page_size: int) -> SlotState:
    """_slots_empty with paged caches: pools of num_pages pages, every table row the dummy page."""
    P = st.capacity // page_size

    def init(ts, ds):
        target, draft = merge_models(st, ts, ds)
        caches = (target.new_paged_cache(st.batch, num_pages, page_size, P),
                  None if draft is None else draft.new_paged_cache(st.batch, num_pages, page_size, P))
        p = idle_params(st.batch, 16)
        loop = prefill(dataclasses.replace(st, prompt_bucket=16), target, draft,
                       p.replace(prompt_start=jnp.zeros((st.batch,), jnp.int32)), caches=caches)
        return SlotState(loop=loop, params=p.replace(prompt=None))
    shapes = jax.eval_shape(init, tstate, dstate)
    s = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    params = s.params.replace(stop_ids=jnp.full(s.params.stop_ids.shape, -1, jnp.int32))
    loop = _without_table(s.loop.replace(done=jnp.ones((st.batch,), bool)))
    return SlotState(loop=loop, params=params)


def _without_table(loop: LoopState) -> LoopState:
    """loop with its caches' tables taken out: the state keeps none (the host owns the table and
    each program gets the rows it needs, as wide as the pages they hold: a power of two)."""
    return _with_table(loop, None)


def _paged_insert(st: Static, tstate, dstate, slots: SlotState, p: Params, rows, table):
    """_slots_insert into the pools: the Bp requests of p (p.prompt_start: their prefix hits) with
    their page tables `table` [Bp, P], prefilled from their hit on and written into slot rows."""
    with sharding.active(st.mesh):
        target, draft = merge_models(st, tstate, dstate)
        old, pools = _split_pools(slots.loop)
        Bp = p.prompt.shape[0]
        zeros = jnp.zeros((Bp,), jnp.int32)
        tc = slots.loop.target_cache.replace(table=table, lens=zeros)
        dc = slots.loop.draft_cache
        new = prefill(st, target, draft, p, caches=(tc, None if dc is None else dc.replace(table=table, lens=zeros)))
        drafts = _next_drafts(st, target, draft, p, new)
        new, pools = _split_pools(_without_table(new))
        put = lambda o, x: o.at[rows].set(x, mode="drop")                              # noqa: E731
        loop = with_globals(jax.tree.map(put, rows_only(old), rows_only(new)), slots.loop)
        params = jax.tree.map(put, slots.params, p.replace(prompt=None, stream_id=None, prompt_start=None,
                                                            grammar_mask=None))
        first = jnp.take_along_axis(new.tokens, p.prompt_lens[:, None], axis=1)[:, 0]
        return (_slots_placed(st, SlotState(loop=_join_pools(loop, pools), params=params)), first, new.done) + drafts


def _paged_step(st: Static, n_iters: int, tstate, dstate, slots: SlotState, release, wp, table):
    """_slots_step with the host's page table [B, P] for this step (P: the pages the busy rows hold,
    rounded up to a power of two: the layers gather and attend over P pages a row)."""
    slots = slots.replace(loop=_with_table(slots.loop, table))
    slots, *out = _slots_step(st, n_iters, tstate, dstate, slots, release, wp)
    return (slots.replace(loop=_without_table(slots.loop)), *out)


def _paged_step_rows(st: Static, n_iters: int, tstate, dstate, slots: SlotState, release, wp, idx, table):
    """_slots_step_rows with the host's page table [B, P] for this step (as _paged_step's)."""
    slots = slots.replace(loop=_with_table(slots.loop, table))
    slots, *out = _slots_step_rows(st, n_iters, tstate, dstate, slots, release, wp, idx)
    return (slots.replace(loop=_without_table(slots.loop)), *out)


def step_functions(st: Static, steps: int, page_size: int | None = None, num_pages: int | None = None):
    """(empty, step): the slot state's allocation `empty(tstate, dstate)` and the step program
    `step(tstate, dstate, slots, release, wp[, table])` of `steps` iterations over st.batch slots,
    dense or (page_size) paged with num_pages pages: what Slots compiles, for ahead-of-time
    lowering from configs alone (decode.lower_slot_step)."""
    if page_size is None:
        return (lambda ts, ds: _slots_empty(st, ts, ds)), functools.partial(_slots_step, st, steps)
    return ((lambda ts, ds: _paged_empty(st, ts, ds, num_pages, page_size)),
            functools.partial(_paged_step, st, steps))


def _slots_specs(st: Static, slots: SlotState) -> SlotState:
    """The slot state's PartitionSpecs on st.mesh: slots on 'data' (as the loop's rows)."""
    return SlotState(loop=loop_specs(st, slots.loop), params=param_specs(slots.params))


def _slots_placed(st: Static, slots: SlotState) -> SlotState:
    """The slot state constrained to _slots_specs, so insert and step keep one layout (a compiled
    step refuses state laid out otherwise)."""
    if st.mesh is None:
        return slots
    return jax.tree.map(lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(st.mesh, spec)),
                        _slots_specs(st, slots), slots, is_leaf=lambda x: isinstance(x, P))


def _slots_step(st: Static, n_iters: int, tstate, dstate, slots: SlotState, release, wp):
    """n_iters iterations of iterate over every slot; slots with release [B] set are marked done
    first; wp: the verify-width fields of Params (loop.width_params; {} without widths). Returns (slots, commits [n, B, S], produced [n, B], done [B]): slot b committed
    commits[k, b, :produced[k, b]] at iteration k (a done row commits nothing)."""
    with sharding.active(st.mesh):
        return _slots_step_body(st, n_iters, tstate, dstate, slots, release, wp)


def _slots_step_body(st: Static, n_iters: int, tstate, dstate, slots: SlotState, release, wp):
    """The step's n_iters iterations as a loop of that fixed trip count, run only when some row is
    not done: a step whose rows are all done at its start (the step dispatched ahead of the read
    that finishes its last request, and every step after a release of the rest) runs no iteration
    and commits nothing. Inside the loop a row that finishes makes its later iterations no-ops; the
    loop does not stop early, because a loop of unknown trip count makes XLA:GPU copy its predicate
    to the host and wait for the device at every iteration, which blocks the host thread for the
    whole step, so the host could not dispatch the next insert or step while this one runs
    (docs/perf-log.md, session 22). The one condition reads its predicate once per step, at the
    step's start, after the previous program: the host still dispatches ahead by a step, and a
    step of done rows costs that read instead of n_iters full iterations (docs/perf-log.md, issue
    33: the served embedded pair). With adaptive widths (st.widths) the iterations run in one while
    loop per width instead (see below); wp: the Params' verify-width fields."""
    target, draft = merge_models(st, tstate, dstate)
    loop = slots.loop.replace(done=slots.loop.done | release)
    params = slots.params.replace(**wp)

    if st.widths is None or draft is None:
        def iterations(s):
            def body(s, _):
                s, commit, n = iterate(st, target, draft, params, s)
                return s, (commit, n)
            return jax.lax.scan(body, s, None, length=n_iters)                   # [n, B, S], [n, B]

        def idle(s):
            return s, (jnp.zeros((n_iters, st.batch, st.block_size), jnp.int32),
                       jnp.zeros((n_iters, st.batch), jnp.int32))

        loop, (commits, produced) = jax.lax.cond(jnp.any(~loop.done), iterations, idle, loop)
        return (slots.replace(loop=loop), commits, produced, loop.done) + _next_drafts(st, target, draft, params, loop)
    # Adaptive widths: one while loop per width, as loop.run (a lax.switch per iteration would copy
    # every cache buffer into its branch). Its trip count is unknown to XLA:GPU anyway (the
    # host-wait cost of session 22 applies again, docs/adaptive-width.md), so it also stops as soon
    # as every row is done.
    B, S = st.batch, st.block_size
    start = loop.step
    out = (loop, jnp.zeros((n_iters, B, S), jnp.int32), jnp.zeros((n_iters, B), jnp.int32))
    left = lambda c: (c[0].step < start + n_iters) & jnp.any(~c[0].done)                   # noqa: E731

    def one(k):
        def body(c):
            s, commits, produced = c
            i = s.step - start
            s, commit, n = iterate(st, target, draft, params, s, k)
            return s, commits.at[i].set(commit), produced.at[i].set(n)
        return body

    def visit(c):   # W = 0 appends its taps while every row has room (loop.run)
        for k, W in enumerate(st.widths):
            on = lambda c, k=k: left(c) & (pick_width(st, params, c[0]) == k)                  # noqa: E731
            if W == 0:
                c = jax.lax.while_loop(lambda c, on=on: on(c) & ~pending_room(c[0]),
                                       lambda c: (flush_pending(draft, c[0]),) + c[1:], c)
                cond = lambda c, on=on: on(c) & pending_room(c[0])                             # noqa: E731
            else:
                cond = on
            c = jax.lax.while_loop(cond, one(k), c)
        return c
    loop, commits, produced = jax.lax.while_loop(left, visit, out)
    return (slots.replace(loop=loop), commits, produced, loop.done) + _next_drafts(st, target, draft, params, loop)


def _next_drafts(st: Static, target, draft, params, loop) -> tuple:
    """A grammar step's extra output: (drafts [B, S-1] the next iteration would verify,), which the
    host walks each constrained row's grammar along to build that step's masks; () otherwise."""
    if not st.grammar:
        return ()
    if draft is None:
        return (jnp.zeros((st.batch, max(st.block_size - 1, 1)), jnp.int32),)
    return (propose_next(st, target, draft, params, loop),)


def _slots_step_rows(st: Static, n_iters: int, tstate, dstate, slots: SlotState, release, wp, idx):
    """_slots_step over the n slots `idx` [n] int32 alone (distinct slot indices: the busy ones,
    padded with free ones), st being the full state's (batch = every slot). `release` is applied to
    every slot's done first; the n rows of the state are gathered, run by _slots_step_body in a
    program of batch n and written back in place (the other slots are untouched). Returns the
    full-width (slots, commits [n_iters, B, S], produced [n_iters, B], done [B]), zeros for the slots
    outside idx, so the host reads it as _slots_step's."""
    with sharding.active(st.mesh):
        n = idx.shape[0]
        loop, pools = _split_pools(slots.loop.replace(done=slots.loop.done | release))
        take = lambda x: x[idx]                                                      # noqa: E731
        sub = SlotState(loop=_join_pools(with_globals(jax.tree.map(take, rows_only(loop)), loop), pools),
                        params=jax.tree.map(take, slots.params))
        sub, commits, produced, _, *drafts = _slots_step_body(dataclasses.replace(st, batch=n), n_iters, tstate,
                                                              dstate, sub, jnp.zeros((n,), bool), wp)
        sub_loop, pools = _split_pools(sub.loop)
        put = lambda old, x: old.at[idx].set(x, unique_indices=True)                # noqa: E731
        loop = _join_pools(with_globals(jax.tree.map(put, rows_only(loop), rows_only(sub_loop)), sub_loop), pools)
        B = st.batch
        commits = jnp.zeros((n_iters, B, st.block_size), jnp.int32).at[:, idx].set(commits, unique_indices=True)
        produced = jnp.zeros((n_iters, B), jnp.int32).at[:, idx].set(produced, unique_indices=True)
        drafts = tuple(jnp.zeros((B,) + d.shape[1:], d.dtype).at[idx].set(d, unique_indices=True) for d in drafts)
        return (_slots_placed(st, slots.replace(loop=loop)), commits, produced, loop.done) + drafts


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
    # structured output: its grammar's state (dflash_jax.grammar.Constraint: mask(), walk(drafts)),
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
# K = 2 (measured: docs/perf-log.md, session 30): with many rows a row that ends mid-step idles, and
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
                 prefix_cache: bool = True):
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
        # the models' mesh (both must be on the same one): slots on 'data', the model on 'model'
        self.mesh = resolve_mesh(None, target, draft)
        self._data = 1 if self.mesh is None else sharding.data_axis_size(self.mesh)
        if self.slots % self._data:
            raise ValueError(f"slots={slots} must be a multiple of the mesh's data axis ({self._data})")
        self.step_buckets = self._check_buckets(step_buckets)
        self.bucket_steps: collections.Counter = collections.Counter()   # steps dispatched per row count
        self._tdef, self._tstate = nnx.split(target)
        self._ddef, self._dstate = nnx.split(draft) if draft is not None else (None, None)
        st = self._static(prompt_bucket=0, batch=self.slots, mode="greedy")
        if self.paged:
            self.page_size, self.pages_per_row = int(page_size), self.capacity // int(page_size)
            self.pages = PageAllocator(int(kv_pages), self.page_size, prefix_cache=bool(prefix_cache))
            self.table = np.zeros((self.slots, self.pages_per_row), np.int32)
            self._row_pages: list[list[int]] = [[] for _ in range(self.slots)]
            self._row_tokens: list[list[int]] = [[] for _ in range(self.slots)]   # prompt + committed
            self._known = np.zeros((self.slots,), np.int64)      # committed length the host has read
            self._limit = np.zeros((self.slots,), np.int64)      # prompt + max_new
            self._inflight = np.zeros((self.slots,), np.int64)   # iterations dispatched, not read
            self.epoch = np.zeros((self.slots,), np.int64)       # inserts into the slot so far
            self._admitted: dict[int, tuple[list[int], int]] = {}   # slot -> (pages, prefix hit) before insert
            self.preemptions = 0
            self.state = _paged_empty(st, self._tstate, self._dstate, int(kv_pages), self.page_size)
        else:
            with sharding.active(self.mesh):
                self.state = _slots_empty(st, self._tstate, self._dstate)
        if self.mesh is not None:
            self.state = jax.tree.map(lambda spec, x: jax.device_put(x, NamedSharding(self.mesh, spec)),
                                      _slots_specs(st, self.state), self.state,
                                      is_leaf=lambda x: isinstance(x, P))
        self._release = np.zeros((self.slots,), bool)
        self._programs: dict = {}     # (mode, rows) -> step program, ("insert", ...) -> insert program
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
        grammar = is_grammar(mode)
        mode, adjusted = split_mode(mode)
        return make_static(self._tdef, self._ddef, self.draft.config if self.draft is not None else None,
                           block_size=self.block_size, batch=batch, prompt_bucket=prompt_bucket,
                           capacity=self.capacity, mode=mode, kernels=self.kernels, mesh=self.mesh,
                           adaptive=self.verify_width is not None,
                           verify_width=self.verify_width if self.verify_width is not None else "auto",
                           penalties=adjusted, grammar=grammar)

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
        return min(pow2(n, 16), self.capacity)

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
            p = params_on_mesh(idle_params(width, bucket).replace(**self._first_masks(mode, [], width)), self.mesh)
            rows = self._put(np.full((width,), self.slots, np.int32))
            if self.paged:
                p = p.replace(prompt_start=self._put(np.zeros((width,), np.int32), P("data")))
                table = self._table_arg(np.zeros((width, pages), np.int32))
                prog = cached_program(("engine_insert_paged", st, self.slots, self.pages.num_pages, pages),
                                      _paged_insert, (st,), (self._tstate, self._dstate, self.state, p, rows, table),
                                      donate=(2,))
            else:
                prog = cached_program(("engine_insert", st, self.slots), _slots_insert, (st,),
                                      (self._tstate, self._dstate, self.state, p, rows), donate=(2,))
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

    def _pages_bucket(self, pages: int | None) -> int | None:
        """A paged program's table width for rows holding up to `pages` pages: the next power of two,
        at most a row's every page (None: that); None without pages."""
        if not self.paged:
            return None
        return self.pages_per_row if pages is None else min(pow2(max(int(pages), 1), 1), self.pages_per_row)

    def _rows_pages(self, slots) -> int:
        """The most pages any of these slots holds."""
        return max([len(self._row_pages[s]) for s in slots] + [1])

    def _step_key(self, mode: str, rows: int | None):
        st = self._static(prompt_bucket=0, batch=self.slots, mode=mode)
        full = rows is None or rows == self.slots
        K = self.steps_for(self.slots if rows is None else rows, mode)
        return st, (("engine_step", st, K) if full else ("engine_step_rows", st, K, rows))

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
        st, key = self._step_key(mode, rows)
        wp = dict(width_params(st), **self._grammar_fields(mode, list(range(rows))))
        table = (self._table_arg(self.table[:, :pages]),) if self.paged else ()
        if self.paged:
            key = ("paged", self.pages.num_pages, pages) + key
        if rows == self.slots:
            prog = cached_program(key, _paged_step if self.paged else _slots_step, (st, self.steps_for(rows, mode)),
                                  (self._tstate, self._dstate, self.state, self._put(self._release), wp) + table,
                                  donate=(2,))
        else:
            idx = self._put(np.arange(rows, dtype=np.int32))
            prog = cached_program(key, _paged_step_rows if self.paged else _slots_step_rows,
                                  (st, self.steps_for(rows, mode)),
                                  (self._tstate, self._dstate, self.state, self._put(self._release), wp, idx) + table,
                                  donate=(2,))
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
        st, key = self._step_key(mode, rows)
        if st.widths is None:
            wp = {}
        elif profile_width is not None:
            wp = width_params(st, st.widths[profile_width])
            return dict(wp, width_profile=self._put(np.bool_(True), P()))
        else:
            from dflash_jax.loop import WIDTH_COSTS
            wp = width_params(st, self.verify_width, WIDTH_COSTS.get(key))
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
        st, key = self._step_key(mode, rows)
        if st.widths is None or self.verify_width != "auto" or not bool(np.all(to_host(self.state.loop.done))):
            return
        n = rows or self.slots
        prog = self._step_program(mode, n)
        idx = () if n == self.slots else (self._put(np.arange(n, dtype=np.int32)),)

        def time_width(i):
            t0 = time.perf_counter()
            table = (self._table_arg(self.table),) if self.paged else ()
            self.state, commits, _, _ = prog(self._tstate, self._dstate, self.state, self._put(self._release),
                                             self._width_params(mode, n, i), *idx, *table)
            jax.block_until_ready(commits)
            return time.perf_counter() - t0, 0.0, self.steps_for(n)
        width_costs(key, time_width, len(st.widths))
        self._wps.pop((mode, n), None)            # the step's width fields now carry these costs

    def warmup(self, prompt_lengths=(1,), modes=("greedy",)) -> None:
        """Compile the insert programs of these prompt lengths' buckets (every insert width) and the
        step programs of these modes (every step bucket) now, so no request waits for a compile;
        with verify_width "auto", profile each step program's widths (profile_widths) while every
        slot is free."""
        for m in modes:
            for n in self.step_buckets or (self.slots,):
                self._step_program(m, n)
                self.profile_widths(m, n)
                self._width_params(m, n)          # built now, not on a request's first step
            for n in sorted({self.prompt_bucket(n) for n in prompt_lengths}):
                for w in self.insert_widths():
                    self._insert_program(n, m, w)

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
                prompt = np.zeros((W, bucket), np.int32)
                lens = np.ones((W,), np.int32)
                rows = np.full((W,), self.slots, np.int32)
                starts = np.zeros((W,), np.int32)
                pages = self._pages_bucket(max(len(self._admitted[slot][0]) for slot, _ in chunk)) if self.paged else None
                table = np.zeros((W, pages), np.int32) if self.paged else None
                settings = [RowRequest(prompt=(0,), max_new=1).settings()] * W
                for i, (slot, r) in enumerate(chunk):
                    if self.paged:
                        starts[i] = self._start_row(slot, r)
                        table[i] = self.table[slot, :pages]
                    prompt[i, :len(r.prompt) - starts[i]] = r.prompt[starts[i]:]
                    lens[i], rows[i] = len(r.prompt), slot
                    settings[i] = r.settings()
                    self.modes[slot] = r.mode
                    self.grammars[slot] = r.grammar
                    self._has_drafts[slot] = False
                    self._release[slot] = False
                p = Params(prompt=jnp.asarray(prompt), prompt_lens=jnp.asarray(lens),
                           active=jnp.asarray(np.arange(W) < len(chunk)), **row_settings(settings),
                           **self._first_masks(mode, [r for _, r in chunk], W))
                p = params_on_mesh(p, self.mesh)
                prog = self._insert_program(bucket, mode, W, pages)
                if self.paged:
                    p = p.replace(prompt_start=self._put(starts, P("data")))
                    self.state, first, done, *drafts = prog(self._tstate, self._dstate, self.state, p, self._put(rows),
                                                   self._table_arg(table))
                    for slot, r in chunk:   # both caches hold the prompt once the prefill runs (dispatch order)
                        self.pages.publish(r.prompt, self._row_pages[slot])
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
                self.pages.release(self._admitted.pop(slot)[0])
                return
            pages = self._row_pages[slot]
            if pages:
                # rows below known - S are final in both caches: the draft's context trails the
                # target by the pending taps (<= S), and every later write lands at or past them
                final = max(0, int(self._known[slot]) - self.block_size)
                self.pages.publish(self._row_tokens[slot][:final], pages)
                self.pages.release(pages)
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
        """Pages for `slot` to cover `positions`, allocated now; False (nothing allocated) when short."""
        need = pages_for(positions, self.page_size) - len(self._row_pages[slot])
        if need <= 0:
            return True
        new = self.pages.allocate(need)
        if new is None:
            return False
        n = len(self._row_pages[slot])
        self._row_pages[slot].extend(new)
        self.table[slot, n:n + len(new)] = new
        return True

    def admit(self, slot: int, r: RowRequest) -> bool:
        """Paged: take `slot`'s pages for r (its prefix hit, the rest of its prompt and its first
        step's reach) before insert; False (nothing taken) when the pool is short: the request waits."""
        self.check(r)
        # a resumed row's generated tail must reach its token buffer (the penalties count it there):
        # its hit stops before it
        lookup = r.prompt[:len(r.prompt) - r.resumed] if r.mode.endswith(PENALTIES) else r.prompt
        hit_pages, hit = self.pages.match(lookup, count=False)     # counted once admitted: a queue head
        S, K = self.block_size, self.steps_for(1)                  # retried every turn counts once
        reach = min(len(r.prompt) + K * S + S, len(r.prompt) + r.max_new + S, self.capacity)
        new = self.pages.allocate(max(0, pages_for(reach, self.page_size) - len(hit_pages)))
        if new is None:
            self.pages.release(hit_pages)
            return False
        self.pages.count(len(r.prompt), hit)
        self._admitted[slot] = (hit_pages + new, hit)
        return True

    def _start_row(self, slot: int, r: RowRequest) -> int:
        """The admitted slot's row state on the host; returns its prefix hit (the prefill's start)."""
        pages, hit = self._admitted.pop(slot)
        self._row_pages[slot] = pages
        self.table[slot] = 0
        self.table[slot, :len(pages)] = pages
        self._row_tokens[slot] = list(r.prompt)
        self._known[slot], self._limit[slot] = len(r.prompt), len(r.prompt) + r.max_new
        self._inflight[slot] = 0
        self.epoch[slot] += 1
        return hit

    def grow(self, busy: Sequence[int]) -> list[int]:
        """Paged: pages for each busy slot to cover what its next step may write (see _reach).
        Returns the slots that could not get them (they got nothing); the caller frees pages
        (preempting a request) and asks again, or stops stepping them."""
        K = self.steps_for(self.step_bucket(len(busy)))
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
        return dict(self.pages.stats(), preemptions=self.preemptions) if self.paged else {}

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
        prog = self._step_program(mode, n, pages)
        self.bucket_steps[n] += 1
        wp = self._width_params(mode, n)
        release = self._put_cached(self._release)
        table = ()
        if self.paged:
            K = self.steps_for(n, mode)
            short = [b for b in busy if pages_for(self._reach(b, K), self.page_size) > len(self._row_pages[b])]
            if short:
                raise PagesShort(f"slots {short} have no pages for their next step: call grow() first")
            self._inflight[busy] += K
            table = (self._table_arg(self.table[:, :pages]),)
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

    def __len__(self) -> int:
        return len(self._inflight)

    def insert(self, items: Sequence[tuple[int, RowRequest, Any]]) -> None:
        """Dispatch the prefills of (slot, request, owner) items (Slots.insert_async)."""
        owners = {slot: who for slot, _, who in items}
        for rows, first, done in self.slots.insert_async([(slot, r) for slot, r, _ in items]):
            self._inflight.append(("insert", (first, done), [(slot, owners[slot]) for slot in rows],
                                   self._epochs(rows)))

    def step(self, owners: dict[int, Any]) -> None:
        """Dispatch one step over the slots of `owners` ({slot: owner}, the busy slots)."""
        self._inflight.append(("step", self.slots.step_async(list(owners)), dict(owners), self._epochs(owners)))

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
        host = [np.asarray(x) for x in jax.device_get(arrays)]
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
