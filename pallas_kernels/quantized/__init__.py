"""Matmuls against 8-bit weights (int8 per column, FP8 block-scaled) that read the weight once:
gpu.py (Triton, few rows). dflash_jax.models.layers.linear uses it on CUDA."""
