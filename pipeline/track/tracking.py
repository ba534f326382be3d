"""MLflow tracking for the process that owns a run (rank 0 of a Ray Train job, or the local
trainer).

Only :class:`mlflow.MlflowClient` calls with explicit run ids are used, never the fluent
``mlflow.start_run`` / active-run state, so a tracker is safe inside a Ray worker, next to
other trackers in the same process, and in threads. The tracker never reads the rank: the
caller decides who tracks.

Every hot-path call is one request: parameters and metrics go through ``log_batch`` (one
``log_metric`` over HTTP costs ~51 ms, see docs/operations.md). Figures are
``matplotlib.figure.Figure`` objects built by :mod:`pipeline.track.plots` without pyplot, saved
through the Agg canvas and dropped after upload, so nothing accumulates over epochs.

Artifacts of a run::

    transitions/phi_epoch_NNN.png   learned phi per epoch (and the truth beside it)
    curves.png                      accuracy / recovery / transition-error curves
    transition.csv                  final phi, header row/col of class names
    outliers.csv                    LCCN*: per-sample p(outlier) and flag (the method's file)
    checkpoint/...                  the checkpoint directory, as is

Conventions: ``phi[k, j] = P(observed = j | latent = k)``; rows sum to 1; shape
``(K_latent, K)``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

try:  # MLflow's request limits (an internal module: fall back to the documented values)
    from mlflow.utils.validation import (
        MAX_METRICS_PER_BATCH,
        MAX_PARAM_VAL_LENGTH,
        MAX_PARAMS_TAGS_PER_BATCH,
    )
except ImportError:  # pragma: no cover
    MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH = 1000, 6000, 100

from pipeline.core import storage
from pipeline.track import plots
from pipeline.track.uris import redact_args, redact_uri

__all__ = ["Tracker", "default_tracking_uri", "flatten_params", "redact_args", "redact_uri",
           "tracking_access_problem", "write_transition_csv"]

log = logging.getLogger(__name__)


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else a sqlite store ``<abs run_dir>/mlflow.db``.

    Always an explicit URI: MLflow's own default is a database in the *current* directory,
    which under Ray Train is the worker's run directory, not the job's. ``ValueError`` for
    an ``s3://`` run dir (no sqlite file there).
    """
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if storage.is_remote(run_dir):
        raise ValueError(f"{run_dir}: the default MLflow store is a sqlite file in that "
                         f"folder, which object storage cannot hold; pass --tracking-uri (an "
                         f"MLflow server, or sqlite:////ABS/PATH/mlflow.db on a shared disk) "
                         f"or --no-tracking")
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


AUTH_HELP = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
             "MLFLOW_TRACKING_TOKEN, or ~/.mlflow/credentials), on every node of a cluster "
             "too: the Ray workers log the run (infra/README.md)")


def tracking_access_problem(uri: str | None, *, timeout: float = 5.0) -> str | None:
    """One line when the tracking server at ``uri`` (http or https) refuses this process's
    credentials (HTTP 401 or 403 on a search of one experiment, with the basic or bearer
    credentials MLflow's client would send from its environment); None otherwise, also
    when the server does not answer (MLflow's own retries and errors handle that)."""
    if not uri or not uri.startswith(("http://", "https://")):
        return None
    import base64
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri)
    user = os.environ.get("MLFLOW_TRACKING_USERNAME") or parts.username
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD") or parts.password
    if not user:
        try:
            from mlflow.utils.credentials import read_mlflow_creds

            creds = read_mlflow_creds()
            user, password = creds.username, creds.password
        except Exception:  # noqa: BLE001 - an unreadable credentials file: send none
            pass
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") +
                                   "/api/2.0/mlflow/experiments/search", "max_results=1", ""))
    req = urllib.request.Request(url)
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        req.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    elif user:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            who = f"user {user!r}" if user else "no credentials"
            return (f"the MLflow server at {redact_uri(uri)} refused {who} (HTTP {e.code}): "
                    f"{AUTH_HELP}")
        return None
    except (OSError, ValueError):
        return None


def add_tracking_options(parser: Any, *, store: str) -> None:
    """``--tracking-uri`` and ``--no-tracking`` on ``parser`` (an argparse parser or group);
    ``store`` names the folder of the default sqlite store in the help. Read them back with
    :func:`tracking_uri_of`."""
    parser.add_argument("--tracking-uri", default=None,
                        help=f"MLflow tracking URI (default $MLFLOW_TRACKING_URI, else "
                             f"sqlite:///{store}/mlflow.db)")
    parser.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")


def tracking_uri_of(args: Any, run_dir: str | os.PathLike) -> str | None:
    """The tracking URI the options of :func:`add_tracking_options` ask for: None with
    ``--no-tracking``, else ``--tracking-uri`` or :func:`default_tracking_uri` of
    ``run_dir``."""
    if args.no_tracking:
        return None
    return args.tracking_uri or default_tracking_uri(run_dir)


def flatten_params(params: Mapping[str, Any] | Any, *, sep: str = ".") -> dict[str, str]:
    """Nested dicts (e.g. ``dataclasses.asdict`` of a RunConfig) or dataclass instances to
    ``{"lccn.alpha": "1.0", ...}``: keys joined by ``sep``, values stringified (tuples and
    lists as ``str``), truncated to MLflow's limit of 6000 characters."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict or a dataclass instance, got "
                        f"{type(params).__name__}")
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping):
            if not value and prefix:
                out[prefix] = "{}"
            for key, sub in value.items():
                walk(f"{prefix}{sep}{key}" if prefix else str(key), sub)
            return
        text = str(value)
        if len(text) > MAX_PARAM_VAL_LENGTH:
            text = text[:MAX_PARAM_VAL_LENGTH - 3] + "..."
        out[prefix] = text

    walk("", params)
    return out


def write_transition_csv(path: str | os.PathLike, phi, *,
                         class_names: Sequence[str] | None = None) -> Path:
    """Write ``phi (K_latent, K)`` as CSV: the top-left cell is ``latent\\observed``, the
    first row holds the observed class names, the first column the latent ones (plus
    ``outlier`` for LCCN*); values in full precision (``repr`` of a float)."""
    m = plots.as_matrix(phi)
    k_latent, k = m.shape
    rows = plots.latent_names(k_latent, class_names, k)
    cols = [str(c) for c in class_names] if class_names is not None else [str(j) for j in range(k)]
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["latent\\observed", *cols])
        for name, row in zip(rows, m):
            w.writerow([name, *(repr(float(v)) for v in row)])
    return path


@contextlib.contextmanager
def _use_tracking_uri(uri: str):
    """MLflow's global tracking URI set to ``uri`` for the block, then put back (the fluent
    calls ``mlflow.pytorch.log_model`` and ``mlflow.register_model`` read it)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri as use

    with use(uri):
        yield


@contextlib.contextmanager
def _env(**values: str | None):
    """Environment variables set (None: removed) for the block, then put back."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, str(v))
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _chunks(items: list, size: int):
    for s in range(0, len(items), size):
        yield items[s:s + size]


class Tracker:
    """One MLflow run, driven through explicit run ids.

    tracking_uri: e.g. ``http://127.0.0.1:5000`` or ``sqlite:////abs/run/mlflow.db``; None
        means :func:`default_tracking_uri` of the current directory (prefer passing one).
    experiment: created on first use. For a sqlite store the experiment's artifacts go next
        to the database (``<db dir>/mlartifacts``) unless ``artifact_location`` says
        otherwise; a server decides for itself (``--default-artifact-root`` /
        ``--artifacts-destination``).
    run_id: resume this run (continue logging into it) instead of creating one.
    tags: set on the run when it is created (e.g. ``{"mlflow.parentRunId": ...}`` makes it
        a child run of a sweep's parent run).

    Attributes after :meth:`start`: ``run_id``, ``experiment_id``; ``dropped`` maps a metric
    key to how many non-finite values were left out.
    """

    def __init__(self, *, tracking_uri: str | None, experiment: str, run_name: str,
                 run_id: str | None = None, artifact_location: str | None = None,
                 tags: Mapping[str, str] | None = None) -> None:
        if not experiment:
            raise ValueError("experiment name must be non-empty")
        self.tracking_uri = tracking_uri or default_tracking_uri(os.getcwd())
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.artifact_location = artifact_location
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.experiment_id: str | None = None
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.dropped: dict[str, int] = {}
        self.resumed = False
        self.model_id: str | None = None  # the LoggedModel of log_model

    # -- lifecycle ------------------------------------------------------------------------------

    def _artifact_location(self) -> str | None:
        if self.artifact_location is not None:
            return self.artifact_location
        if self.tracking_uri.startswith("sqlite:///"):
            db = Path(self.tracking_uri[len("sqlite:///"):])
            if str(db) and str(db) != ":memory:":
                return (db.resolve().parent / "mlartifacts").as_uri()
        return None

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.lifecycle_stage != "active":
                raise ValueError(f"MLflow experiment {self.experiment!r} at "
                                 f"{redact_uri(self.tracking_uri)} "
                                 f"is deleted; restore it or pick another name")
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment,
                                                 artifact_location=self._artifact_location())
        except MlflowException:  # created concurrently by another process: use theirs
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def start(self, params: Mapping[str, Any] | Any) -> str:
        """Create the run (or resume ``run_id``) and log ``params`` flattened, in batches of
        at most 100 (MLflow's limit; one request for any config of ours). Returns the run id.

        On resume, parameters the run already holds with the same value are skipped; a
        parameter whose value changed cannot be overwritten in MLflow, so it is skipped
        with a warning and recorded as the tag ``resume.changed.<key>``.
        """
        flat = flatten_params(params)
        tags: dict[str, str] = {}
        if self.run_id is not None:
            run = self.client.get_run(self.run_id)  # raises a clear MlflowException if absent
            self.experiment_id = run.info.experiment_id
            if run.info.status != "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
            self.resumed = True
            old = run.data.params
            for key in [k for k in flat if k in old]:
                if old[key] != flat[key]:
                    log.warning("run %s: param %s was %r, now %r; MLflow params are immutable, "
                                "keeping the old value", self.run_id, key, old[key], flat[key])
                    tags[f"resume.changed.{key}"] = flat[key][:MAX_PARAM_VAL_LENGTH]
                del flat[key]
        else:
            self.experiment_id = self._experiment_id()
            run = self.client.create_run(self.experiment_id, run_name=self.run_name,
                                         tags=self.tags or None)
            self.run_id = run.info.run_id
        items = [Param(k, v) for k, v in flat.items()] + [RunTag(k, v) for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=[p for p in chunk if isinstance(p, Param)],
                                  tags=[t for t in chunk if isinstance(t, RunTag)])
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run terminated: ``FINISHED``, ``FAILED`` or ``KILLED``."""
        self._need_run()
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status must be FINISHED, FAILED or KILLED, got {status!r}")
        if self.dropped:
            self.client.set_tag(self.run_id, "nonfinite_metrics_dropped",
                                ",".join(f"{k}={n}" for k, n in sorted(self.dropped.items())))
        self.client.set_terminated(self.run_id, status=status)

    def _need_run(self) -> None:
        if self.run_id is None:
            raise RuntimeError("Tracker.start() must be called first")

    # -- metrics ---------------------------------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Log ``metrics`` at ``step`` in one ``log_batch`` request (chunks of 1000).

        NaN and ±inf values are dropped and counted in :attr:`dropped` (a tag at
        :meth:`end`); a value that is not a number raises TypeError naming its key.
        """
        self._need_run()
        ts = int(time.time() * 1000)
        batch: list[Metric] = []
        for key, value in metrics.items():
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} at step {step} is not a number: "
                                f"{value!r}") from None
            if not math.isfinite(v):
                if key not in self.dropped:
                    log.warning("run %s: dropping non-finite metric %s=%r (step %d); further "
                                "ones are counted silently", self.run_id, key, v, step)
                self.dropped[key] = self.dropped.get(key, 0) + 1
                continue
            batch.append(Metric(str(key), v, ts, int(step)))
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    # -- figures and files ---------------------------------------------------------------------

    def _log_figure(self, fig, artifact_file: str) -> None:
        try:
            self.client.log_figure(self.run_id, fig, artifact_file,
                                   save_kwargs={"dpi": 100, "format": "png"})
        finally:
            fig.clear()  # pyplot-free figure: clearing drops the artists, GC does the rest

    def log_transition(self, phi, *, epoch: int, truth=None,
                       class_names: Sequence[str] | None = None, log_scale: bool = False) -> None:
        """Heat map of ``phi (K_latent, K)`` (and the true transition beside it when given)
        as ``transitions/phi_epoch_NNN.png``; ``log_scale`` as in the paper's Fig. 6."""
        self._need_run()
        fig = plots.transition_heatmap(phi, truth=truth, class_names=class_names,
                                       log_scale=log_scale, title=f"learned phi, epoch {epoch}")
        self._log_figure(fig, f"transitions/phi_epoch_{int(epoch):03d}.png")

    def log_curves(self, history: Sequence[Mapping[str, float]], *,
                   keys: Sequence[str] = ("test_top1", "label_recovery", "transition_error")
                   ) -> list[str]:
        """Curves of ``keys`` over the epochs of ``history`` as ``curves.png``.

        A key the rows lack is taken from this run's metric history in MLflow (step =
        the row's ``epoch``): metrics computed at checkpoint time, such as
        ``transition_error``, are logged but not kept in the rows. A key with no finite
        value anywhere (``transition_error`` without a true transition) gets no panel;
        with no key left nothing is logged. Returns the keys drawn.
        """
        self._need_run()
        rows, drawn = self.curve_rows(history, keys=keys)
        if drawn:
            self._log_figure(plots.curves(rows, keys=drawn), "curves.png")
        return drawn

    def curve_rows(self, history: Sequence[Mapping[str, float]], *,
                   keys: Sequence[str]) -> tuple[list[dict], list[str]]:
        """``history`` with the values of ``keys`` filled in from MLflow where a row has
        none, and the keys that have at least one finite value (see :meth:`log_curves`)."""
        rows = [dict(r) for r in history]

        def finite(v: Any) -> bool:
            try:
                return math.isfinite(float(v))
            except (TypeError, ValueError):
                return False

        drawn = []
        for key in keys:
            if any(not finite(r.get(key)) for r in rows):
                logged = {int(m.step): float(m.value)
                          for m in self.client.get_metric_history(self.run_id, key)}
                for i, r in enumerate(rows):
                    step = int(r.get("epoch", i))
                    if not finite(r.get(key)) and step in logged:
                        r[key] = logged[step]
            if any(finite(r.get(key)) for r in rows):
                drawn.append(key)
        return rows, drawn

    def log_model(self, model: Any, example: Any, *, name: str = "model") -> str:
        """``model`` logged as an MLflow 3 LoggedModel ``name`` of this run
        (``mlflow.pytorch.log_model(..., name=name, run_id=...)``: found by
        ``mlflow.search_logged_models``, linked to the run as its output), with the
        signature of ``model(example)`` (``example``: a small input tensor), the first image
        of ``example`` as its input example, and the project's ``pipeline`` package beside
        it (the networks' classes), so that ``mlflow.pytorch.load_model`` of the returned
        ``models:/<model id>`` URI, or of ``runs:/<run id>/<name>``, rebuilds it anywhere
        the requirements are installed. MLflow's global tracking URI is this tracker's only
        for the call. Returns the ``runs:/`` URI; :attr:`model_id` is the model's id."""
        import mlflow
        import mlflow.pytorch
        import torch
        from mlflow.models import infer_signature

        self._need_run()
        with torch.no_grad():
            out = model(example)
        signature = infer_signature(example.cpu().numpy(), out.cpu().numpy())
        code = str(Path(__file__).resolve().parents[1])   # the pipeline package
        # the LoggedModel goes to the run's experiment: without an active run MLflow takes
        # the experiment from the environment (else it would be "Default")
        with _env(MLFLOW_EXPERIMENT_ID=self.experiment_id,
                  MLFLOW_TRACKING_URI=os.environ.get("MLFLOW_TRACKING_URI")), \
                _use_tracking_uri(self.tracking_uri):
            info = mlflow.pytorch.log_model(
                model, name=name, run_id=self.run_id, signature=signature,
                input_example=example[:1].cpu().numpy(), code_paths=[code],
                serialization_format="pickle",   # any batch size; the classes in code_paths
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                  f"mlflow=={mlflow.__version__}"])
        self.model_id = info.model_id
        return f"runs:/{self.run_id}/{name}"  # = info.model_uri, models:/<model id>

    def log_file(self, path: str | os.PathLike, *, artifact_path: str | None = None) -> None:
        """One file as an artifact of the run (e.g. LCCN*'s ``outliers.csv``)."""
        self._need_run()
        self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def log_final(self, phi, *, checkpoint_dir: str | os.PathLike | None = None,
                  class_names: Sequence[str] | None = None) -> None:
        """``transition.csv`` (header row/col of class names; none when ``phi`` is None: a
        method without a transition) and, when given, the files of ``checkpoint_dir`` under
        ``checkpoint/``."""
        self._need_run()
        if checkpoint_dir is not None and not Path(checkpoint_dir).is_dir():
            raise FileNotFoundError(f"checkpoint_dir {checkpoint_dir} is not a directory")
        if phi is not None:
            with tempfile.TemporaryDirectory(prefix="lccn-track-") as tmp:
                path = write_transition_csv(Path(tmp) / "transition.csv", phi,
                                            class_names=class_names)
                self.client.log_artifact(self.run_id, str(path))
        if checkpoint_dir is not None:
            self.client.log_artifacts(self.run_id, str(checkpoint_dir), artifact_path="checkpoint")


# -- the job's driver: the store before the run, the run's links after it ----------------------


def sqlite_artifact_root(tracking_uri: str) -> str | None:
    """``<db dir>/mlartifacts`` as a file URI for a ``sqlite:///`` store (where every
    experiment of the store keeps its artifacts), else None (a server decides)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = tracking_uri[len("sqlite:///"):]
    if not db or db == ":memory:":
        return None
    return (Path(db).resolve().parent / "mlartifacts").as_uri()


def prepare_store(tracking_uri: str, experiment: str) -> str:
    """On a job's driver, before any worker starts: a ``sqlite:///`` store created with its
    artifact root beside the database (MLflow's own "Default" experiment included, which
    would otherwise point at ``./mlruns`` of the first process to open the store: a Ray
    worker's temporary directory, gone after a restart), and the job's experiment created
    (or found) there with that root. Returns the experiment's id."""
    root = sqlite_artifact_root(tracking_uri)
    if root is not None:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        SqlAlchemyStore(tracking_uri, root)  # creates the tables and "Default" at root
    return Tracker(tracking_uri=tracking_uri, experiment=experiment,
                   run_name="-")._experiment_id()


UI_QUERY = "?workflowType=machine_learning"  # MLflow 3's UI otherwise opens the GenAI view


def ui_links(tracking_uri: str, experiment_id: str, run_id: str | None = None,
             model_id: str | None = None) -> dict[str, str]:
    """The MLflow UI pages of an experiment's runs table, a run and a logged model, with
    ``?workflowType=machine_learning``; for a server, under its URL, otherwise under the
    ``mlflow ui`` a user starts (``http://127.0.0.1:5000``). ``command``: that ``mlflow ui``
    command line (a local store only)."""
    server = tracking_uri.startswith(("http://", "https://"))
    base = redact_uri(tracking_uri).rstrip("/") if server else "http://127.0.0.1:5000"
    exp = f"{base}/#/experiments/{experiment_id}"
    links = {"experiment": f"{exp}/runs{UI_QUERY}"}
    if run_id:
        links["run"] = f"{exp}/runs/{run_id}{UI_QUERY}"
    if model_id:
        links["model"] = f"{exp}/models/{model_id}{UI_QUERY}"
    if not server:
        links["command"] = f"mlflow ui --backend-store-uri {redact_uri(tracking_uri)}"
    return links


def log_dataset(client: MlflowClient, run_id: str, *, source: str, digest: str, name: str,
                context: str = "training", num_samples: int | None = None) -> None:
    """The run's training data as an MLflow dataset input (the runs table's Dataset
    column): ``name`` (the split and its label view), ``digest`` (of its manifest),
    ``source`` (the shards' URI or path)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types import ColSpec, Schema

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "can be interpreted in multiple ways"
        src = resolve_dataset_source(source)
    schema = Schema([ColSpec("binary", "image"), ColSpec("long", "label")])
    ds = MetaDataset(source=src, name=name, digest=digest, schema=schema)
    entity = ds._to_mlflow_entity()
    if num_samples is not None:
        import json

        from mlflow.entities import Dataset

        entity = Dataset(name=entity.name, digest=entity.digest,
                         source_type=entity.source_type, source=entity.source,
                         schema=entity.schema,
                         profile=json.dumps({"num_rows": int(num_samples)}))
    client.log_inputs(run_id, datasets=[DatasetInput(
        dataset=entity, tags=[InputTag("mlflow.data.context", context)])])
