"""HF safetensors → our modules: `load_target`, `load_draft`, and random `init_target` / `init_draft`.

Safetensors only: nothing is unpickled and no remote code is run. Tensors are streamed one at a time
(cast, transposed to [in, out], fused into qkv / gate_up once a layer's parts are all read) into a
module built abstractly (`nnx.eval_shape`), so peak host memory stays near one tensor.
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import validation
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.modeling.draft import DFlashDraft
from dflash_jax.modeling.qwen3 import Qwen3

__all__ = ["load_target", "load_draft", "init_target", "init_draft", "resolve_model_dir"]

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def _dtype(dtype):
    """A dtype from its name (validation.DTYPES or an alias, as on the command line) or a dtype."""
    if isinstance(dtype, str):
        return _DTYPES[validation.dtype_name(dtype)]
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}; expected one of {', '.join(validation.DTYPES)}") from None
    if dt not in [jnp.dtype(d) for d in _DTYPES.values()]:
        raise ValueError(f"dtype={dt}; expected one of {', '.join(validation.DTYPES)}")
    return dt


def resolve_model_dir(path_or_hub_id: str) -> str:
    """A local directory as is; otherwise a hub id fetched (config, safetensors, tokenizer files only).

    Offline (HF_HUB_OFFLINE=1, read by huggingface_hub), a hub id resolves from the local cache alone."""
    validation.check_source(path_or_hub_id)
    if os.path.isdir(path_or_hub_id):
        return path_or_hub_id
    if os.path.exists(path_or_hub_id) or path_or_hub_id.startswith((".", "/", "~")) or path_or_hub_id.count("/") != 1:
        raise FileNotFoundError(f"model directory {path_or_hub_id!r} does not exist (and it is not a hub id 'org/name')")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(path_or_hub_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated: say which and why
        raise FileNotFoundError(f"could not fetch {path_or_hub_id!r} from the hub: {type(e).__name__}: {e}") from None


def _safetensors_files(d: str) -> list[str]:
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


def _iter_tensors(d: str):
    from safetensors import safe_open
    for path in _safetensors_files(d):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} (listed in the safetensors index) does not exist")
        try:
            with safe_open(path, framework="flax") as f:
                names = list(f.keys())
                for name in names:
                    yield name, f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - SafetensorError and friends: truncated, empty, not safetensors
            raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_LAYER_LEAVES = {  # HF leaf name → (our path inside the layer, part of a fused matrix or None)
    "input_layernorm.weight": (("input_layernorm", "weight"), None),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), None),
    "self_attn.q_norm.weight": (("q_norm", "weight"), None),
    "self_attn.k_norm.weight": (("k_norm", "weight"), None),
    "self_attn.o_proj.weight": (("o",), "T"),
    "self_attn.q_proj.weight": (("qkv",), ("q", "k", "v")),
    "self_attn.k_proj.weight": (("qkv",), ("q", "k", "v")),
    "self_attn.v_proj.weight": (("qkv",), ("q", "k", "v")),
    "mlp.gate_proj.weight": (("mlp", "gate_up"), ("gate", "up")),
    "mlp.up_proj.weight": (("mlp", "gate_up"), ("gate", "up")),
    "mlp.down_proj.weight": (("mlp", "down"), "T"),
}


def _variable(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _part_widths(config) -> dict[str, int]:
    """Output widths of the parts of our fused matrices: qkv = [q | k | v], gate_up = [gate | up]."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q": q, "k": kv, "v": kv, "gate": config.intermediate_size, "up": config.intermediate_size}


def _map_tensor(name: str, top_level: dict, model, flat, what: str):
    """THE mapping from a checkpoint tensor to our parameter: (our path, how, part key, expected HF
    shape), or None for a tensor this model does not have. `how`: None (as is), "T" (transposed to
    [in, out]) or the fused parts' order; shapes are the HF tensor's own, so errors name HF terms."""
    if name in top_level:
        path, how = top_level[name]
        key = None
    else:
        m = _LAYER.match(name)
        if not (m and m.group(2) in _LAYER_LEAVES):
            return None
        sub, how = _LAYER_LEAVES[m.group(2)]
        path = ("layers", int(m.group(1))) + sub
        if path not in flat:
            raise ValueError(f"{what}: checkpoint has {name} but the config has {len(model.layers)} layers")
        key = m.group(2).split(".")[-2].replace("_proj", "") if isinstance(how, tuple) else None
    ours = tuple(_variable(model, path).get_value().shape)
    if how is None:
        want = ours
    elif how == "T":
        want = ours[::-1]
    else:  # HF [out, in] of one part; ours is [in, sum of the parts' out]
        want = (_part_widths(model.config)[key], ours[0])
    return path, how, key, want


def _fill(model, named_tensors, top_level: dict, dtype, what: str, skip=(), expect_later=()):
    """Stream (hf_name, array) pairs into the abstract `model`; every parameter must be set once
    (but those of `expect_later`, paths the caller sets itself: a family's own tensors).

    Each tensor is checked against the shape the config implies for it (named as in the checkpoint)
    and for non-finite values before it is cast and placed."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    todo = set(flat) - set(expect_later)
    parts: dict[tuple, dict[str, jax.Array]] = {}

    def put(path, arr):
        _variable(model, path).set_value(arr.astype(dtype))
        todo.discard(path)

    for name, t in named_tensors:
        mapped = _map_tensor(name, top_level, model, flat, what)
        if mapped is None:
            if not any(re.fullmatch(s, name) for s in skip):
                raise ValueError(f"{what}: unexpected tensor {name!r} in the checkpoint")
            continue
        path, how, key, want = mapped
        if tuple(t.shape) != want:
            raise ValueError(f"{what}: tensor {name} has shape {tuple(t.shape)}, the config implies {want}")
        if not jnp.issubdtype(t.dtype, jnp.floating):  # int8 / bool / int: quantised or not weights at all
            raise ValueError(f"{what}: tensor {name} has dtype {jnp.dtype(t.dtype).name}; weights must be "
                             "floating point (float32, bfloat16, float16)")
        if not bool(jnp.isfinite(t).all()):
            raise ValueError(f"{what}: tensor {name} holds NaN or inf values")
        if how is None:
            put(path, t)
        elif how == "T":
            put(path, t.T)
        else:  # one part of a fused matrix: keep it until all parts are read
            got = parts.setdefault(path, {})
            got[key] = t.T.astype(dtype)
            if all(p in got for p in how):
                put(path, jnp.concatenate([got[p] for p in how], axis=1))
                del parts[path]
    if todo:
        names = sorted(".".join(map(str, p)) for p in todo)
        raise ValueError(f"{what}: checkpoint lacks {len(names)} parameter(s): {', '.join(names[:6])}"
                         + (" ..." if len(names) > 6 else ""))
    return model


def load_target(path_or_hub_id: str, dtype="bfloat16", *, mesh=None) -> Qwen3:
    """A Qwen3 causal LM from a HF directory or hub id (config.json + safetensors, sharded or not).
    mesh (a Mesh or a spec such as "data=2,model=4"): placed on it by sharding.RULES in the fused
    TP layout, each process reading only its devices' slices (sharding.load_target_sharded)."""
    from dflash_jax import sharding
    m = sharding.as_mesh(mesh)
    if m is not None:
        return sharding.load_target_sharded(path_or_hub_id, m, dtype)
    dt = _dtype(dtype)
    d = resolve_model_dir(path_or_hub_id)
    config = TargetConfig.from_pretrained(d)
    model = nnx.eval_shape(lambda: Qwen3(config, dt, rngs=nnx.Rngs(0)))
    top = {"model.embed_tokens.weight": (("embed",), None), "model.norm.weight": (("norm", "weight"), None)}
    skip = [r"lm_head\.weight"] if config.tie_word_embeddings else []
    if not config.tie_word_embeddings:
        top["lm_head.weight"] = (("lm_head",), "T")
    skip += [r".*rotary_emb\.inv_freq"]
    return _fill(model, _iter_tensors(d), top, dt, f"target {path_or_hub_id}", skip)


def load_draft(path_or_hub_id: str, target: Qwen3 | None = None, dtype="bfloat16", *, mesh=None) -> DFlashDraft:
    """A z-lab DFlash draft. With `target`, a draft that does not fit it is refused, naming the mismatch.
    mesh: as load_target (the draft sits on the target's mesh with the same rules)."""
    from dflash_jax import sharding
    dt = _dtype(dtype)
    d = resolve_model_dir(path_or_hub_id)
    config = DraftConfig.from_pretrained(d)
    if target is not None:
        config.check_fits(target.config)
    m = sharding.as_mesh(mesh)
    if m is not None:
        return sharding.load_draft_sharded(d, m, dtype)
    model = nnx.eval_shape(lambda: DFlashDraft(config, dt, rngs=nnx.Rngs(0)))
    top = {"fc.weight": (("fc",), "T"), "hidden_norm.weight": (("hidden_norm", "weight"), None),
           "norm.weight": (("norm", "weight"), None)}
    return _fill(model, _iter_tensors(d), top, dt, f"draft {path_or_hub_id}", [r".*rotary_emb\.inv_freq"])


def init_target(config: TargetConfig | str, seed: int = 0, dtype="bfloat16") -> Qwen3:
    """Random weights (for benchmarks on machines without checkpoints). `config` may be a preset name."""
    if isinstance(config, str):
        config = TargetConfig.preset(config)
    return Qwen3(config, _dtype(dtype), rngs=nnx.Rngs(validation.check_seed(seed)))


def init_draft(config: DraftConfig, seed: int = 0, dtype="bfloat16", target: Qwen3 | None = None) -> DFlashDraft:
    if target is not None:
        config.check_fits(target.config)
    return DFlashDraft(config, _dtype(dtype), rngs=nnx.Rngs(validation.check_seed(seed)))
