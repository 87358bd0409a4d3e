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
"""

from __future__ import annotations

import jax

import pallas_kernels

IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")

# What `resolve_impl` returns: the concrete path.
_RESOLVED = ("xla", "pallas_tpu", "pallas_gpu", "pallas_interpret")


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
    return pallas_kernels.block_attention(q, k_cache, v_cache, k_end, impl=kernel, scale=scale)
