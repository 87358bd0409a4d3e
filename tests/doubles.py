"""Test doubles for the compiled loop."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class TruthProposer(nnx.Module):
    """A proposer double, passed to generate where the draft goes: it wraps a real draft (whose
    context cache it keeps writing, so the loop's bookkeeping is exercised as in a real run) and
    replaces its drafts by the target's true continuation, from truth [B, L] = prompt + the
    target's own greedy output, with draft slot `corrupt_slot` (0-based among the S-1 drafts)
    replaced by a wrong token; None corrupts nothing (full acceptance)."""

    def __init__(self, draft, truth, corrupt_slot: int | None, vocab: int):
        self.draft = draft
        self.config = draft.config
        self.truth = nnx.Variable(jnp.asarray(truth, jnp.int32))      # traced: no compile key
        self.corrupt_slot, self.vocab = corrupt_slot, vocab

    def new_cache(self, batch: int, capacity: int):
        return self.draft.new_cache(batch, capacity)

    def write_context(self, feats, positions, cache, valid=None):
        return self.draft.write_context(feats, positions, cache, valid)

    def propose(self, target, current, lens, *args, **kwargs):
        drafts, cache = self.draft.propose(target, current, lens, *args, **kwargs)
        truth = self.truth[...]
        idx = lens[:, None] + 1 + jnp.arange(drafts.shape[1])
        true = jnp.take_along_axis(truth, jnp.minimum(idx, truth.shape[1] - 1), axis=1)
        if self.corrupt_slot is not None:
            true = true.at[:, self.corrupt_slot].set((true[:, self.corrupt_slot] + 1) % self.vocab)
        return true, cache


def truth_proposer(draft, truth, corrupt_slot: int | None, vocab: int) -> TruthProposer:
    return TruthProposer(draft, truth, corrupt_slot, vocab)
