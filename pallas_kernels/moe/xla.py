"""The portable grouped matmul: XLA's `jax.lax.ragged_dot`. Correct on every backend; its weight
traffic is the lowering's (on GPU it streams every group's matrix whatever the routing, see
docs/moe.md), so it is the CPU path and the baseline the kernels beat."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm_xla(lhs, rhs, group_sizes):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M) -> [M, N] in lhs's dtype; rows
    past sum(group_sizes) are zero."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                              preferred_element_type=jnp.float32).astype(lhs.dtype)
