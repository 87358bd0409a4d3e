"""What the Pallas kernels of every family share: the Unsupported error (a shape a kernel cannot
tile; callers fall back to XLA), the block-attention shape contract, small integer helpers, the
Triton module import, and the online-softmax step of the block-attention kernels."""

from __future__ import annotations

import contextlib
import warnings

import jax.numpy as jnp
from jax import lax

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton  # noqa: F401  (re-exported)

# A finite "minus infinity": exp(MASK - m) underflows to 0 without the inf - inf = nan of -inf.
MASK = -1e30
HEAD_DIMS = (64, 128, 256)


class Unsupported(ValueError):
    """The shape cannot be tiled for this kernel; callers fall back to the reference."""


# (logger name, reason) pairs already logged by warn_once: a fallback is traced once per layer and
# per program, so the same reason would otherwise be printed dozens of times a run.
_WARNED: set[tuple[str, str]] = set()


def warn_once(log, reason: str, msg: str, *args) -> bool:
    """log.warning(msg, *args) the first time this process meets `reason` on `log`; True if logged."""
    key = (log.name, reason)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    log.warning(msg, *args)
    return True


def precision(dtype):
    # f32 inputs: full-precision passes (the default is TF32 on GPU, bf16 passes on some TPUs).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def quiet_triton():
    """A context that silences the Pallas Triton backend's deprecation warning (JAX 0.11)."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
    return stack


def check_shapes(q, k_cache, v_cache, k_end):
    """Shape errors that no backend can handle (as opposed to Unsupported tilings)."""
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [B,T,Hq,D] and k_cache [B,Hkv,C,D]; got {q.shape}, {k_cache.shape}")
    B, T, Hq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape} (batch, head_dim)")
    if Hq % k_cache.shape[1]:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={k_cache.shape[1]}")
    if k_end.shape != (B, T):
        raise ValueError(f"k_end must be [B,T]={(B, T)}; got {k_end.shape}")


def online_softmax_step(q, k, load_v, m, l, acc, *, scale: float, visible=None, exp=jnp.exp):
    """One KV tile of the online softmax, as every block-attention kernel runs it.

    q [R, D], k [bk, D]; load_v() -> v [bk, D] (loaded where the caller's kernel loads it);
    m, l [R] or [R, 1] float32 (running max, in the units of `exp`, and sum), acc [R, D] float32.
    visible: None (every key visible) or a function of nothing -> bool [R, bk], masked to MASK.
    exp: jnp.exp, or jnp.exp2 with `scale` already multiplied by log2(e).
    Returns (m, l, acc) after the tile."""
    keep = m.ndim == 2
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=precision(q.dtype)) * scale                    # [R, bk]
    vis = None
    if visible is not None:
        vis = visible()
        s = jnp.where(vis, s, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keep))
    alpha = exp(m - m_new)
    p = exp(s - (m_new if keep else m_new[:, None]))                             # [R, bk]
    if vis is not None:
        # A row with nothing visible yet has m_new == MASK and exp(0) == 1: zero it.
        p = jnp.where(vis, p, 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=keep)
    v = load_v()
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=precision(v.dtype))  # [R, D]
    acc = acc * (alpha if keep else alpha[:, None]) + pv
    return m_new, l, acc
