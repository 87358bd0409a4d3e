"""The host API of the generation loop: `generate` (batched token-id prompts in, GenerateResult
out, one compiled program per static key, optional streaming through `on_commit`),
`precompile` / `compiled_program`, and the ahead-of-time forms (`lower_generate`, `lower_iteration`,
`export_generate`: programs built from configs alone, e.g. for a TPU topology from a CPU host).

The loop itself (state, prefill, iteration, the compiled program and its cache) is dflash_jax.loop;
`generate(slots=N)` runs through the slot engine of dflash_jax.serving.slots.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import penalties, sampling, sharding, validation
from dflash_jax.kernel_config import KernelConfig, kernels_from
from dflash_jax import width
from dflash_jax.loop import (MAX_STOP_IDS, Params, buckets, clear_compiled, compile_count, compiled, iteration,
                             loop_specs, make_static, merge_models, param_specs, params_on_mesh, pow2, prefill,
                             resolve_mesh, round_up, row_settings, run, stream_sink, to_host, width_costs, width_history,
                             width_params)
from dflash_jax import drafts, models
from dflash_jax.models.stack import CausalLM
from dflash_jax.serving.slots import RowRequest, Slots, offline_defaults, platform_of

__all__ = ["generate", "GenerateOptions", "GenerateResult", "precompile", "compiled_program", "lower_generate", "lower_iteration",
           "export_generate", "abstract_program", "compile_count", "clear_compiled"]


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


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """`generate`'s keywords and their defaults, written once (generate's docstring says what each
    does); `generate`, `precompile` and `compiled_program` take them as keywords."""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: Any = None
    block_size: int | None = None
    seed: int = 0
    attention_impl: str | None = None
    capacity: int | None = None
    on_commit: Callable[[list[list[int]]], bool | None] | None = None
    kernels: KernelConfig | None = None
    mesh: Any = None
    slots: int | None = None
    step_buckets: Any = "auto"
    verify_width: Any = "auto"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Any = None           # {token id: bias in [-100, 100]}, at most penalties.MAX_BIAS
    min_tokens: int = 0

    def program(self) -> dict:
        """The keywords that decide the one-shot program and its inputs (every field but the
        streaming sink and the slot engine's)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_PROGRAM}


_NOT_PROGRAM = ("on_commit", "slots", "step_buckets")


def _static_and_params(target, draft, prompts, *, stream, **options):
    """(static key, target state, draft state, Params, rows, prompt lengths) of a one-shot call;
    options: GenerateOptions.program()'s keywords (defaults for those left out)."""
    o = GenerateOptions(**options)
    max_new_tokens, temperature, top_p, top_k = o.max_new_tokens, o.temperature, o.top_p, o.top_k
    block_size, seed, capacity = o.block_size, o.seed, o.capacity
    if not isinstance(target, CausalLM):
        raise TypeError(f"target must be a model from load_target/init_target, got {type(target).__name__}")
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
    if draft is None and o.verify_width not in ("auto", "block", 0):
        raise ValueError(f"verify_width={o.verify_width!r} needs a draft and a block size above 1 "
                         f"(plain decoding verifies no drafts: 'auto' or 0)")
    if draft is not None and o.verify_width != "block":
        width.width_index(width.widths_for(S), o.verify_width)       # a one-line error for a bad width
    stop = validation.check_stop_ids(o.stop_token_ids, cfg.vocab_size)
    bad = penalties.problem(o.presence_penalty, o.frequency_penalty, o.logit_bias, o.min_tokens, cfg.vocab_size,
                            max_new_tokens)
    if bad is not None:
        raise ValueError(" ".join(bad))
    adjusted = not penalties.is_default(o.presence_penalty, o.frequency_penalty, o.logit_bias, o.min_tokens)
    longest = max(len(r) for r in rows)
    Tb, C = buckets(longest, max_new_tokens, S, capacity)
    if longest + 1 + S > C or Tb > C:
        raise ValueError(f"prompt of {longest} tokens (bucket {Tb}) plus a block of {S} does not fit the "
                         f"KV-cache capacity {C}; raise capacity or shorten the prompt")
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(draft) if draft is not None else (None, None)
    mesh = resolve_mesh(o.mesh, tstate, dstate)
    # a power of two, and a multiple of the data axis (every data shard gets whole rows; the
    # padding rows are inactive)
    B = round_up(pow2(len(rows), 1), 1 if mesh is None else sharding.data_axis_size(mesh))
    prompt = np.zeros((B, Tb), np.int32)
    lens = np.ones((B,), np.int32)
    for i, r in enumerate(rows):
        prompt[i, :len(r)] = r
        lens[i] = len(r)
    active = np.arange(B) < len(rows)
    kernels = kernels_from(o.kernels, o.attention_impl).resolve()
    mode = sampling.mode_for(temperature, top_p, top_k)
    st = make_static(tdef, ddef, draft.config if draft is not None else None, block_size=S, batch=B,
                     prompt_bucket=Tb, capacity=C, mode=mode, kernels=kernels, stream=stream, mesh=mesh,
                     adaptive=o.verify_width != "block", verify_width=o.verify_width, penalties=adjusted)
    p = Params(prompt=jnp.asarray(prompt), prompt_lens=jnp.asarray(lens), active=jnp.asarray(active),
               **row_settings([dict(max_new=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     stop_ids=stop, seed=seed, rng_row=i, presence=o.presence_penalty,
                                     frequency=o.frequency_penalty, logit_bias=o.logit_bias,
                                     min_tokens=o.min_tokens) for i in range(B)]),
               stream_id=jnp.asarray(0, jnp.int32) if stream else None,
               **width_params(st, o.verify_width if draft is not None else "auto"))
    p = params_on_mesh(p, mesh)
    return st, tstate, dstate, p, len(rows), lens


def _profile_widths(st, fn, tstate, dstate, p: Params):
    """Params p with width_cost measured for the program fn (cached per Static, loop.width_costs):
    each width's iterations timed on p's own prompts with acceptance forced to 0 (one token per
    iteration, so every width runs the same number of them), less a prefill-only run beside it."""
    B = p.prompt.shape[0]

    def timed(q) -> tuple[float, int]:
        t0 = time.perf_counter()
        step = int(to_host(fn(tstate, dstate, q).step))
        return time.perf_counter() - t0, step

    def forced(i, max_new):
        arr = np.asarray if st.mesh is not None else jnp.asarray
        return params_on_mesh(p.replace(verify_width=arr(np.int32(i)), width_profile=arr(np.bool_(True)),
                                        max_new=arr(np.full((B,), max_new, np.int32)),
                                        stop_ids=arr(np.full(p.stop_ids.shape, -1, np.int32))), st.mesh)

    def time_width(i):
        base = timed(forced(i, 1))[0]            # the prefill alone, next to each timed run
        t, iters = timed(forced(i, 17))
        return t, base, iters
    costs = width_costs(st, time_width, len(st.widths))
    return p.replace(width_cost=params_on_mesh(p.replace(width_cost=costs), st.mesh).width_cost
                     if st.mesh is not None else jnp.asarray(costs))


def compiled_program(target: CausalLM, draft, prompts, **kwargs):
    """(executable, compile seconds) of the program `generate(target, draft, prompts, **kwargs)` runs,
    compiled and cached if it was not yet; the executable's `as_text()` / `cost_analysis()` describe it."""
    on_commit = kwargs.pop("on_commit", None)
    validation.check_on_commit(on_commit)
    st, tstate, dstate, p, _, _ = _static_and_params(target, draft, prompts, stream=on_commit is not None,
                                                     **_generate_defaults(kwargs))
    return compiled(st, tstate, dstate, p)


def precompile(target: CausalLM, draft, prompts, **kwargs) -> float:
    """Compile (and cache) the program `generate(target, draft, prompts, **kwargs)` would run, without
    running it. Returns the compile seconds (0.0 when it was already compiled)."""
    return compiled_program(target, draft, prompts, **kwargs)[1]


def _generate_defaults(kw: dict) -> dict:
    """GenerateOptions.program() of the keywords kw (the others at their defaults)."""
    fields = {f.name for f in dataclasses.fields(GenerateOptions)} - set(_NOT_PROGRAM)
    unknown = set(kw) - fields
    if unknown:
        raise TypeError(f"unexpected arguments: {sorted(unknown)}")
    return GenerateOptions(**kw).program()


def generate(target: CausalLM, draft, prompts, **options) -> GenerateResult:
    """Generate from a batch of token-id prompts with one compiled program.

    draft: a DFlashDraft (or another proposer, see drafts.dflash); None (or block_size=1) runs
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
    (dflash_jax.serving.slots.Slots: continuous batching, `slots` rows at once, each refilled as its row
    finishes) instead of one batch that runs until its longest row ends; the tokens are the same
    (greedy, or sampled with the same seed: row i keeps its stream i). Not with on_commit. On a
    mesh, `slots` must be a multiple of the data axis. `step_buckets`: the slot engine's step row
    counts (slots.Slots; "auto": powers of two up to `slots`, None: every step over all slots).
    `verify_width`: drafts the target verifies per iteration: "auto" (default: chosen per iteration
    on the device from measured per-width costs and the acceptance seen, docs/adaptive-width.md;
    its program holds the widths of width.program_widths, 0, 3 and 15 at block 16 (and 7 on CPU), compiles longer
    than one width (docs/adaptive-width.md, "Compile time") and times each width once per program before its
    first call), "block" (the
    whole block, a program with one verify width: the acceptance lengths the paper and the
    reference report) or one of 0, 1, 3, 7, ... S-1 (0: plain decoding; S-1: the whole block; a
    width outside that set is compiled into the program too). Lossless at every width.
    With `slots`, "auto" runs the engine's whole-block step programs (a number runs the adaptive ones).
    `presence_penalty` / `frequency_penalty` (in [-2, 2], over the tokens generated so far, not the
    prompt), `logit_bias` ({token id: bias in [-100, 100]}, at most 300) and `min_tokens` (stop ids
    masked until that many are generated) adjust the target's distribution (OpenAI / vLLM
    semantics, dflash_jax.penalties) at every sampled and verified position; speculative output
    stays exactly plain decoding's of the adjusted target. Any of them set: a program of its own.
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(GenerateOptions)}
    if unknown:
        raise TypeError(f"generate() got unexpected keyword arguments: {sorted(unknown)}")
    o = GenerateOptions(**options)
    validation.check_on_commit(o.on_commit)
    if o.slots is not None and len(prompts) > o.slots:
        return _generate_slots(target, draft, prompts, o)
    return _generate(target, draft, prompts, on_commit=o.on_commit, **o.program())[0]


# the keywords of `generate`, for help() and inspect: GenerateOptions' fields
generate.__signature__ = inspect.Signature(
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("target", "draft", "prompts")]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
       for f in dataclasses.fields(GenerateOptions)], return_annotation="GenerateResult")


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


def _generate(target, draft, prompts, *, on_commit=None, **options):
    """`generate` in one program (options: GenerateOptions.program()'s keywords), also returning
    the final loop state (`LoopState`: caches, lengths; tests read it)."""
    st, tstate, dstate, p, n_rows, lens = _static_and_params(target, draft, prompts, stream=on_commit is not None,
                                                             **options)
    max_new_tokens = GenerateOptions(**options).max_new_tokens
    fn, compile_time = compiled(st, tstate, dstate, p)
    auto = st.widths is not None and GenerateOptions(**options).verify_width == "auto"
    if auto:
        p = _profile_widths(st, fn, tstate, dstate, p)
        seen = width_history(st)
        if seen is not None and st.mesh is not None:     # a warm start from this program's last "auto" call
            q = params_on_mesh(p.replace(width_stats0=seen[0], width0=seen[1], width_step0=seen[2]), st.mesh)
            p = p.replace(width_stats0=q.width_stats0, width0=q.width0, width_step0=q.width_step0)
        elif seen is not None:
            p = p.replace(width_stats0=jnp.asarray(seen[0]), width0=jnp.asarray(seen[1]),
                          width_step0=jnp.asarray(seen[2]))

    def run_once():
        t0 = time.perf_counter()
        state = fn(tstate, dstate, p)
        out = to_host((state.tokens, state.lens, state.accept_log, state.iters, state.step))
        return state, out, time.perf_counter() - t0

    if on_commit is None:
        state, out, run_time = run_once()
    else:
        sink = _Stream(on_commit, n_rows)
        with stream_sink(sink) as call_id:
            p = p.replace(stream_id=params_on_mesh(p.replace(stream_id=np.int32(call_id)), st.mesh).stream_id
                          if st.mesh is not None else jnp.asarray(call_id, jnp.int32))
            state, out, run_time = run_once()
            stopped = np.asarray(to_host(state.stopped))
        if sink.error is not None:
            raise sink.error
    if auto:
        width_history(st, state, p)
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


def _generate_slots(target, draft, prompts, o: GenerateOptions):
    """generate through the slot engine (generate's `slots`)."""
    if o.on_commit is not None:
        raise ValueError("on_commit (streaming) is not supported with slots=; use dflash_jax.serving.engine.SlotEngine")
    if not validation.is_int(o.slots) or o.slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {o.slots!r}")
    st, _, _, p, n_rows, lens = _static_and_params(target, draft, prompts, stream=False, **o.program())
    stop = [int(t) for t in np.asarray(p.stop_ids[0]) if t >= 0]
    eng = Slots(target, draft if st.draft_def is not None else None, slots=int(o.slots), capacity=st.capacity,
                block_size=st.block_size, kernels=st.kernels, step_buckets=o.step_buckets,
                steps=offline_defaults(platform_of(nnx.state(target)))["steps"],
                verify_width=None if st.draft_def is None or o.verify_width == "block" else o.verify_width)
    reqs = [RowRequest(prompt=tuple(int(t) for t in r), max_new=int(o.max_new_tokens),
                       temperature=float(o.temperature), top_k=int(o.top_k), top_p=float(o.top_p),
                       stop_ids=tuple(stop), seed=int(o.seed), rng_row=i, presence=float(o.presence_penalty),
                       frequency=float(o.frequency_penalty), logit_bias=_bias_pairs(o.logit_bias),
                       min_tokens=int(o.min_tokens)) for i, r in enumerate(prompts)]
    t0 = time.perf_counter()
    n0 = compile_count()
    eng.warmup([len(r.prompt) for r in reqs], [reqs[0].mode])
    compile_time = time.perf_counter() - t0 if compile_count() > n0 else 0.0
    t0 = time.perf_counter()
    out = eng.run(reqs)
    run_time = time.perf_counter() - t0
    return GenerateResult(tokens=[o.tokens for o in out], acceptance_lengths=[o.acceptance_lengths for o in out],
                          finish_reasons=[o.finish_reason for o in out], block_size=st.block_size,
                          num_iterations=max(len(o.acceptance_lengths) for o in out),
                          compile_time_s=compile_time, run_time_s=run_time)


def _bias_pairs(logit_bias) -> tuple:
    """A logit_bias mapping as RowRequest's sorted (id, bias) pairs."""
    items = logit_bias.items() if isinstance(logit_bias, dict) else (logit_bias or ())
    return tuple(sorted((int(k), float(v)) for k, v in dict(items).items()))


def _abstract_inputs(target_config, draft_config=None, *, batch: int = 1, prompt_len: int = 512,
                     max_new_tokens: int = 256, capacity: int | None = None, block_size: int | None = None,
                     sampling_mode: str = "greedy", dtype="bfloat16", attention_impl: str | None = None,
                     device=None, kernels: KernelConfig | None = None, mesh=None, quantize: str | None = None):
    """The static key and abstract arguments of a generation, from configs alone (nothing allocated).
    mesh: a Mesh (e.g. over a TPU topology's devices) or a spec: the weights laid out and placed
    as sharding.shard_model would (fused layout), rows on 'data'. quantize: the target's, as
    load_target's (on a mesh too: the scales placed with their weights' columns)."""
    from dflash_jax.quantize import quantize_target
    from dflash_jax.checkpoint_io import dtype_of as _dtype
    if sampling_mode not in sampling.MODES:
        raise ValueError(f"sampling_mode={sampling_mode!r}; expected one of {sampling.MODES}")
    dt = _dtype(dtype)
    target = nnx.eval_shape(lambda: quantize_target(
        models.family(target_config.model_type).model(target_config, dt, rngs=nnx.Rngs(0)), quantize))
    draft = (nnx.eval_shape(lambda: drafts.variant_of_config(draft_config).model(draft_config, dt, rngs=nnx.Rngs(0)))
             if draft_config is not None else None)
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
    Tb, C = buckets(prompt_len, max_new_tokens, S, capacity)
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(draft) if draft is not None else (None, None)
    st = make_static(tdef, ddef, draft_config, block_size=S, batch=batch, prompt_bucket=Tb, capacity=C,
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
    p = Params(prompt=abstract((batch, Tb), i32), prompt_lens=abstract(row, i32),
                active=abstract(row, jnp.bool_), max_new=abstract(row, i32), temperature=abstract(row, f32),
                top_k=abstract(row, i32), top_p=abstract(row, f32), stop_ids=abstract((batch, MAX_STOP_IDS), i32),
                seed=abstract(row, jnp.uint32), rng_row=abstract(row, jnp.uint32))
    if mesh is not None:
        p = jax.tree.map(lambda spec, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
                         param_specs(p), p, is_leaf=lambda x: isinstance(x, P))
    return st, (tstate, dstate, p)


def abstract_program(target_config, draft_config=None, **kw):
    """The generation program (jitted, static key bound) and its abstract arguments."""
    st, args = _abstract_inputs(target_config, draft_config, **kw)
    return jax.jit(functools.partial(run, st)), args


def lower_iteration(target_config, draft_config=None, **kw):
    """Lower ONE loop iteration alone, its loop state donated as inside the while_loop (same keywords
    as `lower_generate`): the compiler's cost of an iteration (a whole program counts the loop body
    once and adds the prefill)."""
    st, (tstate, dstate, p) = _abstract_inputs(target_config, draft_config, **kw)

    with sharding.active(st.mesh):
        loop = jax.eval_shape(lambda ts, ds, p: prefill(st, *merge_models(st, ts, ds), p), tstate, dstate, p)
        if st.mesh is None:
            one = jax.tree.leaves(tstate)[0].sharding
            loop = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), loop)
        else:
            loop = jax.tree.map(lambda spec, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                     sharding=NamedSharding(st.mesh, spec)),
                                loop_specs(st, loop), loop, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(lambda ts, ds, p, s: iteration(st, *merge_models(st, ts, ds), p, s),
                       donate_argnums=(3,)).trace(tstate, dstate, p, loop).lower()


def lower_slot_step(target_config, draft_config=None, *, slots: int = 8, capacity: int = 4096, steps: int = 4,
                    page_size: int | None = None, num_pages: int | None = None, table_pages: int | None = None,
                    window_pages: int | None = None, **kw):
    """Lower the slot engine's step program (`steps` iterations over `slots` rows: the step of
    `slot_programs.step_functions`) from configs alone, or with `page_size` its paged form (pools of
    `num_pages` pages, default every row's whole capacity, and a page table `table_pages` wide,
    default a row's every page; `window_pages`: a draft's sliding-window layers in a window pool of
    that many pages, read through a second table of the same width, as `--kv-window-pages`). Other
    keywords as `lower_generate` (dtype, kernels / attention_impl, device, quantize). Returns
    `jax.stages.Lowered` (e.g. compiled for a TPU topology from a CPU host)."""
    import dataclasses as dc

    from dflash_jax.serving.slot_programs import step_functions

    st, (tstate, dstate, _) = _abstract_inputs(target_config, draft_config, batch=slots, prompt_len=16,
                                               max_new_tokens=max(1, capacity - 64), capacity=capacity, **kw)
    if st.mesh is not None:
        raise ValueError("lower_slot_step: one device only")
    st = dc.replace(st, prompt_bucket=0)
    one = jax.tree.leaves(tstate)[0].sharding
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)                # noqa: E731
    extra = ()
    if page_size is not None:
        if st.capacity % page_size:
            raise ValueError(f"capacity {st.capacity} is not a whole number of pages of {page_size}")
        per_row = st.capacity // page_size
        num_pages = num_pages or slots * per_row + 1
        table = place(jax.ShapeDtypeStruct((slots, table_pages or per_row), jnp.int32))
        extra = ((table, table),) if window_pages else (table,)
    elif window_pages:
        raise ValueError("lower_slot_step: window_pages needs page_size (the paged step)")
    empty, fn = step_functions(st, steps, page_size, num_pages, window_pages)
    state = jax.eval_shape(empty, tstate, dstate)
    state = jax.tree.map(place, state)
    release = place(jax.ShapeDtypeStruct((slots,), jnp.bool_))
    return jax.jit(fn, donate_argnums=(2,)).trace(tstate, dstate, state, release, {}, *extra).lower()


def lower_generate(target_config, draft_config=None, **kw):
    """Lower the whole generation program from configs alone (abstract weights: nothing allocated),
    e.g. to compile ahead of time for a TPU topology from a CPU host (`device=` a TPU device).
    Keywords: batch, prompt_len, max_new_tokens, capacity, block_size, sampling_mode, dtype,
    kernels (a KernelConfig; default the XLA path) or attention_impl, device. Returns `jax.stages.Lowered`."""
    fn, args = abstract_program(target_config, draft_config, **kw)
    return fn.trace(*args).lower()


def export_generate(target_config, draft_config=None, *, platforms=("cuda",), **kw):
    """`jax.export` of the generation program for other platforms (e.g. CUDA from a CPU host)."""
    fn, args = abstract_program(target_config, draft_config, **kw)
    # Pallas-Triton kernels are custom calls without a serialization-stability promise.
    checks = [jax.export.DisabledSafetyCheck.custom_call(name)
              for name in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")]
    return jax.export.export(fn, platforms=list(platforms), disabled_checks=checks)(*args)
