"""The layers shared by every target family and the DFlash draft: RMSNorm, RoPE (default and
llama3 scaling), SwiGLU MLP (optional biases), and a decoder layer (q/k norm and attention biases
per family) whose attention writes its K/V into a fixed-capacity cache before attending.

A layer call picks one function per kernel path for each half, once: the attention half
(`attend_xla`, `attend_gpu_fused`, `attend_tpu`) and the MLP half (`finish_xla`, which runs the
TPU MLP kernel where it applies, and `finish_gpu_fused`); each returns the same shapes, and a
layer hands the next one `Residual`. `run_layers` is the one layer loop of targets and drafts.

Weight layout (chosen for decode speed, see docs/perf-log.md):
  - one buffer per layer (no stacked [L, ...] weights: slicing them in a loop measured slower on GPU);
  - q/k/v fused into one [H, (Hq + 2 Hkv) D] matrix and gate/up into one [H, 2 I] matrix, stored
    [in, out] so activations multiply from the left without transposes.
The draft reuses `DecoderLayer` unchanged: its context tokens go through the same fused projection
(only their K/V are kept), so one weight read serves both the context and the block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.attention import (add_rmsnorm, attend, attend_paged, attend_prefill, fused_add_norm,
                                  fused_prologue, qk_norm_rope_write, reads_pages)
from dflash_jax.cache import TPU_WRITE_PATHS, KVCache, is_paged, write_kv_rows
from dflash_jax.kernel_config import TPU_PATHS, KernelConfig
from dflash_jax.quantize import QUANTIZED, Fp8ChannelWeight, Fp8W8A8Weight, Int8Weight
from dflash_jax.sharding import current_mesh, split_gate_up, split_qkv
from pallas_kernels.quantized import gpu as quantized_gpu
from pallas_kernels.quantized import gpu_w8a8


# XLA:GPU rewrites a vector x matrix dot whose operands hold fewer than this many elements as a
# multiply and a reduce (GpuAlgebraicSimplifier's dot strength reduction); the multiply writes the
# weight-sized [K, N] product to HBM and the reduce reads it back along K. At one row (a B = 1 decode
# step) that catches every projection under 10M weights: on the H200 Coder-30B-A3B's 4096 x 2048
# o-projection ran as 11.0 + 17.4 us, and the 12-layer B = 1 plain step took 1.397 ms against 1.063
# with a zero second row (docs/perf-log.md, 'one-row projections').
SMALL_DOT = 10_000_000


def _two_rows(x, w):
    """x [..., K] of one row @ w [K, N] as a two-row dot (the row and a zero row), the second row
    dropped: a matrix x matrix dot, which XLA:GPU leaves to its GEMM emitters."""
    x2 = x.reshape(1, -1)
    y = jnp.concatenate([x2, jnp.zeros_like(x2)]) @ w                                    # [2, N]
    return y[:1].reshape(*x.shape[:-1], w.shape[1])


def _quantized_block(w):
    """The scales' block of a quantized 2-D weight for the GPU kernel: None (int8, per column) or
    the FP8 checkpoint's (bk, bn)."""
    return w.block if hasattr(w, "block") else None


def _quantized_kernel_applies(x, w) -> bool:
    M = math.prod(x.shape[:-1])
    return (w.ndim == 2 and current_mesh() is None
            and quantized_gpu.worthwhile(M, x.shape[-1], w.shape[1], x.dtype, _quantized_block(w)))


def _quantized_gpu(x, w):
    return quantized_gpu.matmul(x, w.q, w.scale, block=_quantized_block(w))


# the W8A8 kernel's tiling on the model path up to W8A8_FUSED_ROWS rows: 64-column tiles (the H100
# sweep's best for qkv and gate_up at 16 rows), the K block per step (x quantized in the kernel), K
# split as gpu_w8a8.tiles. Beyond, x is quantized by XLA before the kernel and the kernel runs its
# default tiling: every program of the fused form quantizes all of x again, which at 128 rows (a B = 8
# verify) cost 2.1x the unfused form per layer on an H100 (docs/perf-log.md).
W8A8_BN = 64
W8A8_FUSED_ROWS = 16


def _w8a8_kernel_tiles(x, w) -> tuple[int, int] | None:
    """(bn, splits) of the fused W8A8 Pallas kernel for x @ w (an Fp8W8A8Weight), or None where XLA's
    fp8 dot runs: one row (faster there: 0.684x bf16 per layer against 0.711x), a mesh, more than
    gpu_w8a8.MAX_ROWS rows, or a shape the kernel does not tile."""
    M, (K, N), (bk, bn_s) = math.prod(x.shape[:-1]), w.shape, w.block
    if not 2 <= M <= gpu_w8a8.MAX_ROWS or current_mesh() is not None or N % W8A8_BN or bn_s % W8A8_BN or K % bk:
        return None
    splits = 1
    while splits < 8 and (N // W8A8_BN) * splits < 384 and K % (bk * splits * 2) == 0:
        splits *= 2
    return W8A8_BN, splits


def _w8a8_gpu(x, w):
    if math.prod(x.shape[:-1]) > W8A8_FUSED_ROWS:
        return gpu_w8a8.matmul_pallas(x, w.q, w.scale, block=w.block, layout="nk", bm=64)
    bn, splits = _w8a8_kernel_tiles(x, w)
    return gpu_w8a8.matmul_pallas(x, w.q, w.scale, block=w.block, layout="nk", bn=bn, bk=w.block[0],
                                  splits=splits, fuse_quant=True)


def linear(x, w):
    """x [..., K] @ w [K, N]. On CUDA, a single row times a matrix of fewer than SMALL_DOT
    elements runs as a two-row dot (`_two_rows`) so XLA does not rewrite it as a multiply + reduce;
    the same value (the zero row adds nothing), any other shape or platform the plain dot. A
    quantized weight (dflash_jax.quantize: int8, an FP8 checkpoint's): its own matmul around this
    dot (int8: the matrix converted to x's dtype, then its per-column scale); on CUDA, off a mesh,
    where `pallas_kernels.quantized.gpu.worthwhile` says the Pallas kernel that reads the 8-bit
    weight once beats that (FP8 blocks at up to 128 rows, large int8 matrices at one row). An FP8
    weight run W8A8 (quantize.Fp8W8A8Weight): XLA's fp8 dot at one row, on CUDA off a mesh the
    Pallas kernel at 2-128 rows (x quantized in its prologue up to W8A8_FUSED_ROWS rows, by XLA before
    it beyond: the faster of each on an H100), beyond 128 rows the quantized operands dequantized and
    one dot (Fp8W8A8Weight.matmul). Requantized per output channel (quantize.Fp8ChannelWeight): one fp8
    dot at every row count, its scales after it."""
    if isinstance(w, Fp8ChannelWeight):
        return w.matmul(x)
    if isinstance(w, Fp8W8A8Weight):
        if _w8a8_kernel_tiles(x, w) is not None:
            return jax.lax.platform_dependent(x, w, cuda=_w8a8_gpu, default=lambda x, w: w.matmul(x))
        return w.matmul(x)
    if isinstance(w, QUANTIZED):
        if _quantized_kernel_applies(x, w):
            return jax.lax.platform_dependent(x, w, cuda=_quantized_gpu, default=lambda x, w: w.matmul(x, dot=linear))
        return w.matmul(x, dot=linear)
    if math.prod(x.shape[:-1]) != 1 or w.ndim != 2 or w.shape[1] == 1 or x.shape[-1] + w.size >= SMALL_DOT:
        return x @ w
    return jax.lax.platform_dependent(x, w, cuda=_two_rows, default=lambda x, w: x @ w)


def init_param(rngs: nnx.Rngs, shape, dtype, scale: float):
    """A parameter of `shape` drawn from N(0, scale^2) (random weights: tests, benchmarks)."""
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        # As HF Qwen3RMSNorm: normalise in float32, cast back, then scale.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)

    def scaled(self, x, scale: "RowScale"):
        """The norm of x given its rows' scale (computed where x was made, with this eps): the
        same ops without the reduction, so XLA fuses it into the matmul that reads it."""
        if scale.eps != self.eps:
            return self(x)
        return self.weight[...] * (x.astype(jnp.float32) * scale.r).astype(x.dtype)


class RowScale(NamedTuple):
    """rsqrt(mean(x²) + eps) [B, T, 1] float32 of a layer output x's rows, made by the TPU MLP
    kernel with x: the next RMSNorm (RMSNorm.scaled) then reads x once, inside its matmul."""
    r: jax.Array
    eps: float


def inv_frequencies(D: int, theta: float, scaling=None):
    """The rotary inverse frequencies [D/2] float32: theta^(-2i/D), then, with a `rope_type: llama3`
    scaling (config.RopeScaling), HF's llama3 rule: wavelengths 2π/f above original / low_freq_factor
    divided by `factor`, those below original / high_freq_factor kept, the band between smoothly
    interpolated."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))      # [D/2]
    if scaling is None:
        return inv_freq
    old, lo, hi, factor = (scaling.original_max_position_embeddings, scaling.low_freq_factor,
                           scaling.high_freq_factor, scaling.factor)
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions, D: int, theta: float, scaling=None):
    """cos, sin [B, T, D/2] float32 of the rotary angles at positions [B, T] (scaling: a llama3
    RopeScaling or None)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_frequencies(D, theta, scaling)  # [B, T, D/2]
    return jnp.cos(ang), jnp.sin(ang)


def rope(x, positions, theta: float, scaling=None):
    """Rotary embedding, HF `rotate_half` convention. x [B, T, N, D], positions [B, T] int32."""
    cos, sin = rope_tables(positions, x.shape[-1], theta, scaling)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _interpret(kernels: KernelConfig):
    """The `interpret` argument of a Pallas TPU kernel on this path (the interpreter in CPU tests)."""
    if not kernels.interpret:
        return False
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()


def add_norm(x, y, norm: RMSNorm, kernels: KernelConfig):
    """(x + y, norm(x + y)): one Pallas kernel on the fused GPU path (attention.fused_add_norm),
    else the XLA ops; the same numbers either way."""
    if fused_add_norm(kernels, x.shape[1], x.shape[-1]) and x.dtype == y.dtype:
        return add_rmsnorm(x, y, norm.weight[...], norm.eps, kernels)
    x = x + y
    return x, norm(x)


class MLP(nnx.Module):
    """The MLP's weights: down(gated_silu(x @ gate_up + gate_up_bias)) + down_bias (biases: the
    Llama family's mlp_bias; None elsewhere)."""
    def __init__(self, hidden: int, inter: int, dtype, rngs: nnx.Rngs, bias: bool = False):
        self.gate_up = init_param(rngs, (hidden, 2 * inter), dtype, hidden ** -0.5)     # [H, 2I]
        self.down = init_param(rngs, (inter, hidden), dtype, inter ** -0.5)             # [I, H]
        self.gate_up_bias = nnx.Param(jnp.zeros((2 * inter,), dtype)) if bias else None   # [2I]
        self.down_bias = nnx.Param(jnp.zeros((hidden,), dtype)) if bias else None         # [H]

    def __call__(self, h, groups: int = 1, kernels: KernelConfig | None = None):
        """The MLP of already-normed rows h [..., H] (gate_up in the fused layout of `groups`;
        kernels: unused here, the MoE block's grouped matmul reads it)."""
        y = linear(gated_silu(_bias(linear(h, self.gate_up[...]), self.gate_up_bias), groups), self.down[...])
        return _bias(y, self.down_bias)


def _bias(y, b):
    """y + b, or y where the layer has no such bias."""
    return y if b is None else y + b[...]


def gated_silu(y, groups: int = 1):
    """silu(gate) * up for y = [gate | up] on its last axis, or in the fused layout of `groups`
    tensor-parallel shards ([gate_0 | up_0 | gate_1 | up_1 | ...], dflash_jax.sharding), where the
    split is local to each shard."""
    gate, up = split_gate_up(y, groups)
    return jax.nn.silu(gate) * up


class DecoderLayer(nnx.Module):
    """Pre-norm attention + SwiGLU MLP with GQA: Qwen3 style (q_norm / k_norm before RoPE) by
    default; qk_norm=False and the bias flags give the Llama layer. RoPE (theta, llama3 scaling)
    from cfg."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, *, qk_norm: bool = True, attention_bias: bool = False,
                 mlp_bias: bool = False, mlp: nnx.Module | None = None):
        """mlp: the MLP block (default: the dense SwiGLU MLP of cfg.intermediate_size); another
        block (the MoE block) is called the same way: mlp(h [B, T, H], groups, kernels) -> [B, T, H]."""
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        # Tensor parallelism: qkv / gate_up in the fused layout of this many shards (each shard's
        # contiguous columns are its own q, k, v heads), and num_kv_heads the layout's (kv heads
        # copied when the model has fewer than the shards). sharding.shard_model and the sharded
        # loaders set both; 1 is the plain [q | k | v] layout.
        self.qkv_groups = 1
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = getattr(cfg, "rope_scaling", None)
        W = (cfg.num_heads + 2 * cfg.num_kv_heads) * D
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.qkv = init_param(rngs, (H, W), dtype, H ** -0.5)
        self.qkv_bias = nnx.Param(jnp.zeros((W,), dtype)) if attention_bias else None   # [W], qkv's layout
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.o = init_param(rngs, (cfg.num_heads * D, H), dtype, (cfg.num_heads * D) ** -0.5)
        self.o_bias = nnx.Param(jnp.zeros((H,), dtype)) if attention_bias else None
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(H, cfg.intermediate_size, dtype, rngs, bias=mlp_bias) if mlp is None else mlp

    def _rope_tables(self, positions):
        return rope_tables(positions, self.head_dim, self.rope_theta, self.rope_scaling)

    def _rope(self, x, positions, norm):
        """RoPE of x [B, T, N, D] at positions, after `norm` (q_norm / k_norm; None: the Llama layer)."""
        return rope(x if norm is None else norm(x), positions, self.rope_theta, self.rope_scaling)

    def _project(self, h):
        """The fused projection h @ qkv (+ its bias)."""
        return _bias(linear(h, self.qkv[...]), self.qkv_bias)

    def _o_proj(self, o):
        """o [B, T, Hq, D] or [B, T, Hq·D] → o_proj(o) [B, T, H] (+ its bias)."""
        return _bias(linear(o.reshape(o.shape[0], o.shape[1], -1), self.o[...]), self.o_bias)

    def _split_heads(self, qkv):
        """q [B, T, Hq, D], k, v [B, T, Hkv, D] of the fused projection (its layout: qkv_groups)."""
        return split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_groups)

    def qkv_heads(self, h, positions):
        """The XLA path's attention inputs of already-normed rows h [B, T, H] at positions [B, T]:
        q [B, T, Hq, D], k, v [B, T, Hkv, D], q and k normed and rotated. Training's packed-block
        forward calls this and `attn_mlp` around its own attention (dflash_jax.train)."""
        return self._heads(self._project(h), positions, positions)

    def _heads(self, qkv, positions, k_positions):
        """q, k, v of the fused projection's output qkv [B, Tk, (Hq + 2 Hkv) D]: q of its last T
        rows (positions [B, T]) and k of all Tk rows (k_positions [B, Tk]), normed and rotated."""
        q, k, v = self._split_heads(qkv)
        q = self._rope(q[:, -positions.shape[1]:], positions, self.q_norm)    # [B, T, Hq, D]
        return q, self._rope(k, k_positions, self.k_norm), v                  # [B, Tk, Hkv, D]

    def _tpu_fused_q(self, kernels: KernelConfig, T: int, Tc: int, k_cache, dtype, prefill: bool) -> bool:
        """The loop's blocks on the TPU attention path, plain qkv layout, one device (a mesh runs the
        attention per shard on split heads), a shape the kernel tiles."""
        from dflash_jax import sharding
        if prefill or self.q_norm is None or self.qkv_groups != 1 or kernels.attention not in TPU_PATHS or \
                sharding.current_mesh() is not None:
            return False
        from pallas_kernels.attention import tpu as tpu_attention
        return tpu_attention.fused_q_supported(T, Tc, self.num_heads, self.num_kv_heads, self.head_dim,
                                               k_cache.shape[2], dtype)

    def _tpu_qkv_write(self, kernels: KernelConfig, T: int, Tc: int, k_cache, qkv, prefill: bool) -> bool:
        """Where the q side is read out of qkv (_tpu_fused_q), the k/v side too: the TPU row writer
        takes them from qkv (not under a mesh: the writer then runs per shard on split k/v)."""
        from dflash_jax import sharding
        if kernels.attention not in TPU_WRITE_PATHS or sharding.current_mesh() is not None or \
                not self._tpu_fused_q(kernels, T, Tc, k_cache, qkv.dtype, prefill):
            return False
        from pallas_kernels.attention import tpu_cache_write
        B, Hkv, C, D = k_cache.shape
        return tpu_cache_write.qkv_supported(Tc + T, 0, Tc + T, self.num_heads, Hkv, D, C, k_cache.dtype,
                                             qkv.shape[-1])

    def attn_mlp(self, x, o, kernels: KernelConfig | None = None):
        """The rest of the layer after attention, in XLA ops: x [B, T, H] the layer input, o
        [B, T, Hq, D] the attention output → x + o_proj(o), then the SwiGLU MLP with its residual."""
        return self._mlp_block(x + self._o_proj(o), kernels)[0]

    def _mlp_block(self, x, kernels: KernelConfig | None, row_scale: bool = False):
        """(x + mlp(norm(x)), None), or with row_scale on the TPU MLP kernel's path (x + ...,
        RowScale of it with the input norm's eps, for the next RMSNorm)."""
        norm = self.post_attention_layernorm
        from dflash_jax import sharding
        # (a family's own MLP block, the MoE block, is not a dense MLP: XLA ops around it, below)
        if isinstance(self.mlp, MLP) and kernels is not None and kernels.tpu_mlp and self.qkv_groups == 1 \
                and sharding.current_mesh() is None and self.mlp.down_bias is None:
            gu, down = self.mlp.gate_up[...], self.mlp.down[...]
            # on the TPU path, one device: norm, MLP and residual as one Pallas kernel (the normed
            # rows and the [rows, I] intermediate stay in VMEM); a mesh keeps XLA's partitioned ops.
            # An int8 target's weights (dflash_jax.quantize.Int8Weight) go in as they are: the
            # kernel reads int8 tiles and scales the products per column (an FP8 checkpoint's block
            # weights keep XLA's path)
            from pallas_kernels.fused_layer import tpu_mlp
            int8 = isinstance(gu, Int8Weight) and isinstance(down, Int8Weight)
            if tpu_mlp.supported(x.shape[0] * x.shape[1], x.shape[-1], down.shape[0], x.dtype) and \
                    (int8 or gu.dtype == x.dtype == down.dtype) and x.dtype == norm.weight[...].dtype:
                eps = self.input_layernorm.eps if row_scale else None
                out = tpu_mlp.mlp(x, gu, down, norm_weight=norm.weight[...], eps=norm.eps,
                                  row_scale_eps=eps, interpret=_interpret(kernels))  # [B, T, H]
                return (out[0], RowScale(out[1], eps)) if row_scale else (out, None)
        return x + self.mlp(norm(x), self.qkv_groups, kernels), None

    def context_kv(self, ctx, positions):
        """K/V of draft context features (no layernorm: DFlash projects the context directly).
        ctx [B, T, H] → k, v [B, T, Hkv, D] (k normed and rotated)."""
        Hq, Hkv, D, G = self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_groups
        w = self.qkv[...]
        # the k|v columns of each shard's chunk (G = 1: the plain layout's last 2 Hkv D columns);
        # the slice is per shard, so under TP it reads only local columns
        kv_cols = lambda a: a.reshape(a.shape[0], G, -1)[..., (Hq // G) * D:].reshape(a.shape[0], -1)
        if isinstance(w, Int8Weight):   # an int8 draft (--quantize-draft): the columns' scales with them
            kv_w = Int8Weight(kv_cols(w.q), kv_cols(w.scale[None])[0])
        else:
            kv_w = kv_cols(w)                                                      # [H, 2 Hkv D]
        kv = ctx @ kv_w
        if self.qkv_bias is not None:
            b = self.qkv_bias[...]
            kv = kv + b.reshape(G, -1)[:, (Hq // G) * D:].reshape(-1)
        B, T, _ = kv.shape
        kv = kv.reshape(B, T, G, 2, Hkv // G, D)
        k, v = kv[:, :, :, 0].reshape(B, T, Hkv, D), kv[:, :, :, 1].reshape(B, T, Hkv, D)
        return self._rope(k, positions, self.k_norm), v

    def attention_path(self, kernels: KernelConfig, T: int, Tc: int, k_cache, qkv, prefill: bool):
        """The kernel path of this call's attention, chosen once from the resolved KernelConfig and
        the shapes: `attend_gpu_fused`, `attend_tpu` or `attend_xla` (module functions below)."""
        G = self.qkv_groups
        if not prefill and fused_prologue(kernels, T, self.head_dim, G) and (
                not Tc or fused_prologue(kernels, Tc, self.head_dim, G)):
            return attend_gpu_fused
        if self._tpu_fused_q(kernels, T, Tc, k_cache, qkv.dtype, prefill):
            return attend_tpu
        return attend_xla

    def mlp_path(self, kernels: KernelConfig, T: int, hidden: int):
        """The kernel path of the post-attention half: `finish_gpu_fused` (add + RMSNorm kernel, the
        MLP output deferred to the next norm), else `finish_xla`, which runs the TPU MLP kernel where
        KernelConfig.tpu_mlp and the shapes allow."""
        return finish_gpu_fused if fused_add_norm(kernels, T, hidden) else finish_xla

    def __call__(self, x, residual: "Residual", positions, k_cache, v_cache, k_end, kernels: KernelConfig, *,
                 context: DraftContext | None = None, prefill: bool = False):
        """One layer. x [B, T, H] at `positions` [B, T]; residual: what the previous layer left
        unfolded into x (`Residual`: nothing, an MLP output this layer's input-norm kernel adds, or
        x's rows' RMS scale from the TPU MLP kernel). The block's K/V go to cache rows
        [positions[:, 0], + T), after the draft's context rows (`context`, written first; the block
        wins where they overlap). prefill: a causal prompt from row 0 (k_end = t + 1), so the
        attention may run on the new K/V alone (attend_prefill).

        Returns (x, Residual, k_cache, v_cache): the layer's output is residual.value(x)."""
        T = x.shape[1]
        Tc = 0 if context is None else context.feats.shape[1]
        x, h = residual.norm(x, self.input_layernorm, kernels)
        hin, k_pos = h, positions
        if Tc:   # the context rows go through the same projection: one weight read for both
            hin = jnp.concatenate([context.feats.astype(h.dtype), h], axis=1)      # [B, Tc+T, H]
            k_pos = jnp.concatenate([context.positions, positions], axis=1)        # [B, Tc+T]
        qkv = self._project(hin)                                                   # [B, Tc+T, W]
        attend_fn = self.attention_path(kernels, T, Tc, k_cache, qkv, prefill)
        o, k_cache, v_cache = attend_fn(self, qkv, positions, k_pos, Tc, k_cache, v_cache, k_end, kernels,
                                        prefill)
        x, residual = self.mlp_path(kernels, T, x.shape[-1])(self, x, o, kernels, prefill)
        return x, residual, k_cache, v_cache


    def paged(self, x, residual: "Residual", positions, cache, i: int, k_end, kernels: KernelConfig, *,
              context: DraftContext | None = None, prefill: bool = False):
        """The layer over a paged cache whose pages the attention kernel reads (attention.reads_pages):
        the rows' K/V scattered into layer i's pools (the context rows, then the block), then the
        attention through the page table, then the MLP half. Returns (x, Residual, cache)."""
        T = x.shape[1]
        Tc = 0 if context is None else context.feats.shape[1]
        x, h = residual.norm(x, self.input_layernorm, kernels)
        hin, k_pos = h, positions
        if Tc:
            hin = jnp.concatenate([context.feats.astype(h.dtype), h], axis=1)
            k_pos = jnp.concatenate([context.positions, positions], axis=1)
        q, k, v = self._heads(self._project(hin), positions, k_pos)
        if Tc:
            cache = cache.write_rows(i, k[:, :Tc], v[:, :Tc], k_pos[:, 0], kernels)
            k, v = k[:, Tc:], v[:, Tc:]
        cache = cache.write_rows(i, k, v, positions[:, 0], kernels)
        o = attend_paged(q, cache.k[i], cache.v[i], cache.table, k_end, kernels)
        x, residual = self.mlp_path(kernels, T, x.shape[-1])(self, x, o, kernels, prefill)
        return x, residual, cache


class Residual(NamedTuple):
    """What a layer leaves unfolded into its output x, for the next RMSNorm (the next layer's
    input norm, or the final norm): `add`, an MLP output the norm's kernel adds (the fused GPU
    path: output = x + add), or `scale`, x's rows' RMS scale made by the TPU MLP kernel (output
    = x; the norm needs no reduction). Neither: output = x."""
    add: jax.Array | None = None
    scale: RowScale | None = None

    def value(self, x):
        """The layer output itself."""
        return x if self.add is None else x + self.add

    def norm(self, x, norm: RMSNorm, kernels: KernelConfig):
        """(the layer output, norm of it), each path's way: the add + RMSNorm kernel, the scaled
        norm, or the plain one."""
        if self.scale is not None:
            return x, norm.scaled(x, self.scale)
        if self.add is not None:
            return add_norm(x, self.add, norm, kernels)
        return x, norm(x)


# ------------------------------------------------------------------ the attention half, per kernel path
# Each takes the fused projection qkv [B, Tc+T, W] (the draft's context rows first) and returns
# (o [B, T, Hq, D] or [B, T, Hq·D], k_cache, v_cache) with the rows' K/V written.

def attend_xla(layer: DecoderLayer, qkv, positions, k_pos, Tc: int, k_cache, v_cache, k_end,
               kernels: KernelConfig, prefill: bool):
    """XLA ops around the attention kernel of `kernels` (XLA, Pallas; cuDNN for long GPU prompts):
    q, k, v normed and rotated, the rows written, then the attention."""
    q, k, v = layer._heads(qkv, positions, k_pos)                 # [B, T, Hq, D], [B, Tc+T, Hkv, D]
    k_cache, v_cache = _write_context_then_block(k, v, positions, k_pos, Tc, k_cache, v_cache, kernels)
    if prefill and not Tc:
        return attend_prefill(q, k, v, k_cache, v_cache, k_end, kernels), k_cache, v_cache
    return attend(q, k_cache, v_cache, k_end, kernels), k_cache, v_cache


def attend_gpu_fused(layer: DecoderLayer, qkv, positions, k_pos, Tc: int, k_cache, v_cache, k_end,
                     kernels: KernelConfig, prefill: bool):
    """The GPU path: ONE prologue kernel (q/k norm where the layer has them, RoPE and the cache
    writes, the draft's context rows first), then the attention kernel."""
    cos, sin = layer._rope_tables(k_pos)
    qn, kn = layer.q_norm, layer.k_norm
    q, k_cache, v_cache = qk_norm_rope_write(
        qkv, cos, sin, None if qn is None else qn.weight[...], None if kn is None else kn.weight[...],
        1e-6 if qn is None else qn.eps, k_cache, v_cache,
        positions[:, 0], kernels, num_heads=layer.num_heads, ctx_rows=Tc,
        ctx_start=k_pos[:, 0] if Tc else None)
    return attend(q, k_cache, v_cache, k_end, kernels), k_cache, v_cache


def attend_tpu(layer: DecoderLayer, qkv, positions, k_pos, Tc: int, k_cache, v_cache, k_end,
               kernels: KernelConfig, prefill: bool):
    """The TPU path: the row writer takes k/v out of qkv and norms/rotates k itself where it can
    (else XLA's k/v and the plain row writer), and the attention kernel reads q out of qkv and
    norms/rotates it itself: q or k in [B, T, N, D] would be a relayout copy of the matmul's output."""
    from pallas_kernels.attention import tpu as tpu_attention
    T = positions.shape[1]
    if layer._tpu_qkv_write(kernels, T, Tc, k_cache, qkv, prefill):
        from pallas_kernels.attention import tpu_cache_write
        cos, sin = layer._rope_tables(k_pos)                                     # [B, Tc+T, D/2]
        k_cache, v_cache = tpu_cache_write.write_kv_rows_qkv(
            k_cache, v_cache, qkv, cos, sin, layer.k_norm.weight[...], layer.k_norm.eps, positions[:, 0],
            num_heads=layer.num_heads, t0=Tc, T=T, ctx_rows=Tc, ctx_start=k_pos[:, 0] if Tc else None,
            interpret=_interpret(kernels))
    else:
        _, k, v = layer._heads(qkv, positions, k_pos)
        k_cache, v_cache = _write_context_then_block(k, v, positions, k_pos, Tc, k_cache, v_cache, kernels)
    cos, sin = layer._rope_tables(positions)                                     # [B, T, D/2]
    o = tpu_attention.block_attention_qkv(
        qkv, cos, sin, layer.q_norm.weight[...], layer.q_norm.eps, k_cache, v_cache, k_end,
        num_heads=layer.num_heads, t0=Tc, interpret=_interpret(kernels))      # [B, T, Hq*D]
    return o, k_cache, v_cache


def _write_context_then_block(k, v, positions, k_pos, Tc: int, k_cache, v_cache, kernels):
    """k, v [B, Tc+T, Hkv, D] into the caches: the draft's context rows at k_pos[:, 0], then the
    block's at positions[:, 0] (the block wins where they overlap)."""
    if Tc:
        k_cache, v_cache = write_kv_rows(k_cache, v_cache, k[:, :Tc], v[:, :Tc], k_pos[:, 0], kernels)
        k, v = k[:, Tc:], v[:, Tc:]
    return write_kv_rows(k_cache, v_cache, k, v, positions[:, 0], kernels)


# ----------------------------------------------------------------------- the MLP half, per kernel path
# Each takes the layer input x and the attention output o and returns (x, Residual).

def finish_xla(layer: DecoderLayer, x, o, kernels: KernelConfig, prefill: bool):
    """x + o_proj(o), then the MLP block with its residual: XLA ops, or on the TPU path the MLP
    kernel (norm, MLP and residual in one), which also gives the next norm its rows' scale."""
    x, scale = layer._mlp_block(x + layer._o_proj(o), kernels, row_scale=True)
    return x, Residual(scale=scale)


def finish_gpu_fused(layer: DecoderLayer, x, o, kernels: KernelConfig, prefill: bool):
    """The GPU path: ONE add + RMSNorm kernel, the MLP matmuls; the MLP output is left for the next
    norm's kernel to add (a prompt's is added here: prefill ends in XLA ops)."""
    x, h = add_norm(x, layer._o_proj(o), layer.post_attention_layernorm, kernels)
    mlp_out = layer.mlp(h, layer.qkv_groups, kernels)
    if prefill:
        return x + mlp_out, Residual()
    return x, Residual(add=mlp_out)


class DraftContext(NamedTuple):
    """The draft's context rows of one pass, given to each of its layers: feats [B, Tc, H] (the
    context features: fc + hidden_norm of the target taps) at positions [B, Tc], whose K/V are
    written at cache rows [positions[:, 0], + Tc)."""
    feats: jax.Array
    positions: jax.Array


def run_layers(layers, x, positions, cache: KVCache, k_end, kernels: KernelConfig, final_norm: RMSNorm, *,
               context: DraftContext | None = None, prefill: bool = False, taps: tuple = (),
               scope: str = "layer"):
    """The layer loop of the target and the draft: x [B, T, H] through `layers`, each writing its
    K/V into its cache entry, then `final_norm`. Each layer hands the next its `Residual` (the
    fused GPU path's MLP output, added by the next RMSNorm's kernel; the TPU MLP kernel's row
    scale, the next RMSNorm's reduction), so the hidden state after layer i is residual.value(x).

    Returns (hidden [B, T, H] final-normed, {i: hidden state after layer i for i in taps}, the
    cache with every layer's rows written; its lens unchanged). The cache is any storage of the
    dflash_jax.cache contract (dense rows or pages): each layer gets its K/V as dense views and
    hands back the rows it wrote, [lo, lo + rows) of each row (the context rows, then the block)."""
    tapped, residual = {}, Residual()
    T = positions.shape[1]
    lo = positions[:, 0] if context is None else jnp.minimum(context.positions[:, 0], positions[:, 0])
    rows = T + (0 if context is None else context.positions.shape[1])
    pages = is_paged(cache) and reads_pages(kernels)
    for i, layer in enumerate(layers):
        if pages:      # the attention kernel reads the pools through the table
            with jax.named_scope(f"{scope}{i}"):
                x, residual, cache = layer.paged(x, residual, positions, cache, i, k_end, kernels, context=context,
                                                 prefill=prefill)
            if i in taps:
                tapped[i] = residual.value(x)
            continue
        with jax.named_scope(f"{scope}{i}"):
            k, v = cache.layer_kv(i)
            x, residual, k, v = layer(x, residual, positions, k, v, k_end, kernels, context=context,
                                      prefill=prefill)
            cache = cache.set_layer(i, k, v, lo, rows)
        if i in taps:
            tapped[i] = residual.value(x)
    h = residual.norm(x, final_norm, kernels)[1]
    return h, tapped, cache
