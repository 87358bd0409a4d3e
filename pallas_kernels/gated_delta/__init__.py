"""The gated delta rule of Gated DeltaNet layers (Qwen3.5 hybrid targets) as Pallas kernels: the
GPU path's fused block kernel (conv, gates, l2 norms, the per-token delta-rule updates over a
verify or decode block, the gated output norm, the fold's records) in `gpu.py`.
KernelConfig.gdn picks it; dflash_jax/models/qwen3_5.py calls it."""

from pallas_kernels.gated_delta.gpu import block_supported, fold_deltas, gdn_block

__all__ = ["gdn_block", "fold_deltas", "block_supported"]
