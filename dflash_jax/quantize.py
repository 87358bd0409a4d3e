"""Quantized target weights (issue 57): int8 weight-only with per-output-channel symmetric scales,
computed at load from a floating-point checkpoint, and FP8 checkpoints (float8_e4m3fn weights with
128 x 128 block scales, Qwen's and DeepSeek's `quant_method: fp8`) kept in 8 bits as they come.

A quantized weight is an `Int8Weight` (q [.., K, N] int8, scale [.., N] float32) stored as the value
of the layer's nnx.Param in place of the float matrix, so the parameter dtypes (and with them every
compiled program's key) change with the choice, and no weight read can take the int8 values for
floats unnoticed: `linear` (models/layers.py) and `x @ w` dequantize, (x @ q) * scale; anything else
(a reshape, a Pallas kernel's operand) fails on the type or is routed to XLA by its caller.

Quantized: the linear weights of every decoder layer (attention qkv / o, the dense MLP's gate_up /
down, Qwen3.5's GDN in_proj / out and the shared expert's MLP) and the stacked MoE experts
(models/moe.py multiplies those on the XLA path). Kept as loaded: embeddings, the LM head, norms,
biases, the MoE router, the GDN conv and gates, and the draft (unless `quantize_draft`). On a mesh
each scale is placed with its weight's columns (sharding._place).

An FP8 checkpoint's layer linears and MoE experts become `Fp8BlockWeight`s (q float8_e4m3fn, the
checkpoint's block scales, both in our [in, out] orientation; experts stacked [E, in, out]); its
other tensors load as the checkpoint has them (one it quantized that we keep in floats, e.g. an
embedding, is dequantized at load). Why keep fp8 and not convert to int8 per output channel: the
model as run then IS the dequantized checkpoint (q * scale in float32, exactly what transformers'
dequantization computes), whereas int8 per output channel would round every weight a second time
(one scale per column across all its 128-row blocks, so a column whose blocks' scales differ loses
bits in its small blocks). A block scale varies along the contraction axis, so it cannot scale the
product the way a per-column int8 scale does: the matmul dequantizes the weight to x's dtype first,
inside the jitted program (a temporary of that program at most, never a stored float copy).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["QUANTIZE", "QUANTIZED", "Int8Weight", "Fp8BlockWeight", "Fp8W8A8Weight", "Fp8ChannelWeight", "W8A8_SCHEMES",
           "check_w8a8", "to_w8a8", "check_quantize", "quantize_int8", "quantize_target", "weight_bytes", "checkpoint_fp8_block", "fp8_weights", "concat_columns",
           "is_quantized", "is_fp8", "quantized_leaves", "mark", "quantize_draft"]

QUANTIZE = ("int8", "int8+head")   # "int8+head": the untied LM head too (a tied one stays as loaded)
# the decoder layers' parameter names that are the weight of a linear [in, out] (layers.DecoderLayer,
# layers.MLP, qwen3_5.GatedAttention / GatedDeltaNet)
LINEAR_NAMES = ("qkv", "o", "gate_up", "down", "in_proj", "out")
# the MoE block's stacked expert weights [E, in, out] (models/moe.MoE)
EXPERT_NAMES = ("experts_gate_up", "experts_down")


def check_quantize(quantize) -> str | None:
    """quantize as given (None: the weights as loaded), or a one-line ValueError naming the choices."""
    if quantize is None or quantize in QUANTIZE:
        return quantize
    raise ValueError(f"quantize={quantize!r} is not supported; supported: None, {', '.join(map(repr, QUANTIZE))}")


@jax.tree_util.register_pytree_node_class
class Int8Weight:
    """An int8 weight-only linear weight: w ≈ q * scale, q [K, N] int8, scale [N] float32 (one per
    output column). `w[...]` is itself (an nnx.Param read); `x @ w` and models.layers.linear give
    (x @ q) * scale in x's dtype."""

    def __init__(self, q, scale):
        self.q, self.scale = q, scale

    def tree_flatten(self):
        return (self.q, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self):
        return self.q.ndim

    @property
    def size(self):
        return self.q.size

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def sharding(self):
        """q's (its scales are placed with its columns: sharding._place), for sharding.mesh_of."""
        return getattr(self.q, "sharding", None)

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("an Int8Weight is read whole (w[...]); dequantize() for a float slice")

    def matmul(self, x, dot=operator.matmul):
        """x [..., K] @ w → [..., N] in x's dtype: the int8 matrix converted to x's dtype, the
        product (`dot`: models.layers.linear passes itself) scaled per output column in float32."""
        y = dot(x, self.q.astype(x.dtype))
        return (y.astype(jnp.float32) * self.scale).astype(x.dtype)

    def __rmatmul__(self, x):
        return self.matmul(x)

    def dequantize(self, dtype=jnp.float32):
        return (self.q.astype(jnp.float32) * self.scale[..., None, :]).astype(dtype)

    def __repr__(self):
        return f"Int8Weight(shape={tuple(self.shape)})"


@jax.tree_util.register_pytree_node_class
class Fp8BlockWeight:
    """An FP8 checkpoint's weight kept in 8 bits: w = q * scale over blocks, q [.., K, N]
    float8_e4m3fn, scale [.., ceil(K / bk), ceil(N / bn)] float32 (the checkpoint's
    weight_scale_inv, transposed with its weight), block (bk, bn) static (bn 1: one scale per column
    in each K block, what a fused matrix gets when its parts' widths are not multiples of bn).
    `w[...]` is itself; `x @ w` and models.layers.linear give x @ dequantize(x.dtype)."""

    def __init__(self, q, scale, block):
        self.q, self.scale, self.block = q, scale, tuple(int(b) for b in block)

    def tree_flatten(self):
        return (self.q, self.scale), self.block

    @classmethod
    def tree_unflatten(cls, block, children):
        return cls(*children, block)

    shape = Int8Weight.shape
    ndim = Int8Weight.ndim
    size = Int8Weight.size
    dtype = Int8Weight.dtype
    sharding = Int8Weight.sharding
    __getitem__ = Int8Weight.__getitem__

    @property
    def T(self):
        """The transpose (an HF [out, in] weight → ours [in, out]), scales and block with it."""
        return Fp8BlockWeight(self.q.T, self.scale.T, self.block[::-1])

    def column_scales(self):
        """scale [.., Kb, N]: each column's scale in every K block (bn = 1)."""
        bn, N = self.block[1], self.q.shape[-1]
        return jnp.repeat(self.scale, bn, axis=-1)[..., :N] if bn > 1 else self.scale

    def spread(self, axis: int) -> "Fp8BlockWeight":
        """The same weight with one scale per row (axis -2: block (1, bn)) or per column (axis -1:
        block (bk, 1)) on that axis: what a shard boundary or a column permutation that cuts through a
        block needs (sharding._place). The values (q * scale) are unchanged."""
        axis = axis % self.q.ndim - self.q.ndim
        if self.block[axis] == 1:
            return self
        if axis == -1:
            return Fp8BlockWeight(self.q, self.column_scales(), (self.block[0], 1))
        bk, K = self.block[0], self.q.shape[-2]
        return Fp8BlockWeight(self.q, jnp.repeat(self.scale, bk, axis=-2)[..., :K, :], (1, self.block[1]))

    def take_columns(self, cols) -> "Fp8BlockWeight":
        """w[..., cols] (a fused-layout permutation, kv columns repeated allowed): the block grid's
        columns taken whole when `cols` moves whole aligned blocks (each run of bn indices starts on a
        block boundary and is contiguous), else the scales spread per column first (block (bk, 1))."""
        cols = np.asarray(cols, np.int64)
        bn, N = self.block[1], self.q.shape[-1]
        q = jnp.take(self.q, cols, axis=-1)
        if bn > 1 and N % bn == 0 and cols.size % bn == 0:
            runs = cols.reshape(-1, bn)
            if (runs[:, 0] % bn == 0).all() and (runs == runs[:, :1] + np.arange(bn)).all():
                return Fp8BlockWeight(q, jnp.take(self.scale, runs[:, 0] // bn, axis=-1), self.block)
        w = self.spread(-1)
        return Fp8BlockWeight(q, jnp.take(w.scale, cols, axis=-1), w.block)

    def dequantize(self, dtype=jnp.float32):
        """q * scale in float32 (transformers' dequantization, the same rounding), cast to dtype."""
        bk, K = self.block[0], self.q.shape[-2]
        s = jnp.repeat(self.column_scales(), bk, axis=-2)[..., :K, :]                   # [.., K, N]
        return (self.q.astype(jnp.float32) * s).astype(dtype)

    def matmul(self, x, dot=operator.matmul):
        """x [..., K] @ w → [..., N]: the weight dequantized to x's dtype, then the dot (the block
        scales vary along K, so they cannot scale the product afterwards as int8's do)."""
        return dot(x, self.dequantize(x.dtype))

    def __rmatmul__(self, x):
        return self.matmul(x)

    def all_finite(self) -> bool:
        return bool(jnp.isfinite(self.q).all()) and bool(jnp.isfinite(self.scale).all())

    def __repr__(self):
        return f"Fp8BlockWeight(shape={tuple(self.shape)}, block={self.block})"


@jax.tree_util.register_pytree_node_class
class Fp8W8A8Weight:
    """An FP8 checkpoint's 2-D linear weight run W8A8 (`to_w8a8`, `load_target(..., w8a8=True)`): the
    activations quantized at run time to float8_e4m3fn per row and K block (the scheme the
    checkpoint declares, `activation_scheme: dynamic`) and the matmul fp8 x fp8 with float32
    accumulation, each K block's product times x's and the weight's block scales
    (pallas_kernels.quantized.gpu_w8a8). q [N, K] float8_e4m3fn and scale [Nb, Kb] float32 are kept
    in the checkpoint's own [out, in] orientation: both fp8 operands K-major, what the H100's fp8
    tensor cores read (the [K, N] layout loses most of the gain over bf16). block is (bk, bn) = (K
    block, N block) as Fp8BlockWeight's; `shape` is the
    logical [K, N] of the weight it replaces. `x @ w` and models.layers.linear give the W8A8 product."""

    __init__ = Fp8BlockWeight.__init__
    tree_flatten = Fp8BlockWeight.tree_flatten
    tree_unflatten = classmethod(Fp8BlockWeight.tree_unflatten.__func__)

    @property
    def shape(self):
        return tuple(self.q.shape[::-1])

    ndim = Int8Weight.ndim
    size = Int8Weight.size
    dtype = Int8Weight.dtype
    sharding = Int8Weight.sharding
    __getitem__ = Int8Weight.__getitem__

    def kn(self) -> Fp8BlockWeight:
        """The same weight as an Fp8BlockWeight ([K, N], the weight-only form)."""
        return Fp8BlockWeight(_transpose(self.q), _transpose(self.scale), self.block)

    def matmul(self, x, dot=None):
        """x [..., K] @ w → [..., N] in x's dtype, W8A8: through XLA's fp8 dot at up to
        gpu_w8a8.MAX_ROWS rows (models.layers.linear runs the Pallas kernel instead where it is
        faster: CUDA, 2-128 rows). Beyond them (a prefill, a verify of more than 8 rows of a block
        of 16), off TPU, the same quantized operands dequantized to x's dtype and one dot: the fp8
        dot's [K blocks, rows, N] float32 partials made a 512-token prefill 4x bf16's on an H200
        and cost 9x the dequantized dot on CPU; TPU's compiler counts fewer bytes for its own fp8
        dots there (it emulates them), so TPU keeps them."""
        from pallas_kernels.quantized import gpu_w8a8
        xla = functools.partial(gpu_w8a8.matmul_xla, block=self.block, layout="nk")
        if math.prod(x.shape[:-1]) <= gpu_w8a8.MAX_ROWS:
            return xla(x, self.q, self.scale)
        return jax.lax.platform_dependent(x, self.q, self.scale, tpu=xla,
                                          default=functools.partial(gpu_w8a8.matmul_dequant, block=self.block,
                                                                            layout="nk"))

    def __rmatmul__(self, x):
        return self.matmul(x)

    def dequantize(self, dtype=jnp.float32):
        """The weight [K, N] (q * scale in float32, cast to dtype): Fp8BlockWeight's."""
        return self.kn().dequantize(dtype)

    all_finite = Fp8BlockWeight.all_finite      # (q and scale as stored: no transpose needed)

    def __repr__(self):
        return f"Fp8W8A8Weight(shape={tuple(self.shape)}, block={self.block})"


@jax.tree_util.register_pytree_node_class
class Fp8ChannelWeight:
    """An FP8 checkpoint's 2-D linear weight requantized to one scale per output channel and run W8A8
    with one activation scale per row (`to_w8a8(model, "channel")`, `--w8a8 channel`; the FP8-dynamic
    scheme of vLLM / llm-compressor): q [N, K] float8_e4m3fn (K-major, as cuBLASLt's fp8 GEMM reads
    both operands), scale [N] float32. With the scales outside the K loop the product is one fp8 x fp8
    dot with float32 output, scaled after it (pallas_kernels.quantized.gpu_w8a8.matmul_channel): on an
    H100 36 layers' matmuls ran 0.72-0.78x bf16's time at 16-512 rows, where the block-scaled form
    loses to bf16 beyond 16 (1.71x at 128, 2.04x at 512). Its numerics are its own: every weight is
    rounded a second time (e4m3 keeps each block's relative precision while a row's block scales span
    less than ~2^8) and x has one scale per row, not per 128 columns. `shape` is the logical [K, N]."""

    def __init__(self, q, scale):
        self.q, self.scale = q, scale

    tree_flatten = Int8Weight.tree_flatten
    tree_unflatten = classmethod(Int8Weight.tree_unflatten.__func__)

    @property
    def shape(self):
        return tuple(self.q.shape[::-1])

    ndim = Int8Weight.ndim
    size = Int8Weight.size
    dtype = Int8Weight.dtype
    sharding = Int8Weight.sharding
    __getitem__ = Int8Weight.__getitem__

    @classmethod
    def from_kn(cls, q_kn, scale) -> "Fp8ChannelWeight":
        """From q in the [K, N] orientation (a placed one: its sharding transposed with it) and scale [N]."""
        return cls(_transpose(q_kn), scale)

    @classmethod
    def from_block(cls, w: "Fp8W8A8Weight") -> "Fp8ChannelWeight":
        from pallas_kernels.quantized import gpu_w8a8
        return cls(*gpu_w8a8.requantize_channels(w.q, w.scale, w.block))

    def matmul(self, x, dot=None):
        """x [..., K] @ w → [..., N] in x's dtype: x quantized to e4m3 per row, one fp8 dot, both scales."""
        from pallas_kernels.quantized import gpu_w8a8
        return gpu_w8a8.matmul_channel(x, self.q, self.scale)

    def __rmatmul__(self, x):
        return self.matmul(x)

    def dequantize(self, dtype=jnp.float32):
        """The weight [K, N]: q * scale in float32, cast to dtype."""
        return (self.q.astype(jnp.float32) * self.scale[:, None]).T.astype(dtype)

    def all_finite(self) -> bool:
        return bool(jnp.isfinite(self.q.astype(jnp.float32)).all()) and bool(jnp.isfinite(self.scale).all())

    def __repr__(self):
        return f"Fp8ChannelWeight(shape={tuple(self.shape)})"


QUANTIZED = (Int8Weight, Fp8BlockWeight, Fp8W8A8Weight, Fp8ChannelWeight)
W8A8_SCHEMES = ("block", "channel")   # to_w8a8's: the checkpoint's K blocks, or one scale per output channel

W8A8_BLOCKS = (32, 64, 128)   # the K blocks W8A8 takes (the activation groups; the kernels' bk)


def _transpose(a):
    """a.T, a placed array's sharding transposed with it (a mesh keeps each shard's own blocks)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    s = getattr(a, "sharding", None)
    t = a.T
    if isinstance(s, NamedSharding):
        spec = tuple(s.spec) + (None,) * (a.ndim - len(s.spec))
        t = jax.device_put(t, NamedSharding(s.mesh, P(*spec[::-1])))
    return t


def w8a8_weight(name: str, w: Fp8BlockWeight) -> Fp8W8A8Weight:
    """One 2-D Fp8BlockWeight → Fp8W8A8Weight, or a one-line ValueError naming it when its K blocking
    cannot group the activations (K not a multiple of the K block, a K block outside W8A8_BLOCKS:
    e.g. one spread per row where a mesh shard boundary cut through a block)."""
    bk, K = w.block[0], w.shape[0]
    if bk not in W8A8_BLOCKS or K % bk:
        raise ValueError(f"w8a8: {name} {list(w.shape)} has K block {bk} (K = {K}); W8A8 quantizes the "
                         f"activations per K block and needs K a multiple of a block in {list(W8A8_BLOCKS)}")
    return Fp8W8A8Weight(_transpose(w.q), _transpose(w.scale), w.block)


def check_w8a8(scheme) -> str:
    """scheme as given, or a one-line ValueError naming the W8A8 schemes."""
    if scheme not in W8A8_SCHEMES:
        raise ValueError(f"w8a8={scheme!r} is not a W8A8 scheme; supported: {', '.join(map(repr, W8A8_SCHEMES))}")
    return scheme


def to_w8a8(model, scheme: str = "block"):
    """The target with its FP8 checkpoint's 2-D layer linears (LINEAR_NAMES) turned W8A8 in place
    (Fp8W8A8Weight: one transpose each, at load); MoE experts keep their weight-only path (the
    grouped-matmul kernels read [E, K, N] fp8) and float weights stay as they are. The module is
    marked "w8a8" (its compile keys change with it: the numerics do). scheme "channel": each such
    weight requantized to one scale per output channel instead (Fp8ChannelWeight, marked
    "w8a8-channel"; on one device, placed after: sharding._place). A target without FP8 block weights, or one whose K
    blocking cannot group the activations, is a one-line ValueError. Returns the model."""
    check_w8a8(scheme)
    found = []
    for path, node in nnx.iter_graph(model.layers):
        if not isinstance(node, nnx.Module):
            continue
        for name in LINEAR_NAMES:
            p = getattr(node, name, None)
            if isinstance(p, nnx.Param) and isinstance(p.get_value(), Fp8BlockWeight) and p.get_value().ndim == 2:
                found.append(("layers/" + "/".join(map(str, path)) + "/" + name, p))
    if not found:
        raise ValueError("w8a8 needs an FP8 checkpoint (config.json quantization_config quant_method 'fp8'): "
                         "this target has no FP8 block-scaled layer weights")
    if scheme == "block":   # (all checked before any is set)
        converted = [(p, w8a8_weight(name, p.get_value())) for name, p in found]
    else:                   # (per channel: any K blocking, a ragged last block included)
        converted = [(p, Fp8W8A8Weight(_transpose(p.get_value().q), _transpose(p.get_value().scale),
                                       p.get_value().block)) for _, p in found]
    if scheme == "channel":
        spread = [name for name, p in found if len(getattr(getattr(p.get_value().q, "sharding", None),
                                                           "device_set", ())) > 1]
        if spread:   # (load_target(mesh=, w8a8="channel") requantizes on one device, then places)
            raise ValueError(f"w8a8='channel' requantizes on one device: {spread[0]} is already placed on a "
                             "mesh (convert before placing: sharding.shard_model places the result)")
        converted = [(p, Fp8ChannelWeight.from_block(w)) for p, w in converted]
    for p, w in converted:
        p.set_value(w)
    return mark(model, "w8a8" if scheme == "block" else "w8a8-channel")


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED)


def concat_columns(parts: list) -> Fp8BlockWeight:
    """Fp8BlockWeights [K, N_i] of one K blocking side by side → [K, sum N_i] (a fused qkv /
    gate_up): the block grids concatenate when every part but the last ends on a block boundary,
    else each part's scales are spread per column (bn = 1) first."""
    bk = {p.block[0] for p in parts}
    if len(bk) != 1 or len({p.q.shape[-2] for p in parts}) != 1:
        raise ValueError(f"fused parts of different K blockings: {parts}")
    bn = parts[0].block[1]
    aligned = all(p.block[1] == bn for p in parts) and all(p.q.shape[-1] % bn == 0 for p in parts[:-1])
    q = jnp.concatenate([p.q for p in parts], axis=-1)
    if aligned:
        return Fp8BlockWeight(q, jnp.concatenate([p.scale for p in parts], axis=-1), (bk.pop(), bn))
    return Fp8BlockWeight(q, jnp.concatenate([p.column_scales() for p in parts], axis=-1), (bk.pop(), 1))


# ------------------------------------------------------------------------------- FP8 checkpoints

FP8_NOTE = ("supported: quant_method 'fp8' with weight_block_size [n, k] (float8_e4m3fn weights and "
            "float32 weight_scale_inv, e.g. Qwen3-*-FP8), or no quantization_config")
_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz")


def checkpoint_fp8_block(raw, what: str) -> tuple[int, int] | None:
    """The FP8 block [n (output rows), k (input columns)] of a config.json dict's
    `quantization_config`, None without one; anything else is a one-line ValueError naming the field
    and what is supported."""
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{what}: config.json quantization_config={qc!r} is not an object; {FP8_NOTE}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{what}: config.json quantization_config.quant_method={method!r} is not supported; {FP8_NOTE}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{what}: config.json quantization_config.fmt={fmt!r} is not supported; {FP8_NOTE}")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":   # static: per-tensor input scales we would ignore (weight-only here)
        raise ValueError(f"{what}: config.json quantization_config.activation_scheme={act!r} is not supported "
                         "(only 'dynamic': the activations stay in the model dtype, or are quantized at run time "
                         "with w8a8=True / --w8a8)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{what}: config.json quantization_config.weight_block_size={block!r} must be two "
                         f"positive integers; {FP8_NOTE}")
    return int(block[0]), int(block[1])


def is_fp8(t) -> bool:
    """A float8 array (a weight an FP8 checkpoint stores; only with its scales is it a weight)."""
    return jnp.dtype(t.dtype).name in _FP8_DTYPES


def quantized_leaves(model) -> list:
    """The module's quantized weights (Int8Weight, Fp8BlockWeight, Fp8W8A8Weight)."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param), is_leaf=is_quantized)
    return [v for v in leaves if is_quantized(v)]


def _fp8_weight(name: str, w, s, block, what: str) -> Fp8BlockWeight:
    """One checkpoint weight [out, in] float8_e4m3fn and its weight_scale_inv [ceil(out / n),
    ceil(in / k)] → Fp8BlockWeight in the checkpoint's [out, in] orientation; a wrong dtype or shape
    is a one-line ValueError naming the tensor."""
    if jnp.dtype(w.dtype).name != "float8_e4m3fn":
        raise ValueError(f"{what}: tensor {name} has dtype {jnp.dtype(w.dtype).name}; an fp8 checkpoint's "
                         "quantized weights must be float8_e4m3fn")
    if w.ndim != 2:
        raise ValueError(f"{what}: tensor {name} is float8 with shape {tuple(w.shape)}; only 2-D [out, in] "
                         "weights are read in fp8")
    want = tuple(math.ceil(d / b) for d, b in zip(w.shape, block))
    if tuple(s.shape) != want:
        raise ValueError(f"{what}: tensor {name}_scale_inv has shape {tuple(s.shape)}; weight {name} "
                         f"{tuple(w.shape)} in blocks of {list(block)} needs {want}")
    if not jnp.issubdtype(s.dtype, jnp.floating) or is_fp8(s):
        raise ValueError(f"{what}: tensor {name}_scale_inv has dtype {jnp.dtype(s.dtype).name}; "
                         "scales must be float32 / bfloat16 / float16")
    return Fp8BlockWeight(jnp.asarray(w), jnp.asarray(s, jnp.float32), block)


def fp8_weights(named_tensors, block, what: str):
    """A checkpoint's (name, array) stream with each float8 `X.weight` and its `X.weight_scale_inv`
    paired into one (X.weight, Fp8BlockWeight [out, in]) (in whichever order they come); other
    tensors pass as they are. A float8 weight without its scale, or a scale without a float8 weight,
    is a one-line ValueError naming it."""
    weights, scales = {}, {}
    for name, t in named_tensors:
        if name.endswith(".weight_scale_inv"):
            base = name[:-len("_scale_inv")]
            if base in weights:
                yield base, _fp8_weight(base, weights.pop(base), t, block, what)
            else:
                scales[base] = t
        elif is_fp8(t):
            if name in scales:
                yield name, _fp8_weight(name, t, scales.pop(name), block, what)
            else:
                weights[name] = t
        elif name in scales:
            raise ValueError(f"{what}: tensor {name} has dtype {jnp.dtype(t.dtype).name} but the checkpoint has "
                             f"{name}_scale_inv; a weight with a block scale must be float8_e4m3fn")
        else:
            yield name, t
    for name in sorted(weights):
        raise ValueError(f"{what}: tensor {name} is float8 but the checkpoint has no {name}_scale_inv "
                         "(its block scales)")
    for base in sorted(scales):
        raise ValueError(f"{what}: tensor {base}_scale_inv has no weight {base} in the checkpoint")


def quantize_int8(w) -> Int8Weight:
    """w [K, N] float → Int8Weight: scale = max |w[:, n]| / 127 per column n (1 for an all-zero
    column), q = round(w / scale) in [-127, 127]."""
    wf = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)                                            # [N]
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return Int8Weight(q, scale)


def mark(model, quantize: str):
    """Record on the module what its weights hold ("int8", "fp8", "fp8+int8"): a static attribute,
    part of the module's GraphDef, so of every compile key that holds it (loop.Static.target_def);
    the quantized leaves alone live in the state, which the keys do not see."""
    prior = getattr(model, "quantize", None)
    model.quantize = quantize if prior in (None, quantize) else f"{prior}+{quantize}"
    return model


def quantize_target(model, quantize):
    """The target with its layers' linear weights and MoE experts quantized in place (`quantize`:
    None → unchanged; weights already in 8 bits, an FP8 checkpoint's, are kept); returns the model."""
    if check_quantize(quantize) is None:
        return model
    mark(model, quantize)
    head = getattr(model, "lm_head", None)
    if quantize == "int8+head" and isinstance(head, nnx.Param) and not is_quantized(head.get_value()):
        head.set_value(quantize_int8(head.get_value()))        # [H, V]: one scale per vocabulary entry
    for _, node in nnx.iter_graph(model.layers):
        if not isinstance(node, nnx.Module):
            continue
        for name, ndim in [(n, 2) for n in LINEAR_NAMES] + [(n, 3) for n in EXPERT_NAMES]:
            p = getattr(node, name, None)
            if isinstance(p, nnx.Param) and not is_quantized(p.get_value()) and p.get_value().ndim == ndim:
                p.set_value(quantize_int8(p.get_value()))
    return model


def quantize_draft(draft, quantize):
    """The draft's layer linears quantized in place as quantize_target's (`quantize`: None →
    unchanged, the default everywhere: the draft's acceptance is the product, and an int8 draft
    costs some of it; the measured tau, CPU test pairs: docs/perf-log.md, 'FP8 checkpoints and the
    rest of int8')."""
    return quantize_target(draft, quantize)


def weight_bytes(model) -> int:
    """Bytes of the module's parameters as stored (int8 matrices and their scales included)."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves)
