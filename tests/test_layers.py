"""The layering contract of the code base (docs/design.md, "The map"): which package may
import which, no import cycle between modules, project imports at module level, Ray only in
the packages that run on a cluster, every import resolved, and no import the checks cannot
see (a module loaded by name at run time, or found through an edited ``sys.path``).

Read from the source with :mod:`ast` (nothing is imported), so a new upward import, a new
cycle or a new function-level import fails here the day it is written.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("pipeline", "shards", "lccn_jobs", "tune", "jobs")

# bottom to top: a package may import its own modules and those of the layers below it
# (jobs/ holds the entry scripts, lccn_jobs the job library they and tune share)
LAYERS = ("pipeline.core", "pipeline.data", "pipeline.track", "pipeline.train",
          "pipeline.cluster", "shards", "lccn_jobs", "tune", "jobs")

# (importing module, imported module): the only project imports that stay inside a
# function, each for an optional dependency a GPU node may lack
LAZY_ALLOWED = {
    ("pipeline.train.engine", "pipeline.track.tracking"): "MLflow, rank 0 of a tracked run only",
}

# (module, the call's first argument): the only modules loaded by name at run time
# (importlib.import_module, __import__, runpy, a spec from a file); none today: a job is
# found in lccn_jobs.catalog.JOBS, a method in the registry of pipeline.train.methods
DYNAMIC_ALLOWED: dict[tuple[str, str], str] = {}
LOADERS = {"import_module", "__import__", "run_module", "run_path", "spec_from_file_location",
           "module_from_spec"}

# third-party packages only some layers may import (at any depth)
RESTRICTED = {
    "ray": ("pipeline.cluster", "lccn_jobs", "tune", "jobs"),
    "mlflow": ("pipeline.track", "lccn_jobs", "tune", "jobs"),
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


def top_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at module level (what ``from it import name`` can take)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


class Source:
    """One module's imports: ``project`` and ``external`` (with their line and whether they
    sit inside a function or class body), ``unresolved`` (project names that are no
    module or no name of one), ``dynamic`` (modules loaded by name: the call's first
    argument, or ``<expr>``) and ``path_edits`` (lines that change ``sys.path``)."""

    def __init__(self, mod: str, path: Path, mods: dict[str, Path],
                 bound: dict[str, set[str]]) -> None:
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(n) for n in tree.body}
        # imports under `if TYPE_CHECKING:` / `try:` at module level count as module level
        for n in tree.body:
            if isinstance(n, (ast.If, ast.Try)):
                for sub in ast.walk(n):
                    top_level.add(id(sub))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        self.project: list[Import] = []
        self.external: list[Import] = []
        self.unresolved: list[tuple[int, str]] = []
        self.dynamic: list[tuple[int, str]] = []
        self.path_edits: list[int] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(ast.unparse(t).startswith("sys.path") for t in targets):
                    self.path_edits.append(node.lineno)
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            lazy = id(node) not in top_level
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._one(a.name, None, node.lineno, lazy, mods, bound)
                continue
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                self._one(base, a.name, node.lineno, lazy, mods, bound)

    def _one(self, module: str, name: str | None, line: int, lazy: bool,
             mods: dict[str, Path], bound: dict[str, set[str]]) -> None:
        """``import module`` (name None) or ``from module import name``."""
        top = module.split(".")[0]
        if top not in TOPS:
            self.external.append(Import(top, line, lazy))
            return
        if module not in mods:
            self.unresolved.append((line, module))
            return
        sub = f"{module}.{name}" if name not in (None, "*") else None
        if sub in mods:  # `from pipeline.core import noise`: the submodule
            self.project.append(Import(sub, line, lazy))
            return
        if name not in (None, "*") and name not in bound[module]:
            self.unresolved.append((line, f"{module}.{name}"))
        self.project.append(Import(module, line, lazy))

    def _call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in LOADERS:
            arg = node.args[0] if node.args else None
            what = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                else f"<{ast.unparse(arg) if arg is not None else ''}>"
            self.dynamic.append((node.lineno, what))
        target = ast.unparse(func)
        if target.startswith("sys.path.") and name in ("insert", "append", "extend", "remove"):
            self.path_edits.append(node.lineno)


@pytest.fixture(scope="module")
def graph():
    return build_graph()


def build_graph() -> tuple[dict[str, Path], dict[str, Source]]:
    mods = project_modules()
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in mods.items()}
    bound = {m: top_level_names(t) for m, t in trees.items()}
    return mods, {m: Source(m, p, mods, bound) for m, p in mods.items()}


def _where(mods: dict[str, Path], m: str, line: int) -> str:
    return f"{mods[m].relative_to(ROOT)}:{line}: {m}"


def test_every_project_module_is_in_a_layer(graph):
    mods, _ = graph
    for m in mods:
        layer_of(m)


def test_every_import_resolves(graph):
    """A project import names a project module (and a name it binds); any other import is
    an installed package or the standard library, found outside this repository: a module
    of the repository reached through ``sys.path`` (``import common`` from a script's
    folder) is no package the layers know, and fails here."""
    mods, edges = graph
    bad = [f"{_where(mods, m, line)} imports {name}: no such project module or name"
           for m, src in edges.items() for line, name in src.unresolved]
    for m, src in edges.items():
        for imp in src.external:
            spec = importlib.util.find_spec(imp.target)
            origin = Path(spec.origin).resolve() if spec and spec.origin not in (
                None, "built-in", "frozen") else None
            if spec is None:
                bad.append(f"{_where(mods, m, imp.line)} imports {imp.target}: not installed")
            elif origin is not None and origin.is_relative_to(ROOT) \
                    and ".venv" not in origin.relative_to(ROOT).parts:
                bad.append(f"{_where(mods, m, imp.line)} imports {imp.target}: a module of the "
                           f"repository ({origin.relative_to(ROOT)}) outside the packages "
                           f"{', '.join(TOPS)}")
    assert not bad, "\n".join(bad)


def test_no_module_is_loaded_by_name(graph):
    """``importlib.import_module``, ``__import__``, ``runpy`` and specs from files hide an
    import from these checks: only the pairs of DYNAMIC_ALLOWED may."""
    mods, edges = graph
    bad = [f"{_where(mods, m, line)} loads {what} by name"
           for m, src in edges.items() for line, what in src.dynamic
           if (m, what) not in DYNAMIC_ALLOWED]
    assert not bad, "\n".join(bad)


def test_no_module_edits_sys_path(graph):
    """Scripts, the job library and the sweeps import installed packages by name."""
    mods, edges = graph
    bad = [f"{_where(mods, m, line)} changes sys.path"
           for m, src in edges.items() for line in src.path_edits]
    assert not bad, "\n".join(bad)


def test_no_upward_import(graph):
    mods, edges = graph
    bad = []
    for m, src in edges.items():
        for imp in src.project:
            if layer_of(imp.target) > layer_of(m):
                bad.append(f"{_where(mods, m, imp.line)} ({LAYERS[layer_of(m)]}) "
                           f"imports {imp.target} ({LAYERS[layer_of(imp.target)]}), a layer above")
    assert not bad, "\n".join(bad)


def test_no_import_cycle(graph):
    """Tarjan's strongly connected components over every project import, lazy ones too."""
    mods, edges = graph
    adj = {m: sorted({i.target for i in edges[m].project if i.target != m}) for m in mods}
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
    for m, src in edges.items():
        for imp in src.project:
            if imp.lazy and (m, imp.target) not in LAZY_ALLOWED:
                bad.append(f"{_where(mods, m, imp.line)} imports {imp.target} inside a function")
    assert not bad, "\n".join(bad)


def test_restricted_third_party_packages(graph):
    mods, edges = graph
    bad = []
    for m, src in edges.items():
        for imp in src.external:
            allowed = RESTRICTED.get(imp.target)
            if allowed is not None and not any(m == a or m.startswith(a + ".") for a in allowed):
                bad.append(f"{_where(mods, m, imp.line)} imports {imp.target}")
    assert not bad, "\n".join(bad)


def test_every_package_says_what_it_owns_and_may_import():
    for layer in LAYERS[:-1]:  # jobs/ is a folder of scripts
        init = ROOT / layer.replace(".", "/") / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(ROOT)}: no 'May import' in its docstring"


def test_the_job_library_and_the_sweeps_are_installed_packages():
    """The scripts in jobs/ and the sweeps find lccn_jobs and tune as installed packages
    (pyproject.toml's package list), whatever the working directory."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    for top in TOPS[:-1]:
        assert f"{top}*" in include, top
    assert not (ROOT / "jobs" / "__init__.py").exists()  # scripts, not a package


def _planted(tmp_path: Path, monkeypatch, files: dict[str, str]):
    """The checks' view of a tree of ``files`` (path -> source) under ``tmp_path``."""
    for rel, text in files.items():
        path = tmp_path / rel
        for parent in reversed(path.relative_to(tmp_path).parents[:-1]):
            (tmp_path / parent).mkdir(exist_ok=True)
            if parent.parts[0] != "jobs":
                (tmp_path / parent / "__init__.py").touch()
        path.write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for top in TOPS:
        (tmp_path / top).mkdir(exist_ok=True)
    return build_graph()


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above are not vacuous: a tree with pipeline.core importing
    pipeline.train, which imports it back, fails both."""
    g = _planted(tmp_path, monkeypatch, {
        "pipeline/core/a.py": "def f():\n    from pipeline.train import b\n",
        "pipeline/train/b.py": "from pipeline.core import a\n"})
    with pytest.raises(AssertionError, match="a layer above"):
        test_no_upward_import(g)
    with pytest.raises(AssertionError, match="pipeline.core.a <-> pipeline.train.b"):
        test_no_import_cycle(g)
    with pytest.raises(AssertionError, match="inside a function"):
        test_project_imports_are_at_module_level(g)


def test_the_checker_sees_what_a_script_folder_hides(tmp_path, monkeypatch):
    """What passed the earlier checks unseen: ``import common`` from a folder put on
    ``sys.path`` (here a real cycle: jobs/common.py imports pipeline.core.storage, which
    imports it back), a name a project module does not have, and ``import_module`` of a
    project module, each fails."""
    g = _planted(tmp_path, monkeypatch, {
        "pipeline/core/storage.py": "import common\nfrom pipeline.core.labels import Nowhere\n",
        "pipeline/core/labels.py": "class LabelView:\n    pass\n",
        "jobs/common.py": "import sys\nsys.path.insert(0, 'jobs')\n"
                          "from pipeline.core import storage\n",
        "tune/trial.py": "import importlib\n\ndef job():\n"
                         "    return importlib.import_module('tune.sweep')\n",
        "tune/sweep.py": "from tune.trial import job\n"})
    with pytest.raises(AssertionError) as e:
        test_every_import_resolves(g)
    assert "pipeline.core.storage imports common:" in str(e.value)
    assert "imports pipeline.core.labels.Nowhere: no such" in str(e.value)
    with pytest.raises(AssertionError, match=r"tune\.trial loads tune\.sweep by name"):
        test_no_module_is_loaded_by_name(g)
    with pytest.raises(AssertionError, match=r"jobs/common.py:2: jobs.common changes sys.path"):
        test_no_module_edits_sys_path(g)
