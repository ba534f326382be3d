"""Every console script in pyproject.toml resolves to an importable callable whose
``--help`` works and names the script itself."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_there_are_console_scripts():
    assert {"lccn-shards", "lccn-labelview"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_resolves_and_prints_help(name, tmp_path):
    target = SCRIPTS[name]
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    assert callable(fn), target
    # what the generated wrapper does: sys.argv[0] is the script's path, then sys.exit(fn())
    code = (f"import sys; sys.argv = [{str(tmp_path / name)!r}, '--help']; "
            f"from {module} import {attr}; sys.exit({attr}())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: {name} "), proc.stdout[:200]


@pytest.mark.parametrize("module", ["shards", "shards.labelview"])
def test_python_dash_m_usage_names_the_module(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python -m {module} "), proc.stdout[:200]


def test_installed_scripts_match_pyproject():
    """When this checkout is the installed one (``pip install -e .``, as scripts/setup.sh
    does), the installed console scripts are exactly those of pyproject.toml and exist
    next to the interpreter."""
    import json
    from importlib import metadata

    # the installed distribution is the one pip recorded (direct_url.json); an .egg-info
    # folder that setuptools leaves in the checkout is found first on sys.path but is not it
    dists = [d for d in metadata.distributions(name="lccn-pipeline")
             if d.read_text("direct_url.json")]
    if not dists:
        pytest.skip("lccn-pipeline is not installed in this environment")
    dist = dists[0]
    direct = json.loads(dist.read_text("direct_url.json"))
    if direct.get("url", "").removeprefix("file://") != str(REPO):
        pytest.skip(f"the installed lccn-pipeline is another checkout ({direct.get('url')})")
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert installed == SCRIPTS
    for name in SCRIPTS:
        assert (Path(sys.executable).parent / name).exists(), name
