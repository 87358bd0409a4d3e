"""Prefill + the compiled generation loop, speculative (DFlash) and plain autoregressive.

A whole generation is ONE jitted function: prefill (target cache, draft context for the prompt, first
token), then a `lax.while_loop` whose iteration
  (1) writes the pending context K/V into the draft cache and (2) drafts S-1 tokens from the block
      [last token, MASK × (S-1)] (both inside the draft's layers: one weight read),
  (3) verifies the S tokens with the target, (4) accepts the longest valid prefix plus the bonus,
  (5) commits per row: tokens, lengths, pending context = target taps of the committed tokens,
      stop flags (stop token, max_new_tokens, capacity) and per-iteration acceptance lengths.
Plain decoding (no draft, or block size 1) is the same loop with S = 1 and no draft step.

Compile keys (`_Static`): batch bucket, prompt bucket, capacity, block size, sampling mode, the
resolved KernelConfig (attention backend, fused GPU kernels, GPU tuning), streaming on/off, and the
model structures. Everything else (prompt lengths,
max_new_tokens, temperature, top-k/top-p, stop ids, seed) is a traced array.

Semantics match the reference `dflash_generate`: the row's length limit is prompt + max_new_tokens
(the first token from prefill counts); near the limit the block is cut to the tokens still allowed
(the draft block's keys end there, as the reference's shorter block would).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import sampling, sharding, validation
from dflash_jax.kernel_config import KernelConfig, kernels_from
from dflash_jax.cache import KVCache
from dflash_jax.modeling.draft import DFlashDraft
from dflash_jax.modeling.qwen3 import Qwen3

__all__ = ["generate", "GenerateResult", "precompile", "compiled_program", "lower_generate", "lower_iteration", "export_generate",
           "compile_count"]


@dataclasses.dataclass(frozen=True)
class _Static:
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


@struct.dataclass
class _Params:
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


@struct.dataclass
class _Loop:
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


# Streaming: the compiled program calls this one host function with the call's id (a traced value,
# so a streaming program is compiled once), which finds that call's sink here. Each generate() call
# registers its own sink for its duration, so streaming calls may run in several threads at once.
_STREAMS: dict = {}
_STREAM_IDS = itertools.count(1)
_STREAM_LOCK = threading.Lock()      # guards the id counter and the dict, not the calls


class _Stream:
    """One call's on_commit. Returns the stop flag for the device loop: True when on_commit
    returned True, or raised (the exception is kept and re-raised by generate)."""

    def __init__(self, on_commit, n_rows: int):
        self.on_commit, self.n_rows, self.error = on_commit, n_rows, None

    def __call__(self, commit, produced) -> bool:
        if self.error is not None:
            return True
        try:
            out = self.on_commit([commit[i, :produced[i]].tolist() for i in range(self.n_rows)])
        except BaseException as e:  # noqa: BLE001  (KeyboardInterrupt too: the caller gets it back)
            self.error = e
            return True
        return isinstance(out, (bool, np.bool_)) and bool(out)


def _stream_to_host(call_id, commit, produced):
    sink = _STREAMS.get(int(call_id))
    return np.bool_(sink is not None and sink(np.asarray(commit), np.asarray(produced)))


def _stream(p: _Params, commit, produced):
    """Send one iteration's commits [B, n] (produced [B] of them per row) to the host; returns
    the host's stop flag [] bool."""
    # ordered effects are refused in programs over several devices; the loop's data dependence
    # (the flag decides `done`) orders the calls there
    return io_callback(_stream_to_host, jax.ShapeDtypeStruct((), jnp.bool_), p.stream_id, commit, produced,
                       ordered=sharding.current_mesh() is None)


def _row_keys(p: _Params, lens):
    """Per-row PRNG keys that depend only on the row's (seed, rng_row, length), never on its batch
    slot or on the other rows."""
    return jax.vmap(lambda s, r, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), n))(
        p.seed, p.rng_row, lens.astype(jnp.uint32))


def _finished(st: _Static, lens, limit, cap_block):
    return (lens + 1 >= limit) | (lens + cap_block > st.capacity)


def _prefill(st: _Static, target: Qwen3, draft, p: _Params):
    B, Tb, S, C = st.batch, st.prompt_bucket, st.block_size, st.capacity
    positions = jnp.broadcast_to(jnp.arange(Tb, dtype=jnp.int32), (B, Tb))
    tcache = _on_mesh(st, target.new_cache(B, C))
    with jax.named_scope("prefill_target"):
        h, feats, tcache = target(p.prompt, positions, tcache, positions + 1, taps=st.taps,
                                  kernels=st.kernels, prefill=True)
    last = jnp.take_along_axis(h, (p.prompt_lens - 1)[:, None, None], axis=1)        # [B, 1, H]
    logits = target.logits(last)[:, 0]                                                 # [B, V]
    # keyed at prompt_len - 1: iterations key at lens >= prompt_len, so no key is used twice
    first = sampling.select(logits, _row_keys(p, p.prompt_lens - 1), p.temperature, p.top_k, p.top_p,
                            st.mode, st.kernels)
    dcache = pending = None
    if draft is not None:
        with jax.named_scope("prefill_draft_context"):
            dcache = draft.write_context(feats, positions, _on_mesh(st, draft.new_cache(B, C)))
        pending = jnp.zeros((B, S, feats.shape[-1]), feats.dtype)
    tokens = jnp.zeros((B, C + S), jnp.int32).at[:, :Tb].set(p.prompt)
    tokens = jax.vmap(lambda t, n, f: t.at[n].set(f))(tokens, p.prompt_lens, first)
    lens = p.prompt_lens
    limit = p.prompt_lens + p.max_new
    stop = jnp.any(first[:, None] == p.stop_ids, axis=1)
    done = ~p.active | stop | _finished(st, lens, limit, S)
    tcache = dataclasses.replace(tcache, lens=lens)
    stopped = None
    if st.stream:  # the prefill token is the first committed token
        halt = _stream(p, first[:, None], p.active.astype(jnp.int32))
        stopped, done = halt & ~done, done | halt
    return _placed(st, _Loop(tokens=tokens, lens=lens, target_cache=tcache, draft_cache=dcache, pending=pending,
                 pending_count=jnp.zeros((B,), jnp.int32), done=done, stopped=stopped,
                 accept_log=jnp.zeros((B, C), jnp.int32), iters=jnp.zeros((B,), jnp.int32),
                 step=jnp.zeros((), jnp.int32)))


def _iteration(st: _Static, target: Qwen3, draft, p: _Params, s: _Loop) -> _Loop:
    return _iterate(st, target, draft, p, s)[0]


def _iterate(st: _Static, target: Qwen3, draft, p: _Params, s: _Loop):
    """One draft-verify-accept-commit iteration: (the next loop state, commit [B, S] the tokens each
    row committed, produced [B] how many of them). The one-shot loop and the engine's step both run it."""
    B, S, C = st.batch, st.block_size, st.capacity
    j = jnp.arange(S, dtype=jnp.int32)
    lens = s.lens
    limit = p.prompt_lens + p.max_new
    remaining = limit - lens                                                    # >= 2 on active rows
    positions = lens[:, None] + j                                               # [B, S]
    current = jnp.take_along_axis(s.tokens, lens[:, None], axis=1)              # [B, 1]
    dcache, taps, proposal = s.draft_cache, (), None
    if draft is not None:   # the proposer: DFlashDraft.propose, or anything with its signature
        taps = st.taps
        args = (target, current, lens, limit, s.pending, s.pending_count, s.draft_cache)
        if st.mode != "greedy" and getattr(draft, "samples_drafts", False):
            # a DFlash2 selector draws its path from q over K candidates: q enters the acceptance
            draft_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0xD2AF7))(_row_keys(p, lens))
            drafts, dcache, proposal = draft.propose(*args, block_size=S, kernels=st.kernels,
                                                     temperature=p.temperature, keys=draft_keys)
        else:
            drafts, dcache = draft.propose(*args, block_size=S, kernels=st.kernels)  # [B, S-1]
        block = jnp.concatenate([current, drafts], axis=1)                          # [B, S]
    else:
        block = current
    with jax.named_scope("verify"):
        h, feats, tcache = target(block, positions, s.target_cache, positions + 1, taps=taps,
                                  kernels=st.kernels)
        logits = target.logits(h)                                                   # [B, S, V]
    with jax.named_scope("accept"):
        keys = _row_keys(p, lens)
        a, nxt = sampling.accept(block, logits, keys, p.temperature, p.top_k, p.top_p, st.mode,
                                 st.kernels, proposal=proposal)
        shifted = jnp.concatenate([block[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        commit = jnp.where(j < a[:, None], shifted, nxt[:, None])                 # [B, S]
        produced = jnp.minimum(a + 1, remaining - 1)
        is_stop = jnp.any(commit[..., None] == p.stop_ids[:, None, :], axis=-1) & (j < produced[:, None])
        produced = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, produced)
        produced = jnp.where(s.done, 0, produced).astype(jnp.int32)
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
    return _placed(st, _Loop(tokens=tokens, lens=new_lens, target_cache=dataclasses.replace(tcache, lens=new_lens),
                 draft_cache=dcache, pending=feats if draft is not None else None, pending_count=produced,
                 done=done, stopped=stopped, accept_log=accept_log, iters=s.iters + active.astype(jnp.int32), step=s.step + 1)), commit, produced


def _loop_specs(st: _Static, s: _Loop) -> _Loop:
    """The loop state's PartitionSpecs on st.mesh: rows on 'data', caches by sharding.cache_specs."""
    row, mat = P("data"), P("data", None)

    def cache(c):
        if not isinstance(c, KVCache):
            return jax.tree.map(lambda _: P(), c)
        kv, lens = sharding.cache_specs(c.k[0].shape[1], st.mesh, c.k[0].shape[0])
        return KVCache(k=tuple(kv for _ in c.k), v=tuple(kv for _ in c.v), lens=lens)
    return _Loop(tokens=mat, lens=row, target_cache=cache(s.target_cache),
                 draft_cache=None if s.draft_cache is None else cache(s.draft_cache),
                 pending=None if s.pending is None else P("data", None, None), pending_count=row, done=row,
                 stopped=None if s.stopped is None else row, accept_log=mat, iters=row, step=P())


def _on_mesh(st: _Static, cache):
    """A cache born inside the program, placed by sharding.cache_specs (left to propagation, a
    cache's layout could differ between prefill and loop and force reshards)."""
    return cache if st.mesh is None or not isinstance(cache, KVCache) else sharding.shard_cache(cache, st.mesh)


def _placed(st: _Static, s: _Loop) -> _Loop:
    """The loop carry constrained to _loop_specs, so it keeps one layout from prefill through
    every iteration."""
    if st.mesh is None:
        return s
    return jax.tree.map(lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(st.mesh, spec)),
                        _loop_specs(st, s), s, is_leaf=lambda x: isinstance(x, P))


def _run(st: _Static, target_state, draft_state, p: _Params):
    with sharding.active(st.mesh):
        target = nnx.merge(st.target_def, target_state)
        draft = None if st.draft_def is None else nnx.merge(st.draft_def, draft_state)
        s = _prefill(st, target, draft, p)
        s = jax.lax.while_loop(lambda s: jnp.any(~s.done) & (s.step < st.capacity),
                               lambda s: _iteration(st, target, draft, p, s), s)
    return s


# ----------------------------------------------------------------------------------------- host side

@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]               # generated ids per prompt (prompt excluded, stop token included)
    acceptance_lengths: list[list[int]]   # tokens produced per loop iteration per prompt
    block_size: int
    num_iterations: int                   # loop iterations (the longest row's)
    compile_time_s: float                 # 0.0 when the program was already compiled
    run_time_s: float                     # the one dispatch, prefill included, to results on the host
    # per row: "stop" (stop token, included in tokens), "length" (max_new_tokens), "capacity" (KV
    # full) or "stopped" (on_commit returned True or raised)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def mean_tau(self) -> float:
        """All tokens produced by loop iterations / all row-iterations."""
        n = sum(len(a) for a in self.acceptance_lengths)
        return sum(sum(a) for a in self.acceptance_lengths) / n if n else 0.0

    @property
    def tau_histogram(self) -> list[int]:
        """Counts of iterations that produced 1 .. block_size tokens."""
        h = [0] * self.block_size
        for row in self.acceptance_lengths:
            for n in row:
                h[n - 1] += 1
        return h

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


_COMPILED: dict = {}
_COMPILES = [0]


def clear_compiled() -> None:
    """Drop every cached generation program (they are kept per static key for the process's life)."""
    _COMPILED.clear()


def compile_count() -> int:
    """How many generation programs this process has compiled (tests use it to prove compile-once)."""
    return _COMPILES[0]


def _pow2(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


MAX_STOP_IDS = validation.MAX_STOP_IDS
_is_int = validation.is_int


def _buckets(longest_prompt: int, max_new_tokens: int, block_size: int, capacity: int | None):
    """(prompt bucket, KV capacity): powers of two for prompts; capacity = bucket + max_new + block,
    rounded up to 1024, unless given."""
    Tb = _pow2(longest_prompt, 16)
    C = capacity if capacity is not None else _round_up(Tb + int(max_new_tokens) + block_size, 1024)
    return Tb, C


def _static(target_def, draft_def, draft_config, *, block_size, batch, prompt_bucket, capacity, mode,
            kernels, stream=False, mesh=None) -> _Static:
    has_draft = draft_def is not None
    return _Static(target_def=target_def, draft_def=draft_def,
                   taps=tuple(draft_config.target_layer_ids) if has_draft else (), block_size=block_size,
                   batch=batch,
                   prompt_bucket=prompt_bucket, capacity=capacity, mode=mode, kernels=kernels,
                   stream=stream, mesh=mesh)


def _static_and_params(target, draft, prompts, *, max_new_tokens, temperature, top_p, top_k, stop_token_ids,
                       block_size, seed, attention_impl, capacity, stream, kernels=None, mesh=None):
    if not isinstance(target, Qwen3):
        raise TypeError(f"target must be a Qwen3 model from load_target/init_target, got {type(target).__name__}")
    if draft is not None and not (isinstance(draft, nnx.Module) and callable(getattr(draft, "propose", None))):
        raise TypeError(f"draft must be a DFlash draft from load_draft/init_draft or None, got {type(draft).__name__}")
    cfg = target.config
    sampling.validate(temperature, top_p, top_k)
    validation.check_top_k(top_k, cfg.vocab_size)
    validation.check_max_new_tokens(max_new_tokens, cfg.max_position_embeddings)
    validation.check_capacity(capacity)
    seed = validation.check_seed(seed)
    rows = validation.check_prompts(prompts, cfg.vocab_size)
    validation.check_lengths([len(r) for r in rows], max_new_tokens, cfg.max_position_embeddings)
    if draft is not None:
        draft.config.check_fits(cfg)
        S = draft.config.block_size if block_size is None else block_size
        if not isinstance(S, (int, np.integer)) or not 1 <= S <= draft.config.block_size:
            raise ValueError(f"block_size={block_size!r} must be an integer in [1, {draft.config.block_size}] "
                             f"(the draft was trained with block size {draft.config.block_size})")
    else:
        if block_size not in (None, 1):
            raise ValueError(f"block_size={block_size} needs a draft model (plain decoding has block size 1)")
        S = 1
    if S == 1:
        draft = None
    stop = validation.check_stop_ids(stop_token_ids, cfg.vocab_size)
    longest = max(len(r) for r in rows)
    Tb, C = _buckets(longest, max_new_tokens, S, capacity)
    if longest + 1 + S > C or Tb > C:
        raise ValueError(f"prompt of {longest} tokens (bucket {Tb}) plus a block of {S} does not fit the "
                         f"KV-cache capacity {C}; raise capacity or shorten the prompt")
    mesh = _resolve_mesh(mesh, target, draft)
    # a power of two, and a multiple of the data axis (every data shard gets whole rows; the
    # padding rows are inactive)
    B = _round_up(_pow2(len(rows), 1), 1 if mesh is None else sharding.data_axis_size(mesh))
    prompt = np.zeros((B, Tb), np.int32)
    lens = np.ones((B,), np.int32)
    for i, r in enumerate(rows):
        prompt[i, :len(r)] = r
        lens[i] = len(r)
    active = np.arange(B) < len(rows)
    kernels = kernels_from(kernels, attention_impl).resolve()
    mode = sampling.mode_for(temperature, top_p, top_k)
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(draft) if draft is not None else (None, None)
    st = _static(tdef, ddef, draft.config if draft is not None else None, block_size=S, batch=B,
                 prompt_bucket=Tb, capacity=C, mode=mode, kernels=kernels, stream=stream, mesh=mesh)
    p = _Params(prompt=jnp.asarray(prompt), prompt_lens=jnp.asarray(lens), active=jnp.asarray(active),
                **_row_settings([dict(max_new=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                      stop_ids=stop, seed=seed, rng_row=i) for i in range(B)]),
                stream_id=jnp.asarray(0, jnp.int32) if stream else None)
    p = _params_on_mesh(p, mesh)
    return st, tstate, dstate, p, len(rows), lens


def _resolve_mesh(mesh, target, draft):
    """The program's mesh: `mesh` (a Mesh or a make_mesh spec) or, when None, the one the target's
    parameters are on. Both models must sit on it (one-line errors otherwise)."""
    on = sharding.mesh_of(target)
    mesh = on if mesh is None else sharding.as_mesh(mesh)
    hint = "load it with load_target/load_draft(..., mesh=) or place it with sharding.shard_model"
    if on != mesh:
        raise ValueError(f"the target's parameters are on {_mesh_name(on)}, generate was given {_mesh_name(mesh)}; {hint}")
    if draft is not None and sharding.mesh_of(draft) != mesh:
        raise ValueError(f"the draft's parameters are on {_mesh_name(sharding.mesh_of(draft))}, the target's on "
                         f"{_mesh_name(mesh)}; {hint}")
    return mesh


def _mesh_name(mesh) -> str:
    return "one device" if mesh is None else "mesh " + ",".join(f"{a}={n}" for a, n in mesh.shape.items())


# _Params fields with one entry per batch row (placed on 'data'); the others are replicated
_ROW_FIELDS = ("prompt", "prompt_lens", "active", "max_new", "temperature", "top_k", "top_p", "stop_ids",
               "seed", "rng_row")


def _param_specs(p: _Params) -> _Params:
    def spec(name, x):
        if x is None:
            return None
        return P("data", *([None] * (len(x.shape) - 1))) if name in _ROW_FIELDS else P()
    return p.replace(**{f.name: spec(f.name, getattr(p, f.name)) for f in dataclasses.fields(p)})


def _params_on_mesh(p: _Params, mesh) -> _Params:
    """The run-time values placed on the mesh (_param_specs). Built from the host copy every
    process holds, each process filling only its own devices (multi-host)."""
    if mesh is None:
        return p

    def put(spec, x):
        if isinstance(x, jax.Array) and x.sharding == NamedSharding(mesh, spec):
            return x                     # placed already (it may span other processes' devices)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])
    return jax.tree.map(put, _param_specs(p), p, is_leaf=lambda x: isinstance(x, P))


def _to_host(tree):
    """device_get, gathering arrays that span other processes' devices first (multi-host)."""
    from jax.experimental import multihost_utils

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)
    return jax.tree.map(get, tree)


def _row_settings(rows: list[dict]) -> dict:
    """_Params' per-row fields from one dict per batch row (max_new, temperature, top_k, top_p,
    stop_ids: a list of at most MAX_STOP_IDS ids, seed, rng_row), as numpy-backed device arrays."""
    stop_ids = np.full((len(rows), MAX_STOP_IDS), -1, np.int32)
    for i, r in enumerate(rows):
        stop_ids[i, :len(r["stop_ids"])] = r["stop_ids"]
    col = lambda k, dt: jnp.asarray(np.array([r[k] for r in rows], dt))             # noqa: E731
    return dict(max_new=col("max_new", np.int32), temperature=col("temperature", np.float32),
                top_k=col("top_k", np.int32), top_p=col("top_p", np.float32), stop_ids=jnp.asarray(stop_ids),
                seed=col("seed", np.uint32), rng_row=col("rng_row", np.uint32))


def _compiled(st: _Static, tstate, dstate, p) -> tuple[Any, float]:
    """The cached executable for `st`, compiling it first if needed; (executable, compile seconds)."""
    fn = _COMPILED.get(st)
    if fn is not None:
        return fn, 0.0
    t0 = time.perf_counter()
    fn = jax.jit(_run, static_argnums=(0,)).lower(st, tstate, dstate, p).compile()
    _COMPILES[0] += 1
    _COMPILED[st] = fn
    return fn, time.perf_counter() - t0


def compiled_program(target: Qwen3, draft, prompts, **kwargs):
    """(executable, compile seconds) of the program `generate(target, draft, prompts, **kwargs)` runs,
    compiled and cached if it was not yet; the executable's `as_text()` / `cost_analysis()` describe it."""
    on_commit = kwargs.pop("on_commit", None)
    st, tstate, dstate, p, _, _ = _static_and_params(target, draft, prompts, stream=on_commit is not None,
                                                     **_generate_defaults(kwargs))
    return _compiled(st, tstate, dstate, p)


def precompile(target: Qwen3, draft, prompts, **kwargs) -> float:
    """Compile (and cache) the program `generate(target, draft, prompts, **kwargs)` would run, without
    running it. Returns the compile seconds (0.0 when it was already compiled)."""
    return compiled_program(target, draft, prompts, **kwargs)[1]


def _generate_defaults(kw: dict) -> dict:
    out = dict(max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=None, block_size=None,
               seed=0, attention_impl=None, capacity=None, kernels=None, mesh=None)
    unknown = set(kw) - set(out)
    if unknown:
        raise TypeError(f"unexpected arguments: {sorted(unknown)}")
    return {**out, **kw}


def generate(target: Qwen3, draft, prompts, *, max_new_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop_token_ids=None,
             block_size: int | None = None, seed: int = 0, attention_impl: str | None = None,
             capacity: int | None = None, on_commit: Callable[[list[list[int]]], bool | None] | None = None,
             kernels: KernelConfig | None = None, mesh=None,
             slots: int | None = None, step_buckets="auto") -> GenerateResult:
    """Generate from a batch of token-id prompts with one compiled program.

    draft: a DFlashDraft (or another proposer, see modeling.draft); None (or block_size=1) runs
    plain autoregressive decoding through the same loop. Greedy
    output equals the target's own greedy decoding token for token; sampled output follows the
    target's processed distribution exactly. Randomness: row i of a call draws from streams keyed by
    (seed, i, position), so a row's output is reproducible given seed, its index and its prompt.
    Streaming: `on_commit(row_tokens)` is called on the host after the prefill and once per loop
    iteration, with the tokens each row committed then (a list per prompt, empty for finished
    rows). If it returns True, the device loop marks every row done at that iteration and
    generate returns what was committed so far, finish reason "stopped" for the rows that were
    still running; if it raises, the loop stops the same way and generate re-raises that
    exception. Each call has its own sink, so streaming calls may run in several threads; the
    streaming program is still compiled once. `capacity` (KV-cache entries) defaults to the prompt bucket +
    max_new_tokens + block, rounded up to 1024; rows stop when it is full.
    `kernels` (a KernelConfig, default KernelConfig(): "auto") picks the attention backend and the
    GPU kernels; it is part of the compile key. `attention_impl` is the older spelling of
    `kernels.attention` (both given and different: ValueError).
    `mesh` (a jax Mesh with axes ('data', 'model'), or a spec such as "data=2,model=4"; default:
    the mesh the target's parameters are on, if any) runs the program sharded: the models must be
    on it (load_target/load_draft(..., mesh=) or sharding.shard_model), the batch is padded to a
    multiple of the data axis; it is part of the compile key. Same tokens as one device.
    `slots`: with more prompts than this, the prompts run through the slot engine
    (dflash_jax.engine.Slots: continuous batching, `slots` rows at once, each refilled as its row
    finishes) instead of one batch that runs until its longest row ends; the tokens are the same
    (greedy, or sampled with the same seed: row i keeps its stream i). Not with on_commit. On a
    mesh, `slots` must be a multiple of the data axis. `step_buckets`: the slot engine's step row
    counts (engine.Slots; "auto": powers of two up to `slots`, None: every step over all slots).
    """
    if slots is not None and len(prompts) > slots:
        return _generate_slots(target, draft, prompts, slots=slots, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids,
                               block_size=block_size, seed=seed, attention_impl=attention_impl, capacity=capacity,
                               on_commit=on_commit, kernels=kernels, mesh=mesh, step_buckets=step_buckets)
    return _generate(target, draft, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, block_size=block_size,
                     seed=seed, attention_impl=attention_impl, capacity=capacity, on_commit=on_commit,
                     kernels=kernels, mesh=mesh)[0]


def _generate(target, draft, prompts, *, max_new_tokens, temperature, top_p, top_k, stop_token_ids,
              block_size, seed, attention_impl, capacity, on_commit, kernels, mesh=None):
    """`generate`, also returning the final loop state (`_Loop`: caches, lengths; tests read it)."""
    st, tstate, dstate, p, n_rows, lens = _static_and_params(
        target, draft, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
        attention_impl=attention_impl, capacity=capacity, stream=on_commit is not None,
        kernels=kernels, mesh=mesh)
    fn, compile_time = _compiled(st, tstate, dstate, p)

    def run():
        t0 = time.perf_counter()
        state = fn(tstate, dstate, p)
        out = _to_host((state.tokens, state.lens, state.accept_log, state.iters, state.step))
        return state, out, time.perf_counter() - t0

    if on_commit is None:
        state, out, run_time = run()
    else:
        sink = _Stream(on_commit, n_rows)
        with _STREAM_LOCK:
            call_id = next(_STREAM_IDS) % (1 << 31)
            _STREAMS[call_id] = sink
        try:
            p = p.replace(stream_id=_params_on_mesh(p.replace(stream_id=np.int32(call_id)), st.mesh).stream_id
                          if st.mesh is not None else jnp.asarray(call_id, jnp.int32))
            state, out, run_time = run()
            stopped = np.asarray(_to_host(state.stopped))
        finally:
            with _STREAM_LOCK:
                del _STREAMS[call_id]
        if sink.error is not None:
            raise sink.error
    tokens, out_lens, log, iters, step = out
    rows = [tokens[i, lens[i]: out_lens[i] + 1].tolist() for i in range(n_rows)]
    stops = set(np.asarray(p.stop_ids[0]).tolist()) - {-1}
    reasons = ["stop" if r[-1] in stops else "length" if len(r) >= max_new_tokens else "capacity" for r in rows]
    if on_commit is not None:
        reasons = ["stopped" if stopped[i] else r for i, r in enumerate(reasons)]
    res = GenerateResult(
        tokens=rows, finish_reasons=reasons,
        acceptance_lengths=[log[i, :iters[i]].tolist() for i in range(n_rows)],
        block_size=st.block_size, num_iterations=int(step), compile_time_s=compile_time, run_time_s=run_time)
    return res, state


# ------------------------------------------------------------------------ the serving engine's programs
# The engine (dflash_jax/engine.py) keeps one loop row per slot on the device and drives it with three
# programs over the same _prefill and _iterate as the one-shot loop: `_slots_empty` (allocation),
# `_slots_insert` (prefill a bucket of requests, write their rows into free slots) and `_slots_step`
# (up to n iterations, the commits returned), or `_slots_step_rows` (the same over a power-of-two
# bucket of the slots: their rows gathered, stepped by a program of that batch, written back).
# Slot state is donated to insert and step.

@struct.dataclass
class _Slots:
    """The engine's device state: one _Loop row per slot and that slot's request settings
    (_Params with prompt None: a slot keeps only its prompt length)."""
    loop: _Loop
    params: _Params


def _models(st: _Static, tstate, dstate):
    return nnx.merge(st.target_def, tstate), (None if st.draft_def is None else nnx.merge(st.draft_def, dstate))


def _idle_params(batch: int, prompt_bucket: int) -> _Params:
    """Parameters of `batch` idle rows (prompt of one token, nothing to generate)."""
    zeros = [dict(max_new=1, temperature=0.0, top_k=0, top_p=1.0, stop_ids=[], seed=0, rng_row=0)] * batch
    return _Params(prompt=jnp.zeros((batch, prompt_bucket), jnp.int32), prompt_lens=jnp.ones((batch,), jnp.int32),
                   active=jnp.zeros((batch,), bool), **_row_settings(zeros))


def _slots_empty(st: _Static, tstate, dstate) -> _Slots:
    """Every slot free: done, length 0 (its verify writes land in its own rows, never read)."""
    def init(ts, ds):
        loop = _prefill(dataclasses.replace(st, prompt_bucket=16), *_models(st, ts, ds), _idle_params(st.batch, 16))
        return _Slots(loop=loop, params=_idle_params(st.batch, 16).replace(prompt=None))
    shapes = jax.eval_shape(init, tstate, dstate)
    s = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    params = s.params.replace(stop_ids=jnp.full(s.params.stop_ids.shape, -1, jnp.int32))
    return _Slots(loop=s.loop.replace(done=jnp.ones((st.batch,), bool)), params=params)


def _slots_insert(st: _Static, tstate, dstate, slots: _Slots, p: _Params, rows):
    """Prefill the requests of p ([Bp] rows, prompt bucket st.prompt_bucket) and write each into
    slot rows[i] (rows [Bp] int32; a row >= the slot count drops that request: bucket padding).
    Other slots are untouched. Returns (slots, first token [Bp], done [Bp])."""
    with sharding.active(st.mesh):
        new = _prefill(st, *_models(st, tstate, dstate), p)
        put = lambda old, x: old.at[rows].set(x, mode="drop")                          # noqa: E731
        loop = jax.tree.map(put, slots.loop.replace(step=None), new.replace(step=None)).replace(step=slots.loop.step)
        params = jax.tree.map(put, slots.params, p.replace(prompt=None, stream_id=None))
        first = jnp.take_along_axis(new.tokens, p.prompt_lens[:, None], axis=1)[:, 0]
        return _slots_placed(st, _Slots(loop=loop, params=params)), first, new.done


def _slots_specs(st: _Static, slots: _Slots) -> _Slots:
    """The slot state's PartitionSpecs on st.mesh: slots on 'data' (as the loop's rows)."""
    return _Slots(loop=_loop_specs(st, slots.loop), params=_param_specs(slots.params))


def _slots_placed(st: _Static, slots: _Slots) -> _Slots:
    """The slot state constrained to _slots_specs, so insert and step keep one layout (a compiled
    step refuses state laid out otherwise)."""
    if st.mesh is None:
        return slots
    return jax.tree.map(lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(st.mesh, spec)),
                        _slots_specs(st, slots), slots, is_leaf=lambda x: isinstance(x, P))


def _slots_step(st: _Static, n_iters: int, tstate, dstate, slots: _Slots, release):
    """n_iters iterations of _iterate over every slot; slots with release [B] set are marked done
    first. Returns (slots, commits [n, B, S], produced [n, B], done [B]): slot b committed
    commits[k, b, :produced[k, b]] at iteration k (a done row commits nothing)."""
    with sharding.active(st.mesh):
        return _slots_step_body(st, n_iters, tstate, dstate, slots, release)


def _slots_step_body(st: _Static, n_iters: int, tstate, dstate, slots: _Slots, release):
    """The step's n_iters iterations as a loop of that fixed trip count, never stopping early when
    every row is done (a done row's iteration is a no-op): a loop of unknown trip count makes XLA:GPU
    copy its predicate to the host and wait for the device at every iteration, which blocks the
    host thread for the whole step, so the host could not dispatch the next insert or step while
    this one runs (measured: ~1 s of a 12 s offline run idle between programs, docs/perf-log.md)."""
    target, draft = _models(st, tstate, dstate)
    loop = slots.loop.replace(done=slots.loop.done | release)

    def body(s, _):
        s, commit, n = _iterate(st, target, draft, slots.params, s)
        return s, (commit, n)

    loop, (commits, produced) = jax.lax.scan(body, loop, None, length=n_iters)   # [n, B, S], [n, B]
    return slots.replace(loop=loop), commits, produced, loop.done


def _slots_step_rows(st: _Static, n_iters: int, tstate, dstate, slots: _Slots, release, idx):
    """_slots_step over the n slots `idx` [n] int32 alone (distinct slot indices: the busy ones,
    padded with free ones), st being the full state's (batch = every slot). `release` is applied to
    every slot's done first; the n rows of the state are gathered, run by _slots_step_body in a
    program of batch n and written back in place (the other slots are untouched). Returns the
    full-width (slots, commits [n_iters, B, S], produced [n_iters, B], done [B]), zeros for the slots
    outside idx, so the host reads it as _slots_step's."""
    with sharding.active(st.mesh):
        n = idx.shape[0]
        loop = slots.loop.replace(done=slots.loop.done | release)
        take = lambda x: x[idx]                                                      # noqa: E731
        sub = _Slots(loop=jax.tree.map(take, loop.replace(step=None)).replace(step=loop.step),
                     params=jax.tree.map(take, slots.params))
        sub, commits, produced, _ = _slots_step_body(dataclasses.replace(st, batch=n), n_iters, tstate, dstate,
                                                     sub, jnp.zeros((n,), bool))
        put = lambda old, x: old.at[idx].set(x, unique_indices=True)                # noqa: E731
        loop = jax.tree.map(put, loop.replace(step=None), sub.loop.replace(step=None)).replace(step=sub.loop.step)
        B = st.batch
        commits = jnp.zeros((n_iters, B, st.block_size), jnp.int32).at[:, idx].set(commits, unique_indices=True)
        produced = jnp.zeros((n_iters, B), jnp.int32).at[:, idx].set(produced, unique_indices=True)
        return _slots_placed(st, slots.replace(loop=loop)), commits, produced, loop.done


def _engine_program(key, fn, static: tuple, args, donate=()):
    """The cached executable of fn(*static, *args) (counted by compile_count); key: everything its
    program depends on beyond the argument values (static, and the slot state's shape)."""
    prog = _COMPILED.get(key)
    if prog is None:
        prog = jax.jit(functools.partial(fn, *static), donate_argnums=donate).lower(*args).compile()
        _COMPILES[0] += 1
        _COMPILED[key] = prog
    return prog


def _generate_slots(target, draft, prompts, *, slots, on_commit, step_buckets="auto", **kw):
    """generate through the slot engine (generate's `slots`)."""
    from dflash_jax.engine import RowRequest, Slots, offline_defaults, platform_of
    if on_commit is not None:
        raise ValueError("on_commit (streaming) is not supported with slots=; use dflash_jax.engine.SlotEngine")
    if not _is_int(slots) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    st, _, _, p, n_rows, lens = _static_and_params(target, draft, prompts, stream=False, **kw)
    stop = [int(t) for t in np.asarray(p.stop_ids[0]) if t >= 0]
    eng = Slots(target, draft if st.draft_def is not None else None, slots=int(slots), capacity=st.capacity,
                block_size=st.block_size, kernels=st.kernels, step_buckets=step_buckets,
                steps=offline_defaults(platform_of(nnx.state(target)))["steps"])
    reqs = [RowRequest(prompt=tuple(int(t) for t in r), max_new=int(kw["max_new_tokens"]),
                       temperature=float(kw["temperature"]), top_k=int(kw["top_k"]), top_p=float(kw["top_p"]),
                       stop_ids=tuple(stop), seed=int(kw["seed"]), rng_row=i) for i, r in enumerate(prompts)]
    t0 = time.perf_counter()
    n0 = _COMPILES[0]
    eng.warmup([len(r.prompt) for r in reqs], [st.mode])
    compile_time = time.perf_counter() - t0 if _COMPILES[0] > n0 else 0.0
    t0 = time.perf_counter()
    out = eng.run(reqs)
    run_time = time.perf_counter() - t0
    return GenerateResult(tokens=[o.tokens for o in out], acceptance_lengths=[o.acceptance_lengths for o in out],
                          finish_reasons=[o.finish_reason for o in out], block_size=st.block_size,
                          num_iterations=max(len(o.acceptance_lengths) for o in out),
                          compile_time_s=compile_time, run_time_s=run_time)


def _abstract_inputs(target_config, draft_config=None, *, batch: int = 1, prompt_len: int = 512,
                     max_new_tokens: int = 256, capacity: int | None = None, block_size: int | None = None,
                     sampling_mode: str = "greedy", dtype="bfloat16", attention_impl: str | None = None,
                     device=None, kernels: KernelConfig | None = None, mesh=None):
    """The static key and abstract arguments of a generation, from configs alone (nothing allocated).
    mesh: a Mesh (e.g. over a TPU topology's devices) or a spec: the weights laid out and placed
    as sharding.shard_model would (fused layout), rows on 'data'."""
    from dflash_jax.weights import _dtype
    if sampling_mode not in sampling.MODES:
        raise ValueError(f"sampling_mode={sampling_mode!r}; expected one of {sampling.MODES}")
    dt = _dtype(dtype)
    target = nnx.eval_shape(lambda: Qwen3(target_config, dt, rngs=nnx.Rngs(0)))
    draft = nnx.eval_shape(lambda: DFlashDraft(draft_config, dt, rngs=nnx.Rngs(0))) if draft_config is not None else None
    S = 1 if draft is None else (block_size or draft_config.block_size)
    if S == 1:
        draft = None
    mesh = sharding.as_mesh(mesh)
    if mesh is not None:
        if batch % sharding.data_axis_size(mesh):
            raise ValueError(f"batch {batch} is not a multiple of the data axis size {sharding.data_axis_size(mesh)}")
        target = sharding.abstract_on_mesh(target, mesh)
        draft = sharding.abstract_on_mesh(draft, mesh) if draft is not None else None
        device = device if device is not None else mesh.devices.flat[0]
    Tb, C = _buckets(prompt_len, max_new_tokens, S, capacity)
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(draft) if draft is not None else (None, None)
    st = _static(tdef, ddef, draft_config, block_size=S, batch=batch, prompt_bucket=Tb, capacity=C,
                 mode=sampling_mode,
                 kernels=kernels_from(kernels, attention_impl or (None if kernels else "xla")).resolve(device=device),
                 mesh=mesh)
    one = jax.sharding.SingleDeviceSharding(device) if device is not None else None

    def abstract(shape, dtype_):
        return jax.ShapeDtypeStruct(shape, dtype_, sharding=one)

    keep = (lambda x: x) if mesh is not None else (lambda x: abstract(x.shape, x.dtype))   # on the mesh already
    tstate = jax.tree.map(keep, tstate)
    dstate = jax.tree.map(keep, dstate) if dstate is not None else None
    i32, f32 = jnp.int32, jnp.float32
    row = (batch,)
    p = _Params(prompt=abstract((batch, Tb), i32), prompt_lens=abstract(row, i32),
                active=abstract(row, jnp.bool_), max_new=abstract(row, i32), temperature=abstract(row, f32),
                top_k=abstract(row, i32), top_p=abstract(row, f32), stop_ids=abstract((batch, MAX_STOP_IDS), i32),
                seed=abstract(row, jnp.uint32), rng_row=abstract(row, jnp.uint32))
    if mesh is not None:
        p = jax.tree.map(lambda spec, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
                         _param_specs(p), p, is_leaf=lambda x: isinstance(x, P))
    return st, (tstate, dstate, p)


def _abstract_program(target_config, draft_config=None, **kw):
    """The generation program (jitted, static key bound) and its abstract arguments."""
    st, args = _abstract_inputs(target_config, draft_config, **kw)
    return jax.jit(functools.partial(_run, st)), args


def lower_iteration(target_config, draft_config=None, **kw):
    """Lower ONE loop iteration alone, its loop state donated as inside the while_loop (same keywords
    as `lower_generate`): the compiler's cost of an iteration (a whole program counts the loop body
    once and adds the prefill)."""
    st, (tstate, dstate, p) = _abstract_inputs(target_config, draft_config, **kw)

    def models(ts, ds):
        return nnx.merge(st.target_def, ts), (None if st.draft_def is None else nnx.merge(st.draft_def, ds))

    with sharding.active(st.mesh):
        loop = jax.eval_shape(lambda ts, ds, p: _prefill(st, *models(ts, ds), p), tstate, dstate, p)
        if st.mesh is None:
            one = jax.tree.leaves(tstate)[0].sharding
            loop = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), loop)
        else:
            loop = jax.tree.map(lambda spec, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                     sharding=NamedSharding(st.mesh, spec)),
                                _loop_specs(st, loop), loop, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(lambda ts, ds, p, s: _iteration(st, *models(ts, ds), p, s),
                       donate_argnums=(3,)).trace(tstate, dstate, p, loop).lower()


def lower_generate(target_config, draft_config=None, **kw):
    """Lower the whole generation program from configs alone (abstract weights: nothing allocated),
    e.g. to compile ahead of time for a TPU topology from a CPU host (`device=` a TPU device).
    Keywords: batch, prompt_len, max_new_tokens, capacity, block_size, sampling_mode, dtype,
    kernels (a KernelConfig; default the XLA path) or attention_impl, device. Returns `jax.stages.Lowered`."""
    fn, args = _abstract_program(target_config, draft_config, **kw)
    return fn.trace(*args).lower()


def export_generate(target_config, draft_config=None, *, platforms=("cuda",), **kw):
    """`jax.export` of the generation program for other platforms (e.g. CUDA from a CPU host)."""
    fn, args = _abstract_program(target_config, draft_config, **kw)
    # Pallas-Triton kernels are custom calls without a serialization-stability promise.
    checks = [jax.export.DisabledSafetyCheck.custom_call(name)
              for name in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")]
    return jax.export.export(fn, platforms=list(platforms), disabled_checks=checks)(*args)
