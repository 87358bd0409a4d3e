"""The house's layout: no import circle among the product's modules (read with `ast`, nothing
imported), and the name `dflash_jax.generate` stays the library function while
`python -m dflash_jax.generate` stays the command."""

from __future__ import annotations

import ast
import pathlib
import runpy
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "pallas_kernels")

# Known circles, allowed until they are broken (none now: issue 34 broke the models' circle).
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
    """module -> {module it imports: first line}. Every import counts, a function's own too; an
    import that resolves to a package's __init__ (a face that re-exports) is no tie."""
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
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod and mods[name].name != "__init__.py":
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
