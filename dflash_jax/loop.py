"""Prefill + the compiled generation loop, speculative (DFlash) and plain autoregressive, and the
program cache every generation and slot program shares.

A whole generation is ONE jitted function (`run`): prefill (target cache, draft context for the
prompt, first token), then a `lax.while_loop` whose iteration (`iterate`)
  (1) writes the pending context K/V into the draft cache and (2) drafts S-1 tokens from the block
      [last token, MASK × (S-1)] (both inside the draft's layers: one weight read),
  (3) verifies the S tokens with the target, (4) accepts the longest valid prefix plus the bonus,
  (5) commits per row: tokens, lengths, pending context = target taps of the committed tokens,
      stop flags (stop token, max_new_tokens, capacity) and per-iteration acceptance lengths.
Plain decoding (no draft, or block size 1) is the same loop with S = 1 and no draft step.
With adaptive widths (Static.widths, dflash_jax.width) each iteration verifies only the last token
plus the first W drafts, W chosen on the device per iteration; W = 0 skips the draft pass.
The host API around it (`generate`) is dflash_jax.decode; the slot engine's programs over the same
`prefill` and `iterate` are dflash_jax.serving.slot_programs (its host side, dflash_jax.serving.slots, asks for them there).

Compile keys (`Static`): batch bucket, prompt bucket, capacity, block size, sampling mode, the
resolved KernelConfig (attention backend, fused GPU kernels, GPU tuning), streaming on/off, and the
model structures. Everything else (prompt lengths,
max_new_tokens, temperature, top-k/top-p, stop ids, seed) is a traced array.

Semantics match the reference `dflash_generate`: the row's length limit is prompt + max_new_tokens
(the first token from prefill counts); near the limit the block is cut to the tokens still allowed
(the draft block's keys end there, as the reference's shorter block would).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import penalties, sampling, sharding, validation, width
from dflash_jax.kernel_config import KernelConfig
from dflash_jax.cache import KVCache
from dflash_jax.models.stack import CausalLM

__all__ = ["Static", "Params", "LoopState", "prefill", "iterate", "iteration", "run", "compiled", "cached_program",
           "compile_count", "clear_compiled", "stream_sink", "make_static", "buckets", "row_settings", "idle_params",
           "params_on_mesh", "param_specs", "loop_specs", "resolve_mesh", "merge_models", "to_host", "row_keys",
           "pow2", "round_up", "MAX_STOP_IDS", "GLOBAL_FIELDS", "rows_only", "with_globals", "width_costs",
           "width_params", "pick_width", "flush_pending", "pending_room"]


@dataclasses.dataclass(frozen=True)
class Static:
    target_def: Any
    draft_def: Any            # the proposer's structure (a DFlashDraft, or a double); None: plain decoding
    taps: tuple
    block_size: int
    batch: int
    prompt_bucket: int
    capacity: int
    mode: str
    kernels: KernelConfig     # resolved
    stream: bool
    mesh: Any = None          # jax.sharding.Mesh ('data', 'model') the program runs on; None: one device
    # the verify widths (drafts verified) one iteration may pick from (width.program_widths); None: the
    # whole block every iteration, no width choice in the program
    widths: Any = None
    # benchmark only (_simulated_acceptance): each row's acceptance drawn from Params.sim_survival
    simulate: bool = False
    # presence / frequency penalties, logit_bias and min_tokens applied to the target's logits (and
    # the draft's): Params' penalty fields are read (dflash_jax.penalties); off: never read
    penalties: bool = False
    # structured output (dflash_jax.serving.grammar): the verify masks each position's logits with
    # Params.grammar_mask and verifies the host's drafts (Params.grammar_drafts: the drafts it walked
    # the grammar along); off: never read
    grammar: bool = False

    def __hash__(self) -> int:
        # Computed once per key: hashing a 36-layer target's GraphDef walks every node (milliseconds
        # of host time), and one generate() call looks its key up in several caches.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


@struct.dataclass
class Params:
    """Traced run-time values: changing them never recompiles."""
    prompt: jax.Array          # [B, Tb] int32
    prompt_lens: jax.Array     # [B] int32
    active: jax.Array          # [B] bool (False: batch padding)
    # Sampling settings and limits are per row, so the rows of one batch (the serving engine's
    # slots) may each carry their own request's.
    max_new: jax.Array         # [B] int32
    temperature: jax.Array     # [B] float32 (0: greedy row)
    top_k: jax.Array           # [B] int32
    top_p: jax.Array           # [B] float32
    stop_ids: jax.Array        # [B, K] int32, -1 padded
    seed: jax.Array            # [B] uint32
    # [B] uint32: the stream a row's randomness is keyed by with its seed: its index in its generate
    # call (not its batch slot), so a request's samples do not depend on where it runs.
    rng_row: jax.Array
    stream_id: Any = None      # [] int32: the call's on_commit in _STREAMS (streaming programs only)
    # Verify width (programs with Static.widths only; replicated, so every replica decides alike):
    verify_width: Any = None   # [] int32: index into Static.widths, or -1: chosen per iteration (width.choose)
    width_cost: Any = None     # [n_widths] float32: measured cost of an iteration at each width
    width_profile: Any = None  # [] bool: accept nothing (host profiling of width_cost: one token per iteration)
    sim_survival: Any = None   # [S-1] float32: benchmark only (Static.simulate), the drawn acceptance's survival
    width_stats0: Any = None   # [2, S-1] float32: the statistics the loop starts from (a warm start, width_history)
    width0: Any = None         # [] int32: the width index it starts at
    width_step0: Any = None    # [] int32: iterations its program ran before (width_step)
    # [B] int32: the position the prompt rows start at (the paged engine's prefix hit: positions
    # before it are already in the caches' pages; prompt holds the tokens from there); None: 0
    prompt_start: Any = None
    # Penalty fields (read by Static.penalties programs only; dflash_jax.penalties):
    presence: Any = None       # [B] float32
    frequency: Any = None      # [B] float32
    bias_ids: Any = None       # [B, MAX_BIAS] int32, -1 padded
    bias_values: Any = None    # [B, MAX_BIAS] float32
    min_tokens: Any = None     # [B] int32: stop ids masked until the row has generated this many
    resumed: Any = None        # [B] int32: prompt tokens at its end that the request generated (a preempted row)
    # Grammar fields (Static.grammar programs only; dflash_jax.serving.grammar): the tokens allowed at each
    # verify position, bit t % 32 of word t // 32 (an unconstrained row: all ones), and the drafts
    # the host walked its grammar along to build them (the last iteration's proposal, or anything:
    # a draft the mask refuses is rejected there). A prefill reads position 0's row alone.
    grammar_mask: Any = None   # [B, S, ceil(V / 32)] int32 (a prefill's: [B, 1, ...])
    grammar_drafts: Any = None  # [B, S - 1] int32


@struct.dataclass
class LoopState:
    tokens: jax.Array          # [B, C + S] prompt, then generated; index `lens` holds the last token
    lens: jax.Array            # [B] tokens in the target cache (= index of the last committed token)
    target_cache: KVCache
    draft_cache: Any           # KVCache or None
    pending: Any               # [B, S, n_taps·H] taps of last iteration's committed tokens, or None
    pending_count: jax.Array   # [B]
    done: jax.Array            # [B] bool
    stopped: Any               # [B] bool: rows on_commit stopped (streaming programs only, else None)
    accept_log: jax.Array      # [B, C] tokens produced per iteration
    iters: jax.Array           # [B] iterations per row
    step: jax.Array            # [] loop iterations
    width_stats: Any = None    # [2, S-1] float32 acceptance statistics (width.update), or None
    width: Any = None          # [] int32 the last iteration's width index, or None
    # [] bool: run's adaptive loop settled on W = 0 for the rest of its call (width.settled): its
    # W = 0 steps stop keeping the draft's context and choosing widths. None outside run.
    retired: Any = None


# LoopState fields that are not per row (slot programs keep them out of row gathers and scatters)
GLOBAL_FIELDS = ("step", "width_stats", "width", "retired")


def rows_only(s: LoopState) -> LoopState:
    """s without its global fields (GLOBAL_FIELDS set to None), for per-row tree maps."""
    return s.replace(**{k: None for k in GLOBAL_FIELDS})


def with_globals(s: LoopState, src: LoopState) -> LoopState:
    """s with src's global fields."""
    return s.replace(**{k: getattr(src, k) for k in GLOBAL_FIELDS})


# Streaming: the compiled program calls this one host function with the call's id (a traced value,
# so a streaming program is compiled once), which finds that call's sink here. Each generate() call
# registers its own sink for its duration, so streaming calls may run in several threads at once.
_STREAMS: dict = {}
_STREAM_IDS = itertools.count(1)
_STREAM_LOCK = threading.Lock()      # guards the id counter and the dict, not the calls


@contextlib.contextmanager
def stream_sink(sink):
    """Register `sink(commit [B, n] numpy, produced [B] numpy) -> stop flag` for the duration of the
    block; yields the call id a streaming program's `Params.stream_id` carries to find it."""
    with _STREAM_LOCK:
        call_id = next(_STREAM_IDS) % (1 << 31)
        _STREAMS[call_id] = sink
    try:
        yield call_id
    finally:
        with _STREAM_LOCK:
            del _STREAMS[call_id]


def _stream_to_host(call_id, commit, produced):
    sink = _STREAMS.get(int(call_id))
    return np.bool_(sink is not None and sink(np.asarray(commit), np.asarray(produced)))


def _stream(p: Params, commit, produced):
    """Send one iteration's commits [B, n] (produced [B] of them per row) to the host; returns
    the host's stop flag [] bool."""
    # ordered effects are refused in programs over several devices; the loop's data dependence
    # (the flag decides `done`) orders the calls there
    return io_callback(_stream_to_host, jax.ShapeDtypeStruct((), jnp.bool_), p.stream_id, commit, produced,
                       ordered=sharding.current_mesh() is None)


def row_keys(p: Params, lens):
    """Per-row PRNG keys that depend only on the row's (seed, rng_row, length), never on its batch
    slot or on the other rows."""
    return jax.vmap(lambda s, r, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), n))(
        p.seed, p.rng_row, lens.astype(jnp.uint32))


def _finished(st: Static, lens, limit, cap_block):
    return (lens + 1 >= limit) | (lens + cap_block > st.capacity)


def _commit(target, cache, n):
    """The target's rollback hook after a forward: a hybrid target folds the first n[b] tokens of
    the block into its recurrent state (models/qwen3_5.py); attention targets have no commit."""
    commit = getattr(target, "commit", None)
    return cache if commit is None else commit(cache, n)


def prefill(st: Static, target: CausalLM, draft, p: Params, retired=None, caches=None):
    """The prompts through the target (and their taps into the draft's context), the first token
    committed: the loop's first state. retired ([] bool, run's adaptive loop): the call is settled
    on plain decoding from its start (`_settled_at_start`), so the draft's context is not written
    (a fresh cache) and the state starts retired. caches: (target cache, draft cache) to write
    into (the paged engine's pools with the new rows' page tables); None: fresh dense rows.
    p.prompt_start (with caches): the prompt rows start there, the positions before it already in
    the caches (a prefix hit); the attention then reads the cached rows too."""
    B, Tb, S, C = st.batch, st.prompt_bucket, st.block_size, st.capacity
    start = p.prompt_start
    positions = jnp.broadcast_to(jnp.arange(Tb, dtype=jnp.int32), (B, Tb))
    if start is not None:
        positions = positions + start[:, None]
    tcache = _on_mesh(st, target.new_cache(B, cache_rows(C))) if caches is None else caches[0]
    with jax.named_scope("prefill_target"):
        h, feats, tcache = target(p.prompt, positions, tcache, positions + 1, taps=st.taps,
                                  kernels=st.kernels, prefill=start is None)
    tcache = _commit(target, tcache, p.prompt_lens)        # a bucket's padding never reaches a state
    tail = p.prompt_lens if start is None else p.prompt_lens - start
    last = jnp.take_along_axis(h, (tail - 1)[:, None, None], axis=1)                   # [B, 1, H]
    logits = target.logits(last)[:, 0]                                                 # [B, V]
    tokens = None
    if st.penalties:
        tokens = jnp.zeros((B, C + S), jnp.int32)
        if start is not None:   # the prompt at its positions: penalties.committed reads a resumed row's tail
            tokens = jax.vmap(lambda t, q, s0: t.at[s0 + jnp.arange(Tb)].set(q, mode="drop"))(tokens, p.prompt, start)
        else:
            tokens = tokens.at[:, :Tb].set(p.prompt)
        counts, seen, generated = penalties.committed(p, tokens, p.prompt_lens - 1, logits.shape[-1])
        logits = penalties.adjust(p, logits[:, None], p.prompt[:, :1], counts, seen, generated)[:, 0]
    if st.grammar:
        logits = grammar_masked(logits, p.grammar_mask[:, 0])
    # keyed at prompt_len - 1: iterations key at lens >= prompt_len, so no key is used twice
    first = sampling.select(logits, row_keys(p, p.prompt_lens - 1), p.temperature, p.top_k, p.top_p,
                            st.mode, st.kernels)
    dcache = pending = None
    if draft is not None:
        with jax.named_scope("prefill_draft_context"):
            fresh = _on_mesh(st, draft.new_cache(B, cache_rows(C))) if caches is None else caches[1]
            write = lambda: draft.write_context(feats, positions, fresh, valid=p.prompt_lens)   # noqa: E731
            # (a measurable share of a short call on CPU)
            dcache = write() if retired is None else jax.lax.cond(retired, lambda: fresh, write)
        pending = jnp.zeros((B, S, feats.shape[-1]), feats.dtype)
    if tokens is None:
        tokens = jnp.zeros((B, C + S), jnp.int32).at[:, :Tb].set(p.prompt)
    tokens = jax.vmap(lambda t, n, f: t.at[n].set(f))(tokens, p.prompt_lens, first)
    lens = p.prompt_lens
    limit = p.prompt_lens + p.max_new
    stop = jnp.any(first[:, None] == p.stop_ids, axis=1)
    done = ~p.active | stop | _finished(st, lens, limit, S)
    tcache = dataclasses.replace(tcache, lens=lens)
    wstats = wsel = None
    if st.widths is not None and draft is not None:
        wstats = p.width_stats0 if p.width_stats0 is not None else jnp.zeros((2, S - 1), jnp.float32)
        wsel = p.width0 if p.width0 is not None else jnp.asarray(len(st.widths) - 1, jnp.int32)
    stopped = None
    if st.stream:  # the prefill token is the first committed token
        halt = _stream(p, first[:, None], p.active.astype(jnp.int32))
        stopped, done = halt & ~done, done | halt
    return _placed(st, LoopState(tokens=tokens, lens=lens, target_cache=tcache, draft_cache=dcache, pending=pending,
                                 pending_count=jnp.zeros((B,), jnp.int32), done=done, stopped=stopped,
                                 accept_log=jnp.zeros((B, C), jnp.int32), iters=jnp.zeros((B,), jnp.int32),
                                 step=jnp.zeros((), jnp.int32), width_stats=wstats, width=wsel, retired=retired))


def iteration(st: Static, target: CausalLM, draft, p: Params, s: LoopState) -> LoopState:
    return iterate(st, target, draft, p, s)[0]


def _write_pending(draft, s: LoopState):
    """The draft cache with the pending taps (s.pending_count rows ending at s.lens) written as
    context; the rows past the count land at/after lens, where a later write or block overwrites them."""
    j = jnp.arange(s.pending.shape[1], dtype=jnp.int32)
    with jax.named_scope("draft_context"):
        pend_pos = (s.lens - s.pending_count)[:, None] + j
        return dataclasses.replace(draft.write_context(s.pending, pend_pos, s.draft_cache), lens=s.lens)


def flush_pending(draft, s: LoopState) -> LoopState:
    """s with its pending taps written into the draft cache and none left pending (the W = 0
    loops run this when a row's pending buffer is full, see pending_room)."""
    return s.replace(draft_cache=_write_pending(draft, s), pending_count=jnp.zeros_like(s.pending_count))


def pending_room(s: LoopState) -> jax.Array:
    """[] bool: every running row can append one more row of pending taps (an appending W = 0
    iteration may run)."""
    return jnp.all(s.done | (s.pending_count < s.pending.shape[1]))


def _verify(st: Static, target: CausalLM, draft, p: Params, s: LoopState, W: int, append: bool = False):
    """Draft (W > 0), verify the last token + the first W drafts, accept. Returns (block [B, S]
    zero-padded past W + 1, a [B] drafts accepted (<= W), next [B] the bonus / correction, feats
    [B, S, n_taps·H] zero-padded (None without a draft), target cache, draft cache). W = 0 with a
    draft is a plain step whose context must still reach the draft cache: with `append` it leaves
    the draft cache alone (the caller appends its one row of taps to the pending ones, written when
    the buffer fills or by the next draft pass: ~1 row of context per plain step); without, it
    writes last iteration's pending taps (up to S rows) now, as a one-iteration-alone caller needs."""
    B, S = st.batch, st.block_size
    j = jnp.arange(S, dtype=jnp.int32)
    lens = s.lens
    limit = p.prompt_lens + p.max_new
    positions = lens[:, None] + j[:W + 1]                                       # [B, W+1]
    current = jnp.take_along_axis(s.tokens, lens[:, None], axis=1)              # [B, 1]
    dcache, taps, proposal, block = s.draft_cache, (), None, current
    if st.penalties:
        counts, seen, generated = penalties.committed(p, s.tokens, lens, target.config.vocab_size)
    if draft is not None and W > 0 and st.grammar:   # the host's drafts (Params.grammar_drafts)
        taps = st.taps
        dcache = _write_pending(draft, s)       # the context propose would have written
        block = jnp.concatenate([current, p.grammar_drafts[:, :W]], axis=1)           # [B, W+1]
    elif draft is not None and W > 0:   # the proposer: DFlashDraft.propose, or anything with its signature
        taps = st.taps
        head = _proposer_head(st, target, p, generated if st.penalties else None)
        args = (head, current, lens, limit, s.pending, s.pending_count, s.draft_cache)
        # a prefix verify wants W drafts: the LM head runs on those rows alone (over all 15 rows of
        # a B = 64 block at Qwen3-8B's vocab it is 1.2 TFLOP, ~10% of a W = 3 iteration's work)
        cut = {"heads": W} if W < S - 1 else {}
        if st.mode != "greedy" and getattr(draft, "samples_drafts", False):
            # a DFlash2 selector draws its path from q over K candidates: q enters the acceptance
            draft_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0xD2AF7))(row_keys(p, lens))
            drafts, dcache, proposal = draft.propose(*args, block_size=S, kernels=st.kernels,
                                                     temperature=p.temperature, keys=draft_keys, **cut)
            proposal = tuple(x[:, :W] for x in proposal)       # the unverified tail leaves acceptance
        else:
            drafts, dcache = draft.propose(*args, block_size=S, kernels=st.kernels, **cut)  # [B, S-1]
        block = jnp.concatenate([current, drafts[:, :W]], axis=1)                  # [B, W+1]
    elif draft is not None:
        taps = st.taps
        if not append:
            dcache = _write_pending(draft, s)
    # a plain step commits one token on every running row (iterate's `produced`): a hybrid target
    # advances their recurrent states in its forward instead of folding them again after it
    one_row = dict(commit_rows=~s.done) if W == 0 and getattr(target, "commit", None) is not None else {}
    with jax.named_scope("verify"):
        h, feats, tcache = target(block, positions, s.target_cache, positions + 1, taps=taps,
                                  kernels=st.kernels, **one_row)
        logits = target.logits(h)                                                   # [B, W+1, V]
    if st.penalties:
        with jax.named_scope("penalties"):
            logits = penalties.adjust(p, logits, block, counts, seen, generated)
    if st.grammar:
        logits = grammar_masked(logits, p.grammar_mask[:, :W + 1])
    with jax.named_scope("accept"):
        keys = row_keys(p, lens)
        a, nxt = sampling.accept(block, logits, keys, p.temperature, p.top_k, p.top_p, st.mode,
                                 st.kernels, proposal=proposal)
        if st.simulate:   # benchmark only: real costs at a drawn acceptance (its bonus: the argmax there)
            sim_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0x51A))(keys)
            a = jnp.minimum(width.simulate(p.sim_survival, sim_keys), W)
            nxt = sharding.argmax(jnp.take_along_axis(logits, a[:, None, None], axis=1))[:, 0]
        if p.width_profile is not None:   # profiling a width's cost: nothing accepted
            a = jnp.where(p.width_profile, 0, a)
            nxt = jnp.where(p.width_profile, sharding.argmax(logits[:, :1])[:, 0], nxt)
    pad = S - (W + 1)
    block = jnp.pad(block, ((0, 0), (0, pad)))
    if draft is not None:
        feats = jnp.pad(feats, ((0, 0), (0, pad), (0, 0)))
    else:
        feats = None
    return block, a.astype(jnp.int32), nxt.astype(jnp.int32), feats, tcache, dcache


def grammar_masked(logits, mask):
    """logits [..., V] with the tokens `mask` [..., ceil(V / 32)] int32 refuses at -inf (bit t % 32 of
    word t // 32 set: allowed). A refused draft then has probability 0 and is rejected (greedy: it is
    never the argmax; sampled: u < p fails), and the correction is drawn from the allowed tokens."""
    V = logits.shape[-1]
    bits = (mask[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1                # [..., W, 32]
    allowed = bits.reshape(*mask.shape[:-1], -1)[..., :V].astype(bool)
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))


def propose_next(st: Static, target: CausalLM, draft, p: Params, s: LoopState):
    """[B, S-1] the drafts the next iteration would verify from state s (a grammar program
    returns them, so the host walks each constrained row's grammar along them before that
    iteration). Deterministic drafts (a DFlash2 selector's argmax path): acceptance is exact for
    any deterministic proposal, so sampled rows stay exact."""
    lens = s.lens
    current = jnp.take_along_axis(s.tokens, lens[:, None], axis=1)
    generated = penalties.committed(p, s.tokens, lens, target.config.vocab_size)[2] if st.penalties else None
    head = _proposer_head(st, target, p, generated)
    drafts, _ = draft.propose(head, current, lens, p.prompt_lens + p.max_new, s.pending, s.pending_count,
                              s.draft_cache, block_size=st.block_size, kernels=st.kernels)
    return drafts.astype(jnp.int32)


def _proposer_head(st: Static, target, p: Params, generated):
    """The target as the proposer sees it: with penalties, its head adjusted (_AdjustedHead)."""
    return _AdjustedHead(target, p, generated) if st.penalties else target


class _AdjustedHead:
    """The target as a proposer sees it: its LM head's logits with the rows' logit_bias and
    min_tokens mask (penalties.draft_logits), so the draft proposes a forced token and holds a
    stop back as the adjusted target does. Every other attribute is the target's."""

    def __init__(self, target, p: Params, generated):
        self._target, self._p, self._generated = target, p, generated

    def __getattr__(self, name):
        return getattr(self._target, name)

    def logits(self, h):
        out = self._target.logits(h)
        return penalties.draft_logits(self._p, out, self._generated).astype(out.dtype)


def _width_inputs(st: Static, p: Params):
    """(forced width index or -1, per-width costs, ones until measured) of an adaptive program."""
    force = p.verify_width if p.verify_width is not None else jnp.asarray(-1, jnp.int32)
    cost = p.width_cost if p.width_cost is not None else jnp.ones((len(st.widths),), jnp.float32)
    return force, cost


def width_step(p: Params, s: LoopState):
    """The iteration count the width rule's warm-up and probes run on: this call's steps after the
    earlier calls' of its program (p.width_step0, a warm start), so a run of short calls still
    probes and warms up once."""
    return s.step if p.width_step0 is None else s.step + p.width_step0


def _batch_left(st: Static, p: Params, s: LoopState):
    """(the most tokens a running row still has to produce, the running rows, or None at one row:
    there width.batch_tokens is E(W), whose per-step ops are skipped) of a one-shot batch."""
    left = jnp.max(jnp.where(s.done, 0, p.prompt_lens + p.max_new - s.lens))
    return left, (jnp.sum(~s.done) if st.batch > 1 else None)


def pick_width(st: Static, p: Params, s: LoopState, one_shot: bool = False):
    """The width index of the next iteration (width.choose over replicated values). one_shot: the
    batch ends with its slowest row (run's loop; the slot engine refills rows), so the choice
    weighs the running rows' spread (width.batch_tokens)."""
    force, cost = _width_inputs(st, p)
    left, rows = _batch_left(st, p, s)
    batch = (left, rows) if one_shot and rows is not None else None
    return width.choose(s.width_stats, cost, s.width, width_step(p, s), force, st.widths,
                        horizon=jnp.max(p.max_new), batch=batch)


def iterate(st: Static, target: CausalLM, draft, p: Params, s: LoopState, k: int | None = None):
    """One draft-verify-accept-commit iteration: (the next loop state, commit [B, S] the tokens each
    row committed, produced [B] how many of them). The one-shot loop and the engine's step both run it.
    With Static.widths: k (a Python int) runs width index k (run and the slot step call it so, from
    one while loop per width; at W = 0 it appends its taps to the pending ones, so it may run only
    while `pending_room`, with `flush_pending` before it otherwise); None chooses it first and runs
    that width's branch of a lax.switch (one iteration alone, e.g. `iteration`; inside a loop the
    switch copies the caches, see run)."""
    B, S, C = st.batch, st.block_size, st.capacity
    j = jnp.arange(S, dtype=jnp.int32)
    lens = s.lens
    limit = p.prompt_lens + p.max_new
    remaining = limit - lens                                                    # >= 2 on active rows
    wstats, wsel = s.width_stats, s.width
    append = False
    if st.widths is None or draft is None:
        block, a, nxt, feats, tcache, dcache = _verify(st, target, draft, p, s, S - 1 if draft is not None else 0)
    elif k is not None:
        wsel = jnp.asarray(k, jnp.int32)
        # a W = 0 loop appends its taps (its caller runs it only under pending_room, see run)
        append = st.widths[k] == 0
        block, a, nxt, feats, tcache, dcache = _verify(st, target, draft, p, s, st.widths[k], append=append)
    else:
        with jax.named_scope("choose_width"):
            wsel = pick_width(st, p, s)
        block, a, nxt, feats, tcache, dcache = jax.lax.switch(
            wsel, [functools.partial(_verify, st, target, draft, p, s, W) for W in st.widths])
    if wstats is not None:
        ran = ~s.done if p.width_profile is None else ~s.done & ~p.width_profile
        # (retired W = 0 steps verify nothing: the statistics decay as an unretired W = 0 loop's
        # would, so the next call of the program starts where it would have without retirement)
        wstats = width.update(s.width_stats, a, jnp.asarray(st.widths, jnp.int32)[wsel], ran)
        force, cost = _width_inputs(st, p)
        wsel = width.kept(wsel, s.width, width_step(p, s), force, cost)
    with jax.named_scope("accept"):
        shifted = jnp.concatenate([block[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        commit = jnp.where(j < a[:, None], shifted, nxt[:, None])                 # [B, S]
        produced = jnp.minimum(a + 1, remaining - 1)
        is_stop = jnp.any(commit[..., None] == p.stop_ids[:, None, :], axis=-1) & (j < produced[:, None])
        produced = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, produced)
        produced = jnp.where(s.done, 0, produced).astype(jnp.int32)
        tcache = _commit(target, tcache, produced)        # rejected drafts never reach a state
    with jax.named_scope("commit"):
        def put(row, start, new, n):
            old = jax.lax.dynamic_slice(row, (start,), (S,))
            return jax.lax.dynamic_update_slice(row, jnp.where(j < n, new, old), (start,))
        tokens = jax.vmap(put)(s.tokens, lens + 1, commit, produced)
        new_lens = lens + produced
        active = ~s.done
        accept_log = jax.vmap(lambda r, i, n, on: jnp.where(on, r.at[i].set(n), r))(
            s.accept_log, jnp.minimum(s.iters, C - 1), produced, active)
        done = s.done | jnp.any(is_stop, axis=1) | _finished(st, new_lens, limit, S)
        stopped = s.stopped
        if st.stream:   # on_commit asked to stop (or raised): every row still running stops here
            halt = _stream(p, commit, produced)
            stopped, done = s.stopped | (halt & ~done), done | halt
    pending, pending_count = feats, produced
    if append:   # this row's taps after the pending ones (a done row's count stays; a full row never runs here)
        # one row written in place per batch row (a select over the whole [B, S, taps] buffer
        # measured slower on the H200)
        def put_row(pend, row, n):
            at = jnp.minimum(n, S - 1)
            old = jax.lax.dynamic_slice_in_dim(pend, at, 1, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(pend, jnp.where(n < S, row, old), at, axis=0)
        pending = jax.vmap(put_row)(s.pending, feats[:, :1], s.pending_count)
        pending_count = s.pending_count + produced
        if s.retired is not None:       # retired: no more draft context (never flushed, never drafted from)
            pending_count = jnp.where(s.retired, s.pending_count, pending_count)
    return _placed(st, LoopState(tokens=tokens, lens=new_lens, target_cache=dataclasses.replace(tcache, lens=new_lens),
                                 draft_cache=dcache, pending=pending, pending_count=pending_count,
                                 done=done, stopped=stopped, accept_log=accept_log, iters=s.iters + active.astype(jnp.int32),
                                 step=s.step + 1, width_stats=wstats, width=wsel, retired=s.retired)), commit, produced


def loop_specs(st: Static, s: LoopState) -> LoopState:
    """The loop state's PartitionSpecs on st.mesh: rows on 'data', caches by sharding.cache_specs."""
    row, mat = P("data"), P("data", None)

    def cache(c):
        if hasattr(c, "specs"):           # a cache that lays itself out (the hybrid target's)
            return c.specs(st.mesh)
        if not isinstance(c, KVCache):
            return jax.tree.map(lambda _: P(), c)
        kv, lens = sharding.cache_specs(c.k[0].shape[1], st.mesh, c.k[0].shape[0])
        return KVCache(k=tuple(kv for _ in c.k), v=tuple(kv for _ in c.v), lens=lens)
    return LoopState(tokens=mat, lens=row, target_cache=cache(s.target_cache),
                     draft_cache=None if s.draft_cache is None else cache(s.draft_cache),
                     pending=None if s.pending is None else P("data", None, None), pending_count=row, done=row,
                     stopped=None if s.stopped is None else row, accept_log=mat, iters=row, step=P(),
                     width_stats=None if s.width_stats is None else P(), width=None if s.width is None else P(),
                     retired=None if s.retired is None else P())


def _on_mesh(st: Static, cache):
    """A cache born inside the program, placed by sharding.cache_specs (left to propagation, a
    cache's layout could differ between prefill and loop and force reshards)."""
    return cache if st.mesh is None or not isinstance(cache, KVCache) else sharding.shard_cache(cache, st.mesh)


def _placed(st: Static, s: LoopState) -> LoopState:
    """The loop carry constrained to loop_specs, so it keeps one layout from prefill through
    every iteration."""
    if st.mesh is None:
        return s
    return jax.tree.map(lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(st.mesh, spec)),
                        loop_specs(st, s), s, is_leaf=lambda x: isinstance(x, P))


def _settled_at_start(st: Static, p: Params) -> jax.Array:
    """[] bool: an adaptive one-shot call that starts at W = 0 (forced, or a warm start there) and
    is settled (width.settled) before its first step: it decodes plainly throughout, so its
    prefill need not write the draft's context."""
    force, cost = _width_inputs(st, p)
    S = st.block_size
    stats = p.width_stats0 if p.width_stats0 is not None else jnp.zeros((2, S - 1), jnp.float32)
    current = p.width0 if p.width0 is not None else jnp.asarray(len(st.widths) - 1, jnp.int32)
    step = p.width_step0 if p.width_step0 is not None else jnp.asarray(0, jnp.int32)
    left = jnp.max(jnp.where(p.active, p.max_new, 0))
    batch = (left, jnp.sum(p.active)) if st.batch > 1 else None
    first = width.choose(stats, cost, current, step, force, st.widths, horizon=jnp.max(p.max_new), batch=batch)
    rows = None if batch is None else batch[1]
    return (first == 0) & width.settled(stats, cost, step, force, st.widths, left, rows)


def run(st: Static, target_state, draft_state, p: Params):
    with sharding.active(st.mesh):
        target = nnx.merge(st.target_def, target_state)
        draft = None if st.draft_def is None else nnx.merge(st.draft_def, draft_state)
        running = lambda s: jnp.any(~s.done) & (s.step < st.capacity)                  # noqa: E731
        if st.widths is None or draft is None:
            s = prefill(st, target, draft, p)
            return jax.lax.while_loop(running, lambda s: iteration(st, target, draft, p, s), s)
        s = prefill(st, target, draft, p, retired=_settled_at_start(st, p))

        # One while loop per width, each running while the choice stays on its width, inside an
        # outer loop that visits them in turn (each visit runs >= 1 iteration: the width chosen is
        # one of them). A lax.switch over the widths would do the same with one loop, but XLA then
        # copies every KV-cache buffer into each branch per iteration (in-place updates inside
        # conditional branches); a while loop carries them in place (docs/adaptive-width.md).
        # W = 0 appends each step's one row of taps to the pending ones instead of writing them
        # (a plain step's cost, not S rows of draft context): its loop runs while every row has
        # room, and a flush loop before it writes a full buffer out (once per S plain steps).
        # Retirement: when W = 0 is chosen and would stay chosen to the end of the call
        # (width.settled, checked on entering W = 0 and at each flush: once per S plain steps), the
        # W = 0 loop runs to the end without appending taps, flushing or choosing: plain decoding's
        # own step (the draft context is never needed again in this call).
        def settled(s):
            force, cost = _width_inputs(st, p)
            left, rows = _batch_left(st, p, s)
            return width.settled(s.width_stats, cost, width_step(p, s), force, st.widths, left, rows)

        def visit(s):
            for k, W in enumerate(st.widths):
                on = lambda s, k=k: running(s) & (pick_width(st, p, s, one_shot=True) == k)  # noqa: E731
                if W == 0:
                    s = s.replace(retired=s.retired | (on(s) & settled(s)))
                    s = jax.lax.while_loop(lambda s, on=on: ~s.retired & on(s) & ~pending_room(s),
                                           lambda s: flush_pending(draft, s), s)
                    # the choice is not evaluated once retired (a device-side conditional)
                    cond = lambda s, on=on: running(s) & jax.lax.cond(                  # noqa: E731
                        s.retired, lambda: jnp.asarray(True), lambda: on(s) & pending_room(s))
                else:
                    cond = on
                s = jax.lax.while_loop(cond, lambda s, k=k: iterate(st, target, draft, p, s, k)[0], s)
            return s
        s = jax.lax.while_loop(running, visit, s)
    return s


# ----------------------------------------------------------------------------------------- programs
# Every compiled program (generate's, keyed by Static; the slot engine's, keyed by its own tuple) is
# kept here for the process's life; compile_count counts them.
_COMPILED: dict = {}
_COMPILES = [0]
_COMPILES_LOCK = threading.Lock()     # programs may compile in threads (Slots.warmup)


def clear_compiled() -> None:
    """Drop every cached generation program (they are kept per static key for the process's life)
    and the verify-width costs measured on them."""
    _COMPILED.clear()
    WIDTH_COSTS.clear()
    _WIDTH_HISTORY.clear()


# Measured cost of an iteration at each verify width, per program (key: its cache key), seconds
WIDTH_COSTS: dict = {}


def width_costs(key, time_width, n: int, rounds: int = 3) -> np.ndarray:
    """[n] float32 seconds per iteration at each width index of the program `key`, measured once and
    cached. time_width(index) -> (seconds of a run forced to that width, seconds of the same run's
    fixed part to subtract (0.0 when none), iterations it ran). `rounds` interleaved rounds over the
    widths after one warm-up call; the fastest run and the fastest fixed part are kept SEPARATELY
    (the fastest difference would be a spike: one slow fixed-part run made a B = 1 MoE plain step
    cost ~0 on the H200, and "auto" then decoded plainly, far below the block's speed: 247.5 against
    742.9 tok/s at Coder-30B-A3B shapes), then the costs are made non-decreasing in the width (more
    verified rows never cost less; the measured order can only be noise). Over several processes (a
    multi-host mesh) every process uses process 0's costs: each host times the same runs, but its own
    clock would give each its own width choices, and replicas of one program must take the same
    branch."""
    costs = WIDTH_COSTS.get(key)
    if costs is None:
        time_width(n - 1)
        got = [[time_width(i) for i in range(n)] for _ in range(rounds)]
        costs = np.asarray([max(min(r[i][0] for r in got) - min(r[i][1] for r in got), 0.0) / max(got[0][i][2], 1)
                            for i in range(n)])
        costs = np.maximum.accumulate(np.maximum(costs, 1e-3 * max(float(costs.max()), 1e-9)))
        costs = costs.astype(np.float32)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            costs = np.asarray(multihost_utils.broadcast_one_to_all(costs), np.float32)
        WIDTH_COSTS[key] = costs
    return costs


# The statistics and width an "auto" generation of each program ended with (key: its cache key):
# the next call of that program starts from them instead of an empty warm-up (width_history).
_WIDTH_HISTORY: dict = {}


def width_history(key, state=None, p: Params | None = None):
    """The (statistics [2, S-1], width index, iterations so far) the last "auto" call of program
    `key` ended with, or None; with `state` (a finished LoopState) and its params `p`, store its own
    first. generate() pays the full-width warm-up once per program, not once per call (on 2 CPU
    cores, where no width beats plain decoding, the warm-up iterations were a visible share of a
    short call: 128 tokens of the embedded pair ran auto at 0.79x plain with 8 full-width warm-up
    iterations, 0.99x with a priced warm-up and this warm start), and the probes' schedule runs on over the calls (width_step)."""
    if state is not None:
        before = 0 if p is None or p.width_step0 is None else int(to_host(p.width_step0))
        _WIDTH_HISTORY[key] = (np.asarray(to_host(state.width_stats), np.float32),
                               np.asarray(to_host(state.width), np.int32),
                               np.asarray(min(before + int(to_host(state.step)), 2 ** 30), np.int32))
    return _WIDTH_HISTORY.get(key)


def compile_count() -> int:
    """How many generation programs this process has compiled (tests use it to prove compile-once)."""
    return _COMPILES[0]


def pow2(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def cache_rows(capacity: int) -> int:
    """KV rows allocated for a capacity: rounded up to 16, the GPU attention kernel's smallest key
    tile (a user's capacity of 1000 would otherwise send every layer to XLA's attention). The
    capacity itself still bounds the tokens (_finished); the extra rows are never written."""
    return round_up(int(capacity), 16)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


MAX_STOP_IDS = validation.MAX_STOP_IDS


def buckets(longest_prompt: int, max_new_tokens: int, block_size: int, capacity: int | None):
    """(prompt bucket, KV capacity): powers of two for prompts; capacity = bucket + max_new + block,
    rounded up to 1024, unless given."""
    Tb = pow2(longest_prompt, 16)
    C = capacity if capacity is not None else round_up(Tb + int(max_new_tokens) + block_size, 1024)
    return Tb, C


def make_static(target_def, draft_def, draft_config, *, block_size, batch, prompt_bucket, capacity, mode,
            kernels, stream=False, mesh=None, adaptive=False, verify_width="auto", penalties=False,
            grammar=False) -> Static:
    """The compile key. adaptive: the program picks its verify width per iteration (Static.widths;
    only with a draft and a block of more than one token) from width.program_widths(block_size,
    verify_width): a width forced outside the default set is compiled in too."""
    has_draft = draft_def is not None
    # on XLA:CPU a verified row costs its compute at any batch: the half block joins the widths
    platform = (mesh.devices.flat[0].platform if mesh is not None else jax.default_backend())
    widths = (width.program_widths(block_size, verify_width, per_row_cost=platform == "cpu")
              if adaptive and has_draft and block_size > 1 else None)
    return Static(target_def=target_def, draft_def=draft_def,
                   taps=tuple(draft_config.target_layer_ids) if has_draft else (), block_size=block_size,
                   batch=batch,
                   prompt_bucket=prompt_bucket, capacity=capacity, mode=mode, kernels=kernels,
                   stream=stream, mesh=mesh, widths=widths, simulate=widths is not None and _SIMULATE[0] is not None,
                   penalties=bool(penalties), grammar=bool(grammar))


# Benchmark only: a survival profile that adaptive programs built meanwhile draw their acceptance
# from (Static.simulate marks them, so they never share a cache entry with real ones; the profile
# itself is a traced value, width_params). Reached only through _simulated_acceptance, which no CLI
# flag, generate() keyword or server path sets.
_SIMULATE: list = [None]


@contextlib.contextmanager
def _simulated_acceptance(survival):
    """Within the block, programs built (make_static) replace each row's accepted drafts by a draw
    from `survival` (P(a > p) = survival[p], clipped to the width verified): real weights' costs at a
    chosen acceptance, for scripts/bench_adaptive.py. Not thread-safe; benchmarks only."""
    s = tuple(float(x) for x in survival)
    if any(not 0.0 <= x <= 1.0 for x in s) or any(b > a for a, b in zip(s, s[1:])):
        raise ValueError("a survival profile is non-increasing values in [0, 1]")
    prev, _SIMULATE[0] = _SIMULATE[0], s
    try:
        yield s
    finally:
        _SIMULATE[0] = prev


def resolve_mesh(mesh, target, draft):
    """The program's mesh: `mesh` (a Mesh or a make_mesh spec) or, when None, the one the target's
    parameters are on. Both models must sit on it (one-line errors otherwise). target and draft
    may be the models or their nnx.States (sharding.mesh_of)."""
    on = sharding.mesh_of(target)
    mesh = on if mesh is None else sharding.as_mesh(mesh)
    hint = "load it with load_target/load_draft(..., mesh=) or place it with sharding.shard_model"
    if on != mesh:
        raise ValueError(f"the target's parameters are on {_mesh_name(on)}, generate was given {_mesh_name(mesh)}; {hint}")
    d = None if draft is None else sharding.mesh_of(draft)
    if draft is not None and d != mesh:
        raise ValueError(f"the draft's parameters are on {_mesh_name(d)}, the target's on {_mesh_name(mesh)}; {hint}")
    return mesh


def _mesh_name(mesh) -> str:
    return "one device" if mesh is None else "mesh " + ",".join(f"{a}={n}" for a, n in mesh.shape.items())


# Params fields with one entry per batch row (placed on 'data'); the others are replicated
_ROW_FIELDS = ("prompt", "prompt_lens", "active", "max_new", "temperature", "top_k", "top_p", "stop_ids",
               "seed", "rng_row", "presence", "frequency", "bias_ids", "bias_values", "min_tokens",
               "resumed", "grammar_mask", "grammar_drafts")


def param_specs(p: Params) -> Params:
    def spec(name, x):
        if x is None:
            return None
        return P("data", *([None] * (len(x.shape) - 1))) if name in _ROW_FIELDS else P()
    return p.replace(**{f.name: spec(f.name, getattr(p, f.name)) for f in dataclasses.fields(p)})


def params_on_mesh(p: Params, mesh) -> Params:
    """The run-time values placed on the mesh (param_specs). Built from the host copy every
    process holds, each process filling only its own devices (multi-host)."""
    if mesh is None:
        return p

    def put(spec, x):
        if isinstance(x, jax.Array) and x.sharding == NamedSharding(mesh, spec):
            return x                     # placed already (it may span other processes' devices)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])
    return jax.tree.map(put, param_specs(p), p, is_leaf=lambda x: isinstance(x, P))


def to_host(tree):
    """device_get, gathering arrays that span other processes' devices first (multi-host)."""
    from jax.experimental import multihost_utils

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)
    return jax.tree.map(get, tree)


def row_settings(rows: list[dict], host: bool = False) -> dict:
    """Params' per-row fields from one dict per batch row (max_new, temperature, top_k, top_p,
    stop_ids: a list of at most MAX_STOP_IDS ids, seed, rng_row; optional: penalties.row_fields'
    keys), as numpy-backed device arrays; host: as the numpy arrays themselves (a compiled
    program's call moves them to the device with its other arguments, where each jnp.asarray is
    an eager op of its own: the slot engine's prefills)."""
    stop_ids = np.full((len(rows), MAX_STOP_IDS), -1, np.int32)
    for i, r in enumerate(rows):
        stop_ids[i, :len(r["stop_ids"])] = r["stop_ids"]
    put = np.asarray if host else jnp.asarray
    col = lambda k, dt: put(np.array([r[k] for r in rows], dt))             # noqa: E731
    return dict(max_new=col("max_new", np.int32), temperature=col("temperature", np.float32),
                top_k=col("top_k", np.int32), top_p=col("top_p", np.float32), stop_ids=put(stop_ids),
                seed=col("seed", np.uint32), rng_row=col("rng_row", np.uint32),
                **{k: put(v) for k, v in penalties.row_fields(rows).items()})


def compiled(st: Static, tstate, dstate, p) -> tuple[Any, float]:
    """The cached executable for `st`, compiling it first if needed; (executable, compile seconds)."""
    fn = _COMPILED.get(st)
    if fn is not None:
        return fn, 0.0
    t0 = time.perf_counter()
    fn = jax.jit(run, static_argnums=(0,)).lower(st, tstate, dstate, p).compile(
        compiler_options=st.kernels.compiler_options())
    with _COMPILES_LOCK:
        _COMPILES[0] += 1
        _COMPILED[st] = fn
    return fn, time.perf_counter() - t0


def merge_models(st: Static, tstate, dstate):
    """The target and the draft (None for plain decoding) of st, merged from their states."""
    return nnx.merge(st.target_def, tstate), (None if st.draft_def is None else nnx.merge(st.draft_def, dstate))


def width_params(st: Static, verify_width="auto", costs=None) -> dict:
    """Params' verify-width fields of a program (empty without Static.widths): the forced index (-1:
    auto), the costs (ones until measured: full width wins) and the profiling flag off; replicated."""
    if st.widths is None:
        return {}
    put = (lambda x: x) if st.mesh is None else (lambda x: jax.device_put(x, NamedSharding(st.mesh, P())))
    costs = np.ones((len(st.widths),), np.float32) if costs is None else np.asarray(costs, np.float32)
    out = dict(verify_width=put(jnp.asarray(width.width_index(st.widths, verify_width), jnp.int32)),
               width_cost=put(jnp.asarray(costs)), width_profile=put(jnp.asarray(False)),
               width_stats0=put(jnp.zeros((2, st.block_size - 1), jnp.float32)),
               width0=put(jnp.asarray(len(st.widths) - 1, jnp.int32)), width_step0=put(jnp.zeros((), jnp.int32)))
    if st.simulate:
        if _SIMULATE[0] is None:
            raise RuntimeError("a simulated-acceptance program needs loop._simulated_acceptance active")
        sim = np.zeros((st.block_size - 1,), np.float32)
        prof = np.asarray(_SIMULATE[0], np.float32)[:st.block_size - 1]
        sim[:len(prof)] = prof
        out["sim_survival"] = put(jnp.asarray(sim))
    return out


def idle_params(batch: int, prompt_bucket: int) -> Params:
    """Parameters of `batch` idle rows (prompt of one token, nothing to generate)."""
    zeros = [dict(max_new=1, temperature=0.0, top_k=0, top_p=1.0, stop_ids=[], seed=0, rng_row=0)] * batch
    return Params(prompt=jnp.zeros((batch, prompt_bucket), jnp.int32), prompt_lens=jnp.ones((batch,), jnp.int32),
                  active=jnp.zeros((batch,), bool), **row_settings(zeros))


def cached_program(key, fn, static: tuple, args, donate=()):
    """The cached executable of fn(*static, *args) (counted by compile_count); key: everything its
    program depends on beyond the argument values (static, and the slot state's shape). static[0]
    is the program's Static (its kernels' compile options)."""
    prog = _COMPILED.get(key)
    if prog is None:
        prog = jax.jit(functools.partial(fn, *static), donate_argnums=donate).lower(*args).compile(
            compiler_options=static[0].kernels.compiler_options())
        with _COMPILES_LOCK:
            _COMPILES[0] += 1
            _COMPILED[key] = prog
    return prog


