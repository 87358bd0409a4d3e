"""Structured output's cost on the slot engine (issue 59): constrained rows' tokens/s against
unconstrained DFlash on the same pair and prompts, and against plain constrained decoding (the
target alone under the same grammar), side by side in one process.

A grammar step runs one iteration and the host walks every constrained row's grammar along its
drafts before the next (dflash_jax.serving.grammar, docs/serving.md): that walk, the one-iteration steps
and the read after each step are the cost measured here. The pair writes Python, so the grammar is
one its own output satisfies (a regular expression over code: no tab characters), so the masks
never change its tokens: the constrained run must emit exactly the unconstrained run's tokens (checked),
at the pair's own acceptance, and only the overhead differs. `--grammar json` instead asks for a
JSON object {"code": string} (the pair then writes code inside a JSON string, where its drafts fit
less well: τ drops; reported for the record).

    python scripts/bench_structured.py                       # embedded pair, 16 HumanEval prompts
    python scripts/bench_structured.py --smoke               # 4 prompts, 24 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

GRAMMARS = {"regex": dict(regex=r"[^\t]*"),
            "json": dict(response_format={"type": "json_schema", "json_schema": {"name": "code", "schema": {
                "type": "object", "required": ["code"], "additionalProperties": False,
                "properties": {"code": {"type": "string"}}}}})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target dir (default: the embedded pair)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--grammar", choices=sorted(GRAMMARS), default="regex")
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.prompts, a.new = 4, 24
    import dflash_jax as dj
    from transformers import AutoTokenizer

    from dflash_jax.serving.engine import Request, SlotEngine
    from dflash_jax.serving.grammar import Grammars

    if a.target is None:
        from dflash_jax.assets import default_pair
        a.target, a.draft = default_pair()
    target = dj.load_target(a.target, dtype=a.dtype)
    draft = dj.load_draft(a.draft, target=target, dtype=a.dtype)
    tok = AutoTokenizer.from_pretrained(a.target)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    grammars = Grammars(tok, target.config.vocab_size)
    spec = grammars.compile(**GRAMMARS[a.grammar])
    here = os.path.dirname(os.path.abspath(dj.__file__))
    rows = [json.loads(x) for x in open(os.path.join(here, "datasets", "humaneval.jsonl"))][:a.prompts]
    # as the pair was trained to answer them: a chat turn (its template), the answer a fenced code block
    prompts = [tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                        add_generation_prompt=True), add_special_tokens=False))
               for r in rows]

    def run(with_draft: bool, constrained: bool, prompts=prompts):
        engine = SlotEngine(target, draft if with_draft else None, slots=a.slots, capacity=a.capacity,
                            eos_token_ids=eos, max_queue=len(prompts) + a.slots)
        try:
            reqs = [Request(prompt=p, max_tokens=a.new, grammar=spec.new() if constrained else None)
                    for p in prompts]
            t0 = time.perf_counter()
            handles = [engine.submit(r) for r in reqs]
            outs, iters = [], 0
            for h in handles:
                toks = []
                for ev in h.events():
                    if hasattr(ev, "ids"):
                        toks += list(ev.ids)
                    else:
                        iters += ev.stats.iterations
                outs.append(toks)
            wall = time.perf_counter() - t0
        finally:
            engine.shutdown(timeout=5)
        n = sum(len(o) for o in outs)
        return dict(tokens=n, wall_s=wall, tok_s=n / wall, tau=n / max(iters, 1)), outs

    cases = [("DFlash, free", True, False), ("DFlash, constrained", True, True),
             ("plain, constrained", False, True), ("plain, free", False, False)]
    res, outs = {}, {}
    for name, d, c in cases:         # each run twice, the second timed: every program compiled by then
        run(d, c)
        res[name], outs[name] = run(d, c)
    print(f"device {jax.devices()[0].device_kind}, pair {os.path.basename(os.path.dirname(a.target))}, "
          f"{a.dtype}, {a.slots} slots, {a.prompts} HumanEval prompts x {a.new} new tokens, greedy, grammar "
          f"{a.grammar}: {GRAMMARS[a.grammar]}")
    print("| run | tokens | wall s | tokens/s | tau | vs DFlash free | vs plain constrained |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base, plain_c = res["DFlash, free"]["tok_s"], res["plain, constrained"]["tok_s"]
    for name, r in res.items():
        print(f"| {name} | {r['tokens']} | {r['wall_s']:.2f} | {r['tok_s']:.1f} | {r['tau']:.2f} | "
              f"{r['tok_s'] / base:.2f}x | {r['tok_s'] / plain_c:.2f}x |")
    same = outs["DFlash, constrained"] == outs["DFlash, free"]
    print(f"constrained tokens == free tokens: {same}" + ("" if a.grammar == "regex" else " (json: not expected)"))
    print(f"constrained == plain constrained: {outs['DFlash, constrained'] == outs['plain, constrained']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=res, same_as_free=same, device=jax.devices()[0].device_kind, args=vars(a)), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
