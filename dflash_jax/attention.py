"""Attention dispatch: every attention in the target and the draft goes through `attend`, on the
backend a resolved `KernelConfig` names (dflash_jax.kernel_config). Shapes a kernel cannot tile
fall back to the XLA path (pallas_kernels.block_attention does that).

`attend_prefill` is the prompt's causal attention from position 0. On the GPU path a long bf16/fp16
prompt goes to cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) on
the prompt's own K/V: faster than our Triton kernel from a few thousand tokens on, slower at a few
hundred (see docs/perf-log.md).

The fused GPU layer kernels (`fused_prologue`, `fused_add_norm`) apply on the GPU path with
`KernelConfig.fused_layer`, to blocks of up to 64 tokens (decode, verify, the draft block). Under a
mesh they run per shard like the attention (`qk_norm_rope_write`, `add_rmsnorm` below): the
prologue on each shard's own heads, which needs qkv in the fused layout of the model axis.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

import pallas_kernels
from dflash_jax import sharding
from dflash_jax.kernel_config import GPU_PATHS, KernelConfig

_log = logging.getLogger(__name__)

# Prompt buckets at or above this length use cuDNN on the GPU path (see the module docstring).
CUDNN_PREFILL_MIN_T = 2048


def _fused_ok(kernels: KernelConfig, T: int) -> bool:
    return kernels.fused and 1 <= T <= 64


def fused_prologue(kernels: KernelConfig, T: int, head_dim: int, groups: int = 1) -> bool:
    """Whether a layer's q/k norm, RoPE and cache writes run as one Pallas GPU kernel
    (pallas_kernels.fused_layer.qk_norm_rope_write) instead of ~6 XLA kernels. groups: the layer's
    qkv layout (DecoderLayer.qkv_groups); the kernel reads a plain [q | k | v] per shard, which
    the layout gives only when it has one group per shard of the active mesh's model axis."""
    from pallas_kernels import fused_layer
    mesh = sharding.current_mesh()
    if groups != (1 if mesh is None else sharding.model_axis_size(mesh)):
        return False
    return _fused_ok(kernels, T) and fused_layer.prologue_supported(T, head_dim)


def fused_add_norm(kernels: KernelConfig, T: int, hidden: int) -> bool:
    """Whether `x + y` and the following RMSNorm run as one Pallas GPU kernel
    (pallas_kernels.fused_layer.add_rmsnorm); same conditions as fused_prologue."""
    from pallas_kernels import fused_layer
    return _fused_ok(kernels, T) and fused_layer.add_rmsnorm_supported(hidden)


def qk_norm_rope_write(qkv, cos, sin, q_weight, k_weight, eps: float, k_cache, v_cache, start,
                       kernels: KernelConfig, *, num_heads: int, ctx_rows: int = 0, ctx_start=None):
    """pallas_kernels.fused_layer.qk_norm_rope_write (same arguments; num_heads the layer's q
    heads), per shard under a mesh (sharding.per_shard_prologue): each shard's q heads are its
    share of num_heads, as its cache holds its share of the kv heads. q_weight / k_weight None: a
    layer without q/k norm (the Llama family), RoPE only."""
    norm = q_weight is not None
    if not norm:   # the kernel's signature takes weights; unused without the norm
        q_weight = k_weight = jnp.ones((2 * cos.shape[-1],), qkv.dtype)
    from pallas_kernels import fused_layer
    Hkv = k_cache.shape[1]

    def fn(qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, start, ctx_start):
        return fused_layer.qk_norm_rope_write(
            qkv, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, start,
            num_heads=num_heads * k_cache.shape[1] // Hkv, ctx_rows=ctx_rows,
            ctx_start=ctx_start if ctx_rows else None, interpret=kernels.interpret, norm=norm)
    # without context rows the kernel ignores ctx_start: start stands in for it (one signature)
    return sharding.per_shard_prologue(fn, qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, start,
                                       start if ctx_start is None else ctx_start)


def add_rmsnorm(x, y, weight, eps: float, kernels: KernelConfig):
    """pallas_kernels.fused_layer.add_rmsnorm(x, y, weight, eps), per data shard under a mesh
    (sharding.per_data_shard): the rows are whole, replicated over 'model'."""
    from pallas_kernels import fused_layer
    fn = lambda x, y, w: fused_layer.add_rmsnorm(x, y, w, eps, interpret=kernels.interpret)
    return sharding.per_data_shard(fn, x, y, weight)


def attend(q, k_cache, v_cache, k_end, kernels: KernelConfig, *, scale: float | None = None, k_start=None,
           ring: bool = False):
    """q [B,T,Hq,D] over cache [B,Hkv,C,D]; row t of batch b sees keys [k_start[b,t], k_end[b,t])
    (k_start None: from 0). kernels: a resolved KernelConfig. A per-row k_start (a sliding-window
    draft layer) runs in the Pallas kernels on one device, else on the XLA path. ring (with
    k_start): the cache is a ring of C slots holding key p in slot p mod C, and k_start / k_end are
    absolute positions, k_end - k_start <= C (a windowed draft layer's cache, cache.write_ring_rows).

    Returns [B,T,Hq,D] in q.dtype (float32 accumulation); a row with k_end == 0 gives zeros.
    """
    path = kernels.attention
    if k_start is not None:
        if path == "pallas_gpu" and sharding.current_mesh() is None:
            return pallas_kernels.block_attention(q, k_cache, v_cache, k_end, impl="gpu", scale=scale,
                                                  interpret=kernels.interpret, k_start=k_start, ring=ring,
                                                  **kernels.gpu_attention_tuning())
        if path in ("pallas_tpu", "pallas_interpret") and sharding.current_mesh() is None:
            return pallas_kernels.block_attention(q, k_cache, v_cache, k_end, impl="tpu", scale=scale,
                                                  interpret=path == "pallas_interpret", k_start=k_start,
                                                  ring=ring)
        return pallas_kernels.xla_block_attention(q, k_cache, v_cache, k_end, scale=scale,
                                                  kv_chunk=kernels.xla_kv_chunk, k_start=k_start, ring=ring)
    if ring:
        raise ValueError("attend(ring=True) needs k_start")
    if path == "xla":   # sharded through jit's propagation (heads and batch stay local)
        return pallas_kernels.xla_block_attention(q, k_cache, v_cache, k_end, scale=scale,
                                                  kv_chunk=kernels.xla_kv_chunk)
    if path == "pallas_interpret":
        fn = lambda q, k, v, e: pallas_kernels.block_attention(q, k, v, e, impl="tpu", scale=scale,
                                                               interpret=True)
    elif path == "pallas_tpu":
        fn = lambda q, k, v, e: pallas_kernels.block_attention(q, k, v, e, impl="tpu", scale=scale)
    else:
        fn = lambda q, k, v, e: pallas_kernels.block_attention(q, k, v, e, impl="gpu", scale=scale,
                                                               interpret=kernels.interpret,
                                                               **kernels.gpu_attention_tuning())
    # A Pallas kernel is one custom call XLA cannot partition: under a mesh it runs per shard
    # (shard_map), each on its batch rows and its kv heads with their q heads.
    return sharding.per_shard(fn, q, k_cache, v_cache, k_end)


# the attention paths whose kernels read K/V through a page table (on one device)
PAGE_READING_PATHS = ("pallas_tpu", "pallas_interpret", "pallas_gpu", "pallas_gpu_interpret")


def reads_pages(kernels: KernelConfig, mesh=None) -> bool:
    """Whether `attend_paged` runs a kernel that reads K/V through a page table (the Pallas TPU and
    GPU paths on one device); else a paged cache's layers attend over gathered views (XLA, a mesh).
    mesh: the models' mesh, when asked outside a trace (inside one, the active mesh)."""
    return kernels.attention in PAGE_READING_PATHS and (mesh if mesh is not None else sharding.current_mesh()) is None


def attend_paged(q, k_pool, v_pool, table, k_end, kernels: KernelConfig, *, scale: float | None = None):
    """q [B,T,Hq,D] over page pools [N, Hkv, page, D] read through table [B, P] (dflash_jax.cache.
    PagedKVCache): pallas_kernels.block_attention_paged on the path of `kernels` (reads_pages)."""
    path = kernels.attention
    impl = "gpu" if path in GPU_PATHS else "tpu"
    tuning = kernels.gpu_attention_tuning() if impl == "gpu" else {}
    return pallas_kernels.block_attention_paged(q, k_pool, v_pool, table, k_end, impl=impl, scale=scale,
                                                interpret=kernels.interpret or path == "pallas_interpret",
                                                **tuning)


def attend_prefill(q, k, v, k_cache, v_cache, k_end, kernels: KernelConfig, *,
                   scale: float | None = None):
    """Causal attention of a prompt written at cache rows [0, T): q [B,T,Hq,D], k/v [B,T,Hkv,D]
    the prompt's own K/V (already in the cache), k_end [B,T] = t + 1.

    Same result as `attend(q, k_cache, v_cache, k_end, kernels)`; long prompts on the GPU path run
    cuDNN's fused causal attention on k/v instead. Rows past a prompt's length are padding: they see
    the padded tokens before them, which no caller reads.
    """
    T = q.shape[1]
    if (kernels.attention == "pallas_gpu" and T >= CUDNN_PREFILL_MIN_T
            and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype):
        try:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                implementation="cudnn")
        except Exception as e:  # cuDNN refuses the shape (head_dim, ...): our kernel takes it
            pallas_kernels.warn_once(_log, f"cudnn: {type(e).__name__}: {e}", "cuDNN prefill attention "
                                     "refused q%s (%s): using the Pallas kernel", q.shape, e)
    if kernels.attention == "xla" and T < k_cache.shape[2]:
        # every key a prompt row sees lies in rows [0, T): the XLA path's prefill is dense over the
        # keys it is given, so the rest of the capacity would be scored and masked. A static slice,
        # fused into the score dot (the Pallas kernels stop at k_end themselves).
        k_cache, v_cache = k_cache[:, :, :T], v_cache[:, :, :T]
    return attend(q, k_cache, v_cache, k_end, kernels, scale=scale)
