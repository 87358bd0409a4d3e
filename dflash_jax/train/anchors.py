"""Anchor sampling: per sequence up to N positions a with loss_mask[a] and loss_mask[a+1] (the anchor
token and at least its first label are response tokens), drawn uniformly without replacement, sorted;
a sequence with fewer valid positions pads with masked-out blocks (keep = False, anchor 0).

The draw is a pure function of (key, loss_mask), so an epoch's anchors are reproducible from the run's
seed, the epoch and the sample's id (`anchor_key`), and a resumed run draws the same anchors."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["valid_anchors", "sample_anchors", "anchor_key"]


def valid_anchors(loss_mask):
    """loss_mask [B, T] → valid [B, T] bool: loss_mask[a] & loss_mask[a+1] (False at a = T-1)."""
    lm = loss_mask.astype(bool)
    nxt = jnp.concatenate([lm[:, 1:], jnp.zeros_like(lm[:, :1])], axis=1)
    return lm & nxt


def anchor_key(seed: int | jax.Array, epoch, sample_ids):
    """Per-sample keys [B] for epoch `epoch`: fold_in(fold_in(key(seed), epoch), sample_id)."""
    base = jax.random.fold_in(jax.random.key(seed), jnp.asarray(epoch, jnp.uint32))
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(sample_ids, jnp.uint32))


def _one(key, valid, num_anchors: int, draw_len: int | None = None):
    T = valid.shape[0]
    u = jax.random.uniform(key, (max(T, draw_len or T),))[:T]               # a prefix of one fixed draw
    scores = jnp.where(valid, u, -1.0)                                       # [T]; invalid below all
    k = min(num_anchors, T)
    top, idx = jax.lax.top_k(scores, k)                                      # [k]
    keep = top >= 0.0
    # padded entries sort after the real anchors, then read as anchor 0
    order = jnp.sort(jnp.where(keep, idx, T))
    keep = order < T
    anchors = jnp.where(keep, order, 0).astype(jnp.int32)
    if k < num_anchors:
        anchors = jnp.pad(anchors, (0, num_anchors - k))
        keep = jnp.pad(keep, (0, num_anchors - k))
    return anchors, keep


def sample_anchors(keys, loss_mask, num_anchors: int, draw_len: int | None = None):
    """keys [B] (anchor_key), loss_mask [B, T] → (anchors [B, N] int32 sorted, keep [B, N] bool).
    Kept anchors are distinct valid positions; the rest are padding (anchor 0, keep False).
    draw_len: the random scores are the first T of a draw over draw_len positions, so a batch cut
    to fewer positions than the data's rows draws the same anchors as the uncut batch."""
    valid = valid_anchors(loss_mask)
    return jax.vmap(lambda k, v: _one(k, v, num_anchors, draw_len))(keys, valid)
