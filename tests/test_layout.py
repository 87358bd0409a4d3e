"""The house's layout: no import circle among the product's modules and no product module taking a
`_private` name of another (both read with `ast`, nothing imported), and the name
`dflash_jax.generate` stays the library function while `python -m dflash_jax.generate` stays the
command."""

from __future__ import annotations

import ast
import pathlib
import runpy
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "pallas_kernels")

# Known circles, allowed until they are broken (none now: issue 34 broke the models' circle, issue 55
# the loader's: the families read checkpoints through dflash_jax.checkpoint_io, not weights).
ALLOWED_CIRCLES: list[set[str]] = []


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}. Every import counts, a function's own too. A
    package's __init__ is a module like the others: `from pkg import sub` ties to pkg.sub, `from pkg
    import name` (a name it re-exports) to pkg's __init__, which ties to what it imports."""
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges.setdefault(name, node.lineno)
        graph[mod] = edges
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def test_no_import_circles():
    mods = _modules()
    assert "dflash_jax.loop" in mods and "pallas_kernels.attention.reference" in mods
    graph = _imports(mods)
    bad = [c for c in _circles(graph) if c not in ALLOWED_CIRCLES]
    lines = []
    for comp in bad:
        lines.append(f"circle of {len(comp)}: " + ", ".join(sorted(comp)))
        lines += [f"  {mods[a].relative_to(REPO)}:{line} imports {b}"
                  for a in sorted(comp) for b, line in graph[a].items() if b in comp]
    assert not bad, "import circles:\n" + "\n".join(lines)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(mods: dict[str, pathlib.Path]) -> dict[tuple[str, str], int]:
    """(module, "other_module._name") -> first line, for every `from other import _name` and every
    `alias._name` where `alias` is bound to another product module by an import (a function's own
    imports too). A private module (`pallas_kernels._common`) is no private name: its public names
    are its package's shared ones."""
    found: dict[tuple[str, str], int] = {}
    for mod, path in mods.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}          # local name -> the product module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in mods:
                        bound[a.asname] = a.name
                    elif not a.asname and a.name.split(".")[0] in mods:
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base not in mods:
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        bound[a.asname or a.name] = full
                    elif _private(a.name) and base != mod:
                        found.setdefault((mod, full), node.lineno)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not (isinstance(value, ast.Name) and value.id in bound):
                continue
            target = ".".join([bound[value.id]] + chain[::-1])
            if target in mods and target != mod and f"{target}.{node.attr}" not in mods:
                found.setdefault((mod, f"{target}.{node.attr}"), node.lineno)
    return found


def test_no_private_names_across_modules():
    mods = _modules()
    uses = _private_uses(mods)
    lines = [f"  {mods[a].relative_to(REPO)}:{line} takes {b}" for (a, b), line in sorted(uses.items())]
    assert not uses, "private names taken across modules (make them public, or keep them home):\n" + "\n".join(lines)


def test_private_name_finder_sees_both_forms(tmp_path):
    (tmp_path / "a.py").write_text("from b import _x, y\nimport b as bb\nfrom b import _c as c\n"
                                   "def f():\n    return bb._z + bb.__name__\n")
    (tmp_path / "b.py").write_text("_x = y = _z = _c = 1\nfrom b import _x\n")
    found = _private_uses({"a": tmp_path / "a.py", "b": tmp_path / "b.py"})
    assert set(found) == {("a", "b._x"), ("a", "b._c"), ("a", "b._z")}


def test_circle_finder_sees_a_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _circles(graph) == [{"a", "b", "c"}]


def test_generate_is_the_function_and_the_clis_run_as_modules(monkeypatch, capsys):
    import importlib

    import dflash_jax
    from dflash_jax import decode

    for command, flag in (("dflash_jax.generate", "--max-new-tokens"), ("dflash_jax.benchmark", "--dataset")):
        monkeypatch.delitem(sys.modules, command, raising=False)
        monkeypatch.setattr(sys, "argv", [command, "--help"])
        with pytest.raises(SystemExit) as e:
            runpy.run_module(command, run_name="__main__", alter_sys=True)
        assert e.value.code == 0 and flag in capsys.readouterr().out
        assert dflash_jax.generate is decode.generate
    monkeypatch.delitem(sys.modules, "dflash_jax.generate", raising=False)
    assert importlib.import_module("dflash_jax.generate") is decode.generate   # imported, not run
    import dflash_jax.cli.benchmark  # noqa: F401  (the CLIs' code)
    import dflash_jax.cli.generate  # noqa: F401
    from dflash_jax import generate
    assert generate is dflash_jax.generate is decode.generate


def test_generate_keywords_are_the_options_fields():
    import dataclasses
    import inspect

    from dflash_jax import decode, generate

    params = inspect.signature(generate).parameters
    fields = dataclasses.fields(decode.GenerateOptions)
    assert list(params)[:3] == ["target", "draft", "prompts"]
    assert [(n, p.default) for n, p in list(params.items())[3:]] == [(f.name, f.default) for f in fields]
    assert params["max_new_tokens"].default == 256 and params["step_buckets"].default == "auto"
    with pytest.raises(TypeError, match="generate.*max_tokens"):
        generate(None, None, [[1]], max_tokens=4)
