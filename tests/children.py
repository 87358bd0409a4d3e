"""Child pytest runs on virtual CPU devices, with the child's results read back and checked.

The virtual devices need XLA_FLAGS before JAX starts its backend, which other tests in the same
process may already have done, so mesh cases run in a child pytest. A child that exits 0 proves
nothing by itself (pytest exits 0 when every case skips), so `run_child` reads the child's JUnit
report and fails unless at least one case ran, none failed, and every skip is the parent's own
runner (the only case a child is meant to skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARENT_ONLY = "the parent's runner"


def child_env(devices: int, **extra: str) -> dict:
    flags = os.environ.get("XLA_FLAGS", "")
    return dict(os.environ, JAX_PLATFORMS="cpu", **extra,
                XLA_FLAGS=(flags + f" --xla_force_host_platform_device_count={devices}").strip(),
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def results(junit_xml: str) -> dict[str, tuple[str, str]]:
    """{test name: (outcome, message)} from a JUnit report: passed, failed, error or skipped. With
    DFLASH_TEST_REPORT set, each case's seconds are appended to child-tests.jsonl beside that report
    (scripts/test_durations.py lists the slowest)."""
    out = {}
    report = os.environ.get("DFLASH_TEST_REPORT")
    cases = list(ET.parse(junit_xml).getroot().iter("testcase"))
    if report:
        os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
        with open(os.path.join(os.path.dirname(os.path.abspath(report)), "child-tests.jsonl"), "a") as f:
            for case in cases:
                f.write(json.dumps(dict(nodeid=f"{case.get('classname')}::{case.get('name')}",
                                        wall_s=float(case.get("time") or 0))) + "\n")
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, msg = ("failed" if tag == "failure" else tag), (el.get("message") or "")
                break
        out[name] = (outcome, msg)
    return out


def run_child(test_file: str, *, devices: int, env: dict | None = None, args: tuple = (),
              min_passed: int = 1) -> dict[str, tuple[str, str]]:
    """Runs `pytest test_file *args` with `devices` virtual CPU devices; asserts its report shows at
    least `min_passed` passed cases, no failure, and no skip but the parent's runner. Returns the
    report's {name: (outcome, message)}."""
    with tempfile.TemporaryDirectory() as d:
        xml = os.path.join(d, "child.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *args, os.path.abspath(test_file)]
        full_env = child_env(devices, **(env or {}))
        full_env.pop("DFLASH_TEST_REPORT", None)      # the child's records are not the run's
        r = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True)
        tail = r.stdout[-6000:] + r.stderr[-3000:]
        assert os.path.exists(xml), "the child wrote no report\n" + tail
        res = results(xml)
        assert r.returncode == 0, tail
    passed = [n for n, (o, _) in res.items() if o == "passed"]
    stray = {n: m for n, (o, m) in res.items() if o != "passed" and PARENT_ONLY not in m}
    assert not stray, f"child cases that did not pass: {stray}\n{tail}"
    assert len(passed) >= min_passed, f"the child ran {len(passed)} cases (want >= {min_passed}): {res}\n{tail}"
    return res
