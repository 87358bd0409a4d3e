"""The sparse MoE block of Qwen3-MoE targets: a router and stacked experts, dropless.

Numerics follow transformers' Qwen3MoeSparseMoeBlock (greedy losslessness is compared against it):
  - router logits = x @ W_router in x's dtype, softmax over ALL experts in float32, top-k of those
    probabilities (ties to the lower expert id, as jax.lax.top_k), divided by their sum when
    `norm_topk_prob`, cast back to x's dtype;
  - each chosen expert: down(silu(x @ gate) * (x @ up)), multiplied by its routing weight AFTER the
    down projection; a token's k expert outputs are added in ascending expert order, in x's dtype
    (HF adds them expert by expert into a zero tensor).
Dropless: every (token, choice) row is computed; the rows are sorted by expert and go through a
grouped matmul (`pallas_kernels.moe.gmm`, implementation from `KernelConfig.moe_gmm`), so shapes are
static whatever the routing and no capacity exists to overflow. One token (a B = 1 decode step) on
the GPU kernel skips the sort: its k choices are k distinct experts, so each (token, choice) row is
its own group (`gmm_rows`) and the outputs come back in place (no argsort, bincount, scatter or
inverse permutation). Measured faster than the sorted path on the H200 at Coder-30B-A3B shapes: one
layer 39.2 against 44.1 us, a 12-layer B = 1 plain step 1.375 against 1.590 ms.

Expert parallelism: the stacked expert weights [E, ...] are split over the mesh's 'model' axis
(sharding.RULES). Tokens are replicated over 'model' already (attention's o projection ends in an
all-reduce), so each shard routes all of its data shard's tokens, computes the rows of its own
experts (the others sort past its groups and are zeroed) and a psum over 'model' adds the shards'
parts: static shapes, every row computed exactly once, no all-to-all.

Weights: router [H, E], experts_gate_up [E, H, 2I] (gate columns before up), experts_down
[E, I, H] ([in, out]).

Quantized experts (dflash_jax.quantize, `quantize="int8"`: q [E, in, out] int8 and one scale per
expert and output column [E, out]): on the Pallas grouped-matmul kernels (`moe_gmm` "pallas_tpu",
"pallas_gpu", their interpreters; the GPU's one-token gmm_rows too) the kernel reads them as they
are, each int8 weight tile converted to x's dtype on chip, the float32 product scaled per column
before its rounding (pallas_kernels/moe/tpu.py, gpu.py). With moe_gmm "xla" the XLA path:
`ragged_dot` multiplies the int8 matrices converted to x's dtype and each row is then scaled by its
own expert's column scales, in float32, as models.layers.linear scales an int8 dense weight; on
TPU that path converts every local expert of the layer per call (Coder-30B-A3B, one layer on a v5e
chip at a B = 1 verify: 3.02 GB of HBM traffic against the kernel's 0.39 GB, ahead of time,
`scripts/tpu_moe_aot.py --layer`).

An FP8 checkpoint's experts (quantize.Fp8BlockWeight: float8_e4m3fn q [E, in, out], block scales
[E, in / bk, out / bn], so the scales vary along the contraction axis too) go to the same kernels
where their tiles fit the blocks (`fp8_supported`; Qwen's 128 x 128 blocks and the per-column bn = 1
of a fused gate | up do): each float8 tile converted to x's dtype on chip, each K block's float32
partial product multiplied by its block's scale before it is added. With moe_gmm "xla" (or blocks the
kernels cannot tile) the weights are dequantized to x's dtype inside the program and multiplied by
ragged_dot: XLA converts every expert of the layer per call (docs/perf-log.md, 'FP8 experts in the
grouped-matmul kernels'). The two paths differ by rounding only: the kernel never
rounds a dequantized weight to x's dtype (bf16 rows: it is the closer to the float64 product).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dflash_jax import sharding
from dflash_jax.kernel_config import KernelConfig
from dflash_jax.models.layers import init_param, linear
from dflash_jax.quantize import Fp8BlockWeight, Int8Weight, is_quantized

__all__ = ["MoE", "route", "experts", "kernel_operands", "quantized_gmm", "distinct_experts", "recording"]

# Benchmarks' probe: while set (during a trace, one device), every MoE call appends its expert
# choices [N, k] (tracers of that trace) to this list; the traced function returns what it needs.
_RECORD: contextvars.ContextVar = contextvars.ContextVar("dflash_moe_record", default=None)


@contextlib.contextmanager
def recording():
    """Collect each MoE layer's expert choices [N, k] while tracing (scripts/bench_moe.py counts the
    distinct experts a step touches with them)."""
    rec: list = []
    tok = _RECORD.set(rec)
    try:
        yield rec
    finally:
        _RECORD.reset(tok)


def route(x, router, top_k: int, norm_topk_prob: bool, ascending: bool = False, kernel: str | None = None):
    """x [N, H], router [H, E] -> (weights [N, k] in x's dtype, experts [N, k] int32), as HF's
    Qwen3MoeTopKRouter: in descending probability, or with `ascending` in ascending expert id (the
    order experts() adds them in). kernel "pallas_gpu" / "pallas_gpu_interpret": everything after
    the router's matmul in one GPU kernel (pallas_kernels.moe.route_ascending; ascending only)."""
    logits = linear(x, router)                                                   # [N, E] x.dtype
    if kernel is not None:
        if not ascending:
            raise ValueError("the routing kernel returns the choices in ascending id order only")
        from pallas_kernels.moe import route_ascending
        got = route_ascending(logits, top_k, norm_topk_prob, kernel)
        if got is not None:
            return got
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)                                       # [N, k]
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    top, idx = top.astype(x.dtype), idx.astype(jnp.int32)
    if ascending:
        idx, top = jax.lax.sort((idx, top), dimension=-1, num_keys=1)
    return top, idx


def experts(x, weights, idx, gate_up, down, *, gmm_impl: str = "xla", first_expert=0,
            ascending: bool = False, kernels: KernelConfig | None = None):
    """The chosen experts' outputs summed per token: x [N, H], weights/idx [N, k] (global expert
    ids; `ascending`: already in ascending id order per row), gate_up [El, H, 2I], down [El, I, H]
    holding experts [first_expert, first_expert + El) -> [N, H] in x's dtype. Choices of other
    experts contribute zero (expert parallelism: another shard computes them); first_expert=None:
    this call holds every expert the ids name (one device), nothing to mask."""
    from pallas_kernels.moe import gmm, gmm_rows, gmm_swiglu
    N, k = idx.shape
    El = gate_up.shape[0]
    quantized = is_quantized(gate_up) or is_quantized(down)
    # int8 / FP8 experts read by the kernel itself where it takes them, else the XLA grouped matmul (docstring)
    gu_ops = kernel_operands(gate_up, gmm_impl, N * k, x.dtype, swiglu=True) if quantized else None
    dn_ops = kernel_operands(down, gmm_impl, N * k, x.dtype) if quantized else None
    q_kernel = gu_ops is not None and dn_ops is not None
    (gu_q, gu_s, gu_b), (dn_q, dn_s, dn_b) = (gu_ops, dn_ops) if q_kernel else ((gate_up, None, None),
                                                                                (down, None, None))
    if quantized and not q_kernel:
        gmm_impl = "xla"
    if not ascending:   # a token's choices in ascending expert order: the order its outputs are added in (HF's)
        idx, weights = jax.lax.sort((idx, weights), dimension=-1, num_keys=1)
    if first_expert is None:
        local, mine = idx, None
    else:
        local = idx - first_expert
        mine = (local >= 0) & (local < El)                                       # [N, k]
    if N == 1 and gmm_impl in ("pallas_gpu", "pallas_gpu_interpret"):
        # a row per choice, x never copied (shared), each projection's raw buffer straight into the next
        group = (local if mine is None else jnp.where(mine, local, -1)).reshape(k)
        tiles = kernels.gmm_rows_tiles if kernels is not None else (lambda which: None)
        a = gmm_rows(x, gu_q, group, gmm_impl, swiglu=True, shared=True, raw=True, tiles=tiles("gate_up"),
                     scale=gu_s, block=gu_b)
        y = gmm_rows(a, dn_q, group, gmm_impl, raw=True, tiles=tiles("down"), scale=dn_s,
                     block=dn_b)                                                 # rows [0, k): the choices'
        out = None
        for j in range(k):
            yj = y[j:j + 1] * weights[:, j:j + 1]
            if mine is not None:                                                 # raw rows of other shards: undefined
                yj = jnp.where(mine[:, j:j + 1], yj, 0)
            out = yj if out is None else out + yj
        return out
    if mine is None:
        mine = jnp.ones(idx.shape, jnp.bool_)
    flat = jnp.where(mine, local, El).reshape(-1)                                # [N k], El: not here
    rows, back, sizes = group_rows(flat, El)
    xs = jnp.take(x, rows // k, axis=0)                                          # [N k, H]
    if q_kernel:
        a = gmm_swiglu(xs, gu_q, sizes, gmm_impl, scale=gu_s, block=gu_b)        # [N k, I]
        y = gmm(a, dn_q, sizes, gmm_impl, scale=dn_s, block=dn_b)                # [N k, H]
    elif quantized:
        expert = jnp.minimum(jnp.take(flat, rows), El - 1)                       # [N k] each sorted row's
        gate, up = jnp.split(quantized_gmm(xs, gate_up, sizes, expert), 2, axis=-1)
        a = jax.nn.silu(gate) * up                                               # [N k, I]
        y = quantized_gmm(a, down, sizes, expert)                                # [N k, H]
    else:
        a = gmm_swiglu(xs, gate_up, sizes, gmm_impl)                             # [N k, I]
        y = gmm(a, down, sizes, gmm_impl)                                        # [N k, H]
    w = jnp.where(mine, weights, 0).reshape(-1)[rows]
    y = jnp.where(jnp.take(mine.reshape(-1), rows)[:, None], y * w[:, None], 0)  # rows of other shards
    y = jnp.take(y, back, axis=0).reshape(N, k, -1)                              # back to [N, k, H]
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out


def kernel_operands(w, gmm_impl: str, M: int, dtype, swiglu: bool = False):
    """(q, scale, block) of quantized experts w [E, K, N] that the grouped-matmul kernel `gmm_impl`
    reads itself for M rows of `dtype` (block None: int8 with column scales; else an FP8
    checkpoint's float8 q and block scales), or None (float experts, or a kernel / shape that does
    not take them: the caller's XLA path)."""
    from pallas_kernels.moe import fp8_supported, int8_supported
    _, K, N = w.shape
    if isinstance(w, Int8Weight):
        return (w.q, w.scale, None) if int8_supported(gmm_impl, M, K, N, dtype, swiglu=swiglu) else None
    if isinstance(w, Fp8BlockWeight) and w.q.ndim == 3 and w.scale.ndim == 3 and \
            fp8_supported(gmm_impl, M, K, N, dtype, w.block, swiglu=swiglu, w_dtype=w.q.dtype):
        return w.q, w.scale, w.block
    return None


def quantized_gmm(lhs, w, group_sizes, expert):
    """The XLA grouped matmul of rows lhs [M, K] grouped by expert (group_sizes [E]) with quantized
    experts w [E, K, N] → [M, N] in lhs's dtype; expert [M]: each row's expert (any valid id for the
    rows past the groups, which are zero). int8: (lhs @ q) then the row's expert's column scales in
    float32; another quantized type: its weights dequantized to lhs's dtype first."""
    from pallas_kernels.moe import gmm
    if not isinstance(w, Int8Weight):
        return gmm(lhs, w.dequantize(lhs.dtype) if is_quantized(w) else w, group_sizes, "xla")
    y = gmm(lhs, w.q.astype(lhs.dtype), group_sizes, "xla")
    return (y.astype(jnp.float32) * jnp.take(w.scale, expert, axis=0)).astype(lhs.dtype)


# Up to this many (token, choice) rows the grouping ranks rows by comparing every pair (an [R, R]
# compare-and-count XLA fuses into a few kernels) instead of a sort, a bincount and an inverse
# permutation's scatter: at a B = 8 decode step (64 rows) those were ~10 launches a layer on the
# H200, ~18 us of a Coder-30B-A3B layer (docs/perf-log.md, 'MoE grouping by comparison'). Past it
# ([R, R] grows as R^2) the sort.
GROUP_BY_COMPARE = 1024


def group_rows(flat, groups: int):
    """(rows, back, sizes) of flat [R] int32 group ids in [0, groups] (`groups`: none, sorted last):
    rows [R] the stable order by group (rows[p] = the index at sorted position p), back [R] its
    inverse (the sorted position of index r), sizes [groups] int32 the rows per group."""
    R = flat.shape[0]
    if R > GROUP_BY_COMPARE:
        rows = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=groups + 1)[:groups].astype(jnp.int32)
        back = jnp.zeros_like(rows).at[rows].set(jnp.arange(R, dtype=rows.dtype))
        return rows, back, sizes
    j = jnp.arange(R, dtype=jnp.int32)
    e_r, e_c = flat[:, None], flat[None, :]
    before = (e_c < e_r) | ((e_c == e_r) & (j[None, :] < j[:, None]))           # [R, R]: c sorts before r
    back = jnp.sum(before, axis=1, dtype=jnp.int32)                              # [R] sorted position of r
    rows = jnp.sum(jnp.where(back[None, :] == j[:, None], j[None, :], 0), axis=1, dtype=jnp.int32)
    sizes = jnp.sum(flat[None, :] == jnp.arange(groups, dtype=flat.dtype)[:, None], axis=1, dtype=jnp.int32)
    return rows, back, sizes


def distinct_experts(idx, num_experts: int):
    """The number of different experts chosen among all rows of idx [..., k] (benchmarks' floor)."""
    hit = jnp.zeros((num_experts,), jnp.bool_).at[idx.reshape(-1)].set(True)
    return jnp.sum(hit.astype(jnp.int32))


class MoE(nnx.Module):
    """Router + stacked SwiGLU experts; called like the dense MLP: mlp(h [B, T, H]) -> [B, T, H]."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 dtype, rngs: nnx.Rngs):
        self.router = init_param(rngs, (hidden, num_experts), dtype, hidden ** -0.5)          # [H, E]
        self.experts_gate_up = init_param(rngs, (num_experts, hidden, 2 * inter), dtype, hidden ** -0.5)  # [E, H, 2I]
        self.experts_down = init_param(rngs, (num_experts, inter, hidden), dtype, inter ** -0.5)          # [E, I, H]
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, bool(norm_topk_prob)

    def _local(self, h, router, gate_up, down, gmm_impl: str, first_expert, kernels: KernelConfig | None):
        route_kernel = kernels is not None and kernels.moe_route
        B, T, H = h.shape
        x = h.reshape(B * T, H)
        w, idx = route(x, router, self.top_k, self.norm_topk_prob, ascending=True,
                       kernel=gmm_impl if route_kernel else None)
        rec = _RECORD.get()
        if rec is not None:
            rec.append(idx)
        return experts(x, w, idx, gate_up, down, gmm_impl=gmm_impl, first_expert=first_expert,
                       ascending=True, kernels=kernels).reshape(B, T, H)

    def __call__(self, h, groups: int = 1, kernels: KernelConfig | None = None):
        """h [B, T, H] already normed -> [B, T, H] (groups: the dense MLP's TP layout, unused: the
        experts are split whole over the mesh instead)."""
        gmm_impl = kernels.moe_gmm if kernels is not None else "xla"
        router, gate_up, down = self.router[...], self.experts_gate_up[...], self.experts_down[...]
        mesh = sharding.current_mesh()
        if mesh is None or sharding.model_axis_size(mesh) == 1:
            return self._local(h, router, gate_up, down, gmm_impl, None, kernels)
        ep = sharding.model_axis_size(mesh)
        if self.num_experts % ep:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the model axis size {ep} "
                             "(expert parallelism splits the experts over it)")
        El = self.num_experts // ep
        d = "data" if h.shape[0] % sharding.data_axis_size(mesh) == 0 else None
        rows, experts_spec = P(d, None, None), P("model", None, None)
        # int8 experts (dflash_jax.quantize): q as the float experts, their scales [E, N] by expert too;
        # FP8 experts (q [E, K, N], scale [E, Kb, Nb], block static): the one spec, a prefix of both
        specs = [Int8Weight(experts_spec, P("model", None)) if isinstance(w, Int8Weight) else experts_spec
                 for w in (gate_up, down)]

        def shard(h, router, gate_up, down):
            first = jax.lax.axis_index("model") * El
            return jax.lax.psum(self._local(h, router, gate_up, down, gmm_impl, first, kernels), "model")

        return jax.shard_map(shard, mesh=mesh, in_specs=(rows, P(), *specs),
                             out_specs=rows, check_vma=False)(h, router, gate_up, down)
