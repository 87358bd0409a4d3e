"""Many devices: the ('data', 'model') mesh, the one table of partition rules for the target, the
draft and their KV caches, the fused-weight layout under tensor parallelism, greedy and sampling over
a vocab-sharded LM head. No model imports: the families (dflash_jax.models) and the loaders
(dflash_jax.weights, which reads each device's slices straight from safetensors) use these rules.

Layout under TP = the 'model' axis size (Megatron style, two all-reduces a layer):
  - embed [V, H] and lm_head [H, V] are sharded on the vocabulary;
  - qkv [H, W] and gate_up [H, 2I] by columns, o [HqD, H] and down [I, H] by rows;
  - norms and the draft's fc [n·H, H] replicated (fc is small and its output feeds an RMSNorm over
    the whole H, so a column split would be all-gathered right away);
  - KV caches [B, Hkv, C, D]: batch on 'data', kv heads on 'model'.
A plain column split of the fused qkv would give shard 0 only q heads: `qkv_permutation` reorders
the columns at load time so shard s's contiguous chunk is [q heads of s | k heads of s | v heads
of s] (and gate_up [gate_s | up_s]), and `split_qkv` / `split_gate_up` recover q, k, v (gate, up)
in the original head order from a projection in that layout with no collective. When Hkv < TP the
kv heads are replicated: each shard gets a copy of the kv head its q heads use, so the layer (and its
cache) has TP kv heads, a legal GQA model with the same outputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["AXES", "make_mesh", "parse_mesh", "RULES", "spec_for", "shard_model", "shard_cache",
           "cache_specs", "check_sharded", "FusedLayout", "fused_layout", "qkv_permutation",
           "gate_up_permutation", "split_qkv", "split_gate_up", "sharded_argmax", "top_k",
           "model_axis_size",
           "data_axis_size", "as_mesh", "mesh_of", "active", "current_mesh", "argmax",
           "attention_specs", "per_shard", "abstract_on_mesh", "fused_layout_fits"]

AXES = ("data", "model")
_ALIASES = {"data": "data", "dp": "data", "model": "model", "tp": "model"}


# ------------------------------------------------------------------------------------------ the mesh

def parse_mesh(spec) -> tuple[int, int]:
    """(data, model) sizes from "data=2,model=4" (aliases dp / tp; a missing axis is 1), "2x4", an
    int (model parallel only) or a (data, model) pair."""
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        sizes = {"data": 1, "model": int(spec)}
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        sizes = {"data": spec[0], "model": spec[1]}
    elif isinstance(spec, str):
        s = spec.replace(" ", "")
        sizes = {"data": 1, "model": 1}
        if re.fullmatch(r"\d+x\d+", s):
            sizes["data"], sizes["model"] = (int(x) for x in s.split("x"))
        else:
            seen = set()
            for part in filter(None, s.split(",")):
                m = re.fullmatch(r"(\w+)=(\d+)", part)
                if not m or m.group(1) not in _ALIASES:
                    raise ValueError(f"mesh {spec!r}: expected 'data=N,model=M' (or dp/tp, or 'NxM'), "
                                     f"could not read {part!r}")
                axis = _ALIASES[m.group(1)]
                if axis in seen:
                    raise ValueError(f"mesh {spec!r}: axis {axis!r} given twice")
                seen.add(axis)
                sizes[axis] = int(m.group(2))
    else:
        raise ValueError(f"mesh {spec!r}: expected 'data=N,model=M', 'NxM', an int or a (data, model) pair")
    for axis, n in sizes.items():
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"mesh {spec!r}: axis {axis!r} must be a positive integer, got {n!r}")
    return int(sizes["data"]), int(sizes["model"])


def make_mesh(spec=None, *, dp: int | None = None, tp: int | None = None, devices=None) -> Mesh:
    """A mesh with axes ('data', 'model'). spec as parse_mesh, or dp= / tp= (the other axis is 1).
    It must cover `devices` exactly (default: every device; pass a subset to use fewer). Axis types
    are Auto: jit's sharding propagation places intermediates, the rules place parameters and caches."""
    if spec is not None and (dp is not None or tp is not None):
        raise ValueError("make_mesh: give either a spec or dp=/tp=, not both")
    data, model = parse_mesh(spec) if spec is not None else parse_mesh((dp or 1, tp or 1))
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        raise ValueError(f"mesh data={data},model={model} needs {data * model} devices, "
                         f"{'there are' if len(devices) == len(jax.devices()) else 'got'} {len(devices)}"
                         + ("" if data * model > len(devices) else "; pass devices=jax.devices()[:n] to use fewer"))
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), AXES, auto, devices=devices)


def as_mesh(mesh) -> Mesh | None:
    """None, a Mesh (axes ('data', 'model')), or a spec for make_mesh ("data=2,model=4", "2x4", an
    int, a pair) → a Mesh or None. A mesh of one device is None (nothing to shard)."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        mesh = make_mesh(mesh)
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)}: expected {AXES} (sharding.make_mesh)")
    return None if mesh.size == 1 else mesh


def mesh_of(model) -> Mesh | None:
    """The ('data', 'model') mesh `model`'s parameters are placed on (None: not on one). Every
    parameter must be on the same mesh. `model` may also be its nnx.State (from an nnx.split the
    caller made anyway: walking a 36-layer model's graph again costs tens of ms of host time)."""
    from flax import nnx
    meshes = set()
    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
    for _, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            continue
        sh = getattr(var.get_value(), "sharding", None)
        meshes.add(sh.mesh if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == AXES else None)
    if len(meshes) > 1:
        raise ValueError(f"{type(model).__name__}'s parameters are not all on one ('data', 'model') mesh; "
                         "place it with sharding.shard_model or load it with mesh=")
    m = meshes.pop() if meshes else None
    return None if m is None or m.size == 1 else m


# The mesh of the program being traced (decode sets it around its trace; the mesh is in the
# compile key). Layers and sampling read it to pick the per-shard paths: a context variable, so
# programs traced in several threads each see their own.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("dflash_mesh", default=None)


@contextlib.contextmanager
def active(mesh: Mesh | None):
    """Trace under `mesh`: `argmax` and the Pallas attention (`per_shard`) use it."""
    tok = _ACTIVE.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE.reset(tok)


def current_mesh() -> Mesh | None:
    return _ACTIVE.get()


def argmax(logits):
    """jnp.argmax(logits, axis=-1) as int32; under an active mesh with a model axis > 1 the
    vocab-sharded `sharded_argmax` (same result, the logits never gathered)."""
    mesh = vocab_mesh(logits)
    if mesh is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sharded_argmax(logits, mesh)


def attention_specs(q_shape, cache_shape, mesh: Mesh):
    """(q / output spec, cache spec, k_end spec) of block attention q [B, T, Hq, D] over caches
    [B, Hkv, C, D] per shard: batch on 'data', heads on 'model' (each shard's q heads are exactly
    those of its kv heads, so every shard is a small GQA attention). Heads that do not split over
    'model' (the plain layout with fewer kv heads than shards) stay whole on every shard."""
    B, Hq, Hkv = q_shape[0], q_shape[2], cache_shape[1]
    d = "data" if B % data_axis_size(mesh) == 0 else None
    tp = model_axis_size(mesh)
    m = "model" if Hkv % tp == 0 and Hq % tp == 0 else None
    return P(d, None, m, None), P(d, m, None, None), P(d, None)


def per_shard(fn, q, k_cache, v_cache, k_end):
    """fn(q, k_cache, v_cache, k_end) (a Pallas attention kernel) on each shard's batch rows and
    heads via shard_map under the active mesh; fn itself without one. No collective inside."""
    mesh = current_mesh()
    if mesh is None:
        return fn(q, k_cache, v_cache, k_end)
    qs, cs, es = attention_specs(q.shape, k_cache.shape, mesh)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qs, cs, cs, es), out_specs=qs,
                         check_vma=False)(q, k_cache, v_cache, k_end)


def per_shard_rows(fn, k_cache, v_cache, k, v, start):
    """fn(k_cache, v_cache, k, v, start) -> (k_cache, v_cache) (a Pallas cache-row writer) on each
    shard's batch rows and kv heads via shard_map under the active mesh; fn itself without one."""
    mesh = current_mesh()
    if mesh is None:
        return fn(k_cache, v_cache, k, v, start)
    rows, cs, _ = attention_specs(k.shape, k_cache.shape, mesh)       # k [B, T, Hkv, D] as q
    return jax.shard_map(fn, mesh=mesh, in_specs=(cs, cs, rows, rows, P(rows[0])), out_specs=(cs, cs),
                         check_vma=False)(k_cache, v_cache, k, v, start)


def per_shard_prologue(fn, qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, start, ctx_start):
    """fn(qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, start, ctx_start) -> (q, k_cache,
    v_cache) (the fused GPU prologue) on each shard's batch rows and kv heads via shard_map under
    the active mesh; fn itself without one. qkv [B, T, F] must be in the fused layout of the model
    axis (each shard's contiguous columns are the plain [q | k | v] of its own heads), so every
    shard runs the one-device kernel on its heads, with no collective."""
    mesh = current_mesh()
    if mesh is None:
        return fn(qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, start, ctx_start)
    d = "data" if qkv.shape[0] % data_axis_size(mesh) == 0 else None
    cs, rows = P(d, "model", None, None), P(d, None, None)
    in_specs = (P(d, None, "model"), rows, rows, P(), P(), cs, cs, P(d), P(d))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(P(d, None, "model", None), cs, cs),
                         check_vma=False)(qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, start, ctx_start)


def per_data_shard(fn, x, y, weight):
    """fn(x, y, weight) -> (a, b) (the fused add + RMSNorm, rows [B, T, H] of whole hidden) on each
    shard's batch rows via shard_map under the active mesh; fn itself without one. x and y are
    replicated over 'model' (y, a row-sharded matmul's output, is all-reduced on the way in, as
    XLA's plain add would); every model shard repeats the same small kernel."""
    mesh = current_mesh()
    if mesh is None:
        return fn(x, y, weight)
    d = "data" if x.shape[0] % data_axis_size(mesh) == 0 else None
    rows = P(d, *([None] * (x.ndim - 1)))
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows, rows, P()), out_specs=(rows, rows),
                         check_vma=False)(x, y, weight)


def model_axis_size(mesh: Mesh) -> int:
    return int(mesh.shape["model"])


def data_axis_size(mesh: Mesh) -> int:
    return int(mesh.shape["data"])


# ------------------------------------------------------------------------------- partition rules

# One table for the target (Qwen3) and the draft (DFlashDraft), by nnx state path joined with "/".
# The first rule whose pattern matches the whole path wins; a leaf no rule matches is an error.
RULES: tuple[tuple[str, P], ...] = (
    (r"embed", P("model", None)),                         # [V, H] vocab
    (r"lm_head", P(None, "model")),                       # [H, V] vocab
    (r"layers/\d+/qkv", P(None, "model")),                # [H, (Hq + 2 Hkv) D] columns, fused_layout order
    (r"layers/\d+/o", P("model", None)),                  # [Hq D, H] rows
    (r"layers/\d+/mlp/router", P()),                      # MoE [H, E] replicated (every shard routes)
    (r"layers/\d+/mlp/experts_(gate_up|down)", P("model", None, None)),  # MoE [E, ...] experts (EP)
    (r"layers/\d+/mlp/gate_up", P(None, "model")),        # [H, 2I] columns, fused_layout order
    (r"layers/\d+/mlp/down", P("model", None)),           # [I, H] rows
    (r"layers/\d+/qkv_bias", P("model")),                 # [(Hq + 2 Hkv) D] as qkv's columns
    (r"layers/\d+/mlp/gate_up_bias", P("model")),         # [2I] as gate_up's columns
    (r"layers/\d+/(o_bias|mlp/down_bias)", P()),          # [H] added after the rows' all-reduce
    (r"fc", P()),                                         # draft [n·H, H] replicated (see module doc)
    # DFlash2: the convs act on whole rows of H (replicated like the norms); the selector's
    # codebooks [V, R] are gathered by token id and small next to the LM head: replicated
    (r"layers/\d+/(attention_conv|mlp_conv)/(base_kernel|kernel_projection)", P()),
    (r"candidate_selector/(predecessor_codebook|successor_codebook|hidden_projection)", P()),
    (r"(layers/\d+/)?(input_layernorm|post_attention_layernorm|q_norm|k_norm|norm|hidden_norm)/weight", P()),
)


def path_str(path) -> str:
    """A parameter's tree path (a tuple of keys) as the "a/b/c" name that RULES match."""
    return "/".join(str(p) for p in path)


def spec_for(path, rules=RULES) -> P:
    """The PartitionSpec of parameter `path` (tuple or "a/b/c")."""
    name = path if isinstance(path, str) else path_str(path)
    for pattern, spec in rules:
        if re.fullmatch(pattern, name):
            return spec
    raise ValueError(f"no partition rule matches parameter {name!r}; add one to dflash_jax.sharding.RULES")


def check_divisible(name: str, shape, spec: P, mesh: Mesh):
    """Refuse (ValueError naming `name`) a `shape` whose dimension `spec` splits unevenly over `mesh`."""
    for dim, (n, axis) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        if axis is None:
            continue
        size = int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))
        if n % size:
            raise ValueError(f"{name}: dimension {dim} of shape {tuple(shape)} ({n}) is not divisible by "
                             f"the mesh axis {axis!r} of size {size}")


def _shards(spec: P, mesh: Mesh) -> int:
    n = 1
    for axis in spec:
        for a in (axis if isinstance(axis, tuple) else (axis,)) if axis is not None else ():
            n *= int(mesh.shape[a])
    return n


# ------------------------------------------------------------------------ fused layout under TP

@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """How a layer's fused projections are laid out for `groups` = TP shards: each contiguous
    1/groups of qkv's columns is [q heads | k heads | v heads] of one shard, with `num_kv_heads`
    (>= the model's, copies when the model has fewer kv heads than shards) kv heads in all."""
    groups: int
    num_heads: int
    num_kv_heads: int          # after replication: max(model kv heads, groups)
    head_dim: int
    kv_repeats: int            # copies of each model kv head (1: none)


def fused_layout(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> FusedLayout:
    """The layout for TP = tp, refusing head counts that do not split."""
    if num_heads % tp:
        raise ValueError(f"num_heads={num_heads} is not divisible by the model axis size {tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} and the model axis size {tp}: one must divide the other")
    rep = max(1, tp // num_kv_heads)
    return FusedLayout(groups=tp, num_heads=num_heads, num_kv_heads=num_kv_heads * rep,
                       head_dim=head_dim, kv_repeats=rep)


def qkv_permutation(layout: FusedLayout) -> np.ndarray:
    """Column indices into the plain [q | k | v] matrix [H, (Hq + 2 Hkv) D] giving the fused layout
    [H, (Hq + 2 Hkv·rep) D]: w[:, perm]. Identity for groups = 1."""
    G, Hq, D, rep = layout.groups, layout.num_heads, layout.head_dim, layout.kv_repeats
    Hkv = layout.num_kv_heads // rep                                     # the model's kv heads
    hq, hkv = Hq // G, layout.num_kv_heads // G                          # per shard
    head = lambda base, h: base + h * D + np.arange(D)
    cols = []
    for s in range(G):
        cols += [head(0, h) for h in range(s * hq, (s + 1) * hq)]
        kv = [(s * hkv + j) // rep for j in range(hkv)]                  # model kv head of each copy
        cols += [head(Hq * D, h) for h in kv]
        cols += [head((Hq + Hkv) * D, h) for h in kv]
    return np.concatenate(cols).astype(np.int32)


def gate_up_permutation(intermediate: int, groups: int) -> np.ndarray:
    """Column indices into [gate | up] [H, 2I] giving [gate_0 | up_0 | gate_1 | up_1 | ...]."""
    if intermediate % groups:
        raise ValueError(f"intermediate_size={intermediate} is not divisible by the model axis size {groups}")
    i = intermediate // groups
    return np.concatenate([np.r_[s * i:(s + 1) * i, intermediate + s * i:intermediate + (s + 1) * i]
                           for s in range(groups)]).astype(np.int32)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int, groups: int = 1):
    """q [..., Hq, D], k, v [..., Hkv, D] in head order from a projection qkv [..., W] in the fused
    layout of `groups` shards (num_kv_heads: the layout's, replicas included). The reshape puts the
    shard axis where the sharded columns are, so the slices are local to each shard."""
    lead, D = qkv.shape[:-1], head_dim
    hq, hkv = num_heads // groups, num_kv_heads // groups
    y = qkv.reshape(*lead, groups, (hq + 2 * hkv) * D)                                # [..., G, per]
    q = y[..., : hq * D].reshape(*lead, num_heads, D)
    k = y[..., hq * D: (hq + hkv) * D].reshape(*lead, num_kv_heads, D)
    v = y[..., (hq + hkv) * D:].reshape(*lead, num_kv_heads, D)
    return q, k, v


def split_gate_up(y, groups: int = 1):
    """(gate, up) [..., I] in order from y [..., 2I] in gate_up_permutation's layout."""
    if groups == 1:   # one device: a plain split (the reshape led XLA:TPU to copy the weight each use)
        gate, up = jnp.split(y, 2, axis=-1)
        return gate, up
    lead = y.shape[:-1]
    z = y.reshape(*lead, groups, 2, y.shape[-1] // (2 * groups))                      # [..., G, 2, I/G]
    return z[..., 0, :].reshape(*lead, -1), z[..., 1, :].reshape(*lead, -1)


def fused_layout_fits(cfg, tp: int) -> bool:
    """Whether cfg's heads split over tp shards in the fused layout (q heads divisible, kv heads
    dividing or divided by tp) and its MLP width divides."""
    return (cfg.num_heads % tp == 0 and (cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0)
            and cfg.intermediate_size % tp == 0)


def use_fused(cfg, tp: int, fused) -> bool:
    """fused_layout=None (the default): the fused layout wherever it fits, else the plain split."""
    return fused_layout_fits(cfg, tp) if fused is None else bool(fused)


def layout_for(cfg, tp: int, fused: bool) -> FusedLayout:
    """The FusedLayout of `cfg` at TP = tp: `fused_layout`'s when fused, else one group (the plain split)."""
    if not fused:
        return FusedLayout(1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1)
    return fused_layout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)


# --------------------------------------------------------------------------- placing the models

def _place(model, mesh: Mesh, rules, transform=None):
    from flax import nnx
    from dflash_jax.quantize import Fp8BlockWeight, Fp8ChannelWeight, Fp8W8A8Weight, Int8Weight, w8a8_weight
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        name = path_str(path)
        value = var.get_value()
        w8a8 = isinstance(value, Fp8W8A8Weight)
        channel = isinstance(value, Fp8ChannelWeight)
        if w8a8:   # (placed as the [K, N] weight it is, then back to the checkpoint's orientation)
            value = value.kn()
        if channel:   # (the same, its per-column scales as an int8 weight's: q [K, N], scale [N])
            value = Int8Weight(value.q.T, value.scale)
        if transform is not None:   # (quantized weights, dflash_jax.quantize: their scales with q's columns)
            if isinstance(value, Int8Weight):
                value = Int8Weight(transform(path, value.q), transform(path, value.scale))
            elif isinstance(value, Fp8BlockWeight):
                cols = jnp.arange(value.shape[-1])
                moved = transform(path, cols)
                value = value if moved is cols else value.take_columns(np.asarray(moved))
            else:
                value = transform(path, value)
        spec = spec_for(name, rules)
        check_divisible(name, value.shape, spec, mesh)
        if isinstance(value, (Int8Weight, Fp8BlockWeight)):
            placed = _place_quantized(value, spec, mesh)
            if channel:
                placed = Fp8ChannelWeight.from_kn(placed.q, placed.scale)
            var.set_value(w8a8_weight(name, placed) if w8a8 else placed)
            continue
        var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    return model


def _place_quantized(value, spec: P, mesh: Mesh):
    """A quantized weight (dflash_jax.quantize) placed as the float weight it replaces (`spec`), its
    scales with it. Int8Weight: scale [.., N] on q's column axis (replicated for a row-split o /
    down, whose columns are whole). Fp8BlockWeight: the block scales [.., Kb, Nb] on q's spec
    itself, each shard holding its own blocks' scales, when every shard boundary falls on a block
    boundary (Qwen3-8B's qkv / gate_up columns and o / down rows at TP 2-8 with 128-blocks do);
    where one cuts through a block (a toy width, a ragged last block) that axis's scales are spread
    to one per row / column first (quantize.Fp8BlockWeight.spread: 4 / bk bytes per weight byte
    more, about 3% at 128), so the scales still shard and every shard dequantizes its own columns
    locally. Replicating the unspread grid instead would be smaller, but each shard's dequantize
    would then expand the whole grid to its block columns through a repeat the SPMD partitioner
    cannot split at a non-block boundary."""
    from dflash_jax.quantize import Int8Weight
    full = tuple(spec) + (None,) * (value.ndim - len(spec))
    if isinstance(value, Int8Weight):
        return Int8Weight(jax.device_put(value.q, NamedSharding(mesh, P(*full))),
                          jax.device_put(value.scale, NamedSharding(mesh, P(*full[:-2], full[-1]))))
    for ax in (-2, -1):
        if full[ax] is not None and (value.shape[ax] // _shards(P(full[ax]), mesh)) % value.block[ax]:
            value = value.spread(ax)
    return type(value)(jax.device_put(value.q, NamedSharding(mesh, P(*full))),
                       jax.device_put(value.scale, NamedSharding(mesh, P(*full))), value.block)


def shard_model(model, mesh: Mesh, *, fused_layout: bool | None = None, rules=RULES):
    """Place `model`'s parameters (a target or a draft, in place) on `mesh` by RULES;
    returns the model. fused_layout (None, the default: wherever the heads split over the model
    axis, `fused_layout_fits`) also permutes qkv / gate_up into the per-shard
    layout (qkv_permutation) and records it on each layer (`qkv_groups`, `num_kv_heads`, which
    DecoderLayer reads through `split_qkv` / `split_gate_up`), so a layer needs no collective but
    its two all-reduces. fused_layout=False keeps the plain column split: still correct (jit
    inserts the collectives the slices need), slower."""
    tp = model_axis_size(mesh)
    cfg = model.config
    check_experts(cfg, tp)
    fused_layout = use_fused(cfg, tp, fused_layout)
    lay = layout_for(cfg, tp, fused_layout)
    perm_qkv = qkv_permutation(lay) if fused_layout else None
    perm_gu = gate_up_permutation(cfg.intermediate_size, tp) if fused_layout else None

    def transform(path, value):
        name = path_str(path)
        if perm_qkv is not None and re.fullmatch(r"layers/\d+/qkv(_bias)?", name):
            return jnp.take(value, perm_qkv, axis=-1)
        if perm_gu is not None and re.fullmatch(r"layers/\d+/mlp/gate_up(_bias)?", name):
            return jnp.take(value, perm_gu, axis=-1)
        return value

    _place(model, mesh, rules, transform)
    if fused_layout:
        set_layout(model, lay)
    return model


def check_experts(cfg, tp: int) -> None:
    """An MoE config's experts must split evenly over the model axis (expert parallelism)."""
    E = getattr(cfg, "num_experts", 0)
    if E and E % tp:
        raise ValueError(f"num_experts={E} is not divisible by the model axis size {tp} "
                         "(expert parallelism splits the experts over it)")


def set_layout(model, lay: FusedLayout):
    """Tell each of the model's layers the qkv layout `lay` (its groups and kv head count)."""
    for layer in model.layers:
        layer.qkv_groups = lay.groups
        layer.num_kv_heads = lay.num_kv_heads


def abstract_on_mesh(model, mesh: Mesh, *, fused_layout: bool | None = None, rules=RULES):
    """An abstract model (nnx.eval_shape) laid out for `mesh` as shard_model would place it: the
    fused layout set on its layers (qkv widened by kv copies), every parameter a ShapeDtypeStruct
    with its NamedSharding (an int8 target's Int8Weights as load_target(mesh=, quantize="int8") places
    them). For ahead-of-time compiles (decode.lower_iteration(mesh=))."""
    from flax import nnx
    from dflash_jax.quantize import Fp8BlockWeight, Fp8ChannelWeight, Fp8W8A8Weight, Int8Weight
    tp = model_axis_size(mesh)
    check_experts(model.config, tp)
    fused_layout = use_fused(model.config, tp, fused_layout)
    lay = layout_for(model.config, tp, fused_layout)
    if fused_layout:
        set_layout(model, lay)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path_str(path)
        x = var.get_value()
        shape = tuple(x.shape)
        if fused_layout and re.fullmatch(r"layers/\d+/qkv(_bias)?", name):
            shape = shape[:-1] + ((lay.num_heads + 2 * lay.num_kv_heads) * lay.head_dim,)
        spec = spec_for(name, rules)
        check_divisible(name, shape, spec, mesh)
        if isinstance(x, (Fp8BlockWeight, Fp8W8A8Weight, Fp8ChannelWeight)):
            raise ValueError(f"{name}: an FP8 checkpoint's block weights ahead of time on a mesh are not supported "
                             "(load the checkpoint with load_target(mesh=) instead)")
        if isinstance(x, Int8Weight):   # q as the float weight, its scales [.., N] with q's columns (_place_quantized)
            full = tuple(spec) + (None,) * (len(shape) - len(spec))
            var.set_value(Int8Weight(
                jax.ShapeDtypeStruct(shape, x.q.dtype, sharding=NamedSharding(mesh, P(*full))),
                jax.ShapeDtypeStruct(shape[:-2] + shape[-1:], x.scale.dtype,
                                     sharding=NamedSharding(mesh, P(*full[:-2], full[-1])))))
            continue
        var.set_value(jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec)))
    return model


def cache_specs(num_kv_heads: int, mesh: Mesh, batch: int | None = None):
    """(k/v spec, lens spec) of a KVCache [B, Hkv, C, D] on `mesh`: batch on 'data', kv heads on
    'model' when they split, else replicated over 'model' (every shard then holds all kv heads; the
    fused layout avoids that case by giving each shard its own copy). batch not divisible by the
    data axis is an error (pad the batch)."""
    if batch is not None and batch % data_axis_size(mesh):
        raise ValueError(f"batch {batch} is not a multiple of the data axis size {data_axis_size(mesh)}; "
                         "pad the batch")
    heads = "model" if num_kv_heads % model_axis_size(mesh) == 0 else None
    return P("data", heads, None, None), P("data")


def shard_cache(cache, mesh: Mesh):
    """A KVCache placed by cache_specs (outside jit: device_put; inside jit: sharding constraints)."""
    kv, lens = cache_specs(cache.k[0].shape[1], mesh, cache.k[0].shape[0])
    put = _constrain_or_put(mesh)
    return dataclasses.replace(cache, k=tuple(put(x, kv) for x in cache.k),
                               v=tuple(put(x, kv) for x in cache.v), lens=put(cache.lens, lens))


def _constrain_or_put(mesh: Mesh):
    def put(x, spec):
        s = NamedSharding(mesh, spec)
        if isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, s)
        return jax.device_put(x, s)
    return put


def _per_device_bytes(x) -> int:
    shard = x.addressable_shards[0].data
    return int(shard.size * shard.dtype.itemsize)


def check_sharded(model, mesh: Mesh, rules=RULES) -> dict[str, tuple[int, int]]:
    """Assert every parameter sits on `mesh` as its rule says, with per-device bytes = total /
    shards (no weight silently replicated). Returns {path: (per-device bytes, total bytes)}."""
    from flax import nnx
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path_str(path)
        x = var.get_value()
        spec = spec_for(name, rules)
        sh = getattr(x, "sharding", None)
        if not isinstance(sh, NamedSharding) or sh.mesh.shape != mesh.shape:
            raise AssertionError(f"{name}: not placed on the mesh (sharding {sh})")
        total = int(x.size * x.dtype.itemsize)
        per = _per_device_bytes(x)
        want = total // _shards(spec, mesh)
        if per != want:
            raise AssertionError(f"{name}: {per} bytes per device, rule {spec} wants {want} (of {total})")
        out[name] = (per, total)
    return out


# --------------------------------------------------------------- greedy and sampling, vocab-sharded

def logit_spec(ndim: int, batch: int, mesh: Mesh) -> P:
    """[B, ..., V] on `mesh`: batch on 'data' when it divides, vocabulary on 'model'."""
    lead = "data" if batch % data_axis_size(mesh) == 0 else None
    return P(lead, *([None] * (ndim - 2)), "model")


def sharded_argmax(logits, mesh: Mesh):
    """jnp.argmax(logits, axis=-1) for logits [B, ..., V] sharded on V over 'model', without
    gathering them: each shard's (max, lowest index of it), all-gathered ([B, ..., TP] each), then
    the first shard holding the maximum. Same result as jnp.argmax, ties to the lowest id included;
    a NaN counts as the maximum (jnp.argmax's policy), so the first NaN wins. int32."""
    V, tp = logits.shape[-1], model_axis_size(mesh)
    if V % tp:
        raise ValueError(f"vocabulary of {V} is not divisible by the model axis size {tp}")
    spec = logit_spec(logits.ndim, logits.shape[0], mesh)
    out_spec = P(*tuple(spec)[:-1])
    return jax.shard_map(argmax_over_shards, mesh=mesh, in_specs=spec, out_specs=out_spec,
                         check_vma=False)(logits)


# Chunk lengths of the staged top k over a vocabulary row on GPU (_staged_top_k): each stage keeps
# the top k of every chunk of that length. On the H200 (a [7, 151936] float32 row block, k 16) the
# stages (512, 128) measured fastest: 171 us, against 214 for the best single stage (512) and 538 for
# lax.top_k (docs/perf-log.md, 'DFlash2: conv + selector').
TOP_K_STAGES = (512, 128)


def _staged_top_k(x, k: int, stages=TOP_K_STAGES):
    """lax.top_k in stages: the top k of each chunk of the last axis (padded with -inf), the
    survivors kept in chunk order, again per stage, then the top k of what is left: the same
    values, ids and order (ties to the lowest id, as in top_k's shard form below; a pad never
    beats a real -inf, which comes first). XLA:GPU runs lax.top_k with a row per thread block: 7
    blocks for a DFlash2 block's [7, 151936] logits."""
    v, ids = x, None
    lead = x.shape[:-1]
    for L in stages:
        V = v.shape[-1]
        C = -(-V // L)
        if C == 1 or L < k:
            break
        pad = [(0, 0)] * len(lead) + [(0, C * L - V)]
        v1, i1 = jax.lax.top_k(jnp.pad(v, pad, constant_values=-jnp.inf).reshape(*lead, C, L), k)
        at = (i1 + (jnp.arange(C, dtype=jnp.int32) * L)[:, None]).reshape(*lead, C * k)   # into v
        ids = at if ids is None else jnp.take_along_axis(jnp.pad(ids, pad), at, axis=-1)
        v = v1.reshape(*lead, C * k)
    vk, j = jax.lax.top_k(v, k)
    j = j.astype(jnp.int32)
    return vk, (j if ids is None else jnp.take_along_axis(ids, j, axis=-1))


def _top_k(x, k: int):
    """(values, int32 ids) of lax.top_k over the last axis: the staged form on CUDA where the row
    is long (_staged_top_k), lax.top_k elsewhere (on CPU one stage of 1024 measured 3.5x slower
    than lax.top_k)."""
    def plain(x):
        v, i = jax.lax.top_k(x, k)
        return v, i.astype(jnp.int32)
    if x.shape[-1] < 8 * TOP_K_STAGES[0] or k > TOP_K_STAGES[-1]:
        return plain(x)
    return jax.lax.platform_dependent(x, cuda=lambda x: _staged_top_k(x, k), default=plain)


def top_k(logits, k: int):
    """jax.lax.top_k(logits, k) as (values, int32 ids); under an active mesh that shards the
    vocabulary (last axis) each shard's top k, all-gathered ([..., TP·k]), then the top k of
    those: the same values, ids and order (ties to the lowest id: the gathered list runs in shard
    order, each shard's ties lowest id first), the logits never gathered."""
    mesh = vocab_mesh(logits)
    if mesh is None or k > logits.shape[-1] // model_axis_size(mesh):
        return _top_k(logits, k)
    spec = logit_spec(logits.ndim, logits.shape[0], mesh)

    def local(x):
        v, i = _top_k(x, k)
        gi = (i + jax.lax.axis_index("model") * x.shape[-1]).astype(jnp.int32)
        vs = jax.lax.all_gather(v, "model", axis=v.ndim - 1, tiled=True)             # [..., TP·k]
        gis = jax.lax.all_gather(gi, "model", axis=gi.ndim - 1, tiled=True)
        v2, j = jax.lax.top_k(vs, k)
        return v2, jnp.take_along_axis(gis, j, axis=-1)
    out = P(*tuple(spec)[:-1], None)
    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(out, out), check_vma=False)(logits)


def argmax_over_shards(x, axis: str = "model"):
    """Inside shard_map: the global argmax over the last axis of x [B, ..., V/TP], a contiguous
    vocab slice per shard of mesh axis `axis`. Each shard's (max, lowest index of it) are
    all-gathered ([B, ..., TP] each) and the first shard holding the maximum wins, so ties and NaNs
    go as jnp.argmax over the whole row. int32, the same on every shard."""
    i = jnp.argmax(x, axis=-1)
    m = jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0]
    gi = (i + jax.lax.axis_index(axis) * x.shape[-1]).astype(jnp.int32)
    ms = jax.lax.all_gather(m, axis, axis=m.ndim)                            # [B, ..., TP]
    gis = jax.lax.all_gather(gi, axis, axis=gi.ndim)
    j = jnp.argmax(ms, axis=-1)                                              # first shard: lowest id
    return jnp.take_along_axis(gis, j[..., None], axis=-1)[..., 0]


def vocab_mesh(logits) -> Mesh | None:
    """The active mesh when it shards the vocabulary (last axis) of `logits` over a model axis > 1,
    else None (one device, TP = 1, or a vocabulary the axis does not divide: jnp paths)."""
    mesh = current_mesh()
    if mesh is None or model_axis_size(mesh) == 1 or logits.shape[-1] % model_axis_size(mesh):
        return None
    return mesh
