"""The DFlash draft: `fc` + `hidden_norm` over the concatenated target taps give the context; each
draft layer projects the context with its own k/v weights into the draft KV cache (k_norm and RoPE at
each token's position) and lets the block [last token, MASK × (S-1)] attend, non-causally, to the
cached context plus the whole block. The draft has no embedding or LM head: it uses the target's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.attention import fused_add_norm
from dflash_jax.kernel_config import KernelConfig, resolved
from dflash_jax.cache import KVCache, write_rows
from dflash_jax.config import DraftConfig
from dflash_jax.modeling.layers import DecoderLayer, RMSNorm, _init, add_norm


class DFlashDraft(nnx.Module):
    def __init__(self, config: DraftConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.fc = _init(rngs, (n * H, H), dtype, (n * H) ** -0.5)                 # [n·H, H]
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)

    def context(self, feats):
        """Target taps [B, T, n·H] → context features [B, T, H]."""
        return self.hidden_norm(feats.astype(self.dtype) @ self.fc[...])

    def write_context(self, feats, positions, cache: KVCache) -> KVCache:
        """Prefill: project the prompt's taps [B, T, n·H] at positions [B, T] into the draft cache
        rows [positions[:, 0], positions[:, 0] + T)."""
        ctx = self.context(feats)
        start = positions[:, 0]
        ks, vs = list(cache.k), list(cache.v)
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(ctx, positions)
            ks[i], vs[i] = write_rows(ks[i], k, start), write_rows(vs[i], v, start)
        return KVCache(k=tuple(ks), v=tuple(vs), lens=start + feats.shape[1])

    def __call__(self, block_embeds, positions, pending_feats, pending_positions, cache: KVCache, k_end,
                 *, kernels: KernelConfig | str | None = None):
        """One draft pass. block_embeds [B, S, H] at positions [B, S] (the block starts at the row's
        length); pending_feats [B, S, n·H]: target taps of tokens committed last iteration, at
        pending_positions [B, S] (entries past the row's pending count land at/after the block start
        and are overwritten by the block). k_end [B, S]. Returns (hidden [B, S, H] final-normed, cache)."""
        kernels = resolved(kernels)
        ctx = self.context(pending_feats)
        x = block_embeds.astype(self.dtype)
        start, ctx_start = positions[:, 0], pending_positions[:, 0]
        ks, vs = list(cache.k), list(cache.v)
        # GPU path: each layer's MLP residual is added by the next RMSNorm's kernel (as in Qwen3)
        defer = fused_add_norm(kernels, x.shape[1], self.config.hidden_size)
        delta = None
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"draft_layer{i}"):
                out = layer(x, positions, ks[i], vs[i], start, k_end, kernels, ctx=ctx,
                            ctx_positions=pending_positions, ctx_write_start=ctx_start,
                            residual=delta, defer=defer)
                if defer:
                    x, delta, ks[i], vs[i] = out
                else:
                    x, ks[i], vs[i] = out
        h = add_norm(x, delta, self.norm, kernels)[1] if defer else self.norm(x)
        return h, KVCache(k=tuple(ks), v=tuple(vs), lens=start)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, self.dtype)
