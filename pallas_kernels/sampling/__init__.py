"""The sampling search kernels of the GPU path (KernelConfig.sampling_kernels)."""

from pallas_kernels.sampling.search import (COUNT_BLOCK, GATHER_MAX, count_layout, count_pass,
                                            gather_above)

__all__ = ["count_pass", "count_layout", "gather_above", "GATHER_MAX", "COUNT_BLOCK"]
