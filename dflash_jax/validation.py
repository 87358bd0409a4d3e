"""The one validation layer: every check of user input that both the library and the CLIs make.

The library (`generate`, `load_*`) calls these before anything is allocated; the CLIs call the same
functions as early as they know the values (before weights load where they can) and turn the
`ValueError` into a one-line usage error (exit 2). Messages name the value and the limit it broke.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

__all__ = ["DTYPES", "DTYPE_ALIASES", "MAX_STOP_IDS", "INT32_MAX", "SEED_LIMIT", "is_int", "dtype_name",
           "check_seed", "check_max_new_tokens", "check_capacity", "check_top_k", "check_prompts",
           "check_stop_ids", "check_lengths", "check_source", "MAX_BLOCK_SIZE", "check_block_size",
           "check_on_commit"]

# Accepted `dtype` names, the same in the library and on the command line.
DTYPES = ("bfloat16", "float32", "float16")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "f32": "float32", "f16": "float16"}
# Stop ids travel as one fixed-width array (a traced value, not a compile key), -1 padded.
MAX_STOP_IDS = 16
INT32_MAX = (1 << 31) - 1
# A draft block is verified as one forward of S rows per step: the public drafts use 16 (DFlash-2: 8),
# the GPU layer kernels take blocks of up to 64 rows, and a block of thousands of rows runs, but
# each step costs as much as a prefill of that length while acceptance stays near the trained τ.
MAX_BLOCK_SIZE = 64
SEED_LIMIT = 1 << 32  # seeds are uint32 on the device


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def dtype_name(dtype: str) -> str:
    """The canonical name of a dtype string ('bf16' → 'bfloat16'), or ValueError listing the names."""
    name = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else None
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {', '.join(DTYPES)} "
                         f"(aliases {', '.join(DTYPE_ALIASES)})")
    return name


def check_seed(seed) -> int:
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    return int(seed)


def check_max_new_tokens(max_new_tokens, max_position_embeddings: int | None = None) -> int:
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if max_position_embeddings is not None and max_new_tokens >= max_position_embeddings:
        raise ValueError(f"max_new_tokens {max_new_tokens} is beyond the model's context: "
                         f"max_position_embeddings is {max_position_embeddings} (prompt included)")
    if max_new_tokens > INT32_MAX // 2:
        raise ValueError(f"max_new_tokens {max_new_tokens} overflows the int32 lengths of the loop")
    return int(max_new_tokens)


def check_capacity(capacity) -> int | None:
    if capacity is None:
        return None
    if not is_int(capacity) or not 1 <= capacity <= INT32_MAX // 2:
        raise ValueError(f"capacity must be an integer in [1, {INT32_MAX // 2}] (KV-cache entries) or None, "
                         f"got {capacity!r}")
    return int(capacity)


def check_top_k(top_k, vocab_size: int) -> None:
    if is_int(top_k) and top_k > vocab_size:
        raise ValueError(f"top_k {top_k} is above the vocabulary size {vocab_size} (0 = off)")


def check_lengths(prompt_lengths: Sequence[int], max_new_tokens: int, max_position_embeddings: int) -> None:
    """The true (unpadded) prompt lengths plus max_new_tokens must fit the model's positions."""
    longest = max(prompt_lengths)
    if longest >= max_position_embeddings:
        raise ValueError(f"prompt of {longest} tokens does not fit the model's max_position_embeddings "
                         f"{max_position_embeddings}")
    if longest + max_new_tokens > max_position_embeddings:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = "
                         f"{longest + max_new_tokens} exceeds the model's max_position_embeddings "
                         f"{max_position_embeddings}; lower max_new_tokens to at most "
                         f"{max_position_embeddings - longest}")


def check_prompts(prompts, vocab: int) -> list[np.ndarray]:
    """A non-empty list of non-empty flat token-id lists inside the vocabulary → int32 arrays."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(is_int(p) for p in prompts):
        raise ValueError("prompts must be a list of token-id lists, got one flat list of ints "
                         "(wrap a single prompt: [ids])")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompt {i} is text ({type(p).__name__}); generate takes token ids "
                             "(use dflash_jax.generate_text for text)")
        if isinstance(p, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in p):
            # numpy would read [1, True] as [1, 1]: a bool is no token id
            raise ValueError(f"prompt {i} holds booleans (True / False), not token ids")
        try:
            a = np.asarray(p)
        except (ValueError, TypeError):  # ragged nesting: numpy refuses the inhomogeneous shape
            raise ValueError(f"prompt {i} must be a flat list of token ids, got a ragged nested list") from None
        if a.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids, got shape {a.shape}")
        if a.size == 0:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"prompt {i} holds non-integer values ({a.dtype})")
        if a.min() < 0 or a.max() >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        out.append(a.astype(np.int32))
    return out


def check_stop_ids(stop_token_ids, vocab: int) -> list[int]:
    if stop_token_ids is None:
        return []
    if is_int(stop_token_ids):
        stop_token_ids = [stop_token_ids]
    ids = list(np.asarray(stop_token_ids).reshape(-1).tolist()) if not isinstance(stop_token_ids, (list, tuple, set)) \
        else list(stop_token_ids)
    if not all(is_int(t) for t in ids):
        raise ValueError(f"stop_token_ids must be integer token ids, got {stop_token_ids!r}")
    stop = sorted({int(t) for t in ids})
    if any(not 0 <= t < vocab for t in stop):
        raise ValueError(f"stop_token_ids {stop} has ids outside the vocabulary [0, {vocab})")
    if len(stop) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} distinct stop_token_ids are supported, got {len(stop)}")
    return stop


def check_on_commit(on_commit) -> None:
    if on_commit is not None and not callable(on_commit):
        raise TypeError(f"on_commit must be a callable (rows -> bool | None) or None, got {on_commit!r}")


def check_source(path_or_hub_id: Any, what: str = "path_or_hub_id") -> str:
    if not isinstance(path_or_hub_id, str) or not path_or_hub_id.strip():
        raise ValueError(f"{what} must be a local directory or a hub id 'org/name', got {path_or_hub_id!r}")
    return path_or_hub_id


def positive_int(value, name: str, what: str, minimum: int = 1) -> int:
    """A config field that must be an integer >= minimum (floats with an integral value are accepted)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value != int(value) or value < minimum):
        raise ValueError(f"{what}: {name}={value!r} must be an integer >= {minimum}")
    return int(value)


def finite_float(value, name: str, what: str, *, positive: bool = False) -> float:
    """A config field that must be a finite number (> 0 with positive=True, else >= 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ValueError(f"{what}: {name}={value!r} must be a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def check_block_size(block_size, what: str = "draft") -> int:
    """A draft's block size: an integer in [1, MAX_BLOCK_SIZE]."""
    if not is_int(block_size) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"{what}: block_size={block_size!r} must be an integer in [1, {MAX_BLOCK_SIZE}] "
                         f"(the public drafts use 16)")
    return int(block_size)


def free_memory() -> tuple[int | None, str]:
    """(bytes free for new buffers, where) on the first local device: the accelerator's own memory
    stats where it has them; host RAM on CPU; (None, ...) where neither is known."""
    import os

    import jax

    dev = jax.local_devices()[0]
    try:
        st = dev.memory_stats()
    except Exception:  # noqa: BLE001  (a backend without memory stats)
        st = None
    if st and st.get("bytes_limit"):
        return int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0)), f"{dev.device_kind} memory"
    if dev.platform != "cpu":
        return None, dev.device_kind
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host RAM (available)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host RAM (free)"
    except (ValueError, OSError, AttributeError):
        return None, "host RAM"
