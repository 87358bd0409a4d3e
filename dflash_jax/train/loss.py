"""Labels, slot weights and the chunked cross-entropy of the draft's packed blocks.

Slot k (1..S-1) of block j predicts x[a_j + k] — what inference reads from `lm_head(norm(h))[1:]`.
Weight w = exp(-(k-1)/γ) · loss_mask[a_j+k] · (a_j+k < T) · keep_j; slot 0 (the anchor token itself)
carries no loss. The caller divides Σ w·CE by Σ w over the whole (global) batch, so the update does
not depend on how the batch is split across devices. The target's LM head runs over the block slots
in chunks under `jax.checkpoint`: vocab × all slots of logits never exist at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["default_gamma", "block_labels", "block_loss_sums"]


def default_gamma(block_size: int) -> float:
    """The paper's decay constant: 7 for S=16, 5 for 10, 4 for 8; about S/2.3 for other sizes."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))


def block_labels(tokens, loss_mask, anchors, keep, block_size: int, gamma: float):
    """tokens, loss_mask [B, T]; anchors, keep [B, N] → labels [B, N, S-1] int32, weights [B, N, S-1]
    f32, valid [B, N, S-1] bool (weight > 0 before decay) for slots 1..S-1."""
    T = tokens.shape[1]
    k = jnp.arange(1, block_size, dtype=jnp.int32)                             # [S-1]
    idx = anchors[:, :, None] + k                                              # [B, N, S-1]
    inb = idx < T
    safe = jnp.minimum(idx, T - 1)
    gather = lambda a: jnp.take_along_axis(a, safe.reshape(a.shape[0], -1), axis=1).reshape(idx.shape)
    labels = gather(tokens).astype(jnp.int32)
    valid = gather(loss_mask).astype(bool) & inb & keep[:, :, None]
    decay = jnp.exp(-(k - 1).astype(jnp.float32) / gamma)                      # [S-1]
    return labels, jnp.where(valid, decay, 0.0), valid


def block_loss_sums(target, hidden, labels, weights, valid, *, head_chunk: int = 1024, draft=None, prev=None):
    """hidden [B, N·S, H] (draft_forward's output), labels / weights / valid [B, N, S-1].
    Returns a dict of sums over the batch: `loss_sum` Σ w·CE, `weight_sum` Σ w, `slot_correct` and
    `slot_count` [S-1] (argmax == label among valid slots), `tau_sum` Σ over kept blocks of
    1 + Σ_k Π_{i≤k}[argmax_i = label_i] (teacher-forced τ), `blocks` the number of kept blocks.

    draft: a DFlash2 draft (drafts.dflash2): the logits are its unary logits (the LM head ×
    output_multiplier, then the softcap), and with a candidate selector and prev [B, N, S-1] (each
    slot's gold predecessor: the anchor for slot 1, else the previous slot's label) also the
    selector's teacher-forced K-way CE over the unary top-K: `sel_loss_sum` Σ w·CE and
    `sel_weight_sum` Σ w over the valid slots whose label is among the K candidates (a slot whose
    label is not is excluded: the walk cannot pick it at inference either), `sel_hits` (those
    slots, unweighted), `sel_correct` [S-1] (the selector's pick after the gold predecessor ==
    label), `sel_tau_sum` (τ of the selector's path: teacher forcing is exact along an accepted
    prefix, so this is the path's acceptance length on the block)."""
    B, N, S1 = labels.shape
    H = hidden.shape[-1]
    selector = getattr(draft, "candidate_selector", None) if prev is not None else None
    h = hidden.reshape(B, N, S1 + 1, H)[:, :, 1:].reshape(B, N * S1, H)       # [B, N·(S-1), H]
    lab = labels.reshape(B, N * S1)
    pre = (prev if prev is not None else labels).reshape(B, N * S1)
    R = N * S1
    c = max(1, min(head_chunk, R))
    n = -(-R // c)
    pad = n * c - R
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        lab = jnp.pad(lab, ((0, 0), (0, pad)))
        pre = jnp.pad(pre, ((0, 0), (0, pad)))
    hc = jnp.moveaxis(h.reshape(B, n, c, H), 1, 0)                            # [n, B, c, H]
    lc = jnp.moveaxis(lab.reshape(B, n, c), 1, 0)                             # [n, B, c]
    pc = jnp.moveaxis(pre.reshape(B, n, c), 1, 0)

    @jax.checkpoint
    def one(args):
        x, y, a = args
        logits = target.logits(x) if draft is None else draft.unary_logits(target, x)   # [B, c, V] f32
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        out = (lse - picked, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        if selector is None:
            return out
        scores, cand = selector.teacher_forced(x, logits, a)                  # [B, c, K]
        is_gold = cand == y[..., None]
        hit = jnp.any(is_gold, axis=-1)
        gold = jnp.sum(jnp.where(is_gold, scores, 0.0), axis=-1)
        sel_ce = jnp.where(hit, jax.nn.logsumexp(scores, axis=-1) - gold, 0.0)
        pick = jnp.take_along_axis(cand, jnp.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
        return out + (sel_ce, hit, pick)

    res = jax.lax.map(one, (hc, lc, pc))
    unchunk = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, n * c)[:, :R].reshape(B, N, S1)   # noqa: E731
    ce, pred = unchunk(res[0]), unchunk(res[1])
    correct = (pred == labels) & valid
    kept = valid[:, :, 0] if S1 else jnp.zeros((B, N), bool)

    def tau_of(ok):
        return jnp.sum(jnp.where(kept, 1.0 + jnp.sum(jnp.cumprod(ok.astype(jnp.float32), axis=-1), axis=-1), 0.0))

    out = dict(
        loss_sum=jnp.sum(weights * ce),
        weight_sum=jnp.sum(weights),
        slot_correct=jnp.sum(correct, axis=(0, 1)).astype(jnp.float32),
        slot_count=jnp.sum(valid, axis=(0, 1)).astype(jnp.float32),
        tau_sum=tau_of(correct),
        blocks=jnp.sum(kept).astype(jnp.float32),
    )
    if selector is not None:
        sel_ce, hit, pick = unchunk(res[2]), unchunk(res[3]), unchunk(res[4])
        used = hit & valid
        sel_ok = (pick == labels) & valid
        out.update(sel_loss_sum=jnp.sum(jnp.where(used, weights * sel_ce, 0.0)),
                   sel_weight_sum=jnp.sum(jnp.where(used, weights, 0.0)),
                   sel_hits=jnp.sum(used).astype(jnp.float32),
                   sel_correct=jnp.sum(sel_ok, axis=(0, 1)).astype(jnp.float32),
                   sel_tau_sum=tau_of(sel_ok))
    return out
