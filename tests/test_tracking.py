"""pipeline.track.tracking and pipeline.track.plots against real MLflow stores: a local sqlite file and a
real ``mlflow server`` (sqlite backend, proxied artifacts) started by this module.

The server boots in the background (~25 s on 2 cores: DB migrations, then uvicorn) while
the pure and sqlite tests run; the server tests wait for its /health.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from pipeline.core.config import LCCNConfig, OptimConfig, RunConfig
from pipeline.track import plots
from pipeline.track.tracking import (
    Tracker,
    default_tracking_uri,
    flatten_params,
    tracking_access_problem,
    write_transition_csv,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck"]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts the PNG signature."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real ``mlflow server`` subprocess in its own process group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.artifacts = root / "artifacts"
        self.log_path = root / "server.log"
        cmd = [sys.executable, "-m", "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}",
               "--serve-artifacts", "--artifacts-destination", str(self.artifacts),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.ready = False

    def wait(self, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}:\n"
                            f"{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    self.ready = r.status == 200
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"mlflow server not healthy after {timeout:.0f} s:\n"
                                f"{self.log_path.read_text()[-3000:]}")
                time.sleep(0.25)
        return self.uri

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Launched (not yet waited for) the first time any test asks for a tracking URI."""
    srv = Server(tmp_path_factory.mktemp("mlflow-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sqlite_run_dir(tmp_path_factory, server) -> Path:
    """One local store per module (creating an MLflow database costs ~10 s of migrations)."""
    return tmp_path_factory.mktemp("run")


@pytest.fixture(params=["sqlite", "server"])
def backend(request, sqlite_run_dir, server, monkeypatch):
    """(tracking_uri, directory where the store keeps artifact files)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if request.param == "sqlite":
        return default_tracking_uri(sqlite_run_dir), sqlite_run_dir / "mlartifacts"
    return server.wait(), server.artifacts


@pytest.fixture
def run_config() -> RunConfig:
    return RunConfig(optim=OptimConfig(epochs=12, milestones=(5, 8)),
                     lccn=LCCNConfig(alpha=(0.5, 1.5), warmup_steps=40))


@pytest.fixture
def phi_star() -> torch.Tensor:
    """An LCCN* transition (11, 10): rows sum to 1, last row the outlier."""
    g = torch.Generator().manual_seed(3)
    m = torch.rand(11, 10, generator=g, dtype=torch.float64)
    m = m + 4 * torch.eye(11, 10, dtype=torch.float64)
    return m / m.sum(1, keepdim=True)


# -- pure pieces ------------------------------------------------------------------------------


def test_flatten_params_nested_dataclass(run_config):
    flat = flatten_params(dataclasses.asdict(run_config))
    assert flat == flatten_params(run_config)
    assert flat["lccn.alpha"] == "(0.5, 1.5)"
    assert flat["optim.milestones"] == "(5, 8)"
    assert flat["optim.epochs"] == "12"
    assert flat["model.name"] == "small_cnn"
    assert flat["lccn.anneal"] == "False"
    assert "lccn" not in flat and all(isinstance(v, str) for v in flat.values())
    assert flatten_params({"a": {"b": {"c": None}}, "e": {}}) == {"a.b.c": "None", "e": "{}"}
    assert len(flatten_params({"long": "x" * 10_000})["long"]) == 6000
    with pytest.raises(TypeError, match="dict or a dataclass"):
        flatten_params([1, 2])


def test_default_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri("runs/a") == f"sqlite:///{tmp_path.resolve()}/runs/a/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert default_tracking_uri("runs/a") == "http://127.0.0.1:5999"


def test_heatmap_panels_and_scale(phi_star):
    fig = plots.transition_heatmap(phi_star, truth=np.eye(10), class_names=CLASSES,
                                   log_scale=True)
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"   # no pyplot, no GUI backend
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == 2                       # learned and truth side by side
    assert type(images[0].norm).__name__ == "LogNorm"
    assert images[0].get_array().shape == (11, 10) and images[1].get_array().shape == (10, 10)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][-1] == "outlier"
    single = plots.transition_heatmap(phi_star)
    assert len([ax for ax in single.axes if ax.images]) == 1
    big = plots.transition_heatmap(torch.full((50, 50), 0.02))
    assert len(big.axes[0].get_xticklabels()) < 50   # no per-class ticks at K = 50
    with pytest.raises(ValueError, match="class names"):
        plots.transition_heatmap(phi_star, class_names=CLASSES[:9])
    with pytest.raises(ValueError, match="truth has shape"):
        plots.transition_heatmap(phi_star, truth=np.eye(9))
    with pytest.raises(ValueError, match="non-finite"):
        plots.transition_heatmap(torch.full((3, 3), float("nan")))


def test_curves_skip_nonfinite():
    hist = [{"epoch": 0, "test_top1": 0.2, "transition_error": float("nan")},
            {"epoch": 1, "test_top1": 0.4, "transition_error": 0.1},
            {"epoch": 2, "test_top1": 0.5}]
    fig = plots.curves(hist, keys=("test_top1", "transition_error", "label_recovery"))
    lines = [ax.lines for ax in fig.axes]
    assert list(lines[0][0].get_xdata()) == [0.0, 1.0, 2.0]
    assert list(lines[1][0].get_ydata()) == [0.1]
    assert len(lines[2]) == 0                     # key never present: empty panel


def test_transition_csv_roundtrip(tmp_path, phi_star):
    path = write_transition_csv(tmp_path / "t.csv", phi_star, class_names=CLASSES)
    rows = list(csv.reader(path.open()))
    assert rows[0] == ["latent\\observed", *CLASSES]
    assert [r[0] for r in rows[1:]] == [*CLASSES, "outlier"]
    np.testing.assert_array_equal(np.array([[float(v) for v in r[1:]] for r in rows[1:]]),
                                  phi_star.numpy())


# -- against real stores -----------------------------------------------------------------------


def _history_steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_run_lifecycle(backend, run_config, phi_star, tmp_path):
    uri, artifact_store = backend
    tracker = Tracker(tracking_uri=uri, experiment="lccn-test", run_name="cifar10-sym50")
    run_id = tracker.start(dataclasses.asdict(run_config))
    client = MlflowClient(tracking_uri=uri)

    params = client.get_run(run_id).data.params
    assert params == flatten_params(run_config)
    assert params["lccn.alpha"] == "(0.5, 1.5)" and params["lccn.warmup_steps"] == "40"

    # metrics: one log_batch per call, non-finite values dropped and counted
    batches = []
    real_log_batch = tracker.client.log_batch
    tracker.client.log_batch = lambda *a, **kw: (batches.append(kw), real_log_batch(*a, **kw))[1]
    tracker.log_metrics({"loss": 1.5, "test_top1": 0.3, "bad": float("nan"),
                         "worse": float("inf")}, step=0)
    tracker.log_metrics({"loss": 1.25, "test_top1": 0.4, "bad": float("nan")}, step=1)
    tracker.client.log_batch = real_log_batch
    assert len(batches) == 2 and [len(b["metrics"]) for b in batches] == [2, 2]
    assert tracker.dropped == {"bad": 2, "worse": 1}
    assert _history_steps(client, run_id, "loss") == [(0, 1.5), (1, 1.25)]
    assert client.get_metric_history(run_id, "bad") == []
    with pytest.raises(TypeError, match="'note' at step 2"):
        tracker.log_metrics({"note": "high"}, step=2)

    # figures
    tracker.log_transition(phi_star, epoch=3, truth=np.eye(10), class_names=CLASSES,
                           log_scale=True)
    tracker.log_transition(phi_star, epoch=4, class_names=CLASSES)
    # transition_error is logged at checkpoint time but not kept in the epoch rows: the
    # curves take it from MLflow; a key measured nowhere gets no panel
    tracker.log_metrics({"transition_error": 0.2}, step=0)
    tracker.log_metrics({"transition_error": 0.1}, step=1)
    history = [{"epoch": 0, "test_top1": 0.3, "label_recovery": 0.6},
               {"epoch": 1, "test_top1": 0.4, "label_recovery": 0.7}]
    rows, drawn = tracker.curve_rows(history, keys=("test_top1", "transition_error", "gone"))
    assert drawn == ["test_top1", "transition_error"]
    assert [r["transition_error"] for r in rows] == [0.2, 0.1]
    assert "transition_error" not in history[0]  # the caller's rows are left alone
    assert tracker.log_curves(history) == ["test_top1", "label_recovery", "transition_error"]
    assert tracker.log_curves([{"epoch": 0, "label_recovery": float("nan")}],
                              keys=("label_recovery",)) == []

    # final transition and checkpoint
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(bytes(range(256)) * 8)
    (ckpt / "sub" / "store.json").write_text('{"version": 7}')
    tracker.log_final(phi_star, checkpoint_dir=ckpt, class_names=CLASSES)
    tracker.end()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["nonfinite_metrics_dropped"] == "bad=2,worse=1"

    dl = tmp_path / "download"
    dl.mkdir()

    def fetch(path: str) -> Path:
        return Path(client.download_artifacts(run_id, path, str(dl)))

    w3, h3 = png_size(fetch("transitions/phi_epoch_003.png"))
    w4, h4 = png_size(fetch("transitions/phi_epoch_004.png"))
    assert w3 > 1.5 * w4 and h3 == h4             # the truth panel sits beside the learned one
    png_size(fetch("curves.png"))
    rows = list(csv.reader(fetch("transition.csv").open()))
    assert rows[0][1:] == CLASSES and rows[-1][0] == "outlier"
    np.testing.assert_array_equal(np.array([[float(v) for v in r[1:]] for r in rows[1:]]),
                                  phi_star.numpy())
    got = fetch("checkpoint")
    assert (got / "model.pt").read_bytes() == (ckpt / "model.pt").read_bytes()
    assert (got / "sub" / "store.json").read_text() == '{"version": 7}'
    # the files went where the store keeps artifacts (the server: through its proxy)
    assert list(artifact_store.rglob("phi_epoch_003.png")), f"nothing under {artifact_store}"

    # resume: the same run continues, the history grows, no second run appears
    changed = dataclasses.replace(run_config, seed=5)
    resumed = Tracker(tracking_uri=uri, experiment="lccn-test", run_name="ignored", run_id=run_id)
    assert resumed.start({**dataclasses.asdict(changed), "resume": {"count": 1}}) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    resumed.log_metrics({"loss": 0.75}, step=2)
    resumed.end()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["resume.count"] == "1"
    assert run.data.params["seed"] == "0" and run.data.tags["resume.changed.seed"] == "5"
    assert _history_steps(client, run_id, "loss") == [(0, 1.5), (1, 1.25), (2, 0.75)]
    assert [r.info.run_id for r in client.search_runs([tracker.experiment_id])] == [run_id]

    # a second run lands in the same experiment
    other = Tracker(tracking_uri=uri, experiment="lccn-test", run_name="second")
    other.start({"method": "ce"})
    assert other.experiment_id == tracker.experiment_id and other.run_id != run_id
    other.end("KILLED")
    assert client.get_run(other.run_id).info.status == "KILLED"


def test_misuse_is_reported(sqlite_run_dir):
    uri = default_tracking_uri(sqlite_run_dir)
    t = Tracker(tracking_uri=uri, experiment="lccn-misuse", run_name="x")
    with pytest.raises(RuntimeError, match="start"):
        t.log_metrics({"a": 1.0}, step=0)
    t.start({})
    with pytest.raises(ValueError, match="FINISHED, FAILED or KILLED"):
        t.end("DONE")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        t.log_final(torch.eye(2), checkpoint_dir="/nonexistent/ckpt")
    t.end()
    with pytest.raises(Exception, match="(?i)run.*not found|no run|does not exist"):
        Tracker(tracking_uri=uri, experiment="lccn-misuse", run_name="x",
                run_id="0" * 32).start({})


def test_latent_rows_without_class_names_name_the_outlier_row():
    from pipeline.track.plots import latent_names

    assert latent_names(4, None, 3) == ["0", "1", "2", "outlier"]
    assert latent_names(3, None, 3) == ["0", "1", "2"]
    assert latent_names(4, ["a", "b", "c"], 3) == ["a", "b", "c", "outlier"]


def test_uris_are_shown_without_their_password():
    from pipeline.track.uris import redact_args, redact_uri

    assert redact_uri("http://user:secret@host:5000/x?y=1") == "http://user:***@host:5000/x?y=1"
    assert redact_uri("postgresql://me:p%40ss@db:5432/m") == "postgresql://me:***@db:5432/m"
    for same in ("sqlite:////abs/mlflow.db", "http://127.0.0.1:5000", "http://user@host",
                 "not a uri", None, ""):
        assert redact_uri(same) == same
    assert redact_args(["--tracking-uri", "http://u:secret@h", "--tracking-uri=http://u:secret@h",
                        "--epochs", "3"]) == ["--tracking-uri", "http://u:***@h",
                                              "--tracking-uri=http://u:***@h", "--epochs", "3"]


def test_a_distributed_runs_parameters_never_carry_the_trackings_password(server):
    """A Train worker logs its DistConfig as parameters: tracked on a real server through a
    URI with ``user:secret@``, the run's parameters show ``user:***@`` and no password."""
    from pipeline.cluster.worker import DistConfig, _public

    base = server.wait()
    uri = base.replace("://", "://user:secret@", 1)
    dist = DistConfig(run_name="r", run_dir="/runs", train_source="/shards/train",
                      tracking_uri=uri)
    tracker = Tracker(tracking_uri=uri, experiment="redact", run_name="r")
    run_id = tracker.start({"dist": _public(dist)})
    tracker.end()
    params = MlflowClient(tracking_uri=base).get_run(run_id).data.params
    assert params["dist.tracking_uri"] == base.replace("://", "://user:***@", 1)
    assert not any("secret" in f"{k}={v}" for k, v in params.items())


def _server_script(tmp_path: Path, *args: str, **env: str):
    """infra/mlflow-server.sh with a stand-in interpreter: ``-c`` runs in this Python
    (except the health probe, which fails), ``-m mlflow server`` records its argv and
    environment and exits 1 (the script then reports a failed start-up). Returns the
    completed script and the recorded lines."""
    record = tmp_path / "record"
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f"if [ \"$1\" = -m ]; then echo \"argv: $*\" >> {record}; "
                    f"echo \"env: $MLFLOW_BACKEND_STORE_URI\" >> {record}; "
                    f"echo \"hosts: ${{MLFLOW_SERVER_ALLOWED_HOSTS:-}}\" >> {record}; "
                    "echo 'cannot reach the database' >&2; exit 1; fi\n"
                    "case \"$2\" in *urlopen*) exit 1 ;; esac\n"
                    f"exec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    full = {**os.environ, "MLFLOW_PYTHON": str(fake)}
    full.pop("MLFLOW_ALLOWED_HOSTS", None)
    full.update(env)
    done = subprocess.run(["bash", str(Path(__file__).resolve().parents[1] / "infra" /
                                       "mlflow-server.sh"), "--home", str(tmp_path / "home"),
                           "--port", str(_free_port()), "--timeout", "20", *args],
                          capture_output=True, text=True, env=full, timeout=120)
    assert done.returncode != 0 and "exited during start-up" in done.stderr, done.stderr
    return done, record.read_text().splitlines()


def test_mlflow_server_script_keeps_the_backend_password_off_command_lines(tmp_path):
    """infra/mlflow-server.sh hands a backend store URI with a password to the server in
    MLFLOW_BACKEND_STORE_URI, not on its command line (which ps shows to every user), and
    prints it masked."""
    uri = "postgresql://mlflow:s3cret@127.0.0.1:1/mlflow"
    done, lines = _server_script(tmp_path, "--backend-store-uri", uri)
    assert lines[0].startswith("argv: -m mlflow server") and "s3cret" not in lines[0]
    assert lines[1] == f"env: {uri}"
    assert "s3cret" not in done.stdout + done.stderr


@pytest.mark.parametrize("extra", ["", "mlflow.lccn.svc.cluster.local:*"])
def test_mlflow_server_script_admits_the_documented_addresses(tmp_path, extra):
    """The Host patterns the script gives the server, checked with MLflow's own function:
    a VPC address (172.31.x.y, outside 172.16.*), an SSH tunnel's localhost:5000 and, with
    MLFLOW_ALLOWED_HOSTS, a Kubernetes Service name, all with their port; an outside name
    is refused."""
    from mlflow.server.security_utils import get_default_allowed_hosts, is_allowed_host_header

    env = {"MLFLOW_ALLOWED_HOSTS": extra} if extra else {}
    _, lines = _server_script(tmp_path, **env)
    given = lines[2].removeprefix("hosts: ")
    allowed = given.split(",") if given else get_default_allowed_hosts()
    hosts = ["172.31.4.5:5000", "localhost:5000", "127.0.0.1:5000", "10.0.0.7:5000",
             "192.168.1.2:5000"] + (["mlflow.lccn.svc.cluster.local:5000"] if extra else [])
    for host in hosts:
        assert is_allowed_host_header(allowed, host), (host, allowed)
    assert not is_allowed_host_header(allowed, "evil.example.com:5000")


def test_mlflow_server_script_with_basic_auth_and_a_job_that_says_what_to_set(tmp_path,
                                                                              monkeypatch):
    """``infra/mlflow-server.sh --auth`` starts MLflow's basic-auth server: a request
    without credentials gets 401, the admin's (from the mode-600 file it generated, passed
    as MLflow's environment variables) log a run; the password is on no command line and
    in no output. A job pointed at the server without credentials stops before Ray starts,
    naming the variables to set."""
    home = tmp_path / "home"
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_TRACKING_", "MLFLOW_AUTH"))}
    env["MLFLOW_PYTHON"] = sys.executable
    script = Path(__file__).resolve().parents[1] / "infra" / "mlflow-server.sh"
    done = subprocess.run(["bash", str(script), "--home", str(home), "--port", str(port),
                           "--workers", "1", "--auth"], capture_output=True, text=True,
                          env=env, timeout=180)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        uri = f"http://127.0.0.1:{port}"
        assert done.stdout.strip() == f"export MLFLOW_TRACKING_URI={uri}"
        pw_file = home / "auth" / "admin_password"
        password = pw_file.read_text().strip()
        assert len(password) >= 20 and (pw_file.stat().st_mode & 0o077) == 0
        assert ((home / "auth" / "basic_auth.ini").stat().st_mode & 0o077) == 0
        assert password not in done.stdout + done.stderr
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                assert password.encode() not in cmdline.read_bytes(), cmdline
            except OSError:
                continue
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                    "MLFLOW_TRACKING_TOKEN"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials of the machine
        with pytest.raises(Exception, match="401"):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        problem = tracking_access_problem(uri)
        assert problem and "HTTP 401" in problem and "MLFLOW_TRACKING_USERNAME" in problem

        from lccn_jobs.datasets import CIFAR
        from lccn_jobs.driver import run_job

        args = CIFAR.get_args_parser().parse_args(
            ["--smoke-test", "--run-dir", str(tmp_path / "runs"), "--tracking-uri", uri])
        jr = CIFAR.prepare_run(args)
        with pytest.raises(SystemExit, match="refused no credentials .*MLFLOW_TRACKING_"):
            run_job(args, job=CIFAR.name, run=jr.run, dist=jr.dist, view=jr.view)

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        assert tracking_access_problem(uri) is None
        tracker = Tracker(tracking_uri=uri, experiment="auth", run_name="r")
        run_id = tracker.start({"a": 1})
        tracker.log_metrics({"m": 0.5}, step=0)
        tracker.end()
        assert MlflowClient(tracking_uri=uri).get_run(run_id).data.metrics["m"] == 0.5
    finally:
        subprocess.run(["bash", str(script), "--home", str(home), "--stop"],
                       capture_output=True, env=env, timeout=60)


def test_mlflow_server_script_reads_the_admin_password_from_a_file(tmp_path):
    """--auth with MLFLOW_AUTH_ADMIN_PASSWORD_FILE (what infra/ray-cluster.yaml passes):
    the server gets the basic-auth app and its config file, the password only in files of
    mode 600, on no command line and in no output."""
    secret = tmp_path / "pw"
    secret.write_text("file-secret-0123456789\n")
    done, lines = _server_script(tmp_path, "--auth",
                                 MLFLOW_AUTH_ADMIN_PASSWORD_FILE=str(secret))
    assert "--app-name basic-auth" in lines[0] and "file-secret" not in lines[0]
    auth = tmp_path / "home" / "auth"
    assert (auth / "admin_password").read_text().strip() == "file-secret-0123456789"
    assert "admin_password = file-secret-0123456789" in (auth / "basic_auth.ini").read_text()
    for f in ("admin_password", "basic_auth.ini", "secret_key"):
        assert (auth / f).stat().st_mode & 0o077 == 0, f
    assert "file-secret" not in done.stdout + done.stderr


def _rest(uri: str, path: str, body: dict | None = None) -> dict:
    """One request to the server's REST API as the UI makes it (``/ajax-api/...``)."""
    import json

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{uri}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_the_job_end_on_a_server_logged_model_dataset_registry_and_ui_pages(server, tmp_path):
    """What a job's run leaves on a real ``mlflow server``, read back through the REST
    endpoints the MLflow 3 UI calls: the classifier as a LoggedModel of the run (signature,
    input example; `runs:/<run>/model` and `models:/<id>` load it), the training shards as
    the run's dataset input (manifest digest, label view name), a registered version with
    --register-model, the per-epoch metrics, the transition heat maps, the checkpoint's path
    as a tag (not its bytes), and the UI links with ?workflowType=machine_learning."""
    import mlflow

    from lccn_jobs.reporting import mlflow_after_run
    from lccn_jobs.sources import write_synthetic_shards
    from pipeline.cluster.worker import DistConfig
    from pipeline.core.labels import LabelView
    from pipeline.data.manifest import Manifest
    from pipeline.track.predict import load_classifier
    from pipeline.train.export import Predictor

    uri = server.wait()
    train_dir, _ = write_synthetic_shards(tmp_path / "shards", dataset="toy", num_classes=3,
                                          size=(8, 8), n_train=24, n_test=6, seed=0,
                                          shard_size=12, noisy_web_labels=True)
    tracker = Tracker(tracking_uri=uri, experiment="lccn-ui", run_name="own")
    run_id = tracker.start({"method": "lccn"})
    for epoch in range(3):
        tracker.log_metrics({"test_top1": 0.3 + 0.1 * epoch}, step=epoch)
        tracker.log_transition(np.full((3, 3), 1 / 3), epoch=epoch, class_names=["a", "b", "c"])
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
    predictor = Predictor([net], 3, preset="imagenet8", class_names=("a", "b", "c"),
                          weights="final epoch 3")
    assert tracker.log_model(predictor, torch.rand(2, 3, 8, 8)) == f"runs:/{run_id}/model"
    tracker.end()
    dist = DistConfig(run_name="own", run_dir=str(tmp_path), train_source=str(train_dir),
                      tracking_uri=uri, experiment="lccn-ui", class_names=("a", "b", "c"))
    view = LabelView(observed=np.zeros(24, np.int64), clean=np.full(24, -1, np.int64),
                     num_classes=3, spec={"kind": "dataset"})
    ckpt = str(tmp_path / "train" / "own" / "checkpoint_000002")
    done = mlflow_after_run({"mlflow_run_id": run_id, "checkpoint": ckpt}, dist=dist,
                            view=view, job="train", register="lccn-own")
    exp = done["experiment_id"]

    # the logged model, as the UI's Models tab searches it
    found = _rest(uri, "/ajax-api/2.0/mlflow/logged-models/search",
                  {"experiment_ids": [exp]})["models"]
    assert len(found) == 1 and found[0]["info"]["source_run_id"] == run_id
    model_id = found[0]["info"]["model_id"]
    assert done["model_id"] == model_id and found[0]["info"]["name"] == "model"
    with tracker_uri(uri):
        lm = mlflow.get_logged_model(model_id)
        files = {f.path for f in mlflow.MlflowClient(uri).list_logged_model_artifacts(model_id)}
    assert {"MLmodel", "input_example.json"} <= files, files
    with tracker_uri(uri):  # models:/ is resolved through the global URI, not tracking_uri
        mlmodel = Path(mlflow.artifacts.download_artifacts(
            f"models:/{model_id}", tracking_uri=uri, dst_path=str(tmp_path / "m"))) / "MLmodel"
    assert "signature:" in mlmodel.read_text() and lm.source_run_id == run_id
    for u in (f"runs:/{run_id}/model", f"models:/{model_id}"):
        model = load_classifier(u, tracking_uri=uri)
        assert model.class_names == ("a", "b", "c") and model(torch.rand(1, 3, 8, 8)).shape == (1, 3)
    # the run: its dataset input, the checkpoint reference, metrics, heat maps
    run = _rest(uri, f"/ajax-api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
    (ds,) = run["inputs"]["dataset_inputs"]
    digest = __import__("hashlib").sha256(Manifest.load(train_dir).to_json().encode()).hexdigest()
    assert ds["dataset"]["name"] == "toy/train:dataset" and ds["dataset"]["digest"] == digest[:12]
    assert str(train_dir) in ds["dataset"]["source"]
    assert {t["key"]: t["value"] for t in run["data"]["tags"]}["lccn.checkpoint"] == ckpt
    hist = _rest(uri, f"/ajax-api/2.0/mlflow/metrics/get-history?run_id={run_id}"
                      f"&metric_key=test_top1")["metrics"]
    assert [round(m["value"], 3) for m in sorted(hist, key=lambda m: m["step"])] == [0.3, 0.4, 0.5]
    arts = _rest(uri, f"/ajax-api/2.0/mlflow/artifacts/list?run_id={run_id}&path=transitions")
    assert sorted(f["path"] for f in arts["files"]) == [
        f"transitions/phi_epoch_{e:03d}.png" for e in range(3)]
    assert not any(f["path"] == "checkpoint"
                   for f in _rest(uri, f"/ajax-api/2.0/mlflow/artifacts/list?run_id={run_id}")
                   .get("files", []))
    # the registry, as the UI's Models page reads it
    versions = _rest(uri, "/ajax-api/2.0/mlflow/model-versions/search?filter=name%3D%27lccn-own%27")
    assert [v["version"] for v in versions["model_versions"]] == ["1"]
    # the UI links: the machine-learning view of the experiment, the run, the model
    links = done["links"]
    assert links["experiment"] == f"{uri}/#/experiments/{exp}/runs?workflowType=machine_learning"
    assert links["run"] == f"{uri}/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"
    assert links["model"] == (f"{uri}/#/experiments/{exp}/models/{model_id}"
                              f"?workflowType=machine_learning")
    with urllib.request.urlopen(links["run"].split("#")[0], timeout=30) as r:
        assert r.status == 200 and b"<div id=\"root\"" in r.read()  # the UI's page


def tracker_uri(uri: str):
    from pipeline.track.tracking import _use_tracking_uri

    return _use_tracking_uri(uri)


def test_the_driver_creates_the_store_with_every_artifact_location_under_the_run_dir(
        tmp_path, monkeypatch):
    """MLflow's own "Default" experiment used to point at ./mlruns of the first process
    that opened the store (a Ray worker's temporary folder); the driver now creates the
    store and the job's experiment first, both under <run-dir>/mlartifacts."""
    from pipeline.track.tracking import prepare_store

    monkeypatch.chdir(tmp_path / ".." )
    uri = default_tracking_uri(tmp_path)
    exp = prepare_store(uri, "lccn-train")
    client = MlflowClient(tracking_uri=uri)
    root = (tmp_path / "mlartifacts").as_uri()
    assert client.get_experiment(exp).artifact_location == root
    assert client.get_experiment("0").artifact_location.startswith(root)
    assert prepare_store(uri, "lccn-train") == exp  # found again, not a second one
