"""DFlash2 drafts, and DFlash drafts whose layers slide or attend causally.

A DFlash2 draft (reference `dflash.model.DFlash2DraftModel`) is the DFlash draft plus
  - a grouped dynamic causal convolution around each sublayer: `prepare` convolves the normed
    sublayer input, `finish` the sublayer output before its residual add, both over the block only
    (zeros before the anchor), with taps base[o, c] + δ[t, o, c // group_size] where δ is a linear
    map of the prepare input (one projection gives both tap sets);
  - a candidate selector: the top-K ids of each slot's logits (lm_head · output_multiplier, then
    the optional softcap) with their logits as unary scores U, and a pair score
    S_t(a, b) = U_t(b) + <P[a] ⊙ W h_t, Q[b]> between the predecessor a and candidate b. The path
    starts at the anchor (the block's slot 0) and takes one candidate per slot.
The predecessor of slot t is one of the K candidates of slot t-1, so the K×K score lattice of every
slot is computed at once (float32) and only the walk over it is sequential (a scan over S-1 slots):
argmax at T = 0; at T > 0 a Gumbel-max draw from q = softmax(S / T), q returned for the acceptance.

Layer attention follows config.layer_types / sliding_window / is_causal (the reference's mask): a
block row at position p sees context keys in (p - W, p] ∩ [0, block end) for a sliding layer, and
the block's keys at most up to p (causal) or p + W (non-causal sliding); full non-causal layers see
everything, as DFlash-1. The window travels as a per-row first key (`attention.attend(k_start=)`).
A DFlash-1 draft whose layers slide or are causal runs here too (no conv, no selector).

A sliding layer's draft cache is a ring of `ring_rows(W, S)` slots (window + block, rounded up;
at most the capacity): position p lives in slot p mod that size, and its attention masks by absolute
position (`attention.attend(ring=True)`): the rows a block can see, (p - W, block end], always fit
the ring, so the cache never grows with the capacity. Full layers keep every row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.attention import attend
from dflash_jax.cache import KVCache, PagedKVCache, is_paged, write_kv_rows, write_ring_kv_rows, write_ring_rows
from dflash_jax.config import DraftConfig
from dflash_jax.kernel_config import KernelConfig, resolved
from dflash_jax.drafts.dflash import TOP_WEIGHTS, DFlashDraft, head_rows, pad_drafts
from dflash_jax.drafts.variant import Variant
from dflash_jax.models import qwen3
from dflash_jax.models.layers import DecoderLayer, DraftContext, RMSNorm, add_norm, gated_silu, init_param
from dflash_jax.sharding import argmax, top_k

__all__ = ["DFlash2Draft", "GroupedDynamicConv", "CandidateSelector", "grouped_dynamic_conv",
           "layer_key_range", "needs_dflash2", "ring_rows"]


def ring_rows(window: int, block_size: int) -> int:
    """Slots of a sliding layer's ring cache: W + S rounded up to 16 (to 128 past 128, the TPU
    kernel's tile; the Triton kernel's 32 / 64 divide both). A block row at position p reads keys
    from p - W + 1 while the block writes up to p + S - 1: W + S - 1 rows must be live at once."""
    n = window + block_size
    return -(-n // (16 if n <= 128 else 128)) * (16 if n <= 128 else 128)


def needs_dflash2(config: DraftConfig) -> bool:
    """Whether a draft config runs on this module (DFlash2, or per-layer windows / causal layers)."""
    return config.is_dflash2 or not config.plain_attention


def grouped_dynamic_conv(x, dyn, base, group_size: int):
    """out[t, c] = Σ_o (base[o, c] + dyn[t, o, c // group_size]) · x[t - o, c], x[t < 0] = 0.
    x [B, S, H], dyn [B, S, K, G], base [K, H]. In x's dtype, as the reference."""
    B, S, H = x.shape
    out = jnp.zeros_like(x)
    for o in range(base.shape[0]):
        xs = x if o == 0 else jnp.pad(x[:, :-o], ((0, 0), (o, 0), (0, 0)))          # [B, S, H]
        w = jnp.repeat(dyn[:, :, o].astype(x.dtype), group_size, axis=-1)            # [B, S, H]
        out = out + base[o].astype(x.dtype) * xs
        out = out + w * xs
    return out


class GroupedDynamicConv(nnx.Module):
    """The reference's GroupedDynamicCausalConv: base_kernel [2, K, H] (prepare, finish) and
    kernel_projection [H, 2·K·G] ([in, out]). identity=True: tap 0 = 1, the rest 0 and a zero
    projection, so the conv is the identity (a fresh DFlash2 draft is a DFlash draft)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, dtype, rngs: nnx.Rngs,
                 identity: bool = False):
        self.kernel_size, self.group_size = kernel_size, group_size
        G = hidden // group_size
        if identity:
            base = jnp.zeros((2, kernel_size, hidden), dtype).at[:, 0].set(1)
            self.base_kernel = nnx.Param(base)
            self.kernel_projection = nnx.Param(jnp.zeros((hidden, 2 * kernel_size * G), dtype))
        else:
            self.base_kernel = init_param(rngs, (2, kernel_size, hidden), dtype, 0.5)
            self.kernel_projection = init_param(rngs, (hidden, 2 * kernel_size * G), dtype, hidden ** -0.5)

    def prepare(self, x, block_size: int | None = None):
        """(conv of x with the prepare taps, the finish taps' dynamic part [B, T, K, G]). x [B, T, H]
        is T / block_size whole blocks (default: one), each convolved on its own (zeros before
        its first row: the taps never cross a block edge)."""
        B, T, H = x.shape
        S = block_size or T
        K, G = self.kernel_size, H // self.group_size
        dyn = (x @ self.kernel_projection[...]).reshape(B, T, 2, K, G)
        xb = x.reshape(B * (T // S), S, H)
        out = grouped_dynamic_conv(xb, dyn[:, :, 0].reshape(B * (T // S), S, K, G), self.base_kernel[0],
                                   self.group_size)
        return out.reshape(B, T, H), dyn[:, :, 1]

    def finish(self, x, dyn, block_size: int | None = None):
        B, T, H = x.shape
        S = block_size or T
        n = B * (T // S)
        out = grouped_dynamic_conv(x.reshape(n, S, H), dyn.reshape(n, S, *dyn.shape[2:]), self.base_kernel[1],
                                   self.group_size)
        return out.reshape(B, T, H)


class DFlash2Layer(DecoderLayer):
    """A draft layer: DecoderLayer's weights (the same names and fused layout) with optional convs
    around its two sublayers, run in XLA ops around `attention.attend` (the window as k_start)."""

    def __init__(self, cfg: DraftConfig, dtype, rngs: nnx.Rngs, identity_conv: bool = False):
        super().__init__(cfg, dtype, rngs)
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, dtype, rngs, identity_conv)
        conv = cfg.conv_kernel_size > 0
        self.attention_conv = nnx.data(GroupedDynamicConv(*args) if conv else None)
        self.mlp_conv = nnx.data(GroupedDynamicConv(*args) if conv else None)

    def attention_input(self, x, block_size: int):
        """The attention sublayer's input: (input_layernorm(x), convolved when the layer has a conv;
        the finish taps or None). x [B, N·S, H] holds N whole blocks of block_size rows (inference:
        one block; training: the packed blocks), each convolved on its own."""
        return _conv_in(self.attention_conv, self.input_layernorm(x), block_size)

    def attention_output(self, x, o, taps, block_size: int):
        """The rest of the layer after attention: x + finish(o_proj(o)), then the (convolved) MLP
        with its residual. o [B, N·S, Hq, D]."""
        x = x + self._attention_out(o, taps, block_size)
        return x + self._mlp_out(self.post_attention_layernorm(x), block_size)

    def _attention_out(self, o, taps, block_size: int):
        """finish(o_proj(o)): the attention sublayer's output before its residual add."""
        a = self._o_proj(o)
        return a if self.attention_conv is None else self.attention_conv.finish(a, taps, block_size)

    def _mlp_out(self, h, block_size: int):
        """The (convolved) MLP of the post-attention normed rows h, before its residual add."""
        h, taps = _conv_in(self.mlp_conv, h, block_size)
        m = gated_silu(h @ self.mlp.gate_up[...], self.qkv_groups) @ self.mlp.down[...]
        return m if self.mlp_conv is None else self.mlp_conv.finish(m, taps, block_size)

    def block(self, x, residual, positions, k_cache, v_cache, context, k_start, k_end, kernels: KernelConfig,
              ring: bool = False):
        """x [B, S, H] block rows at positions [B, S], residual: the previous layer's MLP output
        not yet added (or None); context: DraftContext or None (its rows' K/V written first);
        k_start (or None), k_end [B, S]; ring: the caches are this layer's rings (a sliding
        layer's: slot = position mod their size). Returns (x, its MLP output to add, k_cache,
        v_cache). Each residual add and the RMSNorm after it are one `layers.add_norm` (one Pallas
        kernel on the fused GPU path, the MLP's add deferred into the next norm as DFlash-1's
        layers do). A full layer's q/k norm, RoPE, cache writes and attention take DecoderLayer's
        kernel path (the fused GPU prologue, the TPU fused-q kernels); a sliding layer's are XLA
        ops around the attention kernel over its ring. The convs are XLA ops."""
        write = write_ring_kv_rows if ring else lambda kc, vc, k, v, s: write_kv_rows(kc, vc, k, v, s, kernels)
        T = x.shape[1]
        if residual is None:
            h = self.input_layernorm(x)
        else:
            x, h = add_norm(x, residual, self.input_layernorm, kernels)
        h, attn_taps = _conv_in(self.attention_conv, h, T)
        hin, k_pos, Tc = h, positions, 0
        if context is not None:
            hin = jnp.concatenate([context.feats.astype(h.dtype), h], axis=1)         # [B, Tc+S, H]
            k_pos = jnp.concatenate([context.positions, positions], axis=1)
            Tc = context.feats.shape[1]
        qkv = self._project(hin)                                                       # [B, Tc+S, W]
        if k_start is None:   # a full layer (flat cache, keys from 0): DecoderLayer's kernel paths
            o, k_cache, v_cache = self.attention_path(kernels, T, Tc, k_cache, qkv, False)(
                self, qkv, positions, k_pos, Tc, k_cache, v_cache, k_end, kernels, False)
        else:
            q, k, v = self._heads(qkv, positions, k_pos)
            if Tc:
                k_cache, v_cache = write(k_cache, v_cache, k[:, :Tc], v[:, :Tc], context.positions[:, 0])
                k, v = k[:, Tc:], v[:, Tc:]
            k_cache, v_cache = write(k_cache, v_cache, k, v, positions[:, 0])
            o = attend(q, k_cache, v_cache, k_end, kernels, k_start=k_start, ring=ring)  # [B, S, Hq, D]
        x, h = add_norm(x, self._attention_out(o, attn_taps, T), self.post_attention_layernorm, kernels)
        return x, self._mlp_out(h, T), k_cache, v_cache


def _conv_in(conv, h, block_size: int):
    """(prepare-convolved h and the finish taps) of a sublayer's conv, or (h, None) without one."""
    return (h, None) if conv is None else conv.prepare(h, block_size)


def layer_key_range(config: DraftConfig, i: int, positions, block_end):
    """(k_start [B, S] or None, k_end [B, S]) of draft layer i for block rows at positions [B, S]
    whose keys end at block_end [B] (the reference's mask: causal: key <= p; sliding window W:
    p - key < W, and key - p < W when not causal)."""
    W, causal = config.layer_window(i), config.layer_causal(i)
    end = jnp.broadcast_to(block_end[:, None], positions.shape)
    if causal:
        end = jnp.minimum(end, positions + 1)
    elif W is not None:
        end = jnp.minimum(end, positions + W)
    start = None if W is None else jnp.maximum(positions - W + 1, 0)
    return start, end


class CandidateSelector(nnx.Module):
    """predecessor_codebook, successor_codebook [V, R]; hidden_projection [H, R] ([in, out])."""

    def __init__(self, config: DraftConfig, dtype, rngs: nnx.Rngs, zero_successor: bool = False):
        V, R, H = config.vocab_size, config.selector_rank, config.hidden_size
        self.top_k = config.selector_top_k
        self.predecessor_codebook = init_param(rngs, (V, R), dtype, 0.02 if zero_successor else 1.0)
        self.successor_codebook = (nnx.Param(jnp.zeros((V, R), dtype)) if zero_successor
                                   else init_param(rngs, (V, R), dtype, 1.0))
        self.hidden_projection = init_param(rngs, (H, R), dtype, H ** -0.5)

    def _codes(self, hidden, prev, cand):
        """The pair scores <P[prev] ⊙ W h, Q[cand]> in float32: hidden [..., H], prev [..., A]
        predecessor ids, cand [..., K] candidate ids → [..., A, K]."""
        hp = hidden.astype(jnp.float32) @ self.hidden_projection[...].astype(jnp.float32)   # [..., R]
        pred = self.predecessor_codebook[...][prev].astype(jnp.float32)                    # [..., A, R]
        succ = self.successor_codebook[...][cand].astype(jnp.float32)                      # [..., K, R]
        return jnp.einsum("...ar,...r,...kr->...ak", pred, hp, succ)

    def candidates(self, logits):
        """(unary scores [..., K] float32, candidate ids [..., K] int32): the top-K of the unary
        logits [..., V] (the order of lax.top_k: descending, lowest id first on ties)."""
        return top_k(logits.astype(jnp.float32), self.top_k)   # over a vocab-sharded head: per shard

    def lattice(self, hidden, logits, anchor):
        """hidden [B, L, H] (the draft's rows for slots 1..L), logits [B, L, V] float32 (the unary
        logits), anchor [B] (the predecessor of slot 1). Returns (scores [B, L, K, K] float32:
        scores[b, t, a, k] = S_t(candidate a of slot t-1, candidate k of slot t), every row a of
        slot 0 being the anchor; candidates [B, L, K] int32)."""
        unary, cand = self.candidates(logits)                                           # [B, L, K]
        B, L, K = cand.shape
        prev = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (B, 1, K)), cand[:, :-1]], axis=1)
        return unary[:, :, None, :] + self._codes(hidden, prev, cand), cand

    def teacher_forced(self, hidden, logits, prev):
        """Training's scores: each slot's K candidates scored after its gold predecessor. hidden
        [..., H], logits [..., V] (unary), prev [...] int32 → (scores [..., K] float32, candidates
        [..., K]): the lattice's row of that predecessor when it is among the candidates."""
        unary, cand = self.candidates(logits)
        return unary + self._codes(hidden, prev[..., None], cand)[..., 0, :], cand


def walk(scores, cand, temperature=None, keys=None):
    """The selector's path through its lattice: scores [B, L, K, K], cand [B, L, K]. From row 0 of
    slot 0 (the anchor), each slot takes a candidate given the previous pick: argmax (lowest index
    on ties), or with temperature [B] > 0 and keys [B] a Gumbel-max draw from q = softmax(S / T)
    (a row with temperature 0 takes the argmax). Returns (path [B, L] int32, q [B, L, K] float32 of
    each slot's row given its predecessor, or None at T = 0).

    Only the walk is sequential: a slot's Gumbel noise does not depend on its predecessor, so every
    row's pick (`follow` [B, L, K]: the candidate slot t takes after candidate a of slot t-1) is one
    parallel argmax over the lattice, and the walk is L gathers of one index each, unrolled (a scan
    here is a device loop: on XLA:GPU one host round trip per slot, docs/perf-log.md)."""
    B, L, K, _ = scores.shape
    rows = jnp.arange(B)
    if temperature is None:
        z = noisy = scores
    else:
        z = scores / jnp.where(temperature > 0, temperature, 1.0)[:, None, None, None]
        slots = jnp.arange(L, dtype=jnp.uint32)
        g = jax.vmap(lambda k: jax.vmap(lambda t: jax.random.gumbel(jax.random.fold_in(k, t), (K,), jnp.float32))(
            slots))(keys)                                                               # [B, L, K]
        noisy = jnp.where(temperature[:, None, None, None] > 0, z + g[:, :, None, :], scores)
    follow = jnp.argmax(noisy, axis=-1).astype(jnp.int32)                              # [B, L, K]
    picks, prev = [], jnp.zeros((B,), jnp.int32)
    for t in range(L):
        prev = follow[rows, t, prev]
        picks.append(prev)
    idx = jnp.stack(picks, axis=1)                                                     # [B, L]
    path = jnp.take_along_axis(cand, idx[..., None], axis=-1)[..., 0]
    if temperature is None:
        return path, None
    before = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), idx[:, :-1]], axis=1)     # each slot's predecessor
    row = jnp.take_along_axis(z, before[:, :, None, None], axis=2)[:, :, 0]            # [B, L, K]
    return path, jax.nn.softmax(row, axis=-1)


class DFlash2Draft(nnx.Module):
    """The DFlash2 draft (or a DFlash draft with per-layer windows / causal layers): the proposer
    interface of drafts.dflash.DFlashDraft (config, new_cache, write_context, propose)."""

    def __init__(self, config: DraftConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs, identity_conv: bool = False,
                 zero_successor: bool = False):
        """identity_conv / zero_successor: a fresh draft for training (the convs the identity, the
        successor codebook zero: the selector's pair term is 0, so the path is the unary argmax and
        the draft proposes what a DFlash-1 draft with the same weights proposes)."""
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.fc = init_param(rngs, (n * H, H), dtype, (n * H) ** -0.5)                 # [n·H, H]
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.layers = nnx.List([DFlash2Layer(config, dtype, rngs, identity_conv) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.candidate_selector = nnx.data(CandidateSelector(config, dtype, rngs, zero_successor)
                                           if config.selector_top_k else None)

    @classmethod
    def for_training(cls, config: DraftConfig, dtype=jnp.float32, *, seed: int = 0, init=None):
        """A DFlash2 draft to train: identity convs, a zero successor codebook, and (init: a DFlash-1
        draft of the same shape) its fc, norms and layer weights, so it starts as that draft."""
        d = cls(config, dtype, rngs=nnx.Rngs(seed), identity_conv=True, zero_successor=True)
        if init is not None:
            for path, node in nnx.iter_graph(init):
                if not isinstance(node, nnx.Param):
                    continue
                obj = d
                for k in path[:-1]:
                    obj = obj[k] if isinstance(k, int) else getattr(obj, k, None)
                    if obj is None:
                        break
                dest = None if obj is None else getattr(obj, path[-1], None)
                if not isinstance(dest, nnx.Param) or dest[...].shape != node[...].shape:
                    raise ValueError(f"the init draft's {'.'.join(map(str, path))} has no place in this "
                                     "DFlash2 draft (not a DFlash-1 draft of the same shape)")
                dest[...] = jnp.asarray(node[...], dtype)
        return d

    @property
    def samples_drafts(self) -> bool:
        """At T > 0 the loop passes temperature and keys to propose and q to the acceptance."""
        return self.candidate_selector is not None

    # the context path is DFlash-1's (fc + hidden_norm, each layer's k/v of the context rows)
    context = DFlashDraft.context

    def _ring(self, i: int, cache=None) -> bool:
        """Layer i's cache is a ring: a sliding layer's, except in pages (dflash_jax.cache)."""
        return self.config.layer_window(i) is not None and not is_paged(cache)

    def write_context(self, feats, positions, cache: KVCache, valid=None) -> KVCache:
        """Project taps [B, T, n·H] at positions [B, T] (contiguous per row) into the draft cache:
        full layers' rows [positions[:, 0], + T), sliding layers' rings (write_ring_rows). valid
        [B] (the prefill's prompt lengths): rows at or past it are the bucket's padding, which a
        ring must not let overwrite the rows its window still needs."""
        ctx = self.context(feats)
        start = positions[:, 0]
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(ctx, positions)
            if self._ring(i, cache):
                kr, vr = cache.layer_kv(i)
                cache = cache.set_layer(i, write_ring_rows(kr, k, start, valid), write_ring_rows(vr, v, start, valid))
            else:
                cache = cache.write_rows(i, k, v, start)
        return cache.replace(lens=start + feats.shape[1])

    def __call__(self, block_embeds, positions, pending_feats, pending_positions, cache: KVCache, block_end,
                 *, kernels: KernelConfig | str | None = None):
        """One draft pass: block_embeds [B, S, H] at positions [B, S]; pending_feats [B, S, n·H] at
        pending_positions (as DFlashDraft); block_end [B]: the block's keys end there. Returns
        (hidden [B, S, H] final-normed, cache)."""
        kernels = resolved(kernels)
        context = DraftContext(feats=self.context(pending_feats), positions=pending_positions)
        x, res = block_embeds.astype(self.dtype), None
        lo = jnp.minimum(context.positions[:, 0], positions[:, 0])
        rows = positions.shape[1] + context.positions.shape[1]
        for i, layer in enumerate(self.layers):
            k_start, k_end = layer_key_range(self.config, i, positions, block_end)
            with jax.named_scope(f"draft_layer{i}"):
                kc, vc = cache.layer_kv(i)
                x, res, kc, vc = layer.block(x, res, positions, kc, vc, context, k_start, k_end,
                                             kernels, ring=self._ring(i, cache))
                cache = cache.set_layer(i, kc, vc, lo, rows)
        return add_norm(x, res, self.norm, kernels)[1], cache.replace(lens=positions[:, 0])

    def unary_logits(self, target, hidden):
        """The target's LM head on hidden [B, L, H], times output_multiplier, then the softcap:
        float32 [B, L, V] (the reference's compute_logits)."""
        logits = target.logits(hidden)
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = jnp.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def propose(self, target, current, lens, limit, pending, pending_count, cache: KVCache, *,
                block_size: int, kernels: KernelConfig, temperature=None, keys=None, heads: int | None = None):
        """As DFlashDraft.propose: (drafts [B, S-1] int32, cache); `heads` cuts the LM head to the
        drafts wanted without a candidate selector (the selector's lattice still covers the block:
        its walk's first steps are not checked against a cut one). With temperature [B] and keys [B]
        (sampling) the selector draws its path and the result is (drafts, cache, (candidates
        [B, S-1, K], q [B, S-1, K])) for the acceptance (sampling.accept's `proposal`)."""
        B, S = current.shape[0], block_size
        j = jnp.arange(S, dtype=jnp.int32)
        positions = lens[:, None] + j                                                   # [B, S]
        block = jnp.concatenate([current, jnp.full((B, S - 1), self.config.mask_token_id, jnp.int32)], axis=1)
        block_end = lens + jnp.minimum(S, limit - lens)     # the reference's shortened last block
        pend_pos = (lens - pending_count)[:, None] + j
        with jax.named_scope("draft"):
            dh, cache = self(target.embed_tokens(block), positions, pending, pend_pos, cache, block_end,
                             kernels=kernels)
        with jax.named_scope("draft_lm_head"):
            if self.candidate_selector is None:
                return pad_drafts(argmax(self.unary_logits(target, dh[:, 1:head_rows(S, heads)])), S), cache
            logits = self.unary_logits(target, dh[:, 1:])                               # [B, S-1, V]
        with jax.named_scope("draft_selector"):
            scores, cand = self.candidate_selector.lattice(dh[:, 1:], logits, current[:, 0])
            path, q = walk(scores, cand, temperature, keys)
        if temperature is None:
            return path, cache
        return path, cache, (cand, q)

    def cache_rows(self, capacity: int) -> tuple[int, ...]:
        """Rows of each layer's draft cache: the capacity, or a sliding layer's ring (at most it)."""
        c = self.config
        return tuple(capacity if c.layer_window(i) is None else min(capacity, ring_rows(c.layer_window(i), c.block_size))
                     for i in range(c.num_layers))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        # kv heads from the layers (under TP with fewer kv heads than shards the layers hold copies)
        shapes = [(batch, self.layers[0].num_kv_heads, n, self.config.head_dim) for n in self.cache_rows(capacity)]
        return KVCache(k=tuple(jnp.zeros(s, self.dtype) for s in shapes),
                       v=tuple(jnp.zeros(s, self.dtype) for s in shapes), lens=jnp.zeros((batch,), jnp.int32))

    def window(self) -> int | None:
        """The widest sliding window of the draft's layers (None: no sliding layer): what a window
        pool's rows must keep (pages.WindowPages)."""
        ws = [self.config.layer_window(i) for i in range(self.config.num_layers)]
        ws = [w for w in ws if w is not None]
        return max(ws) if ws else None

    def new_paged_cache(self, batch: int, num_pages: int, page_size: int, pages_per_row: int,
                        window_pages: int | None = None) -> PagedKVCache:
        """Every layer's context K/V in pages. Full layers: addressed by the target's table.
        Sliding layers: the same (their window a mask over every row), or with window_pages a pool
        of that many pages of their own read through the window table, whose entries behind a row's
        window point at the dummy page (the window mask hides it: dflash_jax.cache)."""
        geometry = [(self.layers[0].num_kv_heads, self.config.head_dim)] * self.config.num_layers
        windowed = [self.config.layer_window(i) is not None for i in range(self.config.num_layers)]
        return PagedKVCache.zeros(num_pages, page_size, batch, pages_per_row, geometry, self.dtype,
                                  window_pages=window_pages, windowed=windowed)


# DFlash2 tensors beside the z-lab DFlash ones: the convs in each layer, the selector at the top (the
# reference stores the codebooks without `.weight`; `.weight` is read too).
LAYER_WEIGHTS = {
    **qwen3.LAYER_WEIGHTS,
    "attention_conv.base_kernel": (("attention_conv", "base_kernel"), None),
    "attention_conv.kernel_projection.weight": (("attention_conv", "kernel_projection"), "T"),
    "mlp_conv.base_kernel": (("mlp_conv", "base_kernel"), None),
    "mlp_conv.kernel_projection.weight": (("mlp_conv", "kernel_projection"), "T"),
}
_SELECTOR = {
    "candidate_selector.predecessor_codebook": (("candidate_selector", "predecessor_codebook"), None),
    "candidate_selector.successor_codebook": (("candidate_selector", "successor_codebook"), None),
    "candidate_selector.hidden_projection.weight": (("candidate_selector", "hidden_projection"), "T"),
}
TOP_WEIGHTS2 = {**TOP_WEIGHTS, **_SELECTOR,
                **{k + ".weight": v for k, v in _SELECTOR.items() if "codebook" in k}}

VARIANT = Variant(architecture="DFlash2DraftModel", config_class=DraftConfig, model=DFlash2Draft,
                  top_weights=TOP_WEIGHTS2, layer_weights=LAYER_WEIGHTS)
