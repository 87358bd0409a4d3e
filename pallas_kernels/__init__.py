"""Block attention for DFlash: one signature, several backends.

`block_attention(q[B,T,Hq,D], k_cache[B,Hkv,C,D], v_cache[B,Hkv,C,D], k_end[B,T]) -> [B,T,Hq,D]`,
row t of batch b attending keys [0, k_end[b, t]). `reference.block_attention` is the oracle.
"""

from pallas_kernels.reference import block_attention as reference_block_attention

__all__ = ["reference_block_attention"]
