"""The package layout: imports flow one way (no circles), stages import only earlier stages.

The module graph is read from the source with :mod:`ast`, not by importing: every ``import`` and
``from ... import`` in a module counts, at module level or inside a function (a function-level
import that closes a circle is still a circle, only a later one), relative imports resolved
against the module's package. ``importlib.import_module`` of a name written in the module (the
CLI's stage commands, the instrumentor registry's ``"module:Class"`` entries) counts as an
import of that module. A package's ``__init__`` running before its submodules is Python's doing
and is not an edge; ``from pkg import sub`` is an edge to ``pkg.sub`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import teller

ROOT = Path(teller.__file__).resolve().parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name → (file, is a package ``__init__``) for every module of ``teller``."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module a dotted name lands in (``teller.rundir.RunDir`` → ``teller.rundir``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str) -> list[tuple[str, int, bool]]:
    """(imported teller module, line, inside a function) for each import in ``mod``."""
    path, is_pkg = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    package = mod.split(".") if is_pkg else mod.split(".")[:-1]
    in_function: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    dynamic = any(isinstance(n, ast.Attribute) and n.attr == "import_module"
                  or isinstance(n, ast.Name) and n.id == "import_module" for n in ast.walk(tree))
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import sub` is an import of pkg.sub, not of pkg
                names.append(f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem)
        elif dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":", 1)[0]
            if text in MODULES:
                names = [text]
        for n in names:
            target = _resolve(n) if n.startswith("teller") else None
            if target is not None and target != mod:
                out.append((target, node.lineno, id(node) in in_function))
    return out


GRAPH: dict[str, set[str]] = {m: {t for t, _, _ in _imports(m)} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _edges(src: str, dst: str) -> list[str]:
    """``a -> b (line n)`` for every import from package/module ``src`` into ``dst``."""
    def inside(m: str, p: str) -> bool:
        return m == p or m.startswith(p + ".")

    return [f"{m} -> {t} (line {line})" for m in MODULES if inside(m, src)
            for t, line, _ in _imports(m) if inside(t, dst)]


def test_the_graph_sees_every_kind_of_import():
    """The reader of imports is what the other assertions stand on: check it on known edges."""
    assert "teller.rundir" in GRAPH["teller.record.sink"]  # module level, absolute
    assert "teller.record.launcher" in GRAPH["teller.record.cli"]  # inside a function
    assert "teller.record.cli" in GRAPH["teller.cli"]  # importlib.import_module of a listed name
    assert "teller.record.instrument.vllm" in GRAPH["teller.record.instrument"]  # "module:Class"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import circles (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


# stage direction rules: (importer, must not import, why)
RULES = [
    ("teller.record", "teller.inject", "the recorder knows nothing of fault injection"),
    ("teller.record", "teller.reconstruct", "recording comes before reconstruction"),
    ("teller.ingest", "teller.reconstruct", "ingest comes before reconstruction"),
    ("teller.reconstruct", "teller.localize", "reconstruction comes before localization"),
    ("teller.localize", "teller.report", "the report is built from localize, not the other way"),
    ("teller.localize", "teller.evaluate", "evaluation scores localize's output"),
    ("teller.slicing", "teller.report", "the report is built from slices"),
]
# nothing shipped imports the top-level CLI or the test fixtures
SHIPPED = sorted({m.split(".")[1] for m in MODULES if m.count(".") >= 1} - {"cli", "testing", "__main__"})
RULES += [(f"teller.{s}", "teller.cli", "the CLI sits on top of every stage") for s in SHIPPED]
RULES += [(f"teller.{s}", "teller.testing", "fixtures are for tests and benchmarks")
          for s in SHIPPED]


@pytest.mark.parametrize(("src", "dst", "why"), RULES, ids=[f"{s}-/->{d}" for s, d, _ in RULES])
def test_stage_does_not_import(src: str, dst: str, why: str):
    bad = _edges(src, dst)
    assert not bad, f"{src} must not import {dst} ({why}):\n" + "\n".join(bad)


# these two hold once every stage reads the forest through the shared reader (teller/forest.py)
def test_slicing_does_not_import_localize():
    assert not _edges("teller.slicing", "teller.localize")


def test_inject_does_not_import_localize():
    """Fault injection writes the ground truth that localize is scored on, before it."""
    assert not _edges("teller.inject", "teller.localize")
