"""The project speaks of itself: no file names documents the repository does not hold, and
every relative link in the Markdown guides points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".json"}
FOREIGN = ("DESIGN.md", "PLATFORM.md", "STYLE.md")


def project_files() -> list[Path]:
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if any(part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info")
               for part in rel.parts[:-1]):
            continue
        if p.is_file() and p.suffix in TEXT:
            out.append(p)
    return out


def test_no_file_cites_documents_outside_the_repository():
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(REPO)}: {name}" for p in project_files() if p.resolve() != me
            for name in FOREIGN if name in p.read_text(errors="replace")]
    assert not hits, hits


def test_docs_folder_holds_the_design_notes():
    for name in ("README.md", "design.md", "reliability.md", "operations.md"):
        assert (REPO / "docs" / name).is_file(), name
    design = (REPO / "docs" / "design.md").read_text()
    for topic in ("phi[k, j] = P(observed = j | latent = k)", "Fences", "Invariants",
                  "Exactly once"):
        assert topic in design, topic


GUIDES = ["README.md", "infra/README.md", *sorted(str(p.relative_to(REPO))
                                                   for p in (REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("guide", GUIDES)
def test_relative_links_resolve(guide):
    path = REPO / guide
    text = path.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    targets += re.findall(r"`((?:docs|benchmarks/results|infra|jobs|scripts|tests)/[\w./-]+\.(?:md|py|sh|yaml))`", text)
    missing = [t for t in targets if "://" not in t
               and not ((path.parent / t).exists() or (REPO / t).exists())]
    assert not missing, missing


def _commands(text: str, prefix: str) -> list[list[str]]:
    """Command lines in the fenced code blocks of ``text`` that start with ``prefix``
    (continuation lines joined, comments dropped), split like a shell would."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(prefix):
                out.append(shlex.split(line)[len(prefix.split()):])
    return out


def test_readme_commands_parse():
    """Every lccn-shards / lccn-labelview / job / sweep command the README shows is accepted
    by that program's parser (catches options that were renamed or never existed)."""
    import importlib
    import sys

    from shards import cli, labelview

    text = (REPO / "README.md").read_text()
    shards_cmds = _commands(text, "lccn-shards")
    assert {c[0] for c in shards_cmds} >= {"cifar10", "imagefolder", "clothing1m", "webvision"}
    for argv in shards_cmds:
        cli.build_parser().parse_args(argv)
    for argv in _commands(text, "lccn-labelview"):
        labelview.get_args_parser().parse_args(argv)
    sys.path.insert(0, str(REPO / "jobs"))
    jobs = [argv for argv in _commands(text, "python") if argv and argv[0].startswith("jobs/")]
    assert jobs
    for argv in jobs:
        job = importlib.import_module(Path(argv[0]).stem)
        job.get_args_parser().parse_args(argv[1:])
    from tune import sweep

    sweeps = _commands(text, "python -m tune.sweep")
    assert sweeps
    for argv in sweeps:
        sweep.get_args_parser().parse_args(argv)


def test_readme_says_how_to_use_the_venv_and_the_converters():
    text = (REPO / "README.md").read_text()
    for phrase in ("source .venv/bin/activate", "`imagefolder`", "`--download`",
                   "noisy_label_kv.txt", "python -m tune.sweep", "docs/design.md"):
        assert phrase in text, phrase


def test_presets_table_is_the_code():
    """The "Presets" table of docs/methods.md is the jobs' recipes, rendered
    (``jobs/common.py``: ``presets_table``); rebuild it with that function after a change."""
    import sys

    sys.path.insert(0, str(REPO / "jobs"))
    import common

    text = (REPO / "docs" / "methods.md").read_text()
    m = re.search(r"<!-- presets:start -->\n(.*?)<!-- presets:end -->", text, flags=re.S)
    assert m, "docs/methods.md has no presets table between its markers"
    assert m.group(1) == common.presets_table()
    for (dataset, method), r in common.METHOD_PRESETS.items():  # every recipe in a row
        assert f"| {dataset} | {method} | {r.model}" in m.group(1), (dataset, method)
    assert "docs/methods.md#presets" in (REPO / "README.md").read_text()
