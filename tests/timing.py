"""What each test costs: wall seconds and XLA compiles, per test, for CI's artifact and for the order
in which files are handed to the workers.

- Every process (the controller, each xdist worker, a plain run) counts, per test, the programs
  XLA compiled (`/jax/core/compile/backend_compile_duration`: fresh compiles and persistent-cache
  hits alike), their seconds, and the persistent-cache hits among them.
- With `DFLASH_TEST_REPORT=path.json` the run writes one record per test (nodeid, outcome, wall
  seconds of setup + call + teardown, compiles, compile seconds, cache hits) and a per-file sum;
  `.ci/run` keeps it under `ci-artifacts/` and `scripts/test_durations.py` folds it into
  `tests/durations.json`.
- Collection puts whole files in the order of `tests/durations.json`, longest first (a file not in it
  counts as the median), so `--dist loadfile --no-loadscope-reorder` gives the two workers the long
  files first and the short ones fill the tail.
"""

from __future__ import annotations

import json
import os
import statistics
import threading

DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_current = {"n": 0, "s": 0.0, "hits": 0}
_per_test: dict[str, dict] = {}
_listening = [False]


def _on_duration(event: str, duration: float, **kw) -> None:
    if event == _COMPILE_EVENT:
        with _lock:
            _current["n"] += 1
            _current["s"] += duration


def _on_event(event: str, **kw) -> None:
    if event == _HIT_EVENT:
        with _lock:
            _current["hits"] += 1


def _listen() -> None:
    if _listening[0]:
        return
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    _listening[0] = True


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def file_seconds() -> dict[str, float]:
    try:
        with open(DURATIONS) as f:
            return {k: float(v) for k, v in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def order_items(items) -> None:
    """Whole files, longest first (stable within a file and among files of equal weight)."""
    secs = file_seconds()
    if not secs:
        return
    default = statistics.median(secs.values())
    first = {}
    for i, it in enumerate(items):
        first.setdefault(_file_of(it.nodeid), i)
    items.sort(key=lambda it: (-secs.get(_file_of(it.nodeid), default), first[_file_of(it.nodeid)]))


# ------------------------------------------------------------------------------------------ hooks

def pytest_configure(config):
    _listen()


def pytest_collection_modifyitems(session, config, items):
    order_items(items)


def pytest_runtest_setup(item):
    with _lock:
        _current.update(n=0, s=0.0, hits=0)


def pytest_runtest_makereport(item, call):
    if call.when == "teardown":
        with _lock:
            item.user_properties.append(("compiles", _current["n"]))
            item.user_properties.append(("compile_s", round(_current["s"], 3)))
            item.user_properties.append(("cache_hits", _current["hits"]))


def pytest_runtest_logreport(report):
    # on the controller under xdist (reports arrive from the workers), in-process otherwise
    rec = _per_test.setdefault(report.nodeid, dict(nodeid=report.nodeid, outcome="passed", wall_s=0.0))
    rec["wall_s"] = round(rec["wall_s"] + report.duration, 3)
    if report.failed or (report.skipped and rec["outcome"] == "passed"):
        rec["outcome"] = "failed" if report.failed else "skipped"
    for k, v in getattr(report, "user_properties", ()):
        if k in ("compiles", "compile_s", "cache_hits"):
            rec[k] = v
    worker = getattr(report, "node", None)
    if worker is not None:
        rec["worker"] = getattr(worker, "gateway", None) and worker.gateway.id


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DFLASH_TEST_REPORT")
    if not path or hasattr(session.config, "workerinput"):   # workers send reports; the controller writes
        return
    files: dict[str, dict] = {}
    for rec in _per_test.values():
        f = files.setdefault(_file_of(rec["nodeid"]), dict(wall_s=0.0, tests=0, compiles=0, compile_s=0.0))
        f["wall_s"] = round(f["wall_s"] + rec["wall_s"], 3)
        f["tests"] += 1
        f["compiles"] += rec.get("compiles", 0)
        f["compile_s"] = round(f["compile_s"] + rec.get("compile_s", 0.0), 3)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(exitstatus=int(exitstatus), files=files,
                       tests=sorted(_per_test.values(), key=lambda r: -r["wall_s"])), f, indent=1)
