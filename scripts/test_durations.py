"""Fold a test run's report (ci-artifacts/test-report.json, written by tests/timing.py) into
tests/durations.json, the per-file seconds that order the files for the two CI workers, and print
the slowest files and tests with their XLA compiles.

    python scripts/test_durations.py [ci-artifacts/test-report.json] [--write] [--top 40]

Without --write it only prints. A file the report lacks keeps its old figure.
"""

from __future__ import annotations

import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", nargs="?", default=os.path.join(REPO, "ci-artifacts", "test-report.json"))
    ap.add_argument("--write", action="store_true", help="update tests/durations.json")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    try:
        with open(args.report) as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"test_durations.py: cannot read {args.report}: {e}")
    files, tests = rep["files"], rep["tests"]
    total = sum(f["wall_s"] for f in files.values())
    compiles = sum(f["compiles"] for f in files.values())
    compile_s = sum(f["compile_s"] for f in files.values())
    print(f"{len(tests)} tests, {total:.0f} worker-s, {compiles} XLA compiles taking {compile_s:.0f} s "
          f"({100 * compile_s / max(total, 1e-9):.0f}% of the tests' time)")
    print(f"\n| file | wall s | tests | compiles | compile s |\n| --- | --- | --- | --- | --- |")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"]):
        print(f"| {name} | {f['wall_s']:.1f} | {f['tests']} | {f['compiles']} | {f['compile_s']:.1f} |")
    print(f"\n| the {args.top} slowest tests | wall s | compiles | compile s | cache hits |\n| --- | --- | --- | --- | --- |")
    for t in tests[:args.top]:
        print(f"| {t['nodeid']} | {t['wall_s']:.1f} | {t.get('compiles', 0)} | {t.get('compile_s', 0):.1f} | "
              f"{t.get('cache_hits', 0)} |")
    child = os.path.join(os.path.dirname(os.path.abspath(args.report)), "child-tests.jsonl")
    if os.path.exists(child):
        with open(child) as f:
            recs = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: -r["wall_s"])
        print(f"\n| the {args.top} slowest cases inside child processes (tests/children.py) | wall s |\n| --- | --- |")
        for r in recs[:args.top]:
            print(f"| {r['nodeid']} | {r['wall_s']:.1f} |")
    if args.write:
        path = os.path.join(REPO, "tests", "durations.json")
        try:
            with open(path) as f:
                old = json.load(f)["files"]
        except (OSError, ValueError, KeyError):
            old = {}
        old.update({k: round(v["wall_s"], 1) for k, v in files.items()})
        with open(path, "w") as f:
            json.dump(dict(note="wall seconds per test file, from scripts/test_durations.py --write over a "
                                ".ci/run report; tests/timing.py hands files to the workers longest first",
                           files=dict(sorted(old.items(), key=lambda kv: -kv[1]))), f, indent=1)
            f.write("\n")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
