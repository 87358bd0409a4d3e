"""τ and time per iteration of DFlash with the learned tiny pair (the one the tests train) at several
sampling settings, ours next to the reference `dflash_generate` on the same weights and prompts.

    python scripts/bench_sampling_tau.py            # CPU; needs the [test] extra (torch, dflash)

The pair: a Qwen3ForCausalLM trained on a synthetic grammar and a 2-layer DFlash draft (S=8) trained
on its sampled responses (tests/checkpoints.py). Prints one table; no GPU needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from tests import checkpoints as ck  # noqa: E402

SETTINGS = [("T=0 (greedy)", 0.0, 1.0, 0), ("T=1", 1.0, 1.0, 0),
            ("T=0.6 top-p .95 top-k 20", 0.6, 0.95, 20)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="rows per generate call (ours; first --batch prompts)")
    args = ap.parse_args()

    from dflash_jax import generate, load_draft, load_target

    root = tempfile.mkdtemp(prefix="dflash_pair_")
    t0 = time.perf_counter()
    pair = ck.build_trained_pair(root, **ck.TRAINED_PAIR)
    print(f"trained pair built in {time.perf_counter() - t0:.1f}s at {root}", flush=True)
    target = load_target(pair["target_path"], dtype="float32")
    draft = load_draft(pair["draft_path"], target=target, dtype="float32")
    hf, ref_draft = ck.load_torch_pair(pair["target_path"], pair["draft_path"])
    V = target.config.vocab_size
    prompts = ck.random_prompts(args.prompts, V, seed=1234, exclude=(V - 1,))
    rows = []
    for name, temp, top_p, top_k in SETTINGS:
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=temp, top_p=top_p, top_k=top_k)
        generate(target, draft, prompts[:args.batch], seed=0, **kw, verify_width="block")               # compile
        res = generate(target, draft, prompts[:args.batch], seed=1, **kw, verify_width="block")
        short = generate(target, draft, prompts[:args.batch], seed=1, **{**kw, "max_new_tokens": 8}, verify_width="block")
        ms_iter = 1000 * (res.run_time_s - short.run_time_s) / max(1, res.num_iterations - short.num_iterations)
        per_req = [np.mean(a) for a in res.acceptance_lengths if a]
        ref_lengths = []
        for i, p in enumerate(prompts):
            r = ck.reference_generate(ref_draft, hf, p, args.max_new_tokens, temperature=temp, seed=100 + i,
                                      top_p=top_p, top_k=top_k)
            ref_lengths.append(np.mean(r.acceptance_lengths))
        rows.append((name, float(np.mean(per_req)), float(np.mean(ref_lengths)), ms_iter, res.tau_histogram))
        print(f"{name}: tau {rows[-1][1]:.2f} (reference {rows[-1][2]:.2f}), {ms_iter:.2f} ms/iter", flush=True)

    print(f"\nlearned tiny pair (vocab {V}, S={draft.config.block_size}), {args.prompts} prompts x "
          f"{args.max_new_tokens} new tokens, batch {args.batch}, CPU")
    print(f"{'setting':28s} {'tau ours':>9s} {'tau ref':>8s} {'ms/iter':>8s}  histogram 1..S")
    for name, tau, ref_tau, ms, hist in rows:
        print(f"{name:28s} {tau:9.2f} {ref_tau:8.2f} {ms:8.2f}  {hist}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
