"""Orbax checkpoints of a training run: the train state (float32 draft params, optimiser state, step)
and a JSON record (epoch, data cursor, RNG seed, the run's contract, the draft's config).

The contract (block size, taps, mask id, γ, anchors per sequence, anchor seed) decides what a draft
learns; resuming a run under a different one is refused with the differing fields named."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["ContractError", "RunCheckpoints"]


class ContractError(ValueError):
    """A checkpoint that belongs to a run with a different contract."""


class RunCheckpoints:
    """`save(step, state, meta)`, `latest()`, `restore(step, abstract_state)` → (state, meta)."""

    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
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

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        leaves, treedef = jax.tree.flatten(abstract_state)
        target = {f"{i:06d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                  for i, x in enumerate(leaves)}
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        flat = out["state"]
        return jax.tree.unflatten(treedef, [flat[f"{i:06d}"] for i in range(len(leaves))]), out["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def check_contract(saved: dict, want: dict, where: str) -> None:
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs this run {want.get(k)!r}"
            for k in sorted(set(saved) | set(want)) if saved.get(k) != want.get(k)]
    if diff:
        raise ContractError(f"cannot resume from {where}: the run's contract differs ({'; '.join(diff)}); "
                            "use a new --out directory or the original settings")
