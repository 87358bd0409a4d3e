"""The MoE block's grouped matmul: rows sorted by expert times each expert's matrix.

  reference.py  the oracle (a masked dense matmul per group)
  xla.py        `jax.lax.ragged_dot` (CPU, and the GPU baseline)
  tpu.py        Pallas Mosaic TPU kernel that schedules only non-empty groups (weights of experts
                no token chose are never read)

`gmm(lhs, rhs, group_sizes, impl=)` dispatches on the resolved `KernelConfig.moe_gmm`."""

from __future__ import annotations

from pallas_kernels.moe.reference import gmm_reference
from pallas_kernels.moe.xla import gmm_xla

__all__ = ["gmm", "gmm_reference", "gmm_xla", "GMM_IMPLS"]

# resolved implementations: the XLA op, the TPU kernel, the TPU kernel in the interpreter (tests)
GMM_IMPLS = ("xla", "pallas_tpu", "pallas_tpu_interpret")


def gmm(lhs, rhs, group_sizes, impl: str = "xla"):
    """lhs [M, K] rows grouped by expert, rhs [E, K, N], group_sizes [E] -> [M, N] (rows past the
    groups are zero)."""
    if impl == "xla":
        return gmm_xla(lhs, rhs, group_sizes)
    if impl in ("pallas_tpu", "pallas_tpu_interpret"):
        from pallas_kernels.moe import tpu
        return tpu.gmm(lhs, rhs, group_sizes, interpret=impl == "pallas_tpu_interpret")
    raise ValueError(f"gmm impl={impl!r}; expected one of {GMM_IMPLS}")
