"""Prefix-cache counters count a queued request again on every admission retry: Slots.admit calls
pages.match (which adds len(prompt) to queries and the hit to hits) before allocate, and when allocate
fails it releases the hit pages but leaves the counters. SlotEngine retries the queue head every turn
while pages are short, so prefix_hits_tokens (vllm:prefix_cache_hits_total) grows per retry."""
import dflash_jax as dj
from dflash_jax.config import TargetConfig
from dflash_jax.slots import Slots, RowRequest
cfg = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
target = dj.init_target(cfg, seed=0, dtype="float32")
draft = dj.init_draft(dj.DraftConfig.for_target(cfg, num_layers=1, block_size=8), seed=1, dtype="float32")
sl = Slots(target, draft, slots=2, capacity=128, kv_pages=12, page_size=16)
prompt = tuple(range(1, 41))                       # 40 tokens: 2 full pages
sl.run([RowRequest(prompt=prompt, max_new=4)])     # publishes its 2 full pages
print("after the first run:", sl.pages.stats())
assert sl.admit(0, RowRequest(prompt=tuple(range(100, 180)), max_new=30))   # another request holds most pages
for i in range(3):                                 # the engine's queue head, retried each turn
    ok = sl.admit(1, RowRequest(prompt=prompt + (7,), max_new=60))
    print(f"retry {i}: admitted={ok}", sl.pages.stats())
