"""Shared fixtures. Real data for tests lives in the ``shared/data`` folder beside the
repository (override with ``LCCN_SHARED_DATA``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Settings of the user's shell that would send the suite's runs elsewhere: a tracking
# server (`eval "$(infra/mlflow-server.sh)"` exports MLFLOW_TRACKING_URI), a Ray cluster
# (`RAY_ADDRESS`), a runs folder. The suite uses its own temporary stores and local Ray.
ISOLATED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_TOKEN",
                "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "RAY_ADDRESS",
                "RAY_JOB_ID", "LCCN_RUNS", "AWS_PROFILE", "AWS_SESSION_TOKEN",
                "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")

# Object storage in the suite is a local moto server (fixture ``moto_url``): test
# credentials for every process, Ray workers included (set before any cluster starts),
# and nothing from the user's ~/.aws.
TEST_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture
def one_thread():
    """Two cores shared with other processes: one intra-op thread avoids oversubscription."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# Ray Train settings for a suite of short runs on two cores (set before any local cluster
# starts, so its controller and workers inherit them; a user's own value wins): poll the
# workers every 0.5 s instead of 2 s (a run's end and a worker's death are seen sooner),
# and no preemption watcher (one more actor process per run, for spot nodes this machine
# does not have).
TEST_RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def pytest_configure(config) -> None:
    for key in ISOLATED_ENV:
        os.environ.pop(key, None)
    for key, value in TEST_RAY_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.update(TEST_AWS_ENV)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_url(tmp_path_factory):
    """A moto S3 server in its own process on 127.0.0.1 (an S3-compatible store); yields its
    endpoint URL. Its log goes to a file: a pipe nobody reads fills up after some thousand
    requests and the server then stalls on its next log line."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
