"""Attention dispatch: every attention in the target and the draft goes through `attend`.

impl: "xla" (the jnp reference: CPU default), "pallas" (the Pallas kernel of the running backend:
TPU and GPU default), "auto" (pick by backend).
"""

from __future__ import annotations

import jax

from pallas_kernels.reference import block_attention as _reference

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        return "xla"
    return impl


def attend(q, k_cache, v_cache, k_end, impl: str = "xla"):
    """q [B,T,Hq,D] over cache [B,Hkv,C,D]; row t of batch b sees keys [0, k_end[b,t])."""
    impl = resolve_impl(impl)
    if impl == "xla":
        return _reference(q, k_cache, v_cache, k_end)
    raise NotImplementedError("pallas attention not wired yet")
