"""The decoder stack every dense target family shares: embedding, decoder layers (models/layers.py),
final norm, LM head (tied or not). One forward over (tokens, positions, KV cache, k_end) serves
prefill (T = prompt bucket), multi-token verify (T = block size) and plain decode (T = 1). It returns
the final-normed hidden states (the LM head is applied by the caller, only where logits are needed)
and the DFlash taps: hidden states after the given layers (HF `hidden_states[id + 1]`), concatenated.

A family subclasses CausalLM and sets what its layers have (`layer_options`, DecoderLayer's keywords)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dflash_jax.kernel_config import KernelConfig, resolved
from dflash_jax.cache import KVCache, PagedKVCache
from dflash_jax.quantize import Int8Weight
from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import DecoderLayer, RMSNorm, init_param, run_layers


class CausalLM(nnx.Module):
    def __init__(self, config: TargetConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        H, V = config.hidden_size, config.vocab_size
        self.embed = init_param(rngs, (V, H), dtype, 1.0)                             # [V, H]
        opts = self.layer_options(config)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs, **opts) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else init_param(rngs, (H, V), dtype, H ** -0.5)  # [H, V]

    def layer_options(self, config: TargetConfig) -> dict:
        """DecoderLayer's keywords for this family (default: the Qwen3 layer)."""
        return {}

    def embed_tokens(self, tokens):
        return jnp.take(self.embed[...], tokens, axis=0)                       # [B, T, H]

    def logits(self, h):
        """h [B, T, H] (final-normed) → float32 logits [B, T, V]."""
        if self.lm_head is None:  # tied: contract with the embedding's H axis, no transpose copy
            return jnp.einsum("bth,vh->btv", h, self.embed[...], preferred_element_type=jnp.float32)
        w = self.lm_head[...]
        if isinstance(w, Int8Weight):   # quantize "int8+head": (h @ q) * the vocabulary entries' scales
            return jnp.einsum("bth,hv->btv", h, w.q.astype(h.dtype), preferred_element_type=jnp.float32) * w.scale
        return jnp.einsum("bth,hv->btv", h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions, cache: KVCache, k_end, *, taps: tuple[int, ...] = (),
                 kernels: KernelConfig | str | None = None, prefill: bool = False):
        """tokens, positions, k_end [B, T] int32. The new K/V are written at cache rows
        [positions[:, 0], positions[:, 0] + T). prefill: a prompt from row 0 with k_end = t + 1
        (lets long prompts use a library causal kernel, see attention.attend_prefill). Returns (hidden [B, T, H] final-normed,
        taps [B, T, len(taps) * H] or None, cache with lens = positions[:, 0] + T). kernels: a
        KernelConfig or an attention backend's name (default: the XLA path)."""
        kernels = resolved(kernels)
        x = self.embed_tokens(tokens)
        start = positions[:, 0]
        h, tapped, cache = run_layers(self.layers, x, positions, cache, k_end, kernels, self.norm,
                                      prefill=prefill, taps=taps, scope="target_layer")
        # HF's last hidden_states entry is taken after the final norm; keep its meaning for tap L-1.
        tapped[len(self.layers) - 1] = h
        feats = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return h, feats, cache.replace(lens=start + tokens.shape[1])

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        # kv heads from the layers: under TP with fewer kv heads than shards the layers hold copies
        # (sharding.fused_layout), and each copy has its own cache entry
        c = self.config
        return KVCache.zeros(c.num_layers, batch, self.layers[0].num_kv_heads, capacity, c.head_dim, self.dtype)

    def new_paged_cache(self, batch: int, num_pages: int, page_size: int, pages_per_row: int) -> PagedKVCache:
        """A pool of num_pages pages per layer and a [batch, pages_per_row] table (dflash_jax.cache)."""
        c = self.config
        geometry = [(self.layers[0].num_kv_heads, c.head_dim)] * c.num_layers
        return PagedKVCache.zeros(num_pages, page_size, batch, pages_per_row, geometry, self.dtype)
