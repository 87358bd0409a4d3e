"""The slot engine's device programs (continuous batching) and the one interface its host side
asks for them through: `SlotPrograms`, built once per engine from its models and geometry, hands
dflash_jax.serving.slots.Slots its allocation (`empty`), its compiled insert and step programs by compile
key and shape bucket (`static`, `insert`, `step`; cached with generate's programs,
loop.cached_program) and the values they take (`params`, `width_fields`). The programs themselves
run the loop's own `prefill` and `iterate` (dflash_jax.loop) over `SlotState`, one loop row per
slot; `step_functions` is the same allocation and step for ahead-of-time lowering from configs
alone (decode.lower_slot_step). Which rows to insert into or step, when, and with which pages is
the host's (dflash_jax.serving.slots); this module only builds and runs what it is asked for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import sharding
from dflash_jax.cache import is_paged
from dflash_jax.loop import (WIDTH_COSTS, LoopState, Params, Static, cached_program, flush_pending, idle_params,
                             iterate, loop_specs, make_static, merge_models, param_specs, params_on_mesh,
                             pending_room, pick_width, pow2, prefill, propose_next, resolve_mesh, row_settings,
                             rows_only, to_host, width_costs, width_params, with_globals)

__all__ = ["SlotPrograms", "SlotState", "step_functions"]


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
# the table (dflash_jax.serving.pages allocates and matches prefixes): each insert and step takes the table
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


def _main_table(table):
    """The main page table of a program's table argument: an array [B, P], or (main, window) when the
    draft's sliding layers have a window pool (pages.WindowPages), or None."""
    return table[0] if isinstance(table, (tuple, list)) else table


def _with_table(loop: LoopState, table) -> LoopState:
    """loop's paged caches with the page table `table` [B, P] (the host's, this program's): the
    target reads the main one, the draft its window layers through the window one (a pair)."""
    dc = loop.draft_cache
    return loop.replace(target_cache=loop.target_cache.replace(table=_main_table(table)),
                        draft_cache=None if dc is None else dc.with_tables(table))


def _paged_empty(st: Static, tstate, dstate, num_pages: int, page_size: int,
                 window_pages: int | None = None) -> SlotState:
    """_slots_empty with paged caches: pools of num_pages pages, every table row the dummy page;
    window_pages: the draft's sliding layers in a window pool of that many pages of their own."""
    P = st.capacity // page_size

    def init(ts, ds):
        target, draft = merge_models(st, ts, ds)
        wkw = {} if window_pages is None else {"window_pages": window_pages}
        caches = (target.new_paged_cache(st.batch, num_pages, page_size, P),
                  None if draft is None else draft.new_paged_cache(st.batch, num_pages, page_size, P, **wkw))
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
        tc = slots.loop.target_cache.replace(table=_main_table(table), lens=zeros)
        dc = slots.loop.draft_cache
        new = prefill(st, target, draft, p, caches=(tc, None if dc is None else dc.with_tables(table).replace(lens=zeros)))
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


def step_functions(st: Static, steps: int, page_size: int | None = None, num_pages: int | None = None,
                   window_pages: int | None = None):
    """(empty, step): the slot state's allocation `empty(tstate, dstate)` and the step program
    `step(tstate, dstate, slots, release, wp[, table])` of `steps` iterations over st.batch slots,
    dense or (page_size) paged with num_pages pages: SlotPrograms' empty and full-width step, for
    ahead-of-time lowering from configs alone (decode.lower_slot_step)."""
    if page_size is None:
        return (lambda ts, ds: _slots_empty(st, ts, ds)), functools.partial(_slots_step, st, steps)
    return ((lambda ts, ds: _paged_empty(st, ts, ds, num_pages, page_size, window_pages)),
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
    whole step, so the host could not dispatch the next insert or step while this one runs (on the
    H200 the engine's device sat idle 15% of its run; docs/perf-log.md, 'the step's loop blocked the
    host'). The one condition reads its predicate once per step, at the
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
    # host-wait cost of the docstring applies again, docs/adaptive-width.md), so it also stops as soon
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



# ---------------------------------------------------------------------------------------- interface
class SlotPrograms:
    """The slot engine's programs over one pair of models, as its host side (dflash_jax.serving.slots.Slots)
    asks for them: `slots` rows of `capacity` positions, blocks of `block_size`, `kernels` resolved,
    the adaptive verify width when `verify_width` is set (None: the whole block), and with
    `pages` = (num_pages, page_size[, window_pages]) paged caches (the host passes each program its
    page-table rows: with window_pages, a (main, window) pair, the draft's sliding layers in a window
    pool of their own: pages.WindowPages).

    The host names a program by its compile key (`static`: a loop.Static, opaque to it) and its
    shape buckets (rows, iterations, table width), and passes the arguments it will call it with
    after the models' states (`tstate`, `dstate`): (state, params, rows[, table]) for an insert,
    (state, release, width fields[, idx][, table]) for a step. Every program donates the state."""

    def __init__(self, target, draft, *, slots: int, capacity: int, block_size: int, kernels, verify_width=None,
                 pages: tuple[int, int] | None = None):
        # the models' mesh (both must be on the same one): slots on 'data', the model on 'model'
        self.mesh = resolve_mesh(None, target, draft)
        self._tdef, self.tstate = nnx.split(target)
        self._ddef, self.dstate = nnx.split(draft) if draft is not None else (None, None)
        self._draft_config = draft.config if draft is not None else None
        self.slots, self.capacity, self.block_size = int(slots), int(capacity), int(block_size)
        self.kernels, self.verify_width = kernels, verify_width
        self.paged = pages is not None
        self.num_pages, self.page_size = (int(pages[0]), int(pages[1])) if self.paged else (None, None)
        self.window_pages = int(pages[2]) if self.paged and len(pages) > 2 and pages[2] is not None else None

    def static(self, *, prompt_bucket: int, batch: int, mode: str, penalties: bool = False,
               grammar: bool = False) -> Static:
        """The compile key of a program over `batch` rows in sampling `mode` (prompt_bucket 0: a step)."""
        return make_static(self._tdef, self._ddef, self._draft_config, block_size=self.block_size, batch=batch,
                           prompt_bucket=prompt_bucket, capacity=self.capacity, mode=mode, kernels=self.kernels,
                           mesh=self.mesh, adaptive=self.verify_width is not None,
                           verify_width=self.verify_width if self.verify_width is not None else "auto",
                           penalties=penalties, grammar=grammar)

    def prompt_bucket(self, n: int) -> int:
        """The prompt bucket of n prompt tokens: the next power of two >= 16, at most the capacity."""
        return min(pow2(n, 16), self.capacity)

    def table_width(self, pages: int | None) -> int | None:
        """A paged program's table width for rows holding up to `pages` pages: the next power of two,
        at most a row's every page (None: that); None without pages."""
        if not self.paged:
            return None
        per_row = self.capacity // self.page_size
        return per_row if pages is None else min(pow2(max(int(pages), 1), 1), per_row)

    def empty(self) -> SlotState:
        """The slot state with every slot free (on the mesh: laid out as every program takes it)."""
        st = self.static(prompt_bucket=0, batch=self.slots, mode="greedy")
        if self.paged:
            state = _paged_empty(st, self.tstate, self.dstate, self.num_pages, self.page_size, self.window_pages)
        else:
            with sharding.active(self.mesh):
                state = _slots_empty(st, self.tstate, self.dstate)
        if self.mesh is not None:
            state = jax.tree.map(lambda spec, x: jax.device_put(x, NamedSharding(self.mesh, spec)),
                                 _slots_specs(st, state), state, is_leaf=lambda x: isinstance(x, P))
        return state

    def params(self, prompt, prompt_lens, active, settings: list[dict], **fields) -> Params:
        """An insert's Params on the mesh: prompt [W, bucket], prompt_lens [W], active [W] (host
        arrays), one loop.row_settings dict per row, and any further Params fields."""
        p = Params(prompt=np.asarray(prompt), prompt_lens=np.asarray(prompt_lens), active=np.asarray(active),
                   **row_settings(settings, host=True), **fields)
        return params_on_mesh(p, self.mesh)

    def idle_params(self, batch: int, prompt_bucket: int, **fields) -> Params:
        """Params of `batch` idle rows on the mesh (a program's example arguments), with `fields`."""
        return params_on_mesh(idle_params(batch, prompt_bucket).replace(**fields), self.mesh)

    def insert(self, st: Static, args: tuple, table_width: int | None = None):
        """The compiled insert of st (a prefill of st.batch requests of bucket st.prompt_bucket,
        written into slot rows) for args (state, params, rows[, table]); paged: a table table_width wide."""
        models = (self.tstate, self.dstate)
        if self.paged:
            return cached_program(("engine_insert_paged", st, self.slots, self.num_pages, self.window_pages, table_width),
                                  _paged_insert,
                                  (st,), models + tuple(args), donate=(2,))
        return cached_program(("engine_insert", st, self.slots), _slots_insert, (st,), models + tuple(args),
                              donate=(2,))

    def step(self, st: Static, n_iters: int, rows: int, args: tuple, table_width: int | None = None):
        """The compiled step of st: n_iters iterations over every slot (rows == slots) or over the
        `rows` slots named by idx (a step bucket), for args (state, release, width fields[, idx][, table])."""
        key = self._step_key(st, n_iters, rows)
        if self.paged:
            key = ("paged", self.num_pages, self.window_pages, table_width) + key
        if rows == self.slots:
            fn = _paged_step if self.paged else _slots_step
        else:
            fn = _paged_step_rows if self.paged else _slots_step_rows
        return cached_program(key, fn, (st, n_iters), (self.tstate, self.dstate) + tuple(args), donate=(2,))

    def _step_key(self, st: Static, n_iters: int, rows: int):
        """A step program's key in the program cache and in loop.WIDTH_COSTS (dense or paged alike)."""
        return ("engine_step", st, n_iters) if rows == self.slots else ("engine_step_rows", st, n_iters, rows)

    def width_fields(self, st: Static, n_iters: int, rows: int, profile_width: int | None = None) -> dict:
        """A step's verify-width Params fields ({} without widths): the engine's verify_width with the
        costs profiled for that step program (none yet: ones, so "auto" keeps the whole block), or a
        profiling step forced to width index profile_width with nothing accepted."""
        if st.widths is None:
            return {}
        if profile_width is not None:
            flag = np.array(np.bool_(True), copy=True)
            flag = jnp.asarray(flag) if self.mesh is None else jax.device_put(flag, NamedSharding(self.mesh, P()))
            return dict(width_params(st, st.widths[profile_width]), width_profile=flag)
        return width_params(st, self.verify_width, WIDTH_COSTS.get(self._step_key(st, n_iters, rows)))

    def profile_widths(self, st: Static, n_iters: int, rows: int, time_width) -> None:
        """Measure the step program's iteration cost at each verify width, once per program
        (loop.width_costs; time_width(index) times a step forced to that width)."""
        if st.widths is not None:
            width_costs(self._step_key(st, n_iters, rows), time_width, len(st.widths))

    @staticmethod
    def done(state: SlotState) -> np.ndarray:
        """Each slot's done flag, on the host (gathered over processes: multi-host)."""
        return np.asarray(to_host(state.loop.done))
