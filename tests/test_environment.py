"""The suite's environment is its own: variables from the user's shell that point at a
tracking server or a Ray cluster never reach the tests (conftest.ISOLATED_ENV)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "LCCN_ENV_PROBE"


@pytest.mark.skipif(not os.environ.get(PROBE), reason="runs inside the test below only")
def test_probe_sees_no_user_settings(tmp_path):
    from pipeline.track.tracking import default_tracking_uri

    for key in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "LCCN_RUNS", "MLFLOW_EXPERIMENT_NAME"):
        assert key not in os.environ, key
    assert default_tracking_uri(tmp_path).startswith("sqlite:///")


def test_user_tracking_server_and_cluster_do_not_leak_into_tests():
    """As after ``eval "$(infra/mlflow-server.sh)"`` and ``export RAY_ADDRESS=...``."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **{PROBE: "1"},
               MLFLOW_TRACKING_URI="http://127.0.0.1:9", RAY_ADDRESS="http://127.0.0.1:9",
               LCCN_RUNS="/nonexistent/runs", MLFLOW_EXPERIMENT_NAME="user-experiment")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).name}::test_probe_sees_no_user_settings"],
        cwd=REPO / "tests", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]
