#!/usr/bin/env python
"""What quantizing the target costs in acceptance and in accuracy, on a real trained pair (issue 57): the
embedded demo pair (dflash_jax.assets, or --target / --draft) with its target as loaded, int8 (--quantize
int8), as an FP8 block-128 checkpoint loads (weight-only), and that FP8 checkpoint run W8A8 per K block
(--w8a8) and per output channel (--w8a8 channel). The draft stays as loaded (bf16 by default, the product).

For each form, over the dataset's first --max-samples prompts (chat template applied, greedy, block 16):
  tau          DFlash's mean tokens per iteration (acceptance + 1)
  lossless     rows whose DFlash tokens equal the same quantized target's plain greedy decoding: all of them
               for float, int8 and FP8 weight-only targets; W8A8 rounds each activation to e4m3, so the
               float32 rounding differences between a verify and a one-token step (and between batch
               shapes: its plain decoding of a prompt alone differs from the same prompt's in a batch)
               can flip a rounding and then a near-tied token, as bf16's do
  agree        the fraction of the reference target's greedy tokens this form reproduces before its
               first divergence (1.000: every row identical), averaged over rows
  same rows    rows whose whole greedy output equals the reference's

The FP8 forms are built in memory from the float weights (scripts/bench_gpu.fp8_like_checkpoint: one
float32 scale per 128 x 128 block, amax / 448), as load_target keeps an FP8 checkpoint.

    python scripts/bench_quant_tau.py --dataset humaneval --max-samples 16      # CPU, float32, ~5 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

FORMS = ("none", "int8", "fp8", "fp8-w8a8", "fp8-w8a8-channel")


def build(form: str, target_dir: str, dtype: str):
    from bench_gpu import fp8_like_checkpoint

    from dflash_jax import load_target
    from dflash_jax.quantize import to_w8a8
    if form in ("none", "int8"):
        return load_target(target_dir, dtype=dtype, quantize=None if form == "none" else form)
    model = fp8_like_checkpoint(load_target(target_dir, dtype=dtype))
    if form == "fp8":
        return model
    return to_w8a8(model, "channel" if form.endswith("-channel") else "block")


def agreement(got: list, want: list) -> float:
    n = 0
    for a, b in zip(got, want):
        if a != b:
            break
        n += 1
    return n / max(1, len(want))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target dir (default: the embedded pair's)")
    ap.add_argument("--draft", default=None, help="draft dir (default: the embedded pair's)")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--max-samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma list of: {', '.join(FORMS)}")
    a = ap.parse_args(argv)
    forms = [f for f in a.forms.split(",") if f]
    bad = set(forms) - set(FORMS)
    if bad:
        ap.error(f"--forms: unknown {sorted(bad)}; choose from {', '.join(FORMS)}")
    if a.max_samples < 1 or a.max_new_tokens < 1:
        ap.error("--max-samples and --max-new-tokens must be >= 1")

    import jax
    from transformers import AutoTokenizer

    from dflash_jax import assets, generate, load_draft, load_target
    from dflash_jax.data import apply_chat_template, load_prompts
    pair = assets.default_pair()
    target_dir = a.target or (pair and pair[0])
    draft_dir = a.draft or (pair and pair[1])
    if not target_dir or not draft_dir:
        ap.error("no embedded pair in this package: give --target and --draft")
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [apply_chat_template(tok, r["turns"][0]) for r in load_prompts(a.dataset, max_samples=a.max_samples)]
    draft = load_draft(draft_dir, target=load_target(target_dir, dtype=a.dtype), dtype=a.dtype)
    kw = dict(max_new_tokens=a.max_new_tokens, verify_width="block")
    dev = jax.devices()[0]
    print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}; target {target_dir}, draft {draft_dir}; "
          f"{a.dataset} x {len(prompts)}, {a.max_new_tokens} new tokens, greedy, {a.dtype}", flush=True)
    print("| target | tau | tau / as loaded | lossless | agree with as loaded | same rows | wall s |")
    print("|---|---|---|---|---|---|---|")
    ref_tokens, ref_tau = None, None
    for form in forms:
        t0 = time.perf_counter()
        target = build(form, target_dir, a.dtype)
        res = generate(target, draft, prompts, **kw)
        plain = generate(target, None, prompts, max_new_tokens=a.max_new_tokens)
        if ref_tokens is None:
            ref_tokens, ref_tau = plain.tokens, res.mean_tau
        agree = sum(agreement(g, w) for g, w in zip(plain.tokens, ref_tokens)) / len(prompts)
        same = sum(g == w for g, w in zip(plain.tokens, ref_tokens))
        equal = sum(g == w for g, w in zip(res.tokens, plain.tokens))
        print(f"| {form} | {res.mean_tau:.3f} | {res.mean_tau / ref_tau:.3f} | {equal} / {len(prompts)} | "
              f"{agree:.3f} | {same} / {len(prompts)} | "
              f"{time.perf_counter() - t0:.1f} |", flush=True)
    print(f"(agree / same rows against the first form, {forms[0]}: the target as loaded when it is 'none')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
