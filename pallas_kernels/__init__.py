"""Pallas kernels for DFlash, one folder per kernel family, each kernel beside its reference:

  attention/     block attention: reference.py (the jnp oracle), tpu.py (Mosaic TPU), gpu.py (Triton),
                 merge.py (the split-KV merge), tpu_cache_write.py (the TPU path's K/V row write,
                 caches kept in HBM); `block_attention` dispatches, `xla_block_attention` is the
                 reference with long prompts tiled; paged.py: `block_attention_paged`, the same
                 over a paged cache (page pools read through a page table)
  fused_layer/   the GPU path's fused decoder-layer kernels: the attention prologue (q/k norm, RoPE,
                 cache writes) and the residual add + RMSNorm
  sampling/      the GPU path's top-k / top-p threshold search kernels
  quantized/     matmuls of few rows against 8-bit weights (int8, FP8 block-scaled) on the GPU
  _common.py     what they share: Unsupported, warn_once (a fallback said once per reason), the
                 shape contract, the online-softmax step
"""

from pallas_kernels._common import Unsupported, warn_once
from pallas_kernels.attention import (IMPLS, block_attention, block_attention_paged, default_impl,
                                      reference_block_attention, xla_block_attention,
                                      xla_block_attention_paged)

__all__ = ["block_attention", "reference_block_attention", "xla_block_attention", "IMPLS",
           "Unsupported", "default_impl", "warn_once", "block_attention_paged", "xla_block_attention_paged"]
