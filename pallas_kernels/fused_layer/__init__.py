"""The fused GPU layer kernels of short blocks (decode, verify, the draft block): the attention
prologue and the residual add + RMSNorm. dflash_jax.attention.fused_prologue / fused_add_norm say
when the layers use them (KernelConfig.fused_layer on the GPU path)."""

from pallas_kernels.fused_layer.add_rmsnorm import add_rmsnorm, add_rmsnorm_supported
from pallas_kernels.fused_layer.prologue import prologue_supported, qk_norm_rope_write

__all__ = ["qk_norm_rope_write", "prologue_supported", "add_rmsnorm", "add_rmsnorm_supported"]
