"""Tokens/s of a generation on the XLA attention path against the KV capacity: the dense path (every
step attends over the whole capacity) against the KV-chunk loop (work up to the longest row only).

    python scripts/bench_xla_capacity.py                         # tiny random pair on CPU, ~3 minutes
    python scripts/bench_xla_capacity.py --target DIR --draft DIR --dtype bfloat16
    python scripts/bench_xla_capacity.py --chunks 0,128,256,512,1024 --capacities 8192   # pick a chunk

Each row generates --new-tokens tokens (no stop token, so every run is the same length) from a
--prompt-len prompt at an explicit capacity; "dense" is kv_chunk=0, the path before the chunk loop.
The compile is excluded (one warm-up generation per setting); the time is the median of --repeats
runs. Speculative (the draft given) and plain decoding (--plain) are measured; prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax import decode  # noqa: E402
from dflash_jax.config import DraftConfig, TargetConfig  # noqa: E402

# A tiny Qwen3 (GQA 2, head_dim 32) with positions for the largest capacity measured.
TINY_TARGET = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1 << 17)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _models(args):
    if args.target:
        target = dj.load_target(args.target, dtype=args.dtype)
        draft = dj.load_draft(args.draft, target=target, dtype=args.dtype) if args.draft else None
        return target, draft, "given pair"
    target = dj.init_target(TINY_TARGET, seed=0, dtype=args.dtype)
    draft = dj.init_draft(DraftConfig.for_target(TINY_TARGET, num_layers=2, block_size=8), seed=1,
                          dtype=args.dtype, target=target)
    return target, draft, "tiny random pair (4+2 layers, H 128, 4q/2kv heads, hd 32, S 8)"


def _tokens_per_s(target, draft, prompts, capacity, kv_chunk, args) -> float:
    """Median tokens/s over the repeats, the chunk size set through KernelConfig (its own program)."""
    kw = dict(max_new_tokens=args.new_tokens, capacity=capacity,
              kernels=dj.KernelConfig(attention="xla", xla_kv_chunk=kv_chunk))
    dj.generate(target, draft, prompts, **kw, verify_width="block")                                # compile + warm-up
    rates = []
    for _ in range(args.repeats):
        res = dj.generate(target, draft, prompts, **kw, verify_width="block")
        rates.append(res.num_new_tokens / res.run_time_s)
    decode.clear_compiled()
    return statistics.median(rates)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacities", type=_ints, default=[1024, 8192, 65536])
    ap.add_argument("--chunks", type=_ints, default=[0, 256, 512],
                    help="kv_chunk values; 0 is the dense path (default 0,256,512)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--target", help="HF Qwen3 directory (default: a tiny random pair)")
    ap.add_argument("--draft", help="DFlash draft directory for --target")
    ap.add_argument("--plain", action="store_true", help="also measure plain decoding (no draft)")
    args = ap.parse_args(argv)

    target, draft, what = _models(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, target.config.vocab_size - 1, (args.batch, args.prompt_len)).tolist()
    modes = ([("speculative", draft)] if draft is not None else []) + \
            ([("plain", None)] if args.plain or draft is None else [])
    names = ["dense" if c == 0 else f"chunk {c}" for c in args.chunks]
    rows = []
    for mode, d in modes:
        for cap in args.capacities:
            rates = [_tokens_per_s(target, d, prompts, cap, c, args) for c in args.chunks]
            rows.append((mode, cap, rates))
            print(f"  {mode} capacity {cap}: " + ", ".join(f"{n} {r:.0f}" for n, r in zip(names, rates)),
                  file=sys.stderr, flush=True)

    print(f"\n{what}; {jax.default_backend()} {args.dtype}; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; tokens/s (median of {args.repeats})\n")
    header = f"| mode | capacity | " + " | ".join(names) + " |"
    print(header)
    print("|" + "---|" * (2 + len(names)))
    for mode, cap, rates in rows:
        print(f"| {mode} | {cap} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
