"""Shared fixtures. Real data for tests lives in the ``shared/data`` folder beside the
repository (override with ``LCCN_SHARED_DATA``)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Settings of the user's shell that would send the suite's runs elsewhere: a tracking
# server (`eval "$(infra/mlflow-server.sh)"` exports MLFLOW_TRACKING_URI), a Ray cluster
# (`RAY_ADDRESS`), a runs folder. The suite uses its own temporary stores and local Ray.
ISOLATED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_TOKEN",
                "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "RAY_ADDRESS",
                "RAY_JOB_ID", "LCCN_RUNS")


@pytest.fixture
def one_thread():
    """Two cores shared with other processes: one intra-op thread avoids oversubscription."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_configure(config) -> None:
    for key in ISOLATED_ENV:
        os.environ.pop(key, None)


def shared_data_dir() -> Path:
    return Path(os.environ.get("LCCN_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = shared_data_dir()
    if not d.is_dir():
        pytest.fail(f"shared test data not found at {d}; set LCCN_SHARED_DATA")
    return d


@pytest.fixture(scope="session")
def cifar10_jpeg_tree(shared_data, tmp_path_factory) -> Path:
    """The extracted CIFAR-10 JPEG tree: ``<root>/train|test/<class>/NNNN.jpg``."""
    root = tmp_path_factory.mktemp("cifar10-jpeg")
    with tarfile.open(shared_data / "cifar10-jpeg.tar.gz") as tar:
        tar.extractall(root, filter="data")
    # the archive may hold a top-level folder; find the one that contains train/
    for cand in [root, *root.iterdir()]:
        if (cand / "train").is_dir():
            return cand
    pytest.fail(f"no train/ folder inside {shared_data / 'cifar10-jpeg.tar.gz'}")
