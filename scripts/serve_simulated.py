#!/usr/bin/env python
"""BENCHMARK ONLY: `python -m dflash_jax.serve` whose adaptive step programs replace each row's
accepted drafts by a draw from a geometric survival profile at a given tau (block 16;
dflash_jax.width.geometric_profile, loop._simulated_acceptance), so a random-weight server at real
shapes pays every real cost (engine, prefills, verifies, streaming) at a realistic acceptance.
The server itself has no such flag (no user path reaches the simulation); scripts/load_test.py
starts this wrapper for `--simulated-tau`, and titles its tables "SIMULATED ACCEPTANCE".

    python scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --slots 32 ...   # serve's flags

Only adaptive programs simulate (loop.make_static): with a draft, --verify-width auto is added when
no --verify-width is given (--verify-width 15 serves the fixed block 16 at the same simulated tau).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tau", type=float, required=True, help="mean tokens per full-width iteration (1..16)")
    args, rest = ap.parse_known_args(argv)
    from dflash_jax import loop, width
    from dflash_jax.serving import server as serve
    try:
        profile = width.geometric_profile(args.tau)
    except ValueError as e:
        ap.error(f"--tau: {e}")
    draft_none = "--draft=none" in rest or any(a == "--draft" and b.lower() == "none" for a, b in zip(rest, rest[1:]))
    if not draft_none and not any(a.startswith("--verify-width") for a in rest):
        rest = [*rest, "--verify-width", "auto"]
    print(f"[serve_simulated] SIMULATED ACCEPTANCE: geometric survival at tau {args.tau} (block 16)", flush=True)
    with loop._simulated_acceptance(profile):
        return serve.main(rest)


if __name__ == "__main__":
    sys.exit(main())
