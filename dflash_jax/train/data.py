"""Training data: token ids with a loss mask over the response span, stored once as sharded `.npy`
arrays (rows padded to the run's max length) with a `manifest.json`.

`regenerate` renders each prompt with the evaluation chat template (thinking off unless asked), lets
the target answer with our own batched `generate` (T = 0 by default) and writes shards as it goes;
the manifest records how many prompts are done, so a killed regeneration continues where it stopped.
`TokenData` reads a data directory (memory-mapped) or wraps arrays built in memory."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Sequence

import numpy as np

__all__ = ["TokenData", "DataError", "write_shard", "regenerate", "build_rows"]

MANIFEST = "manifest.json"


class DataError(ValueError):
    """A data set that cannot train a draft (named problem)."""


@dataclasses.dataclass
class TokenData:
    tokens: np.ndarray       # [M, T] int32, padded
    loss_mask: np.ndarray    # [M, T] uint8: 1 on response tokens

    def __post_init__(self):
        if self.tokens.shape != self.loss_mask.shape or self.tokens.ndim != 2:
            raise DataError(f"tokens {self.tokens.shape} and loss_mask {self.loss_mask.shape} must be the same [rows, length]")
        lm = np.asarray(self.loss_mask, bool)
        valid = (lm[:, :-1] & lm[:, 1:]).any(axis=1)
        if not valid.any():
            raise DataError("the data set has no row with two consecutive response tokens (loss_mask): "
                            "nothing to train on; check the chat template and the response spans")
        self.rows_without_anchor = int((~valid).sum())

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def from_dir(cls, path: str) -> "TokenData":
        man = os.path.join(path, MANIFEST)
        if not os.path.isfile(man):
            raise DataError(f"{path} has no {MANIFEST}; write one with `python -m dflash_jax.train regenerate`")
        with open(man) as f:
            m = json.load(f)
        if not m["shards"]:
            raise DataError(f"{path}: the manifest lists no shards")
        toks = [np.load(os.path.join(path, s["tokens"]), mmap_mode="r") for s in m["shards"]]
        masks = [np.load(os.path.join(path, s["loss_mask"]), mmap_mode="r") for s in m["shards"]]
        return cls(np.concatenate(toks).astype(np.int32), np.concatenate(masks).astype(np.uint8))

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int, pad_id: int = 0):
        """rows of (token ids, loss mask), truncated / padded to max_len."""
        tok = np.full((len(rows), max_len), pad_id, np.int32)
        lm = np.zeros((len(rows), max_len), np.uint8)
        for i, (t, m) in enumerate(rows):
            n = min(len(t), max_len)
            tok[i, :n] = np.asarray(t[:n])
            lm[i, :n] = np.asarray(m[:n])
        return cls(tok, lm)


def build_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]):
    """(prompt + response ids, mask 0 over the prompt and 1 over the response) per row."""
    return [(list(p) + list(r), [0] * len(p) + [1] * len(r)) for p, r in zip(prompts, responses)]


def _read_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _write_manifest(out_dir: str, m: dict) -> None:
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(m, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))   # atomic: a kill never leaves half a manifest


def write_shard(out_dir: str, index: int, data: TokenData) -> dict:
    names = dict(tokens=f"shard_{index:05d}.tokens.npy", loss_mask=f"shard_{index:05d}.mask.npy")
    np.save(os.path.join(out_dir, names["tokens"]), data.tokens)
    np.save(os.path.join(out_dir, names["loss_mask"]), data.loss_mask)
    return dict(names, rows=len(data))


def regenerate(target, prompts: Sequence[Sequence[int]], out_dir: str, *, max_len: int = 3072,
               max_new_tokens: int = 1024, temperature: float = 0.0, stop_token_ids=None,
               batch_size: int = 16, shard_rows: int = 1024, seed: int = 0, attention_impl: str = "auto",
               source: dict | None = None, progress: bool = True) -> TokenData:
    """Responses of `target` (plain autoregressive `generate`, our own loop) to token-id `prompts`,
    written to `out_dir` as shards of up to `shard_rows` rows. Resumable: prompts already recorded in
    the manifest are skipped (the manifest's `source` must match). Rows whose response has fewer than
    two tokens are kept out. Returns the whole data set."""
    from dflash_jax.decode import generate

    os.makedirs(out_dir, exist_ok=True)
    m = _read_manifest(out_dir)
    meta = dict(source=source or {}, max_len=max_len, max_new_tokens=max_new_tokens,
                temperature=temperature, seed=seed, num_prompts=len(prompts))
    if m:
        if {k: m.get(k) for k in meta} != meta:
            raise DataError(f"{out_dir} holds a regeneration with other settings "
                            f"({ {k: m.get(k) for k in meta if m.get(k) != meta[k]} }); use a new directory")
    else:
        m = dict(meta, shards=[], prompts_done=0, rows=0, dropped=0)
        _write_manifest(out_dir, m)
    done = m["prompts_done"]
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), initial=done, disable=not progress, desc="regenerate")
    except ImportError:  # pragma: no cover
        bar = None
    while done < len(prompts):
        chunk_end = min(len(prompts), done + shard_rows)
        rows = []
        for i in range(done, chunk_end, batch_size):
            batch = [list(p)[: max_len - 2] for p in prompts[i: min(chunk_end, i + batch_size)]]
            res = generate(target, None, batch, max_new_tokens=max_new_tokens, temperature=temperature,
                           stop_token_ids=stop_token_ids, seed=seed + i, attention_impl=attention_impl)
            rows += build_rows(batch, res.tokens)
            if bar is not None:
                bar.update(len(batch))
        keep = [r for r in rows if sum(r[1][:max_len]) >= 2]
        m["dropped"] += len(rows) - len(keep)
        if keep:
            m["shards"].append(write_shard(out_dir, len(m["shards"]), TokenData.from_rows(keep, max_len)))
            m["rows"] += len(keep)
        done = chunk_end
        m["prompts_done"] = done
        _write_manifest(out_dir, m)
    if bar is not None:
        bar.close()
    return TokenData.from_dir(out_dir)
