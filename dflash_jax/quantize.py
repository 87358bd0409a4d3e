"""Weight-only int8 quantization of a target (issue 57, first slice): per-output-channel symmetric
scales, computed at load from the checkpoint's floating-point weights.

A quantized weight is an `Int8Weight` (q [.., K, N] int8, scale [.., N] float32) stored as the value
of the layer's nnx.Param in place of the float matrix, so the parameter dtypes (and with them every
compiled program's key) change with the choice, and no weight read can take the int8 values for
floats unnoticed: `linear` (models/layers.py) and `x @ w` dequantize, (x @ q) * scale; anything else
(a reshape, a Pallas kernel's operand) fails on the type or is routed to XLA by its caller.

Quantized: the linear weights of every decoder layer (attention qkv / o, the dense MLP's gate_up /
down, Qwen3.5's GDN in_proj / out and the shared expert's MLP). Kept as loaded: embeddings, the LM
head, norms, biases, the MoE router and the stacked MoE experts (the grouped-matmul kernels read
those; a later slice), the GDN conv and gates, and the whole draft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["QUANTIZE", "Int8Weight", "check_quantize", "quantize_int8", "quantize_target", "weight_bytes"]

QUANTIZE = ("int8",)
# the decoder layers' parameter names that are the weight of a linear [in, out] (layers.DecoderLayer,
# layers.MLP, qwen3_5.GatedAttention / GatedDeltaNet)
LINEAR_NAMES = ("qkv", "o", "gate_up", "down", "in_proj", "out")


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

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("an Int8Weight is read whole (w[...]); dequantize() for a float slice")

    def matmul(self, x):
        """x [..., K] @ w → [..., N] in x's dtype: the int8 matrix converted to x's dtype, the
        product scaled per output column in float32."""
        y = x @ self.q.astype(x.dtype)
        return (y.astype(jnp.float32) * self.scale).astype(x.dtype)

    def __rmatmul__(self, x):
        return self.matmul(x)

    def dequantize(self, dtype=jnp.float32):
        return (self.q.astype(jnp.float32) * self.scale[..., None, :]).astype(dtype)

    def __repr__(self):
        return f"Int8Weight(shape={tuple(self.shape)})"


def quantize_int8(w) -> Int8Weight:
    """w [K, N] float → Int8Weight: scale = max |w[:, n]| / 127 per column n (1 for an all-zero
    column), q = round(w / scale) in [-127, 127]."""
    wf = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)                                            # [N]
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return Int8Weight(q, scale)


def quantize_target(model, quantize):
    """The target with its layers' linear weights quantized in place (`quantize`: None → unchanged);
    returns the model."""
    if check_quantize(quantize) is None:
        return model
    # a static attribute: part of the module's GraphDef, so of every compile key that holds it
    # (loop.Static.target_def); the int8 leaves alone live in the state, which the keys do not see
    model.quantize = quantize
    for _, node in nnx.iter_graph(model.layers):
        if not isinstance(node, nnx.Module):
            continue
        for name in LINEAR_NAMES:
            p = getattr(node, name, None)
            if isinstance(p, nnx.Param) and not isinstance(p.get_value(), Int8Weight) and p.get_value().ndim == 2:
                p.set_value(quantize_int8(p.get_value()))
    return model


def weight_bytes(model) -> int:
    """Bytes of the module's parameters as stored (int8 matrices and their scales included)."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves)
