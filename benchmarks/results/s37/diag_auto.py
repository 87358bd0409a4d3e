import time, numpy as np, jax
import dflash_jax as dj
from dflash_jax import decode, width
from dflash_jax.assets import default_pair
from dflash_jax.data import apply_chat_template, load_prompts
from transformers import AutoTokenizer
tdir, ddir = default_pair()
target = dj.load_target(tdir, dtype="float32"); draft = dj.load_draft(ddir, target=target, dtype="float32")
tok = AutoTokenizer.from_pretrained(tdir)
rows = load_prompts("gsm8k", None, 2) + load_prompts("humaneval", None, 2)
prompts = [apply_chat_template(tok, r["turns"][0]) for r in rows]
stop = [tok.convert_tokens_to_ids("<|im_end|>")]
def gen(kw, p):
    return decode._generate(target, draft, [p], max_new_tokens=128, stop_token_ids=stop, **kw)
for kw in (dict(verify_width=0), dict(verify_width="auto")):
    gen(kw, prompts[0])
for rnd in range(3):
    for name, kw in (("w0", dict(verify_width=0)), ("auto", dict(verify_width="auto"))):
        tot = 0; line = []
        for p in prompts:
            r, st = gen(kw, p)
            tot += r.run_time_s
            acc = r.acceptance_lengths[0]
            line.append(f"{r.num_iterations}it/{len(r.tokens[0])}tok ret={bool(np.asarray(st.retired))} t={r.run_time_s*1e3:.0f}ms max_acc={max(acc)}")
        print(rnd, name, f"{tot*1e3:.0f} ms", " | ".join(line), flush=True)
