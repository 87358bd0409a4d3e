"""Training data: token ids with a loss mask over the response span, stored once as sharded `.npy`
arrays (rows padded to the run's max length) with a `manifest.json`.

`regenerate` renders each prompt with the evaluation chat template (thinking off unless asked), lets
the target answer with our own batched `generate` (T = 0 by default) and writes shards as it goes;
the manifest records how many prompts are done, so a killed regeneration continues where it stopped.
`TokenData` reads a data directory (memory-mapped) or wraps arrays built in memory."""

from __future__ import annotations

import dataclasses
import hashlib
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
    # where the rows came from: [(file name, first row)] per shard (from_dir), for errors naming a shard
    sources: list = dataclasses.field(default_factory=list, repr=False)
    # a content fingerprint recorded in checkpoints (from_dir: the manifest's sha256); None: hashed lazily
    fingerprint_value: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if self.tokens.shape != self.loss_mask.shape or self.tokens.ndim != 2:
            raise DataError(f"tokens {self.tokens.shape} and loss_mask {self.loss_mask.shape} must be the same [rows, length]")
        if np.asarray(self.tokens).dtype.kind not in "iu":
            raise DataError(f"token ids must be integers, got {np.asarray(self.tokens).dtype}")
        if np.asarray(self.loss_mask).dtype.kind not in "iub":
            raise DataError(f"the loss mask must be integers or booleans, got {np.asarray(self.loss_mask).dtype}")
        if self.tokens.size and int(np.min(self.tokens)) < 0:
            raise DataError(f"{self._where(self.tokens < 0)}: negative token id {int(np.min(self.tokens))}")
        lm = np.asarray(self.loss_mask, bool)
        valid = (lm[:, :-1] & lm[:, 1:]).any(axis=1)
        if not valid.any():
            raise DataError("the data set has no row with two consecutive response tokens (loss_mask): "
                            "nothing to train on; check the chat template and the response spans")
        self.rows_without_anchor = int((~valid).sum())

    def _where(self, bad: np.ndarray) -> str:
        """'shard FILE row r' (or 'row r') of the first True of a [M, T] mask."""
        row = int(np.argmax(np.asarray(bad).any(axis=1)))
        for name, first in reversed(self.sources):
            if row >= first:
                return f"{name} row {row - first}"
        return f"row {row}"

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the target cannot embed (data from another tokenizer), naming the shard."""
        if self.tokens.size and int(np.max(self.tokens)) >= vocab_size:
            top = int(np.max(self.tokens))
            raise DataError(f"{self._where(self.tokens >= vocab_size)}: token id {top} is outside the target's "
                            f"vocabulary of {vocab_size} (data from another tokenizer?)")

    def fingerprint(self) -> str:
        """A content hash of the data set (the manifest's for a data directory)."""
        if self.fingerprint_value is None:
            h = hashlib.sha256()
            for a in (self.tokens, self.loss_mask):
                a = np.ascontiguousarray(a)
                h.update(f"{a.dtype}{a.shape}".encode())
                h.update(a.tobytes())
            self.fingerprint_value = "arrays:" + h.hexdigest()[:16]
        return self.fingerprint_value

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def from_dir(cls, path: str) -> "TokenData":
        """A data directory written by `regenerate`. Damaged or foreign inputs are refused with the
        file named: a manifest that is not JSON, a shard outside the directory, a shard that is not a
        plain 2-D integer `.npy` (object arrays are never unpickled), shapes that disagree."""
        man = os.path.join(path, MANIFEST)
        if not os.path.isfile(man):
            raise DataError(f"{path} has no {MANIFEST}; write one with `python -m dflash_jax.train regenerate`")
        with open(man, "rb") as f:
            raw = f.read()
        try:
            m = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{man} is not JSON ({e})") from None
        shards = m.get("shards") if isinstance(m, dict) else None
        if not isinstance(shards, list):
            raise DataError(f"{man} has no list of shards (not a manifest written by `regenerate`)")
        if not shards:
            raise DataError(f"{path}: the manifest lists no shards")
        toks, masks, sources, first = [], [], [], 0
        for i, s in enumerate(shards):
            if not (isinstance(s, dict) and isinstance(s.get("tokens"), str) and isinstance(s.get("loss_mask"), str)):
                raise DataError(f"{man}: shard {i} is not {{\"tokens\": FILE, \"loss_mask\": FILE, ...}}")
            t = _load_array(path, s["tokens"], "iu")
            lm = _load_array(path, s["loss_mask"], "iub")
            if t.shape != lm.shape:
                raise DataError(f"{path}: {s['tokens']} {t.shape} and {s['loss_mask']} {lm.shape} differ in shape")
            if toks and t.shape[1] != toks[0].shape[1]:
                raise DataError(f"{path}: {s['tokens']} has rows of {t.shape[1]} tokens, "
                                f"{shards[0]['tokens']} of {toks[0].shape[1]}")
            if t.size and int(np.min(t)) < 0:
                raise DataError(f"{os.path.join(path, s['tokens'])}: negative token id {int(np.min(t))}")
            toks.append(t); masks.append(lm); sources.append((s["tokens"], first)); first += t.shape[0]
        return cls(np.concatenate(toks).astype(np.int32), np.concatenate(masks).astype(np.uint8), sources=sources,
                   fingerprint_value="manifest:" + hashlib.sha256(raw).hexdigest()[:16])

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


def _load_array(root: str, name: str, kinds: str) -> np.ndarray:
    """A shard array [rows, length] of an integer (or bool) dtype from a file inside `root`."""
    full = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([full, os.path.realpath(root)]) != os.path.realpath(root):
        raise DataError(f"{root}: shard path {name!r} leaves the data directory; refused")
    if not os.path.isfile(full):
        raise DataError(f"{root}: shard {name} does not exist")
    try:
        a = np.load(full, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{full}: not a readable .npy array ({' '.join(str(e).split())})") from None
    if not isinstance(a, np.ndarray) or a.ndim != 2:
        raise DataError(f"{full}: expected a 2-D [rows, length] array, got shape {getattr(a, 'shape', None)}")
    if a.dtype.kind not in kinds:
        what = "token ids" if "b" not in kinds else "a loss mask"
        raise DataError(f"{full}: {a.dtype} values are not {what} (integers expected)")
    return a


def build_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]):
    """(prompt + response ids, mask 0 over the prompt and 1 over the response) per row."""
    return [(list(p) + list(r), [0] * len(p) + [1] * len(r)) for p, r in zip(prompts, responses)]


def _read_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            try:
                m = json.load(f)
            except (ValueError, UnicodeDecodeError) as e:
                raise DataError(f"{path} is not JSON ({e}); use a new --out directory") from None
        if not isinstance(m, dict):
            raise DataError(f"{path} is not a manifest written by `regenerate`; use a new --out directory")
        return m
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
        m = dict(meta, shards=[], prompts_done=0, rows=0, dropped=0, dropped_long=0)
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
            batch = [list(p) for p in prompts[i: min(chunk_end, i + batch_size)]]
            # a prompt cut to fit would lose its end (the generation prompt): drop it, counted
            fits = [p for p in batch if len(p) <= max_len - 2]
            m["dropped_long"] = m.get("dropped_long", 0) + len(batch) - len(fits)
            if fits:
                res = generate(target, None, fits, max_new_tokens=max_new_tokens, temperature=temperature,
                               stop_token_ids=stop_token_ids, seed=seed + i, attention_impl=attention_impl)
                rows += build_rows(fits, res.tokens)
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
    if not m["shards"]:
        raise DataError(f"{out_dir}: no prompt gave a training row ({m.get('dropped_long', 0)} prompts longer than "
                        f"max_len - 2 = {max_len - 2} tokens, {m['dropped']} responses under 2 tokens)")
    return TokenData.from_dir(out_dir)
