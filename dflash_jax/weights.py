"""HF safetensors → our modules: `load_target`, `load_draft`, and random `init_target` / `init_draft`.

Safetensors only: nothing is unpickled and no remote code is run. Tensors are streamed one at a time
(cast, transposed to [in, out], fused into qkv / gate_up once a layer's parts are all read) into a
module built abstractly (`nnx.eval_shape`), so peak host memory stays near one tensor. Dtype names,
model directories (hub id or path) and the tensors themselves come through the loader seam,
dflash_jax.checkpoint_io, which the families with their own loader use too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import drafts, models, sharding, validation
from dflash_jax.checkpoint_io import dtype_of, iter_tensors, resolve_model_dir, safetensors_files
from dflash_jax.config import ConfigError, TargetConfig, read_json
from dflash_jax import quantize as q8
from dflash_jax.quantize import check_quantize, quantize_target

__all__ = ["load_target", "load_draft", "init_target", "init_draft", "resolve_model_dir", "load_target_sharded",
           "load_draft_sharded"]


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
def _variable(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _part_widths(config) -> dict[str, int]:
    """Output widths of the parts of our fused matrices: qkv = [q | k | v], gate_up = [gate | up]."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q": q, "k": kv, "v": kv, "gate": config.intermediate_size, "up": config.intermediate_size}


def _map_tensor(name: str, top_level: dict, leaves: dict, model, flat, what: str):
    """THE mapping from a checkpoint tensor to our parameter: (our path, how, part key, expected HF
    shape), or None for a tensor this model does not have. `how`: None (as is), "T" (transposed to
    [in, out]) or the fused parts' order; shapes are the HF tensor's own, so errors name HF terms."""
    if name in top_level:
        path, how = top_level[name]
        key = None
    else:
        m = _LAYER.match(name)
        if not (m and m.group(2) in leaves):
            return None
        sub, how = leaves[m.group(2)]
        path = ("layers", int(m.group(1))) + sub
        if path not in flat:
            raise ValueError(f"{what}: config.json has {len(model.layers)} layers (num_hidden_layers), the "
                             f"checkpoint more (it has {name})")
        key = m.group(2).split(".")[-2].replace("_proj", "") if isinstance(how, tuple) else None
    ours = tuple(_variable(model, path).get_value().shape)
    if how is None:
        want = ours
    elif how == "T":
        want = ours[::-1]
    elif len(ours) == 1:  # a bias part [out]; ours is [sum of the parts' out]
        want = (_part_widths(model.config)[key],)
    else:  # HF [out, in] of one part; ours is [in, sum of the parts' out]
        want = (_part_widths(model.config)[key], ours[0])
    return path, how, key, want


def _hf_names(path, got: dict, top_level: dict, leaves: dict, prefix: str) -> list[str]:
    """The checkpoint tensors (HF names) that set our parameter `path` and have not arrived; `got`:
    the fused parts that have."""
    names = [n for n, (p, _) in top_level.items() if tuple(p) == path]
    if path[0] == "layers":
        for suffix, (sub, how) in leaves.items():
            if (path[1],) + tuple(sub) == path[1:]:
                key = suffix.split(".")[-2].replace("_proj", "") if isinstance(how, tuple) else None
                if key not in got:
                    names.append(f"{prefix}layers.{path[1]}.{suffix}")
    return names or [".".join(map(str, path))]


def _missing(todo, parts: dict, top_level: dict, leaves: dict, model, seen_layers: set, prefix: str,
             what: str) -> ValueError:
    """The error for parameters no checkpoint tensor set, in the checkpoint's terms: whole layers
    past its last are a layer count that differs from config.json's; else the HF tensors missing."""
    n = len(getattr(model, "layers", ()))
    if seen_layers and all(p[0] == "layers" and p[1] > max(seen_layers) for p in todo) \
            and seen_layers == set(range(max(seen_layers) + 1)):
        return ValueError(f"{what}: config.json has {n} layers (num_hidden_layers), the checkpoint "
                          f"{max(seen_layers) + 1}")
    names = sorted({h for p in todo for h in _hf_names(p, parts.get(p, {}), top_level, leaves, prefix)})
    why = ("; config.json says the model has biases (attention_bias / mlp_bias), the checkpoint has none"
           if all(h.endswith(".bias") for h in names) else "")
    return ValueError(f"{what}: checkpoint lacks {len(names)} tensor(s): {', '.join(names[:6])}"
                      + (" ..." if len(names) > 6 else "") + why)


def _fill(model, named_tensors, top_level: dict, leaves: dict, dtype, what: str, skip=()):
    """Stream (hf_name, array) pairs into the abstract `model`; every parameter must be set once.

    Each tensor is checked against the shape the config implies for it (named as in the checkpoint)
    and for non-finite values before it is cast and placed."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    todo = set(flat)
    parts: dict[tuple, dict[str, jax.Array]] = {}
    seen_layers: set[int] = set()
    prefix = "model."

    def put(path, arr):
        if q8.is_quantized(arr):   # an FP8 checkpoint's weight: kept in 8 bits where a linear reads it
            keep = path[0] == "layers" and (path[-1] in q8.LINEAR_NAMES and arr.ndim == 2
                                            or path[-1] in q8.EXPERT_NAMES and arr.ndim == 3)
            _variable(model, path).set_value(arr if keep else arr.dequantize(dtype))
        else:
            _variable(model, path).set_value(arr.astype(dtype))
        todo.discard(path)

    for name, t in named_tensors:
        mapped = _map_tensor(name, top_level, leaves, model, flat, what)
        if mapped is None:
            if not any(re.fullmatch(s, name) for s in skip):
                kind = getattr(model.config, "model_type", None)
                raise (ConfigError if kind else ValueError)(
                    f"{what}: unexpected tensor {name!r} in the checkpoint"
                    + (f" (not a tensor of model_type {kind!r})" if kind else ""))
            continue
        path, how, key, want = mapped
        if path[0] == "layers":
            seen_layers.add(path[1])
            prefix = name[:name.index("layers.")]
        if tuple(t.shape) != want:
            raise ValueError(f"{what}: tensor {name} has shape {tuple(t.shape)}, the config implies {want}")
        quantized = q8.is_quantized(t)   # paired with its scales by quantize.fp8_weights
        if not quantized and (not jnp.issubdtype(t.dtype, jnp.floating) or q8.is_fp8(t)):
            # int8 / bool / int: quantised or not weights at all; float8 without the fp8
            # quantization_config that gives its scales
            raise ValueError(f"{what}: tensor {name} has dtype {jnp.dtype(t.dtype).name}; weights must be "
                             "floating point (float32, bfloat16, float16)"
                             + ("; float8 weights need config.json's quantization_config (quant_method 'fp8')"
                                if q8.is_fp8(t) else ""))
        if not (t.all_finite() if quantized else bool(jnp.isfinite(t).all())):
            raise ValueError(f"{what}: tensor {name} holds NaN or inf values")
        if how is None:
            put(path, t)
        elif how == "T":
            put(path, t.T)
        else:  # one part of a fused matrix: keep it until all parts are read
            got = parts.setdefault(path, {})
            got[key] = t.T if quantized else t.T.astype(dtype)
            if all(p in got for p in how):
                put(path, _concat([got[p] for p in how], dtype))
                del parts[path]
    if todo:
        raise _missing(todo, parts, top_level, leaves, model, seen_layers, prefix, what)
    return model


def _place_loaded(model, mesh):
    """A target loaded on one device placed on `mesh` by its family's rules, as load_target places
    the families it loads whole (their own loader: the plain column split)."""
    fam = models.family(model.config.model_type)
    if fam.load is not None:
        return sharding.shard_model(model, mesh, fused_layout=False, rules=fam.rules)
    return sharding.shard_model(model, mesh, rules=fam.rules)


def _concat(parts: list, dtype):
    """The parts [in, out_i] of a fused matrix side by side: in 8 bits when all are an FP8
    checkpoint's, else in dtype (a part the checkpoint left unquantized takes the others with it)."""
    if all(isinstance(p, q8.Fp8BlockWeight) for p in parts):
        return q8.concat_columns(parts)
    return jnp.concatenate([p.dequantize(dtype) if q8.is_quantized(p) else p for p in parts], axis=-1)


def load_target(path_or_hub_id: str, dtype="bfloat16", *, mesh=None, quantize: str | None = None,
                w8a8: bool | str = False):
    """A causal LM of a registered family (dflash_jax.models, by config.json's model_type) from a
    HF directory or hub id (config.json + safetensors, sharded or not). mesh (a Mesh or a spec such
    as "data=2,model=4"): placed on it by its family's rules in the fused TP layout, each process
    reading only its devices' slices (load_target_sharded). quantize "int8": the layers' linear
    weights and MoE experts quantized at load, int8 per-output-channel (dflash_jax.quantize); with a
    mesh, quantized on one device and then placed, each scale sharded with its weight's columns.

    An FP8 checkpoint (config.json quantization_config quant_method "fp8", block-scaled
    float8_e4m3fn weights with weight_scale_inv) keeps its layer linears in 8 bits as
    quantize.Fp8BlockWeight (with quantize="int8", only the linears it left in floats are quantized);
    with a mesh, loaded on one device and then placed, the block scales with their weights' shards
    (sharding._place_quantized). Any other quantization_config is refused in one line. w8a8 (FP8
    checkpoints only, off by default): its layer linears run W8A8 (quantize.to_w8a8: the
    activations quantized to fp8 per K block at run time, the scheme the checkpoint declares; other
    numerics than the default weight-only path, which keeps the activations in `dtype`); w8a8="channel":
    each weight requantized to one scale per output channel and x to one per row (quantize.Fp8ChannelWeight:
    one fp8 dot at every row count, faster than the block scheme beyond 16 rows on an H100; its own
    numerics; with a mesh, requantized on one device and then placed, each scale with its column); a
    target without FP8 weights is a one-line ValueError."""
    if w8a8:
        scheme = q8.check_w8a8("block" if w8a8 is True else w8a8)   # (before the load: a bad one reads nothing)
        if scheme == "channel":   # (requantized on one device, then placed: scales with their columns)
            m = sharding.as_mesh(mesh)
            model = q8.to_w8a8(load_target(path_or_hub_id, dtype, quantize=quantize), scheme)
            return model if m is None else _place_loaded(model, m)
        return q8.to_w8a8(load_target(path_or_hub_id, dtype, mesh=mesh, quantize=quantize), scheme)
    check_quantize(quantize)
    m = sharding.as_mesh(mesh)
    if quantize is not None:   # (on a mesh: quantized on one device, then placed, scales with their columns)
        model = quantize_target(load_target(path_or_hub_id, dtype), quantize)
        return model if m is None else _place_loaded(model, m)
    dt = dtype_of(dtype)
    d = resolve_model_dir(path_or_hub_id)
    raw = read_json(d)
    config = models.read_config(raw)
    fam = models.family(config.model_type)
    what = f"target {path_or_hub_id}"
    fp8 = q8.checkpoint_fp8_block(raw, what)
    if fp8 is not None and fam.load is None:   # (a family with its own loader reads fp8 there: Qwen3.5)
        model = nnx.eval_shape(lambda: fam.model(config, dt, rngs=nnx.Rngs(0)))
        stream = q8.fp8_weights(iter_tensors(d), fp8, what)
        stream = stream if fam.tensors is None else fam.tensors(config, _fp8_experts(stream, config, what), what)
        model = _fill(model, stream, fam.top_weights(config), fam.layer_weights(config), dt, what, fam.skip)
        model = q8.mark(model, "fp8") if q8.quantized_leaves(model) else model
        # (on a mesh: loaded on one device, then placed, the block scales with their weights' shards)
        return model if m is None else _place_loaded(model, m)
    if fam.load is not None:      # loaded on one device, then placed by the family's rules (plain split)
        model = fam.load(d, config, dt, f"target {path_or_hub_id}")
        return model if m is None else _place_loaded(model, m)
    if m is not None and (fam.tensors is None or fam.sliced is not None):
        return load_target_sharded(path_or_hub_id, m, dtype)
    model = nnx.eval_shape(lambda: fam.model(config, dt, rngs=nnx.Rngs(0)))
    stream = iter_tensors(d) if fam.tensors is None else fam.tensors(config, iter_tensors(d), what)
    model = _fill(model, stream, fam.top_weights(config), fam.layer_weights(config), dt, what, fam.skip)
    return model if m is None else sharding.shard_model(model, m)


_FP8_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _fp8_experts(stream, config, what: str):
    """An FP8 stream for a family that stacks its experts (`Family.tensors`: Qwen3-MoE): each sparse
    layer's fp8 experts stacked here, in 8 bits, into `model.layers.N.mlp.experts.gate_up` [E, H, 2I]
    and `...experts.down` [E, I, H] (Fp8BlockWeight, the names the family's stacked tensors have),
    which the family's rewrite passes on as they are; float experts pass to it unchanged. A layer whose
    experts are partly fp8, or an expert of the wrong shape, is a one-line ValueError."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    want = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    layers: dict[int, dict] = {}
    for name, t in stream:
        m = _FP8_EXPERT.match(name)
        if m is None or not q8.is_quantized(t):
            yield name, t
            continue
        layer, e, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        if e >= E or tuple(t.shape) != want[kind]:
            raise ValueError(f"{what}: tensor {name} has shape {tuple(t.shape)} (expert {e}); the config implies "
                             f"{want[kind]} for each of num_experts={E}")
        got = layers.setdefault(layer, {})
        got[(e, kind)] = t.T                                                          # [in, out]
        if len(got) == 3 * E:
            del layers[layer]
            stack = lambda ws: q8.Fp8BlockWeight(jnp.stack([w.q for w in ws]), jnp.stack([w.scale for w in ws]),
                                                 ws[0].block)
            yield f"model.layers.{layer}.mlp.experts.gate_up", stack(
                [q8.concat_columns([got[(e, "gate")], got[(e, "up")]]) for e in range(E)])
            yield f"model.layers.{layer}.mlp.experts.down", stack([got[(e, "down")] for e in range(E)])
    for layer, got in sorted(layers.items()):
        raise ValueError(f"{what}: layer {layer} has {len(got)} of its {3 * E} expert tensors in fp8; an fp8 "
                         "checkpoint's experts must all be fp8 (with weight_scale_inv) or all floats")


def load_draft(path_or_hub_id: str, target=None, dtype="bfloat16", *, mesh=None, quantize: str | None = None):
    """A draft of a registered variant (dflash_jax.drafts, by config.json's architectures; a z-lab
    DFlash draft by default). With `target`, a draft that does not fit it is refused, naming the
    mismatch. mesh: as load_target (the draft sits on the target's mesh with the same rules).
    quantize "int8": its layers' linear weights quantized at load (quantize.quantize_draft; off by
    default, it costs acceptance); with a mesh, quantized on one device and then placed."""
    check_quantize(quantize)
    if quantize is not None:
        model = q8.quantize_draft(load_draft(path_or_hub_id, target, dtype), quantize)
        m = sharding.as_mesh(mesh)
        return model if m is None else sharding.shard_model(model, m)
    dt = dtype_of(dtype)
    d = resolve_model_dir(path_or_hub_id)
    raw = read_json(d)
    drafts.variant(raw.get("architectures") if isinstance(raw, dict) else None)   # a known one
    config = drafts.read_config(raw)
    var = drafts.variant_of_config(config)
    if target is not None:
        config.check_fits(target.config)
    m = sharding.as_mesh(mesh)
    if m is not None and var is drafts.VARIANTS["DFlashDraftModel"]:
        return load_draft_sharded(d, m, dtype)
    model = nnx.eval_shape(lambda: var.model(config, dt, rngs=nnx.Rngs(0)))
    model = _fill(model, iter_tensors(d), dict(var.top_weights), var.layer_weights, dt,
                  f"draft {path_or_hub_id}", var.skip)
    # DFlash2 / windowed drafts (small; their codebooks have two spellings) load whole, then are
    # placed by the same rules and fused layout as a DFlash draft
    return model if m is None else sharding.shard_model(model, m)


def init_target(config: TargetConfig | str, seed: int = 0, dtype="bfloat16", *, quantize: str | None = None):
    """Random weights (for benchmarks on machines without checkpoints). `config` may be a preset name.
    quantize: as load_target's."""
    check_quantize(quantize)
    if isinstance(config, str):
        config = TargetConfig.preset(config)
    model = models.family(config.model_type).model(config, dtype_of(dtype), rngs=nnx.Rngs(validation.check_seed(seed)))
    return quantize_target(model, quantize)


def init_draft(config, seed: int = 0, dtype="bfloat16", target=None, *, quantize: str | None = None):
    """Random weights of the draft variant whose config class `config` is (a DraftConfig: DFlash).
    quantize: as load_draft's."""
    check_quantize(quantize)
    if target is not None:
        config.check_fits(target.config)
    model = drafts.variant_of_config(config).model(config, dtype_of(dtype), rngs=nnx.Rngs(validation.check_seed(seed)))
    return q8.quantize_draft(model, quantize)


# ------------------------------------------------------------------ loading slices onto a mesh

class _Checkpoint:
    """The safetensors files of a checkpoint directory, read by slice (`read`) and never whole
    unless a caller asks for the whole tensor (replicated parameters)."""

    def __init__(self, d: str):
        from safetensors import safe_open
        self._files = [safe_open(p, framework="numpy") for p in safetensors_files(d)]
        self._where = {n: f for f in self._files for n in f.keys()}
        for n, f in self._where.items():  # as _fill: int8 / bool / int tensors are not weights
            kind = f.get_slice(n).get_dtype()
            if not kind.startswith(("F", "BF")) or kind.startswith("F8"):
                raise ValueError(f"tensor {n} has dtype {kind}; weights must be floating point "
                                 "(float32, bfloat16, float16)")

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name not in self._where:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return np.asarray(self._where[name].get_slice(name)[index])


def _runs(idx: np.ndarray):
    """Maximal runs of consecutive integers in idx: [(first, length), ...]."""
    breaks = np.nonzero(np.diff(idx) != 1)[0] + 1
    return [(int(r[0]), len(r)) for r in np.split(idx, breaks)]


def _fused_reader(ck: _Checkpoint, parts: list[tuple[str, int]], perm: np.ndarray | None):
    """Reads columns [c0, c1) of a fused [in, out] matrix from HF [out_i, in] tensors `parts`
    (name, out_i) concatenated on out, permuted by perm: only the rows each column run needs.
    rows None: a fused bias [out] from HF [out_i] parts."""
    bounds = np.cumsum([0] + [n for _, n in parts])

    def read(rows: slice | None, cols: slice, width: int):
        idx = np.arange(width)[cols]
        src = idx if perm is None else perm[idx]
        pieces = []
        for first, n in _runs(src):
            part = int(np.searchsorted(bounds, first, side="right") - 1)
            while n:
                name, size = parts[part]
                lo = first - bounds[part]
                take = min(n, size - lo)
                if rows is None:
                    pieces.append(ck.read(name, (slice(lo, lo + take),)))
                else:
                    pieces.append(ck.read(name, (slice(lo, lo + take), rows)).T)
                first, n, part = first + take, n - take, part + 1
        return np.concatenate(pieces, axis=-1)
    return read


def _by_path(leaves: dict) -> dict:
    """A family's layer tensor table (HF leaf → (our path, how)) by our path: "a/b" → (HF leaf,
    how), or for a fused matrix ("fused", [HF leaves in part order], part names)."""
    out: dict = {}
    for hf, (sub, how) in leaves.items():
        key = "/".join(sub)
        if isinstance(how, tuple):
            got = out.setdefault(key, ("fused", {}, how))[1]
            got[hf.split(".")[-2].replace("_proj", "")] = hf
        else:
            out[key] = (hf, how)
    return {k: (v if v[0] != "fused" else ("fused", [v[1][p] for p in v[2]], v[2])) for k, v in out.items()}


def _load_sharded(d: str, model, mesh, dtype, top: dict, leaves: dict, prefix: str, fused_layout: bool | None,
                  rules=sharding.RULES, sliced=None):
    """Fill abstract `model` (nnx.eval_shape) with arrays built by make_array_from_callback: each
    local device's block is read from the safetensors slices it covers (fused matrices from the
    parts' matching rows, permuted when fused_layout). top: HF name → (our path, how) outside the
    layers; leaves: the layer table (models.family); prefix: before `layers.N.` in HF names."""
    from jax.sharding import NamedSharding
    ck = _Checkpoint(d)
    cfg = model.config
    tp = sharding.model_axis_size(mesh)
    fused_layout = sharding.use_fused(cfg, tp, fused_layout)
    lay = sharding.layout_for(cfg, tp, fused_layout)
    widths = _part_widths(cfg)
    perm_qkv = sharding.qkv_permutation(lay) if fused_layout else None
    perm_gu = sharding.gate_up_permutation(cfg.intermediate_size, tp) if fused_layout else None
    perms = {"qkv": perm_qkv, "qkv_bias": perm_qkv, "mlp/gate_up": perm_gu, "mlp/gate_up_bias": perm_gu}
    if fused_layout:
        sharding.set_layout(model, lay)
    top_by_path = {"/".join(path): (hf, how) for hf, (path, how) in top.items()}
    layer = _by_path(leaves)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = sharding.path_str(path)
        m = re.fullmatch(r"layers/(\d+)/(.+)", name)
        hf = how = None
        own = sliced(cfg, name, ck) if sliced is not None else None
        if own is not None:                    # a family's own reader (Qwen3-MoE's stacked experts)
            shape, block = own
            spec = sharding.spec_for(name, rules)
            sharding.check_divisible(name, shape, spec, mesh)
            var.set_value(jax.make_array_from_callback(shape, NamedSharding(mesh, spec), _dedup(block, dtype)))
            continue
        if name in top_by_path:
            hf, how = top_by_path[name]
        elif m and m.group(2) in layer:
            entry, base = layer[m.group(2)], f"{prefix}layers.{m.group(1)}."
            if entry[0] == "fused":
                hf = [(base + leaf, widths[part]) for leaf, part in zip(entry[1], entry[2])]
                how = ("fused", perms.get(m.group(2)))
            else:
                hf, how = base + entry[0], entry[1]
        if hf is None:
            raise ValueError(f"no checkpoint tensor is mapped to parameter {name!r}")
        shape = tuple(var.get_value().shape)
        if isinstance(how, tuple) and how[1] is not None:      # the fused layout's width (kv copies)
            shape = shape[:-1] + (len(how[1]),)
        spec = sharding.spec_for(name, rules)
        sharding.check_divisible(name, shape, spec, mesh)
        if isinstance(how, tuple):                                          # a fused [in, out] matrix or bias
            reader = _fused_reader(ck, hf, how[1])
            got = sum(n for _, n in hf) if how[1] is None else len(how[1])
            have = (got,) if len(shape) == 1 else (ck.shape(hf[0][0])[1], got)
            if have != shape:
                raise ValueError(f"{name}: checkpoint parts give {have}, config expects {shape}")
            if len(shape) == 1:
                block = lambda index, r=reader, w=shape[0]: r(None, index[0], w)
            else:
                block = lambda index, r=reader, w=shape[1]: r(index[0], index[1], w)
        else:
            hshape = ck.shape(hf) if hf in ck.names() else None
            want = shape[::-1] if how == "T" else shape
            if hshape != want:
                raise ValueError(f"{name}: checkpoint tensor {hf!r} has shape {hshape}, config expects {want}")
            if how == "T":
                block = lambda index, n=hf: ck.read(n, tuple(index[::-1])).T
            else:
                block = lambda index, n=hf: ck.read(n, tuple(index))
        var.set_value(jax.make_array_from_callback(shape, NamedSharding(mesh, spec), _dedup(block, dtype)))
    return model


def _dedup(block, dtype):
    """make_array_from_callback's callback: block(index) cast to dtype, replicas of one block (the
    data axis) read once."""
    cache: dict = {}

    def cb(index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
            cache[key] = np.asarray(block(index)).astype(dtype)
        return cache[key]
    return cb


def load_target_sharded(path: str, mesh, dtype="bfloat16", *, fused_layout: bool | None = None):
    """A target of a registered family whose parameters are built on `mesh` by its family's rules
    straight from the checkpoint's safetensors slices (each process reads only its devices' blocks)."""
    d = resolve_model_dir(path)
    cfg = models.read_config(read_json(d))
    fam = models.family(cfg.model_type)
    if fam.load is not None or (fam.tensors is not None and fam.sliced is None):
        raise ValueError(f"target {path}: model_type {cfg.model_type!r} is not read slice by slice "
                         "(load_target(..., mesh=) loads it whole and places it)")
    dt = dtype_of(dtype)
    model = nnx.eval_shape(lambda: fam.model(cfg, dt, rngs=nnx.Rngs(0)))
    return _load_sharded(d, model, mesh, dt, fam.top_weights(cfg), fam.layer_weights(cfg), "model.",
                         fused_layout, fam.rules, fam.sliced)


def load_draft_sharded(path: str, mesh, dtype="bfloat16", *, fused_layout: bool | None = None):
    """A draft on `mesh`, as load_target_sharded."""
    d = resolve_model_dir(path)
    raw = read_json(d)
    var = drafts.variant(raw.get("architectures"))
    cfg = drafts.read_config(raw)
    dt = dtype_of(dtype)
    model = nnx.eval_shape(lambda: var.model(cfg, dt, rngs=nnx.Rngs(0)))
    return _load_sharded(d, model, mesh, dt, dict(var.top_weights), var.layer_weights, "", fused_layout)
