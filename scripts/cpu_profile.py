"""Where one generation-loop iteration's time goes on CPU: a per-op profile of the compiled program.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python scripts/cpu_profile.py --dtype float32 [--block-size 16]
        [--draft none] [--kv-chunk 512] [--prompts 1] [--top 25]

Runs the shipped demo pair (or --model/--draft dirs) on HumanEval prompts under jax.profiler with
XLA:CPU's per-op trace events on, and prints the ops' time per loop iteration, grouped (LM heads,
layer matmuls, the XLA attention's KV-chunk loops, the rest) and the top ops with their shapes and
named scopes. XLA:CPU runs the program op by op, so this is the iteration's cost breakdown.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

# XLA:CPU emits one trace event per op only with this flag; it must be set before jax loads.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target HF dir (default: the shipped pair)")
    ap.add_argument("--draft", help="draft dir (default: the shipped pair's); 'none': plain decoding")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--kv-chunk", type=int, default=None, help="KernelConfig.xla_kv_chunk (0: dense; default: from the capacity)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=1, help="HumanEval prompts profiled (one call each)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--other", action="store_true", help="list only the ops outside the named groups")
    args = ap.parse_args()

    import dflash_jax as dj
    from dflash_jax import decode
    from dflash_jax.assets import default_pair
    from dflash_jax.data import apply_chat_template, load_prompts
    from dflash_jax.kernel_config import KernelConfig
    from transformers import AutoTokenizer

    tdir, ddir = default_pair() if args.model is None else (args.model, args.draft)
    ddir = args.draft if args.draft is not None else ddir
    target = dj.load_target(tdir, dtype=args.dtype)
    draft = None if ddir in (None, "none") else dj.load_draft(ddir, target=target, dtype=args.dtype)
    tok = AutoTokenizer.from_pretrained(tdir)
    prompts = [apply_chat_template(tok, r["turns"][0]) for r in load_prompts("humaneval", None, args.prompts)]
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stop, block_size=args.block_size,
              kernels=KernelConfig(xla_kv_chunk=args.kv_chunk))
    decode.generate(target, draft, [prompts[0]], **kw, verify_width="block")          # compile outside the trace
    out = tempfile.mkdtemp(prefix="cpu_profile_")
    iters, run_s, tokens = 0, 0.0, 0
    with jax.profiler.trace(out, create_perfetto_trace=True):
        for p in prompts:
            r = decode.generate(target, draft, [p], **kw, verify_width="block")
            iters, run_s, tokens = iters + r.num_iterations, run_s + r.run_time_s, tokens + len(r.tokens[0])
    fn, _ = decode.compiled_program(target, draft, [prompts[0]], **kw, verify_width="block")
    defs = {}
    for line in fn.as_text().splitlines():
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (\S+).*?(?:op_name=\"([^\"]*)\")?", line)
        if m:
            scope = re.search(r'op_name="([^"]*)"', line)
            defs.setdefault(m.group(1), (m.group(2), scope.group(1) if scope else ""))
    trace = glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True)[0]
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in defs:
            total[e["name"]] += e.get("dur", 0) / 1000.0
            count[e["name"]] += 1
    # ops of the loop body run once per iteration or more; prefill's once per call
    body = {n: t / iters for n, t in total.items() if count[n] >= iters}
    inner = {n for n in body if "/while/body/" in defs[n][1].split("jit(run)/while/body/", 1)[-1]}

    def group(n):
        shape, scope = defs[n]
        if n in inner:
            return None                      # counted in its enclosing loop op
        vocab = f",{target.config.vocab_size}]"
        if "lm_head" in scope or re.search(r"verify/bth,h?v", scope) or (n.startswith("dot.") and vocab in shape):
            return "LM heads"
        if scope.endswith("/while") and "layer" in scope:
            return "attention KV-chunk loops"
        if "dot_general" in scope or n.startswith("dot."):   # M = 1 dots (plain decode) carry no scope
            return "layer matmuls (draft + target)"
        return "other ops"

    groups = collections.Counter()
    for n, t in body.items():
        g = group(n)
        if g:
            groups[g] += t
    print(f"{iters} iterations, {tokens} tokens, {1000 * run_s / iters:.2f} ms/iteration (wall), "
          f"{tokens / run_s:.1f} tok/s; dtype {args.dtype}, block {args.block_size or 'default'}, "
          f"kv_chunk {args.kv_chunk}")
    for g, t in groups.most_common():
        print(f"  {t:7.3f} ms/iter  {g}")
    print(f"  {sum(groups.values()):7.3f} ms/iter  sum of ops")
    print("top ops:")
    for n, t in sorted(((n, t) for n, t in body.items() if n not in inner and (not args.other or group(n) == "other ops")), key=lambda x: -x[1])[:args.top]:
        shape, scope = defs[n]
        print(f"  {t:7.3f} ms/iter  {n:30s} {shape[:28]:28s} {scope.replace('jit(run)/while/body/', '')[-60:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
