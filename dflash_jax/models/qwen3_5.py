"""The Qwen3.5 hybrid target (HF model_type `qwen3_5`, its text model): Gated DeltaNet layers
(linear attention with a recurrent state) and gated full-attention layers, 3 : 1 by default.

Same interface as the Qwen3 target: `model(tokens, positions, cache, k_end, taps=, kernels=,
prefill=)` -> (final-normed hidden, taps, cache), `logits`, `embed_tokens`, `new_cache`, plus
`commit(cache, n)`, the rollback the loop calls after every forward:

A recurrent state cannot be cropped like a KV cache, so a forward leaves each GDN layer's state at
its value BEFORE the block and returns the block's per-token records (the rule's prepared k, v, g,
beta and the conv inputs) in the cache. `commit(cache, n)` then folds the first n[b] tokens of each
row into the state (gated_delta.fold: one chunked pass that reads and writes the state once) and
cuts the conv window at the same token. The records live only between the forward and the commit
of one iteration (never in the loop carry). The loop commits the accepted count after a verify
(a row's rejected drafts never reach its state) and the prompt length after prefill (a bucket's
padding never does). Memory per request beyond the state: the records of one block, transient;
the design note is docs/hybrid-targets.md.

Layer differences from Qwen3 (all as transformers' `modeling_qwen3_5`):
  - RMSNorm is zero-centred: x_hat * (1 + w), computed in float32 (layer, final, q/k norms);
  - attention: q_proj gives [query | gate] per head, q/k norm, RoPE on the first
    partial_rotary_factor of the head dims (rotate_half within them; text-only mRoPE is 1-D RoPE),
    output * sigmoid(gate) before o_proj;
  - GDN: in_proj_qkv / z / b / a (fused here into one matmul), depthwise causal conv (kernel 4,
    SiLU) over q|k|v, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated delta rule
    (gated_delta.py), output norm w * norm(o) * silu(z), out_proj.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jax.sharding import PartitionSpec as P

from dflash_jax import quantize as q8
from dflash_jax import sharding
from dflash_jax.attention import attend, attend_prefill
from dflash_jax.cache import write_kv_rows
from dflash_jax.checkpoint_io import dtype_of, iter_tensors, resolve_model_dir
from dflash_jax.config import ConfigError, TargetConfig, read_json
from dflash_jax.kernel_config import KernelConfig, resolved
from dflash_jax.models import gated_delta as gd
from dflash_jax.models.family import Family
from dflash_jax.models.layers import MLP, init_param, linear, rope
from dflash_jax.models.stack import CausalLM
from dflash_jax.validation import positive_int

__all__ = ["Qwen35Config", "Qwen35", "HybridCache", "load_qwen3_5", "init_qwen3_5", "with_verify_form"]

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
VERIFY_FORMS = ("chunk", "recurrent")


@dataclasses.dataclass(frozen=True)
class Qwen35Config(TargetConfig):
    """A Qwen3.5 text model: TargetConfig's fields (the full-attention layers' heads, the MLP, the
    vocabulary: what a draft is checked against) plus the layer layout and the GDN shapes. Static:
    part of the compile key through the module's structure."""

    layer_types: tuple = ()            # per layer "linear_attention" | "full_attention"
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    model_type: str = "qwen3_5"
    # how a multi-token block (verify, T > 1 outside prefill) runs the rule: "chunk" (one chunk,
    # the state read once, its solved terms kept for the fold) or "recurrent" (unrolled per
    # token); same numbers up to rounding
    verify_form: str = "chunk"
    prefill_chunk: int = 64

    def __post_init__(self):
        super().__post_init__()
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ConfigError(f"layer_types {bad} not supported (linear_attention, full_attention)")
        if self.verify_form not in VERIFY_FORMS:
            raise ConfigError(f"verify_form={self.verify_form!r}; expected one of {VERIFY_FORMS}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dim} "
                              f"rotary dims of head_dim {self.head_dim} (needs an even count > 0)")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    # the config.json model types this class reads, and the keys it cannot do without
    READS = MODEL_TYPES
    NEED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **overrides) -> "Qwen35Config":
        """HF config.json of `Qwen3_5ForConditionalGeneration` (model_type qwen3_5, the text model
        under text_config) or of the text model alone (qwen3_5_text). Layers: `layer_types`, or
        every `full_attention_interval`-th layer (default 4) full attention, the rest GDN."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"target: the config must be a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in cls.READS:
            raise ConfigError(f"target: model_type={mt!r}; this hybrid family reads {cls.READS}")
        tie = d.get("tie_word_embeddings")
        if isinstance(d.get("text_config"), Mapping):
            d = d["text_config"]
        if tie is None:
            tie = d.get("tie_word_embeddings", False)
        missing = [k for k in cls.NEED if k not in d]
        if missing:
            raise ConfigError(f"target: config.json lacks {', '.join(missing)}")
        for k in cls.NEED:
            try:
                positive_int(d[k], k, "target")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if d.get("attention_bias"):
            raise ConfigError("target: attention_bias=True is not supported (Qwen3.5 has no attention bias)")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"target: hidden_act={d.get('hidden_act')!r}; only 'silu' is supported")
        L = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if types is None:
            interval = int(d.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)]
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in ("default", "mrope", None):
            raise ConfigError(f"target: rope_type={kind!r} is not supported (default / text-only mRoPE)")
        n_heads = int(d["num_attention_heads"])
        fields = dict(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size") or cls._intermediate(d)), num_layers=L,
            num_heads=n_heads, num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // n_heads),
            layer_types=tuple(types),
            linear_num_key_heads=int(d["linear_num_key_heads"]),
            linear_num_value_heads=int(d["linear_num_value_heads"]),
            linear_key_head_dim=int(d["linear_key_head_dim"]),
            linear_value_head_dim=int(d["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), model_type=cls.model_type,
            rope_theta=float(rp.get("rope_theta", d.get("rope_theta", 1e7))),
            partial_rotary_factor=float(rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(tie), **cls._more_fields(d))
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def _intermediate(cls, d) -> int:
        return int(d["intermediate_size"])

    @classmethod
    def _more_fields(cls, d) -> dict:
        """A subclass's own fields from the text config (the MoE variant's experts)."""
        return {}

    @classmethod
    def from_pretrained(cls, path: str, **overrides) -> "Qwen35Config":
        return cls.from_dict(read_json(path), **overrides)


class ZeroCentredRMSNorm(nnx.Module):
    """x_hat * (1 + w) in float32, then cast (transformers' Qwen3_5RMSNorm; w starts at zero)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def partial_rope(x, positions, rot: int, theta: float):
    """RoPE (rotate_half) on the first `rot` dims of x [B, T, N, D]; the rest passes through."""
    if rot == x.shape[-1]:
        return rope(x, positions, theta)
    return jnp.concatenate([rope(x[..., :rot], positions, theta), x[..., rot:]], axis=-1)


class GatedAttention(nnx.Module):
    """Full attention with an output gate. Fused projection [H, Hq*2D + 2 Hkv*D]: q_proj's columns
    (per head [query_h | gate_h], as HF lays them), then k, then v."""

    def __init__(self, c: Qwen35Config, dtype, rngs: nnx.Rngs):
        H, D = c.hidden_size, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, D
        self.rotary_dim, self.rope_theta = c.rotary_dim, c.rope_theta
        self.qkv = init_param(rngs, (H, (2 * c.num_heads + 2 * c.num_kv_heads) * D), dtype, H ** -0.5)
        self.q_norm = ZeroCentredRMSNorm(D, c.rms_norm_eps, dtype)
        self.k_norm = ZeroCentredRMSNorm(D, c.rms_norm_eps, dtype)
        self.o = init_param(rngs, (c.num_heads * D, H), dtype, (c.num_heads * D) ** -0.5)

    def __call__(self, h, positions, k_cache, v_cache, k_end, kernels, prefill: bool):
        B, T, _ = h.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(h, self.qkv[...])
        qg = qkv[..., :2 * Hq * D].reshape(B, T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(B, T, Hq * D)
        k = qkv[..., 2 * Hq * D:(2 * Hq + Hkv) * D].reshape(B, T, Hkv, D)
        v = qkv[..., (2 * Hq + Hkv) * D:].reshape(B, T, Hkv, D)
        q = partial_rope(self.q_norm(q), positions, self.rotary_dim, self.rope_theta)   # [B, T, Hq, D]
        k = partial_rope(self.k_norm(k), positions, self.rotary_dim, self.rope_theta)   # [B, T, Hkv, D]
        k_cache, v_cache = write_kv_rows(k_cache, v_cache, k, v, positions[:, 0], kernels)
        if prefill:
            o = attend_prefill(q, k, v, k_cache, v_cache, k_end, kernels)
        else:
            o = attend(q, k_cache, v_cache, k_end, kernels)                             # [B, T, Hq, D]
        o = o.reshape(B, T, Hq * D) * jax.nn.sigmoid(gate)
        return linear(o, self.o[...]), k_cache, v_cache


@struct.dataclass
class Records:
    """A GDN layer's block, kept from its forward to the commit: the rule's inputs (k l2-normed on
    the k-heads, v, g, beta) or, for a block run as one chunk, its solved terms (gated_delta.block);
    and the conv inputs with the window before them xx [B, K-1+T, C]."""
    terms: tuple
    xx: jax.Array
    # what terms are: "inputs" (k, v, g, beta), "deltas" (k, G, delta on the v-heads: the GPU
    # kernel's, pallas_kernels/gated_delta, or gated_delta.block's k, G, v_new) or "committed" (a
    # one-row forward that already advanced its committing rows: (state,), and xx the window)
    kind: str = struct.field(pytree_node=False)
    # "deltas" records: how the commit folds them ("" the XLA fold, else KernelConfig.gdn: the
    # fold kernel compiled or interpreted) and the kernel's value dims per program
    fold: str = struct.field(pytree_node=False, default="")
    block_v: int = struct.field(pytree_node=False, default=0)


class GatedDeltaNet(nnx.Module):
    """The linear-attention mixer. Fused input projection [H, conv_dim + HV*dv + 2 HV]:
    in_proj_qkv | in_proj_z | in_proj_b | in_proj_a."""

    def __init__(self, c: Qwen35Config, dtype, rngs: nnx.Rngs):
        H = c.hidden_size
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.conv_dim, self.kernel = c.conv_dim, c.linear_conv_kernel_dim
        self.verify_form, self.prefill_chunk = c.verify_form, c.prefill_chunk
        vd = self.hv * self.dv
        self.in_proj = init_param(rngs, (H, self.conv_dim + vd + 2 * self.hv), dtype, H ** -0.5)
        self.conv = init_param(rngs, (self.conv_dim, self.kernel), dtype, self.kernel ** -0.5)   # [C, K]
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), dtype))
        a = jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(dtype))
        self.norm = nnx.Param(jnp.ones((self.dv,), dtype))      # the gated output norm (plain w)
        self.norm_eps = c.rms_norm_eps
        self.out = init_param(rngs, (vd, H), dtype, vd ** -0.5)

    def inputs(self, h, window):
        """Projections and conv of h [B, T, H] with the conv window [B, K-1, C]: prepared q, k
        [B, T, HK, dk] (k not yet expanded), v [B, T, HV, dv], g, beta [B, T, HV] (float32), z
        [B, T, HV, dv] and the conv inputs with their window xx [B, K-1+T, C]."""
        B, T, _ = h.shape
        C, vd = self.conv_dim, self.hv * self.dv
        p = linear(h, self.in_proj[...])
        mixed, z = p[..., :C], p[..., C:C + vd].reshape(B, T, self.hv, self.dv)
        b, a = p[..., C + vd:C + vd + self.hv], p[..., C + vd + self.hv:]
        conv, xx = gd.causal_conv(mixed, window, self.conv[...])
        kd = self.hk * self.dk
        q = gd.l2norm(conv[..., :kd].reshape(B, T, self.hk, self.dk)) * (self.dk ** -0.5)
        k = gd.l2norm(conv[..., kd:2 * kd].reshape(B, T, self.hk, self.dk))
        v = conv[..., 2 * kd:].reshape(B, T, self.hv, self.dv).astype(jnp.float32)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        return q, k, v, g, beta, z, xx

    def expand(self, x):
        """k-heads to v-heads: each k-head serves HV/HK consecutive v-heads (repeat_interleave)."""
        rep = self.hv // self.hk
        return x if rep == 1 else jnp.repeat(x, rep, axis=2)

    def use_kernel(self, T: int, kernels: KernelConfig | None, prefill: bool) -> bool:
        """Whether this block runs as the fused GPU kernel (pallas_kernels/gated_delta): a
        resolved KernelConfig with gdn on a Pallas path, a short block (not prefill) of a shape
        the kernel tiles, and no mesh (the kernel sees whole arrays; meshes keep the XLA forms)."""
        if kernels is None or kernels.gdn == "xla" or prefill or sharding.current_mesh() is not None:
            return False
        from pallas_kernels.gated_delta import block_supported
        return block_supported(T, self.hk, self.hv, self.dk, self.dv, self.kernel, kernels.gdn_block_v)

    def kernel_block(self, h, state, window, kernels: KernelConfig):
        """The block through the fused GPU kernel: (out [B, T, H], Records of kind "deltas")."""
        from pallas_kernels.gated_delta import gdn_block
        B, T, _ = h.shape
        p = linear(h, self.in_proj[...])
        o, terms = gdn_block(p, window, self.conv[...], self.A_log[...], self.dt_bias[...], self.norm[...],
                             state, num_k_heads=self.hk, key_dim=self.dk, value_dim=self.dv,
                             norm_eps=self.norm_eps, block_v=kernels.gdn_block_v,
                             interpret=kernels.gdn == "pallas_gpu_interpret")
        if o.ndim == 4:     # value dims split over programs: the gated output norm in XLA
            vd = self.hv * self.dv
            z = p[..., self.conv_dim:self.conv_dim + vd].reshape(B, T, self.hv, self.dv)
            o = self.gated_norm(o, z, h.dtype)
        xx = jnp.concatenate([window.astype(h.dtype), p[..., :self.conv_dim]], axis=1)
        return linear(o, self.out[...]), Records(terms=terms, xx=xx, kind="deltas", fold=kernels.gdn,
                                          block_v=kernels.gdn_block_v)

    def gated_norm(self, o, z, dtype):
        """weight * norm(o) in the model dtype, times silu(z) in float32: [B, T, HV * dv]."""
        B, T = o.shape[:2]
        of = o.astype(dtype).astype(jnp.float32)
        of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + self.norm_eps)
        o = (self.norm[...] * of.astype(dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return o.astype(dtype).reshape(B, T, self.hv * self.dv)

    def __call__(self, h, state, window, prefill: bool, kernels: KernelConfig | None = None, commit_rows=None):
        """h [B, T, H] normed rows; state [B, HV, dk, dv] float32 and window [B, K-1, C] before
        them (left unchanged). Returns (out [B, T, H], the records that `advance` folds into the
        state (Records). kernels: a resolved KernelConfig (its `gdn` picks the short blocks' path).
        commit_rows [B] bool, one-row blocks only: the rows whose token the caller commits
        whatever comes of it (a plain step's running rows). The XLA path then advances their state
        and window here, from the state it reads anyway, and the commit only hands them over: the
        state is read once and written once a step instead of read again by a separate fold (the
        fold's share of a v6e step at Qwen3.5-9B shapes: docs/hybrid-targets.md)."""
        B, T, _ = h.shape
        if self.use_kernel(T, kernels, prefill):
            return self.kernel_block(h, state, window, kernels)
        q, k, v, g, beta, z, xx = self.inputs(h, window)
        qe, ke = self.expand(q), self.expand(k)
        rec = Records(terms=(k, v, g, beta), xx=xx, kind="inputs")
        if commit_rows is not None and T == 1 and not prefill:
            o, new = gd.recurrent(qe, ke, v, g, beta, state)
            on = commit_rows[:, None, None]
            rec = Records(terms=(jnp.where(on[..., None], new, state),),
                          xx=jnp.where(on, xx[:, 1:], window.astype(xx.dtype)), kind="committed")
        elif prefill:
            o, _ = gd.chunked(qe, ke, v, g, beta, state, self.prefill_chunk)
        elif T == 1 or self.verify_form == "recurrent":
            o, _ = gd.recurrent(qe, ke, v, g, beta, state)
        else:   # one chunk; its solved terms are the records (the fold reuses them)
            o, terms = gd.block(qe, ke, v, g, beta, state)
            rec = Records(terms=terms, xx=xx, kind="deltas")
        return linear(self.gated_norm(o, z, h.dtype), self.out[...]), rec

    def advance(self, state, records, n):
        """(state, conv window) after the first n[b] tokens of the records' block ("committed":
        as the forward left them, for its commit_rows, whose n the caller fixed in advance)."""
        if records.kind == "committed":
            return records.terms[0], records.xx
        if records.kind == "deltas" and records.fold:      # the fold kernel
            from pallas_kernels.gated_delta import fold_deltas
            state = fold_deltas(*records.terms, state, n, block_v=records.block_v,
                                interpret=records.fold == "pallas_gpu_interpret")
        elif records.kind == "deltas":
            state = gd.fold_deltas(*records.terms, state, n)
        else:
            k, v, g, beta = records.terms
            state = gd.fold(self.expand(k), v, g, beta, state, n, self.prefill_chunk)
        return state, gd.window_after(records.xx, n, self.kernel)


class HybridLayer(nnx.Module):
    """mlp: the dense SwiGLU MLP, or another block called the same way, mlp(h, groups, kernels)
    (the MoE variant's experts, models/qwen3_5_moe.py)."""

    def __init__(self, c: Qwen35Config, kind: str, dtype, rngs: nnx.Rngs, mlp: nnx.Module | None = None):
        self.kind = kind
        self.input_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mixer = GatedAttention(c, dtype, rngs) if kind == "full_attention" else GatedDeltaNet(c, dtype, rngs)
        self.post_attention_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype, rngs) if mlp is None else mlp

    def finish(self, x, mixed, kernels: KernelConfig | None = None):
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x), 1, kernels)


@struct.dataclass
class HybridCache:
    """The hybrid target's cache: K/V of the full-attention layers ([B, Hkv, C, D] each, as
    KVCache), the GDN layers' recurrent states [B, HV, dk, dv] float32 and conv windows
    [B, K-1, C], per-row lengths, and between a forward and its commit the block's records
    (None in the loop carry)."""
    k: tuple
    v: tuple
    state: tuple
    conv: tuple
    lens: jax.Array
    records: Any = None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def specs(self, mesh) -> "HybridCache":
        """PartitionSpecs on a ('data', 'model') mesh (the loop carry's layout): rows on 'data',
        replicated over 'model' (the parameters are, RULES), so each data shard runs its own rows
        through whole layers; records None (the carry holds none)."""
        row = lambda x: P("data", *(None,) * (x.ndim - 1))
        return HybridCache(k=tuple(row(x) for x in self.k), v=tuple(row(x) for x in self.v),
                           state=tuple(row(x) for x in self.state), conv=tuple(row(x) for x in self.conv),
                           lens=P("data"), records=None)


class Qwen35(CausalLM):
    """The hybrid stack. CausalLM's embedding, head and `logits`; its own layers, forward, cache
    and `commit`."""

    def __init__(self, config: Qwen35Config, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):  # noqa: super not called
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, V = config.hidden_size, config.vocab_size
        self.embed = init_param(rngs, (V, H), dtype, 1.0)                             # [V, H]
        self.layers = nnx.List([HybridLayer(config, t, dtype, rngs, self.make_mlp(config, dtype, rngs))
                                for t in config.layer_types])
        self.norm = ZeroCentredRMSNorm(H, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else init_param(rngs, (H, V), dtype, H ** -0.5)

    def make_mlp(self, config, dtype, rngs):
        """A layer's MLP block: None for the dense one (the MoE variant overrides this)."""
        return None

    # a layer's MLP tensors in the checkpoint (after `model.layers.N.`), given those read so far
    # (the MoE variant's experts come per expert or stacked), and how they fill the block
    @staticmethod
    def mlp_tensors(c, got: dict) -> tuple:
        return _MLP

    @staticmethod
    def fill_mlp(mlp, c, t: dict, put) -> None:
        put(mlp.gate_up, cat([t["mlp.gate_proj.weight"].T, t["mlp.up_proj.weight"].T]))
        put(mlp.down, t["mlp.down_proj.weight"].T)

    def __call__(self, tokens, positions, cache: HybridCache, k_end, *, taps: tuple[int, ...] = (),
                 kernels: KernelConfig | str | None = None, prefill: bool = False, commit_rows=None):
        """As Qwen3.__call__. The attention layers' K/V go to cache rows [positions[:, 0], + T);
        the GDN states stay at their value before the block and the block's records come back in
        the cache: call `commit(cache, n)` next (the loop does). commit_rows [B] bool, for a
        one-row block whose commit will be n = commit_rows (a plain step: every running row keeps
        its token): the XLA path advances those rows' states in the forward (GatedDeltaNet)."""
        kernels = resolved(kernels)
        x = self.embed_tokens(tokens)
        ks, vs = list(cache.k), list(cache.v)
        records, tapped = [], {}
        ia = il = 0
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"target_layer{i}"):
                h = layer.input_layernorm(x)
                if layer.kind == "full_attention":
                    mixed, ks[ia], vs[ia] = layer.mixer(h, positions, ks[ia], vs[ia], k_end, kernels, prefill)
                    ia += 1
                else:
                    mixed, rec = layer.mixer(h, cache.state[il], cache.conv[il], prefill, kernels, commit_rows)
                    records.append(rec)
                    il += 1
                x = layer.finish(x, mixed, kernels)
            if i in taps:
                tapped[i] = x
        h = self.norm(x)
        tapped[len(self.layers) - 1] = h      # HF's last hidden_states entry is after the final norm
        feats = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        cache = HybridCache(k=tuple(ks), v=tuple(vs), state=cache.state, conv=cache.conv,
                            lens=positions[:, 0] + tokens.shape[1], records=tuple(records))
        return h, feats, cache

    def commit(self, cache: HybridCache, n) -> HybridCache:
        """The rollback hook: each GDN layer's state and conv window advanced over the first n[b]
        tokens of the last forward's block (n [B] int32, 0 <= n <= T; 0 leaves a row as it was).
        Attention K/V need nothing: entries past a row's length are never read."""
        if cache.records is None:
            return cache
        gdn = [l.mixer for l in self.layers if l.kind != "full_attention"]
        out = [m.advance(s, r, n) for m, s, r in zip(gdn, cache.state, cache.records)]
        return cache.replace(state=tuple(o[0] for o in out), conv=tuple(o[1] for o in out), records=None)

    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        c = self.config
        kv = (batch, c.num_kv_heads, capacity, c.head_dim)
        nf, nl = len(c.full_layers), len(c.linear_layers)
        st = (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        cw = (batch, c.linear_conv_kernel_dim - 1, c.conv_dim)
        return HybridCache(k=tuple(jnp.zeros(kv, self.dtype) for _ in range(nf)),
                           v=tuple(jnp.zeros(kv, self.dtype) for _ in range(nf)),
                           state=tuple(jnp.zeros(st, jnp.float32) for _ in range(nl)),
                           conv=tuple(jnp.zeros(cw, self.dtype) for _ in range(nl)),
                           lens=jnp.zeros((batch,), jnp.int32))


def state_bytes(config: Qwen35Config, dtype=jnp.bfloat16) -> int:
    """Bytes of one request's GDN state (recurrent float32 + conv window)."""
    c = config
    n = len(c.linear_layers)
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim * jnp.dtype(dtype).itemsize
    return n * (rec + conv)


def record_bytes(config: Qwen35Config, block: int, dtype=jnp.bfloat16, kernel: bool = False) -> int:
    """Bytes of one request's verify records (the rollback's transient working set) for a block:
    the chunk form's or, kernel=True, the GPU kernel's (k, G, delta on the v-heads), or the rule's
    inputs (k on the k-heads, v, g, beta), and the conv inputs with their window."""
    c = config
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    if kernel or c.verify_form == "chunk":
        per_token = 4 * hv * (dk + dv + 1)
    else:
        per_token = 4 * (c.linear_num_key_heads * dk + hv * (dv + 2))
    conv = (c.linear_conv_kernel_dim - 1 + block) * c.conv_dim * jnp.dtype(dtype).itemsize
    return len(c.linear_layers) * (block * per_token + conv)


# ------------------------------------------------------------------------------------------ weights

_PREFIXES = ("model.language_model.", "model.")
_SKIP = re.compile(r"^(mtp\.|model\.visual\.|visual\.|.*rotary_emb\.inv_freq)")


def _text_name(name: str) -> str | None:
    """A checkpoint key in the text model's names (model.layers..., model.norm..., lm_head...),
    or None for keys of other parts (vision tower, MTP head)."""
    if _SKIP.match(name):
        return None
    for p in _PREFIXES:
        if name.startswith(p):
            return "model." + name[len(p):]
    return name


def load_qwen3_5(path_or_hub_id: str, dtype="bfloat16", **overrides) -> Qwen35:
    """A Qwen3.5 target from a HF directory or hub id (safetensors only). overrides: Qwen35Config
    fields (verify_form, prefill_chunk). `load_target` reaches the same loader through the family."""
    d = resolve_model_dir(path_or_hub_id)
    return load_checkpoint(d, Qwen35Config.from_pretrained(d, **overrides), dtype_of(dtype), f"target {path_or_hub_id}")


def load_checkpoint(d: str, c: Qwen35Config, dt, what: str, model_cls=None) -> Qwen35:
    """The checkpoint in directory d, streamed tensor by tensor; a layer's tensors are fused and
    placed once all of them are read. model_cls: Qwen35 or a subclass (its own MLP tensors). The
    family's `load` (Family.load), which load_target calls.

    An FP8 checkpoint (config.json quantization_config quant_method "fp8": Qwen's Qwen3.5-*-FP8)
    keeps its layer linears in 8 bits (quantize.Fp8BlockWeight, paired with their block scales by
    quantize.fp8_weights): attention qkv / o, GDN in_proj / out, the dense MLP, the shared expert
    and the experts stacked by expert. A fused matrix stays fp8 only when every part is (Qwen's
    checkpoints leave in_proj_a / in_proj_b in bf16, so their GDN in_proj loads dequantized, in
    dt; exact, since a float part cannot join an fp8 block grid without rounding); a tensor the
    model keeps in floats (norms, conv, router, the shared-expert gate, embeddings, LM head) is
    dequantized if the checkpoint quantized it."""
    model_cls = Qwen35 if model_cls is None else model_cls
    model = nnx.eval_shape(lambda: model_cls(c, dt, rngs=nnx.Rngs(0)))
    parts: dict[int, dict[str, np.ndarray]] = {}
    seen = set()
    block = q8.checkpoint_fp8_block(read_json(d), what)
    linears = _linear_params(model) if block is not None else set()

    def put(param, value):
        if q8.is_quantized(value) and id(param) not in linears:
            value = value.dequantize()
        if tuple(param.get_value().shape) != tuple(value.shape):
            raise ValueError(f"{what}: tensor of shape {tuple(value.shape)} where the config implies "
                             f"{tuple(param.get_value().shape)}")
        if q8.is_quantized(value):
            if not value.all_finite():
                raise ValueError(f"{what}: a tensor holds NaN or inf values")
            param.set_value(value)
            return
        value = np.asarray(value)
        if not np.isfinite(value).all():
            raise ValueError(f"{what}: a tensor holds NaN or inf values")
        param.set_value(jnp.asarray(value, dt))

    stream = iter_tensors(d) if block is None else q8.fp8_weights(iter_tensors(d), block, what)
    for raw, tensor in stream:
        name = _text_name(raw)
        if name is None or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        t = tensor if q8.is_quantized(tensor) else _float_tensor(raw, tensor, what)
        if name == "model.embed_tokens.weight":
            put(model.embed, t)
        elif name == "model.norm.weight":
            put(model.norm.weight, t)
        elif name == "lm_head.weight":
            put(model.lm_head, t.T)
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
            if not m or int(m.group(1)) >= c.num_layers:
                raise ValueError(f"{what}: unexpected tensor {raw!r}")
            i, rest = int(m.group(1)), m.group(2)
            parts.setdefault(i, {})[rest] = t
            if _layer_complete(model_cls, c, i, parts[i]):
                _fill_layer(model_cls, model.layers[i], c, parts.pop(i), put)
                seen.add(i)
        seen.add(name)
    missing = [i for i in range(c.num_layers) if i not in seen]
    if missing or parts:
        raise ValueError(f"{what}: layers {sorted(set(missing) | set(parts))} incomplete in the checkpoint")
    if "model.embed_tokens.weight" not in seen:
        raise ValueError(f"{what}: the checkpoint lacks model.embed_tokens.weight")
    if not c.tie_word_embeddings and "lm_head.weight" not in seen:
        raise ValueError(f"{what}: the checkpoint lacks lm_head.weight (and the config is untied)")
    return q8.mark(model, "fp8") if q8.quantized_leaves(model) else model


def _float_tensor(raw: str, tensor, what: str) -> np.ndarray:
    """A checkpoint tensor as float32 NumPy; a float8 one without its scales (no fp8
    quantization_config) or an integer one is a one-line ValueError naming it."""
    if q8.is_fp8(tensor) or not jnp.issubdtype(tensor.dtype, jnp.floating):
        raise ValueError(f"{what}: tensor {raw} has dtype {jnp.dtype(tensor.dtype).name}; weights must be floating "
                         "point (float32, bfloat16, float16)"
                         + ("; float8 weights need config.json's quantization_config (quant_method 'fp8')"
                            if q8.is_fp8(tensor) else ""))
    return np.asarray(tensor, np.float32)


def _linear_params(model) -> set:
    """ids of the layers' linear weights an FP8 checkpoint's 8 bits are kept in (quantize's
    LINEAR_NAMES [in, out] and EXPERT_NAMES [E, in, out]: the GDN conv, gates, norms, the router
    and the shared-expert gate are read in floats)."""
    out = set()
    for _, node in nnx.iter_graph(model.layers):
        if isinstance(node, nnx.Module):
            for name in q8.LINEAR_NAMES + q8.EXPERT_NAMES:
                p = getattr(node, name, None)
                if isinstance(p, nnx.Param):
                    out.add(id(p))
    return out


def cat(parts: list):
    """The parts [in, out_i] of a fused matrix side by side: in 8 bits when every part is an FP8
    checkpoint's (quantize.concat_columns), else float32 NumPy (fp8 parts dequantized: exact)."""
    if all(isinstance(p, q8.Fp8BlockWeight) for p in parts):
        return q8.concat_columns(parts)
    return np.concatenate([np.asarray(p.dequantize()) if q8.is_quantized(p) else p for p in parts], axis=1)


def stack(parts: list):
    """Experts [in, out] stacked [E, in, out]: in 8 bits when every one is fp8 (one block), else
    float32 NumPy."""
    if all(isinstance(p, q8.Fp8BlockWeight) for p in parts) and len({p.block for p in parts}) == 1:
        return q8.Fp8BlockWeight(jnp.stack([p.q for p in parts]), jnp.stack([p.scale for p in parts]), parts[0].block)
    return np.stack([np.asarray(p.dequantize()) if q8.is_quantized(p) else p for p in parts])


_COMMON = ("input_layernorm.weight", "post_attention_layernorm.weight")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")
_GDN = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight", "linear_attn.dt_bias",
        "linear_attn.A_log", "linear_attn.norm.weight", "linear_attn.out_proj.weight")


def _layer_complete(model_cls, c: Qwen35Config, i: int, got: dict) -> bool:
    need = _COMMON + model_cls.mlp_tensors(c, got) + (_ATTN if c.layer_types[i] == "full_attention" else _GDN)
    extra = set(got) - set(need)
    if extra:
        raise ValueError(f"layer {i} ({c.layer_types[i]}): unexpected tensors {sorted(extra)}")
    return all(n in got for n in need)


def _fill_layer(model_cls, layer: HybridLayer, c: Qwen35Config, t: dict, put) -> None:
    put(layer.input_layernorm.weight, t["input_layernorm.weight"])
    put(layer.post_attention_layernorm.weight, t["post_attention_layernorm.weight"])
    model_cls.fill_mlp(layer.mlp, c, t, put)
    m = layer.mixer
    if layer.kind == "full_attention":
        a = "self_attn."
        put(m.qkv, cat([t[a + "q_proj.weight"].T, t[a + "k_proj.weight"].T, t[a + "v_proj.weight"].T]))
        put(m.o, t[a + "o_proj.weight"].T)
        put(m.q_norm.weight, t[a + "q_norm.weight"])
        put(m.k_norm.weight, t[a + "k_norm.weight"])
    else:
        a = "linear_attn."
        put(m.in_proj, cat([t[a + n].T for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                                 "in_proj_a.weight")]))
        conv = t[a + "conv1d.weight"]
        put(m.conv, (np.asarray(conv.dequantize()) if q8.is_quantized(conv) else conv).reshape(
            c.conv_dim, c.linear_conv_kernel_dim))
        put(m.dt_bias, t[a + "dt_bias"])
        put(m.A_log, t[a + "A_log"])
        put(m.norm, t[a + "norm.weight"])
        put(m.out, t[a + "out_proj.weight"].T)


def with_verify_form(model: Qwen35, form: str) -> Qwen35:
    """The same weights with the GDN layers' verify form set to `form` (a new module sharing the
    arrays; `model` itself when it already has it): A/B of the forms on one weight set."""
    if model.config.verify_form == form:
        return model
    gdef, state = nnx.split(model)
    clone = nnx.merge(gdef, state)
    for layer in clone.layers:
        if layer.kind != "full_attention":
            layer.mixer.verify_form = form
    clone.config = dataclasses.replace(model.config, verify_form=form)
    return clone


def init_qwen3_5(config: Qwen35Config, seed: int = 0, dtype="bfloat16") -> Qwen35:
    """Random weights (benchmarks); `init_target(config)` does the same through the family."""
    return Qwen35(config, dtype_of(dtype), rngs=nnx.Rngs(seed))


# ------------------------------------------------------------------------------ the family's faces

def _no_table(config) -> dict:
    return {}        # the family loads its checkpoint itself (Family.load)


# On a ('data', 'model') mesh: rows on 'data' (HybridCache.specs), every parameter replicated but
# the MoE variant's experts, split over 'model' as models/moe.py's expert parallelism expects.
# Tensor parallelism over heads (GDN state split over its v-heads) is not done: a 'model' axis
# repeats the dense work on each of its devices.
RULES = ((r"layers/\d+/mlp/experts/experts_(gate_up|down)", P("model", None, None)),
         (r".*", P()))


def shard(model, mesh):
    """Place a hybrid target on `mesh` by RULES (load_target(..., mesh=) does this; the fused TP
    layout is not used: the layers take their projections whole)."""
    return sharding.shard_model(model, sharding.as_mesh(mesh), fused_layout=False, rules=RULES)


FAMILY = Family(model_type="qwen3_5", read_config=Qwen35Config.from_dict, model=Qwen35,
                layer_weights=_no_table, top_weights=_no_table, rules=RULES, load=load_checkpoint)
# the text model's own config.json (Qwen3_5ForCausalLM); its configs read as model_type qwen3_5
TEXT_FAMILY = dataclasses.replace(FAMILY, model_type="qwen3_5_text")
