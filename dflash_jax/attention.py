"""Attention dispatch: every attention in the target and the draft goes through `attend`.

impl (a static string; it picks code at trace time):
  "auto"        TPU/GPU -> the Pallas kernel of that backend, CPU -> "xla"
  "xla"         the jnp reference (queries chunked for long prefill)
  "pallas"      the Pallas kernel of the default backend; on CPU the TPU kernel in interpret mode
                (pltpu.InterpretParams), so the whole decode loop can be tested on CPU
  "pallas_tpu"  force the TPU kernel: ahead-of-time compiles for a TPU from a CPU host, where
                jax.default_backend() is "cpu"
  "pallas_gpu"  force the Triton GPU kernel: jax.export(..., platforms=["cuda"]) from a CPU host
Shapes a kernel cannot tile fall back to the XLA path (pallas_kernels.block_attention does that).

`attend_prefill` is the prompt's causal attention from position 0. On the GPU path a long bf16/fp16
prompt goes to cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) on
the prompt's own K/V: measured faster than our Triton kernel from a few thousand tokens on (H200,
BENCHMARKS.md: T=4096 0.42 ms vs 0.58 ms; at T=512 ours is faster, 63 us vs 72-86 us).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

import pallas_kernels

_log = logging.getLogger(__name__)

# Prompt buckets at or above this length use cuDNN on the GPU path (see the module docstring).
CUDNN_PREFILL_MIN_T = 2048


def _fused_ok(impl: str, T: int) -> bool:
    return (os.environ.get("DFLASH_FUSED_KERNELS", "1") != "0" and 1 <= T <= 64
            and resolve_impl(impl) in ("pallas_gpu", "pallas_gpu_interpret"))


def gpu_interpret(impl: str) -> bool:
    """Whether the GPU kernels of this path run in the Pallas interpreter (CPU tests)."""
    return resolve_impl(impl) == "pallas_gpu_interpret"


def fused_prologue(impl: str, T: int, head_dim: int) -> bool:
    """Whether a target layer's q/k norm, RoPE and cache writes run as one Pallas GPU kernel
    (pallas_kernels.gpu.qk_norm_rope_write) instead of ~6 XLA kernels: the GPU path, blocks of up to
    64 tokens (decode, verify). DFLASH_FUSED_KERNELS=0 in the environment turns the fused kernels
    off (read when a program is traced)."""
    from pallas_kernels import gpu
    return _fused_ok(impl, T) and gpu.prologue_supported(T, head_dim)


def fused_draft(impl: str, T: int) -> bool:
    """Whether the draft's layers take the fused path too (their prologue with the context rows,
    residuals deferred into the next norm)."""
    return _fused_ok(impl, T)


def fused_add_norm(impl: str, T: int, hidden: int) -> bool:
    """Whether `x + attn_out` and the post-attention RMSNorm run as one Pallas GPU kernel
    (pallas_kernels.gpu.add_rmsnorm); same conditions and switch as fused_prologue."""
    from pallas_kernels import gpu
    return _fused_ok(impl, T) and gpu.add_rmsnorm_supported(hidden)


IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")

# What `resolve_impl` returns: the concrete path. "pallas_gpu_interpret" (tests only) runs the GPU
# path, fused kernels included, in the Pallas interpreter on CPU.
_RESOLVED = ("xla", "pallas_tpu", "pallas_gpu", "pallas_interpret", "pallas_gpu_interpret")


def resolve_impl(impl: str) -> str:
    """The concrete path for `impl` on the default backend: one of _RESOLVED (idempotent)."""
    if impl in _RESOLVED:
        return impl
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r}; expected one of {IMPLS}")
    backend = jax.default_backend()
    on_tpu = backend == "tpu"
    on_gpu = backend in ("gpu", "cuda", "rocm")
    if impl == "auto":
        return "pallas_tpu" if on_tpu else "pallas_gpu" if on_gpu else "xla"
    if impl == "pallas":
        return "pallas_tpu" if on_tpu else "pallas_gpu" if on_gpu else "pallas_interpret"
    return impl


def attend(q, k_cache, v_cache, k_end, impl: str = "auto", *, scale: float | None = None):
    """q [B,T,Hq,D] over cache [B,Hkv,C,D]; row t of batch b sees keys [0, k_end[b,t]).

    Returns [B,T,Hq,D] in q.dtype (float32 accumulation); a row with k_end == 0 gives zeros.
    """
    path = resolve_impl(impl)
    if path == "xla":
        return pallas_kernels.xla_block_attention(q, k_cache, v_cache, k_end, scale=scale)
    if path == "pallas_interpret":
        return pallas_kernels.block_attention(q, k_cache, v_cache, k_end, impl="tpu",
                                              scale=scale, interpret=True)
    kernel = "tpu" if path == "pallas_tpu" else "gpu"
    return pallas_kernels.block_attention(q, k_cache, v_cache, k_end, impl=kernel, scale=scale,
                                          interpret=path == "pallas_gpu_interpret")


def attend_prefill(q, k, v, k_cache, v_cache, k_end, impl: str = "auto", *,
                   scale: float | None = None):
    """Causal attention of a prompt written at cache rows [0, T): q [B,T,Hq,D], k/v [B,T,Hkv,D]
    the prompt's own K/V (already in the cache), k_end [B,T] = t + 1.

    Same result as `attend(q, k_cache, v_cache, k_end, impl)`; long prompts on the GPU path run
    cuDNN's fused causal attention on k/v instead. Rows past a prompt's length are padding: they see
    the padded tokens before them, which no caller reads.
    """
    path = resolve_impl(impl)
    T = q.shape[1]
    if (path == "pallas_gpu" and T >= CUDNN_PREFILL_MIN_T
            and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype):
        try:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                implementation="cudnn")
        except Exception as e:  # cuDNN refuses the shape (head_dim, ...): our kernel takes it
            _log.warning("cuDNN prefill attention refused q%s (%s): using the Pallas kernel",
                         q.shape, e)
    return attend(q, k_cache, v_cache, k_end, impl, scale=scale)
