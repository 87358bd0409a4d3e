"""The target's log-probabilities over given tokens: what the server's `logprobs`, `top_logprobs`
and `echo` report (dflash_jax.serve).

One prefill-style forward of the target over a whole sequence (prompt + the tokens the engine
emitted), then, for each scored position, the log_softmax of the raw float32 logits (before
temperature, top-k or top-p: vLLM's default "raw" logprobs) at the actual next token and the top-k
alternatives. The numbers are those plain decoding would report: the target's distribution, not
the draft's, whatever the speculation accepted. The engine is not involved: the forward runs on
its own fresh cache after a request has its tokens, so the engine's KV layout is none of this
module's business, at the cost of a second pass over the sequence (docs/perf-log.md, 'OpenAI extras').

Shapes are bucketed so each (rows, sequence, scored positions) bucket compiles once: rows and
lengths round up to powers of two; the [rows, positions, vocab] logits are produced CHUNK positions
at a time (`lax.map`), so a long echo never holds a full [T, V] float32 array.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import sharding
from dflash_jax.kernel_config import resolved

__all__ = ["Scorer", "Scores", "MAX_TOP_LOGPROBS"]

# OpenAI's and vLLM's cap on alternatives per position; the program always computes this many
MAX_TOP_LOGPROBS = 20
# scored positions whose float32 logits are live at once (x rows x vocab)
CHUNK = 256
MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Scores:
    """One sequence's scores at positions first .. len(tokens) - 1 (N of them)."""
    token_logprobs: np.ndarray           # [N] float32: log p(tokens[i] | tokens[:i])
    top_ids: np.ndarray                  # [N, k] int32, most likely first
    top_logprobs: np.ndarray             # [N, k] float32
    ranks: np.ndarray | None = None      # [N] int32: 1 + how many tokens are likelier than tokens[i] (vLLM's rank)


def _bucket(n: int, lo: int = MIN_BUCKET) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _score_program(graphdef, kernels, mesh, state, tokens, starts, *, window: int):
    """tokens [B, T] (zero-padded after each sequence), starts [B] (>= 1): per row the log-probs of
    tokens[starts + w] given what precedes it, w < window. Returns ([B, W] float32,
    [B, W, K] int32, [B, W, K] float32, [B, W] int32 ranks)."""
    target = nnx.merge(graphdef, state)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    with sharding.active(mesh):
        h, _, _ = target(tokens, positions, target.new_cache(B, T), positions + 1, kernels=kernels, prefill=True)
    # the hidden state at position p predicts token p + 1
    at = jnp.minimum(starts[:, None] - 1 + jnp.arange(window, dtype=jnp.int32), T - 2)     # [B, W]
    nxt = jnp.take_along_axis(tokens, at + 1, axis=1)                                      # [B, W]
    rows = jnp.take_along_axis(h, at[:, :, None], axis=1)                                  # [B, W, H]
    ch = min(window, CHUNK)

    def chunk(args):
        hc, tc = args                                                   # [B, ch, H], [B, ch]
        logp = jax.nn.log_softmax(target.logits(hc), axis=-1)          # [B, ch, V] float32
        tok = jnp.take_along_axis(logp, tc[:, :, None], axis=-1)[..., 0]
        top_v, top_i = jax.lax.top_k(logp, MAX_TOP_LOGPROBS)
        rank = 1 + jnp.sum(logp > tok[..., None], axis=-1, dtype=jnp.int32)
        return tok, top_i.astype(jnp.int32), top_v, rank

    split = lambda x: jnp.moveaxis(x.reshape(B, window // ch, ch, *x.shape[2:]), 1, 0)  # noqa: E731
    tok, top_i, top_v, rank = jax.lax.map(chunk, (split(rows), split(nxt)))
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, window, *x.shape[3:])             # noqa: E731
    return join(tok), join(top_i), join(top_v), join(rank)


class Scorer:
    """Scores token sequences with `target` (a CausalLM from load_target / init_target).

    kernels: the attention backend of the forward (a KernelConfig or a backend's name; default the
    XLA path). max_batch: most sequences in one forward. Thread-safe: calls run one at a time (a
    scoring forward holds its own activations and cache on the device)."""

    def __init__(self, target, *, kernels=None, max_batch: int = 8):
        self.graphdef, self.state = nnx.split(target)
        self.kernels = resolved(kernels)
        self.mesh = sharding.mesh_of(self.state)
        self.vocab_size = target.config.vocab_size
        self.max_batch = max(1, int(max_batch))
        self._lock = threading.Lock()
        self._programs: dict[tuple, object] = {}

    def _program(self, window: int):
        fn = self._programs.get(window)
        if fn is None:
            fn = jax.jit(functools.partial(_score_program, self.graphdef, self.kernels, self.mesh, window=window))
            self._programs[window] = fn
        return fn

    def score(self, sequences, first) -> list[Scores]:
        """sequences: token-id lists; first[i] (>= 1, < len(sequences[i])): the first position of
        sequence i to score (1 with echo: every token but the first; the prompt's length: only
        the output). Returns one Scores per sequence, in order."""
        seqs = [[int(t) for t in s] for s in sequences]
        first = [int(f) for f in first]
        for s, f in zip(seqs, first, strict=True):
            if not 1 <= f < len(s):
                raise ValueError(f"first position {f} must be in [1, {len(s)}) for a sequence of {len(s)} tokens")
        out: list[Scores | None] = [None] * len(seqs)
        # sequences of one length bucket together, a forward per max_batch of them
        order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), len(seqs[i]) - first[i]))
        with self._lock:
            for g in range(0, len(order), self.max_batch):
                group = order[g:g + self.max_batch]
                for i, sc in zip(group, self._score_group([seqs[i] for i in group], [first[i] for i in group])):
                    out[i] = sc
        return out

    def _score_group(self, seqs, first) -> list[Scores]:
        B = _bucket(len(seqs), 1)
        T = _bucket(max(len(s) for s in seqs) + 1)          # + 1: a padding column past every row
        W = min(T, _bucket(max(len(s) - f for s, f in zip(seqs, first))))
        tokens = np.zeros((B, T), np.int32)
        starts = np.ones((B,), np.int32)
        for i, (s, f) in enumerate(zip(seqs, first)):
            tokens[i, :len(s)] = s
            starts[i] = f
        tok, top_i, top_v, rank = jax.device_get(self._program(W)(self.state, jnp.asarray(tokens),
                                                                   jnp.asarray(starts)))
        return [Scores(token_logprobs=tok[i, :len(s) - f], top_ids=top_i[i, :len(s) - f],
                       top_logprobs=top_v[i, :len(s) - f], ranks=rank[i, :len(s) - f])
                for i, (s, f) in enumerate(zip(seqs, first))]
