"""The layering contract of the code base (docs/design.md, "The map"): which package may
import which, no import cycle between modules, project imports at module level, and Ray
only in the packages that run on a cluster.

Read from the source with :mod:`ast` (nothing is imported), so a new upward import, a new
cycle or a new function-level import fails here the day it is written.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("pipeline", "shards", "tune", "jobs")

# bottom to top: a package may import its own modules and those of the layers below it
LAYERS = ("pipeline.core", "pipeline.data", "pipeline.track", "pipeline.train",
          "pipeline.cluster", "shards", "tune", "jobs")

# (importing module, imported module): the only project imports that stay inside a
# function, each for an optional dependency a GPU node may lack
LAZY_ALLOWED = {
    ("pipeline.train.engine", "pipeline.track.tracking"): "MLflow, rank 0 of a tracked run only",
}

# third-party packages only some layers may import (at any depth)
RESTRICTED = {
    "ray": ("pipeline.cluster", "tune", "jobs"),
    "mlflow": ("pipeline.track", "tune", "jobs"),
    "webdataset": ("pipeline.data",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods = {}
    for top in TOPS:
        for p in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in p.parts:
                mods[module_name(p)] = p
    return mods


def layer_of(mod: str) -> int:
    best = -1
    for i, layer in enumerate(LAYERS):
        if mod == layer or mod.startswith(layer + "."):
            best = i
    if best < 0:
        if mod == "pipeline":
            return 0
        raise AssertionError(f"{mod}: in no layer of LAYERS")
    return best


class Import:
    def __init__(self, target: str, line: int, lazy: bool) -> None:
        self.target, self.line, self.lazy = target, line, lazy


def imports_of(mod: str, path: Path, mods: dict[str, Path]) -> tuple[list[Import], list[Import]]:
    """(project imports, third-party imports) of one module, each with its line and
    whether it sits inside a function or class body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    # imports under `if TYPE_CHECKING:` / `try:` at module level count as module level
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            for sub in ast.walk(n):
                top_level.add(id(sub))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    project, external = [], []

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        lazy = id(node) not in top_level
        targets = {t for n in names if (t := resolve(n)) is not None and t != mod}
        if targets:
            # `from pipeline.core import noise` names the submodule, not the package
            if len(targets) > 1 and isinstance(node, ast.ImportFrom):
                targets.discard(resolve(names[0]))
            project += [Import(t, node.lineno, lazy) for t in targets]
        elif names and names[0].split(".")[0] not in TOPS:
            external += [Import(n.split(".")[0], node.lineno, lazy) for n in names[:1]]
    return project, external


@pytest.fixture(scope="module")
def graph():
    mods = project_modules()
    return mods, {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_every_project_module_is_in_a_layer(graph):
    mods, _ = graph
    for m in mods:
        layer_of(m)


def test_no_upward_import(graph):
    mods, edges = graph
    bad = []
    for m, (project, _) in edges.items():
        for imp in project:
            if layer_of(imp.target) > layer_of(m):
                bad.append(f"{mods[m].relative_to(ROOT)}:{imp.line}: {m} ({LAYERS[layer_of(m)]}) "
                           f"imports {imp.target} ({LAYERS[layer_of(imp.target)]}), a layer above")
    assert not bad, "\n".join(bad)


def test_no_import_cycle(graph):
    """Tarjan's strongly connected components over every project import, lazy ones too."""
    mods, edges = graph
    adj = {m: sorted({i.target for i in edges[m][0]}) for m in mods}
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for m in sorted(mods):
        if m not in index:
            visit(m)
    assert not sccs, "import cycles: " + "; ".join(" <-> ".join(c) for c in sccs)


def test_project_imports_are_at_module_level(graph):
    mods, edges = graph
    bad = []
    for m, (project, _) in edges.items():
        if m.split(".")[0] == "jobs":
            continue
        for imp in project:
            if imp.lazy and (m, imp.target) not in LAZY_ALLOWED:
                bad.append(f"{mods[m].relative_to(ROOT)}:{imp.line}: {m} imports {imp.target} "
                           f"inside a function")
    assert not bad, "\n".join(bad)


def test_restricted_third_party_packages(graph):
    mods, edges = graph
    bad = []
    for m, (_, external) in edges.items():
        for imp in external:
            allowed = RESTRICTED.get(imp.target)
            if allowed is not None and not any(m == a or m.startswith(a + ".") for a in allowed):
                bad.append(f"{mods[m].relative_to(ROOT)}:{imp.line}: {m} imports {imp.target}")
    assert not bad, "\n".join(bad)


def test_every_subpackage_says_what_it_owns_and_may_import():
    for layer in LAYERS[:5]:
        init = ROOT / layer.replace(".", "/") / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(ROOT)}: no 'May import' in its docstring"


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above are not vacuous: a tree with pipeline.core importing
    pipeline.train, which imports it back, fails both."""
    for pkg in ("pipeline", "pipeline/core", "pipeline/train"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pipeline/core/a.py").write_text("def f():\n    from pipeline.train import b\n")
    (tmp_path / "pipeline/train/b.py").write_text("from pipeline.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    mods = project_modules()
    g = (mods, {m: imports_of(m, p, mods) for m, p in mods.items()})
    with pytest.raises(AssertionError, match="a layer above"):
        test_no_upward_import(g)
    with pytest.raises(AssertionError, match="pipeline.core.a <-> pipeline.train.b"):
        test_no_import_cycle(g)
    with pytest.raises(AssertionError, match="inside a function"):
        test_project_imports_are_at_module_level(g)
