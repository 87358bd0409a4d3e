"""The DFlash draft: `fc` + `hidden_norm` over the concatenated target taps give the context; each
draft layer projects the context with its own k/v weights into the draft KV cache (k_norm and RoPE at
each token's position) and lets the block [last token, MASK × (S-1)] attend, non-causally, to the
cached context plus the whole block. The draft has no embedding or LM head: it uses the target's.

`propose` is what the generation loop calls (dflash_jax.decode): a proposer is any module with
`config` (block_size, target_layer_ids, check_fits), `new_cache`, `write_context` and `propose`,
so another drafting scheme (a DFlash-2 draft, a test double) can stand where this one does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.cache import KVCache, PagedKVCache
from dflash_jax.config import DraftConfig
from dflash_jax.kernel_config import KernelConfig, resolved
from dflash_jax.sharding import argmax
from dflash_jax.drafts.variant import Variant
from dflash_jax.models import qwen3
from dflash_jax.models.layers import DecoderLayer, DraftContext, RMSNorm, init_param, run_layers


def head_rows(block_size: int, heads: int | None) -> int:
    """The end (exclusive) of the block rows whose drafts a `propose(heads=)` wants: row 0 is the
    last committed token, rows 1..heads its drafts (all S - 1 when heads is None)."""
    return block_size if heads is None else 1 + max(0, min(int(heads), block_size - 1))


def pad_drafts(drafts, block_size: int):
    """drafts [B, n] -> [B, S-1]: the drafts nobody verifies are 0."""
    return jnp.pad(drafts, ((0, 0), (0, block_size - 1 - drafts.shape[1])))


class DFlashDraft(nnx.Module):
    def __init__(self, config: DraftConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.fc = init_param(rngs, (n * H, H), dtype, (n * H) ** -0.5)            # [n·H, H]
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)

    def context(self, feats):
        """Target taps [B, T, n·H] → context features [B, T, H]."""
        return self.hidden_norm(feats.astype(self.dtype) @ self.fc[...])

    def write_context(self, feats, positions, cache: KVCache, valid=None) -> KVCache:
        """Prefill: project the prompt's taps [B, T, n·H] at positions [B, T] into the draft cache
        rows [positions[:, 0], positions[:, 0] + T). valid [B] (the prompt lengths at prefill):
        rows past it are padding, stale entries here (a ring cache must leave them out)."""
        ctx = self.context(feats)
        start = positions[:, 0]
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(ctx, positions)
            cache = cache.write_rows(i, k, v, start)
        return cache.replace(lens=start + feats.shape[1])

    def __call__(self, block_embeds, positions, pending_feats, pending_positions, cache: KVCache, k_end,
                 *, kernels: KernelConfig | str | None = None):
        """One draft pass. block_embeds [B, S, H] at positions [B, S] (the block starts at the row's
        length); pending_feats [B, S, n·H]: target taps of tokens committed last iteration, at
        pending_positions [B, S] (entries past the row's pending count land at/after the block start
        and are overwritten by the block). k_end [B, S]. Returns (hidden [B, S, H] final-normed, cache)."""
        kernels = resolved(kernels)
        context = DraftContext(feats=self.context(pending_feats), positions=pending_positions)
        h, _, cache = run_layers(self.layers, block_embeds.astype(self.dtype), positions, cache, k_end,
                                 kernels, self.norm, context=context, scope="draft_layer")
        return h, cache.replace(lens=positions[:, 0])

    def propose(self, target, current, lens, limit, pending, pending_count, cache: KVCache, *,
                block_size: int, kernels: KernelConfig, heads: int | None = None):
        """The S-1 draft tokens after each row's last token, and the new draft cache.

        target: the Qwen3 target (its embedding and LM head); current [B, 1] the last committed
        token, at position lens [B]; limit [B] the row's length limit (prompt + max_new_tokens);
        pending [B, S, n·H] the target taps of the tokens committed last iteration (pending_count
        [B] of them, ending at lens); cache: the draft's KV cache. Greedy drafts (argmax of the
        target's LM head on the block's hidden states). heads: only the first `heads` drafts are
        wanted (a verify of a prefix of the block, loop._verify): the LM head runs on those rows
        alone and the rest are 0 (the block is still drafted whole: its non-causal context).
        Returns (drafts [B, S-1] int32, cache)."""
        B, S = current.shape[0], block_size
        j = jnp.arange(S, dtype=jnp.int32)
        positions = lens[:, None] + j                                               # [B, S]
        block = jnp.concatenate([current, jnp.full((B, S - 1), self.config.mask_token_id, jnp.int32)],
                                axis=1)                                             # [B, S]
        # The reference shortens the last block to the tokens still allowed; the non-causal draft
        # sees that as keys ending there.
        draft_end = jnp.broadcast_to((lens + jnp.minimum(S, limit - lens))[:, None], (B, S))
        pend_pos = (lens - pending_count)[:, None] + j
        with jax.named_scope("draft"):
            dh, cache = self(target.embed_tokens(block), positions, pending, pend_pos, cache, draft_end,
                             kernels=kernels)
        with jax.named_scope("draft_lm_head"):
            # sharding.argmax: jnp.argmax, or over a vocab-sharded head without gathering the logits
            drafts = argmax(target.logits(dh[:, 1:head_rows(S, heads)]))               # [B, <= S-1]
        return pad_drafts(drafts, S), cache

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        # kv heads from the layers: under TP with fewer kv heads than shards the layers hold copies
        # (sharding.fused_layout), and each copy has its own cache entry
        c = self.config
        return KVCache.zeros(c.num_layers, batch, self.layers[0].num_kv_heads, capacity, c.head_dim, self.dtype)

    def new_paged_cache(self, batch: int, num_pages: int, page_size: int, pages_per_row: int) -> PagedKVCache:
        """The draft's context K/V in pages addressed by the target's table (dflash_jax.cache)."""
        c = self.config
        geometry = [(self.layers[0].num_kv_heads, c.head_dim)] * c.num_layers
        return PagedKVCache.zeros(num_pages, page_size, batch, pages_per_row, geometry, self.dtype)


# A z-lab draft's tensors outside its layers (no prefix, no embedding, no LM head); its layers are a
# Qwen3 target's layer tensors without the `model.` prefix.
TOP_WEIGHTS = {"fc.weight": (("fc",), "T"), "hidden_norm.weight": (("hidden_norm", "weight"), None),
               "norm.weight": (("norm", "weight"), None)}

VARIANT = Variant(architecture="DFlashDraftModel", config_class=DraftConfig, model=DFlashDraft,
                  top_weights=TOP_WEIGHTS, layer_weights=qwen3.LAYER_WEIGHTS)
