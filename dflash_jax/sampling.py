"""Token selection inside the compiled loop: greedy, temperature / top-k / top-p sampling, and the
lossless acceptance rule of speculative decoding.

Sampling modes (a compile key): "greedy" (argmax), "sample" (temperature only), "topk" (top-k,
top_p = 1), "topp" (top-p, top_k = 0) and "filtered" (both). The values themselves (temperature,
top_k, top_p) are traced, a scalar or one per batch row ([B]: rows of one batch may differ, as the
serving engine's slots do), so changing them within a mode does not recompile; a mode runs only the
threshold searches it needs, and a filter a row does not use (top_k 0, top_p 1) keeps its whole
distribution. In a sampling mode, a row with temperature 0 (or top_k 1) is still greedy: its token
is the argmax, exactly as in "greedy" mode.

top-k / top-p without sorting the vocabulary: a token's rank is its (score, -index) order, the
order of a stable descending sort. Top-k keeps the tokens with fewer than k tokens ranked above
them, top-p the tokens whose higher-ranked mass is below p; both sets are "every key >= a
threshold key", and the threshold is found digit by digit (4 bits per pass, 16 candidates per
pass, each pass one fused reduction over the vocabulary): 8 passes for the score bits, 5 for the
index among tied scores. A full sort of the vocabulary, and lax.top_k (XLA:GPU sorts for it too),
were slower per iteration (docs/perf-log.md). On the GPU path with KernelConfig.sampling_kernels
each pass is one Pallas kernel (pallas_kernels.sampling.count_pass); elsewhere XLA reductions. Both
find the same keys. With top-k on that path, the 8 score passes of top-k are followed by one gather
of every token at or above the threshold score (pallas_kernels.sampling.gather_above, <= GATHER_MAX
per row), and the tie cut and the top-p cut run on those (`_gathered_cut`) instead of 18 more
passes.

Speculative acceptance with argmax drafts (q one-hot): draft token d_i is accepted with probability
p_i(d_i) under the target's processed distribution; at the first rejection the next token is drawn
from p_i with d_i removed and renormalised (the residual max(p - q, 0) for one-hot q); if every
draft passes, the bonus is drawn from the last slot's p. This keeps the output distributed exactly
as plain sampling from p (Leviathan et al. 2023, with q = δ(d)).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dflash_jax import sharding
from dflash_jax.kernel_config import KernelConfig

MODES = ("greedy", "sample", "topk", "topp", "filtered")
FILTER_MODES = ("topk", "topp", "filtered")


@dataclasses.dataclass(frozen=True)
class _Vocab:
    """The vocabulary axis of the scores a function sees: the whole row (axis None, one device), or
    inside a shard_map one shard's contiguous slice of `size` tokens over mesh axis `axis` (a
    vocab-sharded LM head). Every reduction over V goes through it, so the sharded program is the
    one-device program with a psum / pmax after each local reduction."""
    size: int | None = None          # the whole vocabulary (None: the local row is the whole row)
    axis: str | None = None

    def sum(self, x, axis):
        s = jnp.sum(x, axis=axis)
        return s if self.axis is None else jax.lax.psum(s, self.axis)

    def max(self, x, axis, keepdims=False):
        m = jnp.max(x, axis=axis, keepdims=keepdims)
        return m if self.axis is None else jax.lax.pmax(m, self.axis)

    def ids(self, n: int):
        """The global token ids of a local row of n: [n] int32."""
        i = jnp.arange(n)
        return i if self.axis is None else i + jax.lax.axis_index(self.axis) * n

    def softmax(self, x):
        if self.axis is None:
            return jax.nn.softmax(x, axis=-1)
        e = jnp.exp(x - jax.lax.stop_gradient(self.max(x, -1, keepdims=True)))
        return e / self.sum(e, -1)[..., None]

    def log_softmax(self, x):
        if self.axis is None:
            return jax.nn.log_softmax(x, axis=-1)
        shifted = x - jax.lax.stop_gradient(self.max(x, -1, keepdims=True))
        return shifted - jnp.log(self.sum(jnp.exp(shifted), -1))[..., None]


WHOLE = _Vocab()


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def validate(temperature: float, top_p: float, top_k: int) -> None:
    """Host-side checks with messages that name the bad value (numpy scalars are accepted)."""
    if not _real(temperature) or math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _real(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, (bool, np.bool_)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def mode_for(temperature: float, top_p: float, top_k: int) -> str:
    if temperature == 0 or top_k == 1:
        return "greedy"
    if top_k > 0:
        return "filtered" if top_p < 1.0 else "topk"
    return "topp" if top_p < 1.0 else "sample"


def _per_row(x, lead: tuple):
    """A scalar or a per-batch-row [B] setting broadcast to the leading shape `lead` ([B] or [B, S])."""
    x = jnp.asarray(x)
    return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(lead) - x.ndim)), lead)


def _greedy_rows(temperature, top_k, lead: tuple):
    """[lead] bool: rows whose settings mean greedy (temperature 0 or top_k 1), as `mode_for` says."""
    return (_per_row(temperature, lead) <= 0) | (_per_row(top_k, lead) == 1)


_DIGIT = 4                      # bits decided per pass (5 was slower: docs/perf-log.md)
_INDEX_BITS = 20                # vocabularies up to 2**20 - 1 tokens


def _score_key(scores):
    """float32 -> uint32 with the same order (negatives flipped, positives above them)."""
    b = jax.lax.bitcast_convert_type(scores, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _min_passing(pred, n_rows: int, bits: int):
    """Smallest x in [0, 2**bits) with pred(x) true, per row, for pred monotone (false then true)
    and true at 2**bits - 1. pred maps candidates [N, K] uint32 -> bool [N, K]. Decided _DIGIT bits
    per pass (the first pass takes the remainder), 2**_DIGIT candidates each."""
    d = _DIGIT
    widths = ([bits % d] if bits % d else []) + [d] * (bits // d)
    x = jnp.zeros((n_rows,), jnp.uint32)
    shift = bits
    for w in widths:
        shift -= w
        digits = jnp.arange(1 << w, dtype=jnp.uint32)
        cand = x[:, None] | (digits[None] << shift) | jnp.uint32((1 << shift) - 1)
        d_ = jnp.argmax(pred(cand), axis=1).astype(jnp.uint32)                 # first passing digit
        x = x | (d_ << shift)
    return x


def _masked_sums(keys, cand, weight, vocab: _Vocab = WHOLE):
    """sum over V of weight where keys > cand: keys [N or 1, V], cand [N, K], weight [N, V] or None
    (a count) -> [N, K].

    One [N, V, K] reduction over V: faster than the same sums laid out [N, K, V] or as K sibling
    [N, V] reductions (docs/perf-log.md)."""
    w = 1.0 if weight is None else weight[:, :, None]
    return vocab.sum(jnp.where(keys[:, :, None] > cand[:, None, :], w, 0.0), axis=1)


def search_kernel(kernels: KernelConfig | None) -> bool:
    """Whether the threshold search's passes run as a Pallas GPU kernel
    (pallas_kernels.sampling.count_pass) rather than XLA reductions: KernelConfig.sampling_kernels on
    the GPU path."""
    return kernels is not None and kernels.search_kernels


def _signed(u):
    """uint32 -> int32 with the same order (the kernel compares signed integers)."""
    return jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)


def _unsigned(i):
    """The inverse of _signed."""
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _kernel_min_passing(keys, weight, offset, budget, bits: int, kernels: KernelConfig | None):
    """`_min_passing` for pred(c) = offset + (weight above c) < budget, each pass one Pallas GPU
    kernel (pallas_kernels.sampling.count_pass) that also decides the previous pass's digit. keys
    [N or 1, V] uint32, weight [N, V] or None (1 each), offset and budget [N] float32."""
    from pallas_kernels import sampling as kernels_
    N, V = budget.shape[0], keys.shape[1]
    P, chunk = kernels_.count_layout(N, V)
    ks, w = _signed(keys), None if weight is None else weight.astype(jnp.float32)
    d = _DIGIT
    widths = ([bits % d] if bits % d else []) + [d] * (bits // d)
    prev, shift, prev_shift = None, bits, 0
    for width in widths:
        shift -= width
        prev = kernels_.count_pass(ks, w, prev, offset, budget, P=P, chunk=chunk, shift=shift, width=width,
                              prev_shift=prev_shift, interpret=kernels.interpret)
        prev_shift = shift
    part, x = prev
    last = jnp.argmax(offset[:, None] + jnp.sum(part, axis=1) < budget[:, None], axis=1)     # [N]
    return jax.lax.bitcast_convert_type(x[:, 0, 0], jnp.uint32) | (last.astype(jnp.uint32) << prev_shift)


def _search(keys, weight, offset, budget, bits: int, kernels: KernelConfig | None, vocab: _Vocab = WHOLE):
    """Smallest x in [0, 2**bits) with offset + (weight above x) < budget, per row: keys [N or 1, V]
    uint32, weight [N, V] or None (1 each), offset and budget [N]. The GPU paths run each pass as
    one count kernel (`search_kernel`), the others as XLA reductions."""
    if search_kernel(kernels) and vocab.axis is None:
        return _kernel_min_passing(keys, weight, offset, budget, bits, kernels)
    return _min_passing(lambda c: offset[:, None] + _masked_sums(keys, c, weight, vocab) < budget[:, None],
                        budget.shape[0], bits)


def _rank_threshold(hi, lo, weight, budget, kernels: KernelConfig | None = None, h=None,
                    vocab: _Vocab = WHOLE):
    """Keep mask [N, V] of the tokens whose higher-ranked weight (weight [N, V], None: 1 each) is
    below budget [N] (> 0).

    Rank order: key (hi, lo) descending, hi the score key, lo = V-1-index (lower index first among
    equal scores). The kept set is {key >= k*} for k* the smallest key whose above-weight is below
    the budget: found on hi first (h, if the caller has it already), then on lo among the tokens
    tied at that score (bf16 logits tie often, so the index search always runs)."""
    w = 1.0 if weight is None else weight
    if h is None:
        h = _search(hi, weight, jnp.zeros(budget.shape, jnp.float32), budget, 32, kernels, vocab)
    base = vocab.sum(jnp.where(hi > h[:, None], w, 0.0), axis=1)                         # [N]
    tie = hi == h[:, None]
    low = _search(lo[None, :], jnp.where(tie, w, 0.0), base, budget, _INDEX_BITS, kernels, vocab)
    return (hi > h[:, None]) | (tie & (lo[None, :] >= low[:, None]))


def _score_of_key(k):
    """Inverse of _score_key: uint32 keys -> the float32 scores."""
    b = jnp.where((k >> 31) == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _gathered_cut(gk, gi, n, top_k, top_p, mode: str):
    """The top-k then top-p cut over a row's gathered top-k candidates (all tokens at or above the
    top-k score threshold, n <= GATHER_MAX of them: gk uint32 keys and gi indices [N, G], in any
    order). Returns the last kept token's (key, index) per row; the kept set is every token ranked
    at or above it. The candidates are put in rank order first (key descending, index ascending:
    rank by counting, then one exact max per rank), so the top-p sums run in a fixed order."""
    N, G = gk.shape
    valid = jnp.arange(G)[None, :] < n[:, None]                                          # [N, G]
    ki, kj = gk[:, :, None], gk[:, None, :]
    above = ((ki > kj) | ((ki == kj) & (gi[:, :, None] < gi[:, None, :]))) & valid[:, :, None]
    rank = jnp.where(valid, jnp.sum(above, axis=1), G)                                   # [N, G]
    at = rank[:, None, :] == jnp.arange(G)[None, :, None]                                # [N, r, j]
    sk = jnp.max(jnp.where(at, gk[:, None, :], jnp.uint32(0)), axis=2)                   # [N, G] by rank
    si = jnp.min(jnp.where(at, gi[:, None, :], jnp.iinfo(jnp.int32).max), axis=2)
    r = jnp.arange(G)[None, :]
    top_k, top_p = _per_row(top_k, (N,))[:, None], _per_row(top_p, (N,))[:, None]
    kept = r < jnp.minimum(jnp.where(top_k > 0, top_k, G), n[:, None])
    if mode == "filtered":
        s = _score_of_key(sk)
        e = jnp.where(kept, jnp.exp(s - s[:, :1]), 0.0)
        p = e / jnp.sum(e, axis=1, keepdims=True)
        kept = kept & ((jnp.cumsum(p, axis=1) - p < top_p) | (top_p >= 1.0))
    last = jnp.maximum(jnp.sum(kept, axis=1) - 1, 0)[:, None]
    return jnp.take_along_axis(sk, last, axis=1)[:, 0], jnp.take_along_axis(si, last, axis=1)[:, 0]


def _keep_mask(scores, top_k, top_p, mode: str = "filtered", kernels: KernelConfig | None = None, fast: bool = True,
               vocab: _Vocab = WHOLE):
    """Which tokens survive top-k then top-p (over the top-k renormalised distribution), cut by
    rank as the reference does. scores [N, V] float32. Returns [N, V] bool. mode "topk" skips the
    top-p search (top_p must be 1), "topp" the top-k search (top_k must be 0). kernels: the attention
    path (resolved); the GPU paths run the search's passes as a Pallas kernel (`search_kernel`) and,
    with `fast` (tests turn it off to compare), gather top-k's candidates for the tie and top-p cuts.
    vocab: a vocab shard inside shard_map (XLA passes, each reduction psum'd), or the whole row."""
    N, Vl = scores.shape
    V = Vl if vocab.size is None else vocab.size
    if V >= 1 << _INDEX_BITS:
        raise ValueError(f"vocabulary of {V} tokens: top-k/top-p support up to {(1 << _INDEX_BITS) - 1}")
    hi = _score_key(scores)
    lo = (V - 1 - vocab.ids(Vl)).astype(jnp.uint32)
    k = None
    if mode != "topp":
        k = _per_row(top_k, (N,)).astype(jnp.float32)
        k = jnp.where(k > 0, k, float(V))                                  # top_k <= 0: off
        if search_kernel(kernels) and fast and vocab.axis is None:
            # Fast path: the top-k score threshold (8 passes), then its candidates gathered; the
            # tie cut and the top-p cut on those. A row with more than GATHER_MAX candidates
            # (top_k > GATHER_MAX, or a wide tie) sends the whole batch down the full searches.
            from pallas_kernels import sampling as kernels_
            h = _search(hi, None, jnp.zeros((N,), jnp.float32), k, 32, kernels)
            n, gk, gi = kernels_.gather_above(_signed(hi), _signed(h), kmax=kernels_.GATHER_MAX,
                                         interpret=kernels.interpret)

            def gathered():
                tk, ti = _gathered_cut(_unsigned(gk), gi, n, top_k, top_p, mode)
                idx = jnp.arange(V)[None, :]
                return (hi > tk[:, None]) | ((hi == tk[:, None]) & (idx <= ti[:, None]))
            return jax.lax.cond(jnp.all(n <= kernels_.GATHER_MAX), gathered,
                                lambda: _full_cut(hi, lo, scores, k, top_k, top_p, mode, kernels, h))
    return _full_cut(hi, lo, scores, k, top_k, top_p, mode, kernels, vocab=vocab)


def _full_cut(hi, lo, scores, k, top_k, top_p, mode: str, kernels: KernelConfig | None, h=None,
              vocab: _Vocab = WHOLE):
    """The keep mask by the threshold searches over the whole vocabulary (h: top-k's score
    threshold when already found)."""
    N = scores.shape[0]
    top_k, top_p = _per_row(top_k, (N,)), _per_row(top_p, (N,)).astype(jnp.float32)
    keep = jnp.ones(scores.shape, bool)
    if mode != "topp":
        keep = _rank_threshold(hi, lo, None, k, kernels, h=h, vocab=vocab) | (top_k <= 0)[:, None]
    if mode != "topk":
        p = vocab.softmax(jnp.where(keep, scores, -jnp.inf))
        keep_p = _rank_threshold(hi, lo, p, top_p, kernels, vocab=vocab)
        keep = keep & (keep_p | (top_p >= 1.0)[:, None])
    return keep


def log_probs(logits, temperature, top_k, top_p, mode: str, kernels: KernelConfig | None = None,
              vocab: _Vocab = WHOLE):
    """The processed target distribution as log-probabilities. logits [B, V] or [B, S, V] float32;
    temperature, top_k, top_p scalars or [B]. kernels: the resolved attention path (picks the
    search's kernels; the result does not depend on it)."""
    lead = logits.shape[:-1]
    # temperature 0 marks a greedy row (select/accept take its argmax); keep its scores finite here
    scores = logits / jnp.maximum(_per_row(temperature, lead), 1e-6)[..., None]
    if mode in FILTER_MODES:
        V = logits.shape[-1]
        flat = lambda x: _per_row(x, lead).reshape(-1)                                  # noqa: E731
        keep = _keep_mask(scores.reshape(-1, V), flat(top_k), flat(top_p), mode, kernels, vocab=vocab)
        scores = jnp.where(keep.reshape(scores.shape), scores, -jnp.inf)
    return vocab.log_softmax(scores)


def select(logits, key, temperature, top_k, top_p, mode: str, kernels: KernelConfig | None = None):
    """One token per row. logits [B, V], key [B] (per-row keys) → [B] int32."""
    if mode == "greedy":   # sharding.argmax: vocab-sharded under a mesh, never gathering the logits
        return sharding.argmax(logits)
    mesh = sharding.vocab_mesh(logits)
    if mesh is not None:
        sampled = _select_sharded(logits, key, temperature, top_k, top_p, mode, mesh)
    else:
        lp = log_probs(logits, temperature, top_k, top_p, mode, kernels)
        sampled = jax.vmap(jax.random.categorical)(key, lp).astype(jnp.int32)
    greedy = sharding.argmax(logits)
    return jnp.where(_greedy_rows(temperature, top_k, logits.shape[:1]), greedy, sampled)


def accept(block, logits, key, temperature, top_k, top_p, mode: str, kernels: KernelConfig | None = None,
           proposal=None):
    """Verify a block. block [B, S] = [last token, d_1 .. d_{S-1}], logits [B, S, V] float32 (slot i
    predicts the token after block[:, i]), key [B]. proposal: None (argmax drafts, q one-hot) or
    (candidates [B, S-1, K], q [B, S-1, K]): each draft was drawn from q over its slot's K candidate
    ids (a DFlash2 selector); then d_i is accepted while u·q_i(d_i) < p_i(d_i) and a rejection draws
    from max(p_i - q_i, 0) renormalised (p_i where that is all zero). Returns (a [B] accepted
    drafts, next_token [B]: the bonus or the correction at slot a)."""
    B, S, V = logits.shape
    drafts = block[:, 1:]                                                       # [B, S-1]
    post = sharding.argmax(logits)                                              # [B, S]
    a_greedy = jnp.sum(jnp.cumprod(drafts == post[:, :-1], axis=1), axis=1).astype(jnp.int32)
    next_greedy = jnp.take_along_axis(post, a_greedy[:, None], axis=1)[:, 0]
    if mode == "greedy":
        return a_greedy, next_greedy
    mesh = sharding.vocab_mesh(logits)
    if mesh is not None:
        a, nxt = _accept_sharded(drafts, logits, key, temperature, top_k, top_p, mode, mesh, proposal)
        greedy = _greedy_rows(temperature, top_k, (B,))
        return jnp.where(greedy, a_greedy, a), jnp.where(greedy, next_greedy, nxt)
    lp = log_probs(logits, temperature, top_k, top_p, mode, kernels)                # [B, S, V]
    k_accept, k_next = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(key), 1, 0)
    if proposal is not None:
        a, nxt = _accept_proposal(drafts, lp, proposal, k_accept, k_next)
        greedy = _greedy_rows(temperature, top_k, (B,))
        return jnp.where(greedy, a_greedy, a), jnp.where(greedy, next_greedy, nxt)
    p_draft = jnp.exp(jnp.take_along_axis(lp[:, :-1], drafts[..., None], axis=-1)[..., 0])  # [B, S-1]
    u = jax.vmap(lambda k: jax.random.uniform(k, (S - 1,)))(k_accept)
    a = jnp.sum(jnp.cumprod(u < p_draft, axis=1), axis=1).astype(jnp.int32)
    row = jnp.take_along_axis(lp, a[:, None, None], axis=1)[:, 0]               # [B, V]
    rejected = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))), a[:, None], axis=1)   # [B, 1]
    remove = (a < S - 1)[:, None] & (jnp.arange(V)[None] == rejected)
    residual = jnp.where(remove, -jnp.inf, row)
    # p(d) == 1 cannot be rejected, so the residual always keeps mass; guard rounding anyway.
    residual = jnp.where(jnp.any(jnp.isfinite(residual), axis=-1, keepdims=True), residual, row)
    nxt = jax.vmap(jax.random.categorical)(k_next, residual).astype(jnp.int32)
    greedy = _greedy_rows(temperature, top_k, (B,))
    return jnp.where(greedy, a_greedy, a), jnp.where(greedy, next_greedy, nxt)


def _accept_proposal(drafts, lp, proposal, k_accept, k_next):
    """accept's rule for drafts drawn from q over candidate ids (Leviathan et al. 2023; the
    reference's _rejection_sample): (a [B], next token [B])."""
    cand, q = proposal                                                          # [B, S-1, K]
    B, S, V = lp.shape
    q_draft = jnp.sum(jnp.where(cand == drafts[..., None], q, 0.0), axis=-1)    # [B, S-1]
    p_draft = jnp.exp(jnp.take_along_axis(lp[:, :-1], drafts[..., None], axis=-1)[..., 0])
    u = jax.vmap(lambda k: jax.random.uniform(k, (S - 1,)))(k_accept)
    a = jnp.sum(jnp.cumprod(u * q_draft < p_draft, axis=1), axis=1).astype(jnp.int32)
    row = jnp.take_along_axis(lp, a[:, None, None], axis=1)[:, 0]               # [B, V]
    at = jnp.minimum(a, S - 2)[:, None, None]
    c_a = jnp.take_along_axis(cand, at, axis=1)[:, 0]                           # [B, K]
    q_a = jnp.take_along_axis(q, at, axis=1)[:, 0] * (a < S - 1)[:, None]       # no q on the bonus slot
    q_full = jax.vmap(lambda c, w: jnp.zeros((V,), jnp.float32).at[c].add(w))(c_a, q_a)   # [B, V]
    residual = jnp.maximum(jnp.exp(row) - q_full, 0.0)
    alive = jnp.sum(residual, axis=-1, keepdims=True) > 0
    residual = jnp.where(alive, jnp.log(residual), row)
    return a, jax.vmap(jax.random.categorical)(k_next, residual).astype(jnp.int32)


# ------------------------------------------------------------- over a vocab-sharded LM head
#
# Under a mesh whose 'model' axis shards the vocabulary, select and accept run the same steps per
# shard inside one shard_map: the threshold searches' sums, the normalisers and the one-hot picks
# are psum'd (pmax'd) per pass, the draws are Gumbel-max with the very noise jax.random.categorical
# adds on one device (threefry is partitionable: each shard generates its own slice of the [B, V]
# noise), and the argmax of the perturbed scores goes through sharding.argmax_over_shards. The
# logits are never gathered; the tokens equal one device's for the same keys (docs/sharding.md:
# a float32 sum in another order can move a top-p boundary or a near-tie by one ulp).

def _noise(key, V: int, dtype, spec, mesh):
    """[B, V] Gumbel noise of per-row keys [B], as categorical draws it, placed vocab-sharded."""
    g = jax.vmap(lambda k: jax.random.gumbel(k, (V,), dtype))(key)
    return jax.lax.with_sharding_constraint(g, jax.sharding.NamedSharding(mesh, spec))


def _rows(*xs, B: int):
    return tuple(_per_row(x, (B,)) for x in xs)


def _select_sharded(logits, key, temperature, top_k, top_p, mode: str, mesh):
    B, V = logits.shape
    spec = sharding.logit_spec(2, B, mesh)                                       # [B, V]
    row = P(spec[0])
    g = _noise(key, V, logits.dtype, spec, mesh)

    def local(x, g, t, k, p):                                                    # [b, V/TP]
        lp = log_probs(x, t, k, p, mode, vocab=_Vocab(V, "model"))
        return sharding.argmax_over_shards(g + lp)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, row, row, row), out_specs=row,
                         check_vma=False)(logits, g, *_rows(temperature, top_k, top_p, B=B))


def _accept_sharded(drafts, logits, key, temperature, top_k, top_p, mode: str, mesh, proposal=None):
    """accept's sampling branch per vocab shard: (a [B], next token [B]); with a proposal
    (candidates, q [B, S-1, K], replicated over the shards) _accept_proposal's rule, the residual
    max(p - q, 0) formed per shard from the candidates that fall in its slice."""
    B, S, V = logits.shape
    spec = sharding.logit_spec(3, B, mesh)                                       # [B, S, V]
    row = P(spec[0])
    k_accept, k_next = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(key), 1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (S - 1,)))(k_accept)           # [B, S-1]
    g = _noise(k_next, V, logits.dtype, P(spec[0], "model"), mesh)               # [B, V]
    has_q = proposal is not None
    cand, q = proposal if has_q else (jnp.zeros((B, S - 1, 1), jnp.int32), jnp.zeros((B, S - 1, 1), jnp.float32))

    def local(x, drafts, u, g, cand, q, t, k, p):                                # x [b, S, V/TP]
        vocab = _Vocab(V, "model")
        lp = log_probs(x, t, k, p, mode, vocab=vocab)
        n = x.shape[-1]
        ids = vocab.ids(n)                                                       # [V/TP] global ids
        # p(d_i): a one-hot pick, exact (one shard holds d_i, the others add zeros)
        pick = vocab.sum(jnp.where(ids == drafts[..., None], lp[:, :-1], 0.0), axis=-1)     # [b, S-1]
        if has_q:
            q_draft = jnp.sum(jnp.where(cand == drafts[..., None], q, 0.0), axis=-1)        # [b, S-1]
            a = jnp.sum(jnp.cumprod(u * q_draft < jnp.exp(pick), axis=1), axis=1).astype(jnp.int32)
        else:
            a = jnp.sum(jnp.cumprod(u < jnp.exp(pick), axis=1), axis=1).astype(jnp.int32)
        row_lp = jnp.take_along_axis(lp, a[:, None, None], axis=1)[:, 0]         # [b, V/TP]
        if has_q:
            at = jnp.minimum(a, S - 2)[:, None, None]
            c_a = jnp.take_along_axis(cand, at, axis=1)[:, 0] - ids[0]            # [b, K] local ids
            q_a = jnp.take_along_axis(q, at, axis=1)[:, 0] * (a < S - 1)[:, None]   # no q on the bonus slot
            c_a = jnp.where((c_a >= 0) & (c_a < n), c_a, n)                      # other shards' candidates: dropped
            q_loc = jax.vmap(lambda c, w: jnp.zeros((n,), jnp.float32).at[c].add(w, mode="drop"))(c_a, q_a)
            res = jnp.maximum(jnp.exp(row_lp) - q_loc, 0.0)
            alive = vocab.sum(res, axis=-1) > 0                                  # [b]
            residual = jnp.where(alive[:, None], jnp.log(res), row_lp)
        else:
            rejected = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))), a[:, None], axis=1)
            residual = jnp.where((a < S - 1)[:, None] & (ids[None] == rejected), -jnp.inf, row_lp)
            alive = vocab.sum(jnp.isfinite(residual).astype(jnp.int32), axis=-1) > 0      # [b]
            residual = jnp.where(alive[:, None], residual, row_lp)
        return a, sharding.argmax_over_shards(g + residual)

    rows3 = P(spec[0], None, None)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(spec, P(spec[0], None), P(spec[0], None), P(spec[0], "model"), rows3, rows3,
                                   row, row, row),
                         out_specs=(row, row), check_vma=False)(
        logits, drafts, u, g, cand, q, *_rows(temperature, top_k, top_p, B=B))
