"""Orbax checkpoints of a training run: the train state (float32 draft params, optimiser state, step)
and a JSON record (epoch, data cursor, RNG seed, the run's contract, the draft's config).

The contract (block size, taps, mask id, γ, anchors per sequence, anchor seed) decides what a draft
learns; resuming a run under a different one is refused with the differing fields named. So is a
resume against another target or data set (`identity`: paths, the target's config and a sample of its
weights, the data's manifest hash) or with other optimiser or precision settings (`settings`: lr,
warm-up, compute dtype, ...), naming the flag and both values.

A step that cannot be read back (a damaged or partial directory) is moved aside to
`checkpoints.damaged/` with a warning and the previous good step is used."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

import jax
import orbax.checkpoint as ocp

__all__ = ["ContractError", "CheckpointError", "RunCheckpoints", "check_contract", "check_draft", "check_identity",
           "check_settings", "target_identity", "FLAGS"]


class ContractError(ValueError):
    """A checkpoint that belongs to a run with a different contract."""


class CheckpointError(ValueError):
    """No checkpoint of the run directory can be read back."""


# setting -> the command-line flag that sets it (named in refusals)
FLAGS = dict(lr="--lr", warmup_frac="--warmup", weight_decay="weight_decay", clip_norm="clip_norm",
             b1="b1", b2="b2", compute_dtype="--compute-dtype", target_dtype="--dtype", target_quantize="--quantize",
             model="--model", data="--data")


class RunCheckpoints:
    """`save(step, state, meta)`, `latest()`, `restore(step, abstract_state)` → (state, meta)."""

    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("state", "meta"))

    @staticmethod
    def _flat(state) -> dict:
        # leaves by index: independent of how nnx / optax name their containers
        return {f"{i:06d}": x for i, x in enumerate(jax.tree.leaves(state))}

    def save(self, step: int, state, meta: dict, *, wait: bool = True) -> None:
        self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._flat(state)), meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
            self.manager.wait_until_finished()

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, abstract_state, check=None,
                       then: str = "resuming from") -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest step that reads back; None when there is no step.
        `abstract_state` may be a function of the step's meta. `check(meta)` runs on each step's meta
        before its state is read (a refusal propagates). An
        unreadable step is moved to `<dir>.damaged/` with a warning on stderr; none readable raises
        CheckpointError."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        failed = []
        for step in steps:
            try:
                meta = self.read_meta(step)
                if not isinstance(meta, dict) or "contract" not in meta:
                    raise ValueError("its meta record has no contract")
            except Exception as e:   # noqa: BLE001  orbax raises many kinds for damaged files
                failed.append((step, _one_line(e)))
                continue
            if check is not None:
                check(meta)
            try:
                abstract = abstract_state(meta) if callable(abstract_state) else abstract_state
                state, meta = self.restore(step, abstract)
            except Exception as e:   # noqa: BLE001
                failed.append((step, _one_line(e)))
                continue
            if failed:
                self._set_aside([s for s, _ in failed], step, then)
            return step, state, meta
        raise CheckpointError(f"no checkpoint in {self.directory} can be read back ("
                              + "; ".join(f"step {s}: {e}" for s, e in failed) + "); use a new --out directory")

    def _set_aside(self, steps, good: int, then: str = "resuming from") -> None:
        """Move damaged step directories out of the manager's way (kept for inspection, never deleted)."""
        aside = self.directory.rstrip(os.sep) + ".damaged"
        os.makedirs(aside, exist_ok=True)
        self.manager.close()
        for s in steps:
            src = os.path.join(self.directory, str(s))
            dst, n = os.path.join(aside, str(s)), 1
            while os.path.exists(dst):
                dst, n = os.path.join(aside, f"{s}.{n}"), n + 1
            if os.path.exists(src):
                os.replace(src, dst)
            print(f"warning: checkpoint step {s} cannot be read back; moved to {dst}, {then} step {good}",
                  file=sys.stderr)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True),
            item_names=("state", "meta"))

    def read_meta(self, step: int) -> dict:
        with _drained_loops():
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        leaves, treedef = jax.tree.flatten(abstract_state)
        target = {f"{i:06d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                  for i, x in enumerate(leaves)}
        with _drained_loops():
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        flat = out["state"]
        return jax.tree.unflatten(treedef, [flat[f"{i:06d}"] for i in range(len(leaves))]), out["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


@contextlib.contextmanager
def _drained_loops():
    """orbax runs a restore in a fresh event loop that it closes as soon as the restore raises; the
    reads still in flight (a damaged step fails on its first bad chunk) then call into the closed
    loop and each prints an "Event loop is closed" traceback (70 for a small draft). Within this
    block such a loop first lets its pending tasks end, as asyncio.run does."""
    try:
        from orbax.checkpoint._src import asyncio_utils
        run = asyncio_utils._run_sync_via_new_loop
    except (ImportError, AttributeError):  # another orbax: nothing to drain here
        yield
        return

    def drained(coro):
        loop = asyncio.new_event_loop()
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(coro)
        finally:
            try:
                pending = asyncio.all_tasks(loop)
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    asyncio_utils._run_sync_via_new_loop = drained
    try:
        yield
    finally:
        asyncio_utils._run_sync_via_new_loop = run


# draft config field -> the train flag that sets it (named in refusals)
DRAFT_FLAGS = dict(num_layers="--draft-layers", block_size="--block-size", target_layer_ids="--taps",
                   mask_token_id="--mask-token-id", conv_kernel_size="--conv-kernel-size",
                   conv_group_size="--conv-group-size", selector_rank="--selector-rank",
                   selector_top_k="--selector-top-k", sliding_window="--sliding-window")
_ARCHS = {"DFlashDraftModel": "a DFlash-1 draft (--arch dflash)",
          "DFlash2DraftModel": "a DFlash2 draft (--arch dflash2)"}


def check_draft(saved: dict | None, want: dict, where: str) -> None:
    """Refuse another draft architecture or shape, naming it and the flag: its steps would not read
    back into this draft (and must not be set aside as damaged)."""
    if not saved:
        return
    want = json.loads(json.dumps(want))  # as the meta record holds it: tuples as lists
    have, new = saved.get("architecture", "DFlashDraftModel"), want.get("architecture", "DFlashDraftModel")
    if have != new:
        raise ContractError(f"cannot resume from {where}: it trains {_ARCHS.get(have, have)} and this run "
                            f"{_ARCHS.get(new, new)}; give the original --arch or a new --out directory")
    diff = [f"{DRAFT_FLAGS.get(k, k)}: checkpoint {saved[k]!r} vs this run {want[k]!r}"
            for k in sorted(saved) if k in want and saved[k] != want[k]]
    if diff:
        raise ContractError(f"cannot resume from {where}: the draft differs ({'; '.join(diff)}); use the original "
                            "flags or a new --out directory")


def check_contract(saved: dict, want: dict, where: str) -> None:
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs this run {want.get(k)!r}"
            for k in sorted(set(saved) | set(want)) if saved.get(k) != want.get(k)]
    if diff:
        raise ContractError(f"cannot resume from {where}: the run's contract differs ({'; '.join(diff)}); "
                            "use a new --out directory or the original settings")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


def target_identity(target, path: str | None = None) -> dict:
    """What names a target in a checkpoint: its path, a hash of its config, and a hash of a sample of
    its weights (the first 16 values of every array, rounded to bfloat16 so the load dtype does not
    change it)."""
    from flax import nnx
    import jax.numpy as jnp
    cfg = json.dumps(dataclasses.asdict(target.config), sort_keys=True, default=str)
    h = hashlib.sha256()
    for x in jax.tree.leaves(nnx.state(target, nnx.Param)):
        h.update(np.asarray(jnp.ravel(x)[:16].astype(jnp.bfloat16).astype(jnp.float32)).tobytes())
    return dict(model=path, target_config=hashlib.sha256(cfg.encode()).hexdigest()[:16],
                target_weights=h.hexdigest()[:16])


def check_identity(saved: dict, want: dict, where: str) -> None:
    """Refuse another target or data set; paths alone may differ (a moved directory)."""
    for key, what, flag, path in (("target_config", "target's config", "--model", "model"),
                                  ("target_weights", "target's weights", "--model", "model"),
                                  ("data", "data set (manifest hash)", "--data", "data_path")):
        if key in saved and saved[key] != want.get(key):
            raise ContractError(f"cannot resume from {where}: it was trained on another {what}: {flag} "
                                f"checkpoint {saved.get(path)!r} ({saved[key]}) vs this run {want.get(path)!r} "
                                f"({want.get(key)}); use a new --out directory or the original {flag}")


def check_settings(saved: dict, want: dict, where: str) -> None:
    """Refuse changed optimiser / precision settings, naming the flag and both values."""
    diff = [f"{FLAGS.get(k, k)}: checkpoint {saved[k]!r} vs this run {want.get(k)!r}"
            for k in sorted(saved) if k in want and saved[k] != want[k]]
    if diff:
        raise ContractError(f"cannot resume from {where}: settings differ ({'; '.join(diff)}); "
                            "use the original values or a new --out directory")
