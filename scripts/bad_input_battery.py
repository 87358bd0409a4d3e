"""The bad-input battery of the loaders, the library and the CLI: each case feeds one bad input and is
classed by what happens (issues 20 and 33), on whatever dflash_jax the interpreter imports:

  clean      a one-line error naming the problem (the library: ValueError / TypeError / ConfigError /
             FileNotFoundError whose message holds the case's needle; the CLI: exit 2 and one
             `error:` line holding it, no traceback)
  traceback  any other exception or exit (a raw error that does not name the problem, a crash)
  hang       not finished within --timeout seconds (killed)
  silent     finished without an error: the bad input was accepted (a wrong answer or token 0)

(Data loss, the fifth class of the issues' batteries, belongs to the trainer and the server; none
of these cases writes anything.) Every case runs in its own process on a tiny float32 pair written
by this script, in child processes: a case past the timeout is killed as a hang and a new child
takes the rest.

    JAX_PLATFORMS=cpu python scripts/bad_input_battery.py [--timeout 120] [--json out.json] [-k NAME]

The counts before and after issue 33 are in docs/perf-log.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=16, rope_theta=1e4, max_position_embeddings=512)
NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------- the tiny pair
def write_pair(root: str) -> tuple[str, str]:
    import dflash_jax as dj
    from dflash_jax.assets import save_target
    from dflash_jax.train.export import export_draft
    cfg = dj.TargetConfig(**TARGET)
    target = dj.init_target(cfg, seed=0, dtype="float32")
    tdir, ddir = os.path.join(root, "target"), os.path.join(root, "draft")
    save_target(target, tdir, "float32")
    draft = dj.init_draft(dj.DraftConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=63), seed=1,
                          dtype="float32")
    export_draft(draft, ddir, dtype="float32")
    return tdir, ddir


def _copy(src: str, dst: str, config=None, tensor=None) -> str:
    """src copied to dst with config.json fields changed (None deletes; a dict for a nested one) and
    one tensor rewritten: tensor = (name, fn(np array) -> np array)."""
    import shutil
    shutil.copytree(src, dst)
    if config:
        path = os.path.join(dst, "config.json")
        cfg = json.load(open(path))
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        json.dump(cfg, open(path, "w"))
    if tensor:
        from safetensors.numpy import load_file, save_file
        path = os.path.join(dst, "model.safetensors")
        ts = load_file(path)
        ts[tensor[0]] = tensor[1](ts[tensor[0]])
        save_file(ts, path, metadata={"format": "pt"})
    return dst


# --------------------------------------------------------------------------------- the cases
# name -> (kind, needle, body). kind "lib": body(tdir, ddir, work) runs in the case's process;
# "cli": body(tdir, ddir, work) returns generate's argv.
CASES: dict[str, tuple[str, str, object]] = {}


def case(name: str, needle: str, kind: str = "lib"):
    def add(fn):
        CASES[name] = (kind, needle, fn)
        return fn
    return add


def _gen(target, draft=None, prompts=((1, 2, 3),), **kw):
    import dflash_jax as dj
    kw.setdefault("max_new_tokens", 4)
    return dj.generate(target, draft, [list(p) for p in prompts], **kw)


def _load(tdir, ddir=None):
    import dflash_jax as dj
    t = dj.load_target(tdir, dtype="float32")
    return t, (dj.load_draft(ddir, target=t, dtype="float32") if ddir else None)


def _target_config_case(name, field, value, needle=None):
    @case(name, needle or field)
    def _(tdir, ddir, work):
        changes = {field: value}
        if field == "rope_theta":
            changes["rope_parameters"] = None
        _gen(_load(_copy(tdir, os.path.join(work, "t"), config=changes))[0])


def _draft_config_case(name, changes, needle):
    @case(name, needle)
    def _(tdir, ddir, work):
        _gen(*_load(tdir, _copy(ddir, os.path.join(work, "d"), config=changes)))


def _weight_case(name, fn, needle):
    @case(name, needle)
    def _(tdir, ddir, work):
        _gen(_load(_copy(tdir, os.path.join(work, "t"), tensor=("model.layers.0.mlp.up_proj.weight", fn)))[0])


_draft_config_case("draft block_size 100000", {"block_size": 100000}, "block_size")
_draft_config_case("draft block_size 0", {"block_size": 0}, "block_size")
_draft_config_case("draft block_size 'x'", {"block_size": "x"}, "block_size")
_draft_config_case("draft mask_token_id inf", {"dflash_config": {"mask_token_id": INF}}, "mask_token_id")
_draft_config_case("draft mask_token_id 'x'", {"dflash_config": {"mask_token_id": "x"}}, "mask_token_id")
_draft_config_case("draft target_layer_ids 'abc'", {"dflash_config": {"mask_token_id": 63, "target_layer_ids": "abc"}},
                   "target_layer_ids")
_draft_config_case("draft rope_theta nan", {"rope_theta": NAN}, "rope_theta")
for _f, _v in (("rope_theta", NAN), ("rope_theta", INF), ("rope_theta", 0), ("rope_theta", -1.0),
               ("rope_theta", "x"), ("rms_norm_eps", NAN), ("rms_norm_eps", -1e-6),
               ("num_hidden_layers", INF), ("vocab_size", NAN), ("num_attention_heads", 0)):
    _target_config_case(f"target {_f} {_v!r}", _f, _v)
_weight_case("int8 weights", lambda t: (t * 100).astype("int8"), "up_proj")
_weight_case("bool weights", lambda t: t > 0, "up_proj")
_weight_case("int32 weights", lambda t: t.astype("int32"), "up_proj")
_weight_case("NaN weights", lambda t: t * float("nan"), "up_proj")
_weight_case("wrong shape weights", lambda t: t[:-1], "up_proj")


@case("truncated safetensors", "safetensors")
def _(tdir, ddir, work):
    d = _copy(tdir, os.path.join(work, "t"))
    p = os.path.join(d, "model.safetensors")
    data = open(p, "rb").read()
    open(p, "wb").write(data[:len(data) // 2])
    _load(d)


@case("for_target(module)", "TargetConfig")
def _(tdir, ddir, work):
    import dflash_jax as dj
    t, _ = _load(tdir)
    dj.DraftConfig.for_target(t)


@case("for_target block_size 100000", "block_size")
def _(tdir, ddir, work):
    import dflash_jax as dj
    t, _ = _load(tdir)
    d = dj.init_draft(dj.DraftConfig.for_target(t.config, num_layers=1, block_size=100000), dtype="float32")
    _gen(t, d)


@case("on_commit=5", "on_commit")
def _(tdir, ddir, work):
    _gen(_load(tdir)[0], on_commit=5)


for _name, _kw, _needle in (("prompts []", dict(prompts=[]), "prompts"),
                            ("prompt id out of vocab", dict(prompts=[[1, 99]]), "outside"),
                            ("seed -1", dict(seed=-1), "seed"),
                            ("max_new_tokens 0", dict(max_new_tokens=0), "max_new_tokens"),
                            ("top_k above vocab", dict(top_k=1000), "top_k"),
                            ("stop_token_ids [-1]", dict(stop_token_ids=[-1]), "stop_token_ids"),
                            ("capacity 0", dict(capacity=0), "capacity"),
                            ("block_size above the draft's", dict(block_size=1000), "block_size")):
    def _body(tdir, ddir, work, kw=_kw):
        _gen(*_load(tdir, ddir), **kw)
    case(f"generate {_name}", _needle)(_body)


@case("load dtype int8", "dtype")
def _(tdir, ddir, work):
    import dflash_jax as dj
    dj.load_target(tdir, dtype="int8")


@case("cli: draft block_size 100000", "block_size", kind="cli")
def _(tdir, ddir, work):
    return ["--model", tdir, "--draft", _copy(ddir, os.path.join(work, "d"), config={"block_size": 100000}),
            "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]


@case("cli: target rope_theta nan", "rope_theta", kind="cli")
def _(tdir, ddir, work):
    return ["--model", _copy(tdir, os.path.join(work, "t"), config={"rope_theta": NAN, "rope_parameters": None}),
            "--draft", "none", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]


@case("cli: int8 weights", "up_proj", kind="cli")
def _(tdir, ddir, work):
    d = _copy(tdir, os.path.join(work, "t"), tensor=("model.layers.0.mlp.up_proj.weight",
                                                     lambda t: (t * 100).astype("int8")))
    return ["--model", d, "--draft", "none", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]


@case("cli: --max-new-tokens 0", "--max-new-tokens", kind="cli")
def _(tdir, ddir, work):
    return ["--model", tdir, "--draft", ddir, "--prompt-ids", "1,2", "--max-new-tokens", "0"]


@case("cli: --top-p 2", "--top-p", kind="cli")
def _(tdir, ddir, work):
    return ["--model", tdir, "--draft", ddir, "--prompt-ids", "1,2", "--top-p", "2"]


@case("cli: --dtype int8", "--dtype", kind="cli")
def _(tdir, ddir, work):
    return ["--model", tdir, "--draft", ddir, "--prompt-ids", "1,2", "--dtype", "int8"]


# --------------------------------------------------------------------------------- running one
CLEAN_TYPES = ("ValueError", "TypeError", "ConfigError", "FileNotFoundError")


def run_one(name: str, tdir: str, ddir: str) -> dict:
    """In the case's own process: run it, return {class, detail}."""
    kind, needle, body = CASES[name]
    with tempfile.TemporaryDirectory() as work:
        if kind == "cli":
            argv = body(tdir, ddir, work)
            env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            p = subprocess.run([sys.executable, "-m", "dflash_jax.generate", *argv], capture_output=True, text=True,
                               env=env, cwd=REPO)
            errors = [line for line in p.stderr.splitlines() if "error:" in line]
            if p.returncode == 0:
                return dict(cls="silent", detail=p.stdout.strip()[-120:])
            if p.returncode == 2 and "Traceback" not in p.stderr and len(errors) == 1 and needle in errors[0]:
                return dict(cls="clean", detail=errors[0])
            return dict(cls="traceback", detail=f"exit {p.returncode}: {(errors or p.stderr.splitlines() or [''])[-1]}")
        try:
            body(tdir, ddir, work)
        except BaseException as e:  # noqa: BLE001 - the class is the point
            msg = " ".join(str(e).split())
            clean = type(e).__name__ in CLEAN_TYPES and "\n" not in str(e).strip() and needle in msg
            return dict(cls="clean" if clean else "traceback", detail=f"{type(e).__name__}: {msg[:200]}")
        return dict(cls="silent", detail="accepted")


def _child(names: list[str], tdir: str, ddir: str) -> None:
    """Run cases in this process one after another, one JSON line each (the parent times them)."""
    for name in names:
        print(json.dumps(dict(name=name, **run_one(name, tdir, ddir))), flush=True)


def _run_all(names: list[str], tdir: str, ddir: str, timeout: float) -> dict:
    """The cases in child processes (JAX imported once per child): a case past `timeout` is a hang,
    its child is killed and a new one takes the remaining cases; a child that dies is a traceback."""
    import selectors
    results, todo = {}, list(names)
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(todo), "--pair", tdir, ddir],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        t = time.perf_counter()
        while todo:
            name = todo[0]
            if not sel.select(timeout=max(0.0, timeout - (time.perf_counter() - t))):
                proc.kill()
                results[name] = dict(cls="hang", detail=f"killed after {timeout:.0f} s")
                todo.pop(0)
                break
            line = proc.stdout.readline()
            if not line:  # the child died inside this case
                proc.wait()
                results[name] = dict(cls="traceback", detail=f"process died (exit {proc.returncode}): "
                                                            f"{proc.stderr.read().strip()[-200:]}")
                todo.pop(0)
                break
            res = json.loads(line)
            results[res.pop("name")] = res
            todo.pop(0)
            print(f"{res['cls']:9s} {name}: {res['detail'][:150]}", flush=True)
            t = time.perf_counter()
        if proc.poll() is None and not todo:
            proc.wait()
        for name in names:
            if name in results and results[name]["cls"] in ("hang", "traceback") and "printed" not in results[name]:
                results[name]["printed"] = True
                print(f"{results[name]['cls']:9s} {name}: {results[name]['detail'][:150]}", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a case may run before it is a hang")
    p.add_argument("--json", help="write the per-case results here")
    p.add_argument("-k", default="", help="only cases whose name contains this")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--pair", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(json.loads(args.child), *args.pair)
        return 0
    import dflash_jax
    with tempfile.TemporaryDirectory() as root:
        tdir, ddir = write_pair(root)
        results = _run_all([n for n in CASES if args.k in n], tdir, ddir, args.timeout)
    for r in results.values():
        r.pop("printed", None)
    counts = {c: sum(r["cls"] == c for r in results.values()) for c in ("clean", "traceback", "hang", "silent")}
    print(f"{len(results)} cases on {os.path.dirname(dflash_jax.__file__)}: " +
          ", ".join(f"{c} {n}" for c, n in counts.items()) + ", data loss 0 (no case writes)")
    if args.json:
        json.dump(dict(counts=counts, cases=results), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
