"""The loader seam: what every model family reads a checkpoint through.

A dtype from its name (`dtype_of`), a model directory from a local path or a hub id
(`resolve_model_dir`), a checkpoint's safetensors files (`safetensors_files`) and its tensors one at
a time (`iter_tensors`). dflash_jax.weights (the tabled families and the drafts) and a family with
its own loader (models/qwen3_5.py) both use these; this module imports no model, so no family and
no loader import each other in a circle. Safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp

from dflash_jax import validation

__all__ = ["DTYPES", "dtype_of", "resolve_model_dir", "safetensors_files", "iter_tensors"]

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def dtype_of(dtype):
    """A dtype from its name (validation.DTYPES or an alias, as on the command line) or a dtype."""
    if isinstance(dtype, str):
        return DTYPES[validation.dtype_name(dtype)]
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}; expected one of {', '.join(validation.DTYPES)}") from None
    if dt not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"dtype={dt}; expected one of {', '.join(validation.DTYPES)}")
    return dt


def is_hub_id(source: str) -> bool:
    """`source` has the shape of a hub id, org/name, and not of a local path."""
    return not (os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") != 1)


def resolve_model_dir(path_or_hub_id: str) -> str:
    """A local directory as is; otherwise a hub id fetched (config, safetensors, tokenizer files only).

    Offline (HF_HUB_OFFLINE=1, read by huggingface_hub), a hub id resolves from the local cache alone."""
    validation.check_source(path_or_hub_id)
    if os.path.isdir(path_or_hub_id):
        return path_or_hub_id
    if not is_hub_id(path_or_hub_id):
        raise FileNotFoundError(f"model directory {path_or_hub_id!r} does not exist (and it is not a hub id 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return snapshot_download(path_or_hub_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"])
    except LocalEntryNotFoundError:
        # offline (set by the user, or by the CLIs when the hub is unreachable): huggingface_hub's own
        # advice, HF_HUB_OFFLINE=0, would only make an unreachable hub retry
        import huggingface_hub.constants as hc
        raise FileNotFoundError(f"{path_or_hub_id!r} is not in the local hub cache ({hc.HF_HUB_CACHE}) and the hub "
                                f"is offline; download it on a machine that reaches the hub (`hf download "
                                f"{path_or_hub_id}`, then copy the cache) or give a local directory") from None
    except Exception as e:  # unknown repo, gated, ...: say which and why
        raise FileNotFoundError(f"could not fetch {path_or_hub_id!r} from the hub: {type(e).__name__}: {e}") from None


def safetensors_files(d: str) -> list[str]:
    """The safetensors files of checkpoint directory `d` (by its index when sharded); a directory of
    pickle weights only is refused, naming how to convert them."""
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(d, x) for x in files]
    files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    if not files:
        pickles = [os.path.basename(p) for p in glob.glob(os.path.join(d, "*.bin")) + glob.glob(os.path.join(d, "*.pt")) + glob.glob(os.path.join(d, "*.pth"))]
        if pickles:
            raise ValueError(f"{d} holds only pickle weights ({', '.join(sorted(pickles)[:3])}); dflash-jax loads "
                             "safetensors only and never unpickles. Convert them first, e.g. "
                             "`model.save_pretrained(dir, safe_serialization=True)` in transformers.")
        raise FileNotFoundError(f"no *.safetensors weights in {d}")
    return files


# safetensors dtypes NumPy has no type for (safetensors' flax / numpy readers fail on them): read
# from the file's bytes as ml_dtypes' types (FP8 checkpoints' weights)
RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _raw_entries(path: str) -> dict:
    """name → (ml_dtypes type name, shape, absolute byte range) of the tensors of safetensors file
    `path` whose dtype is one of RAW_DTYPES (its JSON header only is read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {name: (RAW_DTYPES[e["dtype"]], tuple(e["shape"]), (8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1]))
            for name, e in header.items() if name != "__metadata__" and e.get("dtype") in RAW_DTYPES}


def _read_raw(path: str, entry):
    import ml_dtypes
    import numpy as np
    kind, shape, (start, end) = entry
    data = np.fromfile(path, dtype=np.uint8, count=end - start, offset=start)
    return jnp.asarray(data.view(getattr(ml_dtypes, kind)).reshape(shape))


def iter_tensors(d: str):
    """(name, array) for every tensor of checkpoint directory `d`, one at a time (a file that is not
    readable safetensors is a one-line ValueError naming it). float8 tensors come as ml_dtypes'
    float8 arrays."""
    from safetensors import safe_open
    for path in safetensors_files(d):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} (listed in the safetensors index) does not exist")
        try:
            raw = _raw_entries(path)
            with safe_open(path, framework="flax") as f:
                names = list(f.keys())
                for name in names:
                    yield name, _read_raw(path, raw[name]) if name in raw else f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - SafetensorError and friends: truncated, empty, not safetensors
            raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None
