"""The grouped matmul's oracle: rows [M, K] in groups of consecutive rows (group g holds
`group_sizes[g]` rows, in group order from row 0), each multiplied by its group's matrix
rhs[g] [K, N]; rows past the last group are zero. Written as one dense matmul per group under a row
mask, so it shares nothing with the XLA (`jax.lax.ragged_dot`) or Pallas paths it checks."""

from __future__ import annotations

import jax.numpy as jnp


def gmm_reference(lhs, rhs, group_sizes):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M) -> [M, N] in lhs's dtype,
    accumulated in float32."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jnp.arange(lhs.shape[0])[:, None]                                         # [M, 1]
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        y = jnp.dot(lhs, rhs[g], preferred_element_type=jnp.float32)                # [M, N]
        out = jnp.where((row >= starts[g]) & (row < ends[g]), y, out)
    return out.astype(lhs.dtype)
