"""Prepared in session 50 for the next device session (issue 56, not yet run): the GPU page-write kernel
(pallas_kernels/attention/gpu_cache_write.py) and the paged attention compiled by Triton on a real GPU, where the
test suite runs them only interpreted (tests/test_paged.py::test_pallas_kernels_read_the_pages_and_change_no_token,
one prompt). Here the embedded trained pair (head_dim 64, the GPU kernels' own) in float32 on
the "pallas_gpu" path: HumanEval prompts through a paged slot engine, each second request sharing the first's
prompt prefix (a prefix hit), against one-shot generate on the dense cache: tokens and acceptance lengths equal, so
both the target's rows and the draft's context rows written by the kernel are right. Exits 1 on a mismatch.

    PYTHONPATH=. python3 benchmarks/results/s50/check_paged_gpu.py     # from a checkout that carries the pair
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from transformers import AutoTokenizer

from dflash_jax import KernelConfig, generate, load_draft, load_target
from dflash_jax.assets import default_pair
from dflash_jax.serving.slots import RowRequest, Slots


def main() -> int:
    tdir, ddir = default_pair()
    tok = AutoTokenizer.from_pretrained(tdir)
    target = load_target(tdir, dtype="float32")
    draft = load_draft(ddir, target=target, dtype="float32")
    kernels = KernelConfig(attention="pallas_gpu")
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "dflash_jax", "datasets", "humaneval.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f][:4]
    eng = Slots(target, draft, slots=4, capacity=512, steps=3, kv_pages=129, page_size=16, kernels=kernels)
    bad, taus = 0, []
    for text in texts:
        first = tok(text)["input_ids"]
        second = first[:len(first) - 5]          # shares every full page of first but the last
        for prompt in (first, second):
            res = eng.run([RowRequest(prompt=tuple(prompt), max_new=64)])[0]
            want = generate(target, draft, [list(prompt)], max_new_tokens=64, capacity=512, verify_width="block",
                            kernels=kernels)
            ok = res.tokens == want.tokens[0] and res.acceptance_lengths == want.acceptance_lengths[0]
            bad += not ok
            taus.append(float(np.mean(res.acceptance_lengths)))
            print(f"prompt {len(prompt)} tokens: tau {taus[-1]:.2f}, {'OK' if ok else 'MISMATCH'}")
    stats = eng.pages.stats()
    print(f"prefix hits {stats['prefix_hits_tokens']} of {stats['prefix_queries_tokens']} tokens; mean tau "
          f"{np.mean(taus):.2f}; {'all equal' if not bad else f'{bad} MISMATCHES'}")
    return 1 if bad or not stats["prefix_hits_tokens"] else 0


if __name__ == "__main__":
    sys.exit(main())
