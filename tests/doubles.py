"""Test doubles for the compiled loop."""

from __future__ import annotations

import jax.numpy as jnp


def truth_proposer(truth, corrupt_slot: int | None, vocab: int):
    """A draft stand-in (decode's `_draft_override`): the target's true continuation, from
    truth [B, L] = prompt + the target's own greedy output, with draft slot `corrupt_slot` (0-based
    among the S-1 drafts) replaced by a wrong token; None corrupts nothing (full acceptance)."""
    truth = jnp.asarray(truth)

    def override(drafts, lens):
        idx = lens[:, None] + 1 + jnp.arange(drafts.shape[1])
        true = jnp.take_along_axis(truth, jnp.minimum(idx, truth.shape[1] - 1), axis=1)
        if corrupt_slot is None:
            return true
        return true.at[:, corrupt_slot].set((true[:, corrupt_slot] + 1) % vocab)
    return override
