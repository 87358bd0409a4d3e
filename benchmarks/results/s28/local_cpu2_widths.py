import time, statistics
import dflash_jax as dj
from dflash_jax import decode, loop
from dflash_jax.assets import default_pair
from dflash_jax.data import apply_chat_template, load_prompts
from transformers import AutoTokenizer
tdir, ddir = default_pair()
target = dj.load_target(tdir, dtype="float32"); draft = dj.load_draft(ddir, target=target, dtype="float32")
tok = AutoTokenizer.from_pretrained(tdir)
rows = load_prompts("gsm8k", None, 2) + load_prompts("humaneval", None, 2)
prompts = [apply_chat_template(tok, r["turns"][0]) for r in rows]
stop = [tok.convert_tokens_to_ids("<|im_end|>")]
cols = (("plain", None, {}), ("w3", draft, dict(verify_width=3)), ("w15", draft, dict(verify_width=15)), ("auto", draft, dict(verify_width="auto")))
gen = lambda d, p, kw: decode.generate(target, d, [p], max_new_tokens=128, stop_token_ids=stop, **kw)
for n, d, kw in cols: gen(d, prompts[0], kw)
print({k: v for k, v in loop._WIDTH_COSTS.items()} and [v for v in loop._WIDTH_COSTS.values()])
best = {}
for rnd in range(3):
    for n, d, kw in cols:
        out = [gen(d, p, kw) for p in prompts]
        t = sum(r.run_time_s for r in out); toks = sum(r.num_new_tokens for r in out)
        best[n] = max(best.get(n, 0), toks / t)
        if rnd == 2: print(n, f"{best[n]:.1f} tok/s {best[n]/best['plain']:.2f}x tau {statistics.mean(r.mean_tau for r in out):.2f} iters {[r.num_iterations for r in out]}")
