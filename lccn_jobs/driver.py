"""The driver of a job: the run's Ray Train settings (:func:`dist_config`), checked before
any worker starts, and :func:`run_job`, which fits (or resumes) the run on Ray and reports
it; :class:`Job`, what every job is (its parser, its run, its ``main``).

Every job runs the same two ways::

    python jobs/<name>.py ...                               # starts a local Ray itself
    ray job submit --working-dir . -- python jobs/<name>.py ...   # on a running cluster

(The driver connects to ``RAY_ADDRESS`` when it is set, which ``ray job submit`` does,
else starts a local Ray instance.) A job re-submitted with the same ``--run-name`` and
``--run-dir`` resumes from its last checkpoint. Under ``ray job submit`` the working
directory is a per-job copy: give an absolute ``--run-dir`` (the default, ``$LCCN_RUNS`` or
``~/lccn_runs/<job>``, is absolute) so that a resubmission finds its run.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lccn_jobs.cli import normal_run_dir
from lccn_jobs.configs import JobConfig, job_config
from lccn_jobs.reporting import summarise
from pipeline.cluster.ray_train import fit_distributed, init_ray
from pipeline.cluster.worker import DistConfig
from pipeline.core import storage
from pipeline.core.config import RunConfig
from pipeline.core.labels import LabelView
from pipeline.data.manifest import Manifest
from pipeline.data.split_labels import read_split_labels
from mlflow.exceptions import MlflowException

from pipeline.track.tracking import (
    prepare_store,
    tracking_access_problem,
    tracking_uri_of,
)
from pipeline.track.uris import redact_uri
from pipeline.train.checkpoints import checkpoint_dirs, init_state_file, resume_problem
from pipeline.train.methods import get_method
from pipeline.train.models import pretrained_weights_problem


@dataclass
class JobRun:
    """Everything a job hands to :func:`run_job`: the configs, the label view and the log
    lines to print first (built by a job's ``prepare_run(args)``; a sweep trial changes
    ``run`` before running it). ``run_warnings`` are the lines that speak of ``run`` (the
    warm-up warning): a trial that changes ``run`` replaces them with its own."""

    run: RunConfig
    dist: DistConfig
    view: LabelView
    log: list[str]
    manifest: Manifest | None = None  # the training split's, where the job read it
    run_warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What the run prints first: ``log``, then ``run_warnings``."""
        return [*self.log, *self.run_warnings]


class Job:
    """A job: ``name`` (its run dir ``$LCCN_RUNS/<name>``, its MLflow experiment
    ``lccn-<name>``, the stem of its script ``jobs/<name>.py``), its parser, its run built
    from the parsed arguments and not started (what a sweep trial runs with a sampled point
    put in), the data it prepares once for every trial of a sweep, and ``main``."""

    name: str

    def get_args_parser(self) -> argparse.ArgumentParser:
        raise NotImplementedError

    def dataset_of(self, args: argparse.Namespace) -> str:
        """The dataset whose recipe (:data:`lccn_jobs.recipes.RECIPES`) the parsed
        arguments run."""
        raise NotImplementedError

    def config(self, args: argparse.Namespace) -> JobConfig:
        """The run's configs from the parsed arguments alone, no data read: the recipe and
        the command line (:func:`lccn_jobs.configs.job_config`; a sweep reads its epochs)."""
        return job_config(args, self.dataset_of(args))

    def prepare_run(self, args: argparse.Namespace) -> JobRun:
        """Parsed arguments -> the run's configs and label view (nothing trained yet)."""
        raise NotImplementedError

    def prepare_data(self, args: argparse.Namespace, root: Path) -> list[str]:
        """Data made ready once, under ``root``, before a sweep's trials start (and
        ``args`` pointed at it); returns the lines to print. Nothing by default."""
        return []

    def main(self, argv: list[str] | None = None) -> dict[str, Any]:
        args = self.get_args_parser().parse_args(argv)
        jr = self.prepare_run(args)
        return run_job(args, job=self.name, run=jr.run, dist=jr.dist, view=jr.view,
                       log=jr.lines())


# below this many images per GPU, batch-norm statistics are noisy enough to cost accuracy
MIN_BATCH_PER_GPU = 16


def small_batch_warning(run: RunConfig, dist: DistConfig) -> str | None:
    """A warning when ``OptimConfig.batch_size`` (global) split over the GPUs leaves fewer
    than :data:`MIN_BATCH_PER_GPU` images per GPU (e.g. the Clothing1M recipe's 32 over 8
    GPUs), with the batch and the linearly scaled lr that reach the floor; None otherwise."""
    if not dist.use_gpu:
        return None
    per = run.optim.batch_size / dist.num_workers
    if per >= MIN_BATCH_PER_GPU:
        return None
    batch = MIN_BATCH_PER_GPU * dist.num_workers
    lr = run.optim.lr * batch / run.optim.batch_size
    return (f"warning: global batch {run.optim.batch_size} over {dist.num_workers} GPUs is "
            f"{per:g} images per GPU: batch-norm statistics from so few are noisy. Consider "
            f"--batch-size {batch} with the lr scaled linearly (--scale-lr: --lr {lr:g}, "
            f"{run.optim.lr:g} x {batch}/{run.optim.batch_size}), --sync-bn (statistics over "
            f"the global batch), or fewer GPUs")


def dist_config(args: argparse.Namespace, cfg: JobConfig, *, run_name: str, train: str,
                test: str | None, class_names: list[str], transform: str) -> DistConfig:
    """The run's Ray Train settings from the parsed arguments and the job's configs
    ``cfg`` (its per-phase rates and ``pretrained``), checked (the run dir's tracking store
    and bucket, ``--init-from``) before any worker starts."""
    if getattr(args, "sync_bn", False) and not args.gpu:
        raise SystemExit("error: --sync-bn needs --gpu (torch.nn.SyncBatchNorm has no CPU "
                         "kernel)")
    run_dir = normal_run_dir(args.run_dir)
    try:
        tracking = tracking_uri_of(args, run_dir)
    except ValueError as e:
        raise SystemExit(f"error: --run-dir {e}") from None
    problem = storage.check_bucket(run_dir, endpoint_url=args.s3_endpoint_url)
    if problem:
        raise SystemExit(f"error: {problem}")
    return DistConfig(
        run_name=run_name, run_dir=str(run_dir), train_source=train, test_source=test,
        num_workers=args.num_workers, use_gpu=args.gpu, loader_workers=args.loader_workers,
        shuffle_buffer=args.shuffle_buffer, preset=transform,
        checkpoint_every=args.checkpoint_every, lr_values=cfg.lr_values,
        pretrained=cfg.pretrained, tracking_uri=tracking, experiment=args.experiment,
        class_names=tuple(class_names), inject_failure=args.inject_failure,
        verify_checksums=args.verify_checksums,
        # resolved here: the workers of a cluster need not have the driver's environment
        s3_endpoint_url=storage.endpoint(args.s3_endpoint_url),
        sync_bn=getattr(args, "sync_bn", False), decode=getattr(args, "decode", "cpu"),
        export_model=bool(getattr(args, "export_model", True)) and not args.smoke_test,
        init_from=_init_from(args, cfg.run, storage.join(run_dir, "train", run_name),
                             endpoint_url=args.s3_endpoint_url),
        progress_seconds=args.progress_seconds)


def _init_from(args: argparse.Namespace, run: RunConfig, own_checkpoints: Path | str, *,
               endpoint_url: str | None = None) -> str | None:
    """--init-from as the absolute path of the state file it names, checked before any
    worker starts (a wrong path is one line, not a failed run). A run that resumes from
    its own checkpoints ignores it, so then a path that no longer resolves is no error."""
    if not getattr(args, "init_from", None):
        return None
    try:
        path = str(init_state_file(args.init_from).resolve())
    except (OSError, ValueError) as e:
        if checkpoint_dirs(own_checkpoints, endpoint_url=endpoint_url):
            return None  # resuming: the weights come from the run's own checkpoint
        raise SystemExit(str(e)) from None
    pre = run.optim.pretrain_epochs
    if pre:
        print(f"note: --init-from with {pre} CE pre-training epochs first; "
              f"--pretrain-epochs 0 starts the noise phase at once (the paper's code's "
              f"protocol after a finished CE run)", flush=True)
    return path


def warmup_words(optim) -> str:
    """The CE warm-up as the job's header line says it: ``3 CE`` or ``CE until the noisy
    validation accuracy stops rising, at most 15``."""
    if optim.pretrain_auto:
        return (f"CE until the noisy validation accuracy stops rising, at most "
                f"{optim.pretrain_epochs}")
    return f"{optim.pretrain_epochs} CE"


def connect_ray() -> bool:
    """Connect to the cluster at ``RAY_ADDRESS`` (set by ``ray job submit``) or, without
    it, start a local Ray instance bound to 127.0.0.1 (``address="local"``: never attach to
    some other cluster found through ``/tmp/ray/ray_current_cluster``). No-op when already
    connected; returns whether this call connected (:func:`pipeline.cluster.ray_train.init_ray`)."""
    return init_ray()


def stop_on_sigterm() -> Any:
    """SIGTERM (``kill``, ``timeout``, a pod's termination) stops the run as Ctrl-C does:
    Ray Train's SIGINT handler, registered while the run trains, aborts it gracefully (its
    checkpoints kept, the resume hint printed). Without this, Ray's own handler in the
    driver aborts the process with a stack dump. Main thread only (a sweep's trials run in
    threads, and Tune handles the signals there). Returns the handler it replaced, for
    :func:`restore_sigterm` (None where it installed none, or where the replaced one was not
    set from Python, as Ray's in a driver: that one cannot be put back, and this one stays)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def forward(signum: int, frame: Any) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, forward)


def restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def run_job(args: argparse.Namespace, *, job: str, run: RunConfig, dist: DistConfig,
            view: LabelView, log: list[str] | None = None,
            callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Fit (or resume) the run on Ray, print a summary and write ``results/<run>.json``
    under the run dir (and the method's end-of-run files beside it, LCCN*'s
    ``results/<run>-outliers.csv``). Returns the summary dict. ``callbacks``: Ray Train callbacks for the
    trainer (a sweep trial's report to Tune)."""
    import ray

    problem = (resume_problem(run, dist) or tracking_access_problem(dist.tracking_uri)
               or (dist.pretrained
                   and pretrained_weights_problem(run.model.name, run.model.weights)))
    if problem:
        raise SystemExit(f"error: {problem}")
    register = getattr(args, "register_model", None)
    if register and not dist.tracking_uri:
        raise SystemExit("error: --register-model needs MLflow tracking (leave out "
                         "--no-tracking)")
    if dist.tracking_uri:  # the store and the experiment, with artifacts under the run dir
        try:
            prepare_store(dist.tracking_uri, dist.experiment)
        except (MlflowException, ValueError) as e:
            raise SystemExit(f"error: MLflow {redact_uri(dist.tracking_uri)}: {e}") from None
    if run.lccn.use_trusted and not view.trusted.any():
        raise SystemExit("error: LCCN+ (a trusted-set option) was asked for, but the label view "
                         "has no trusted samples")
    try:
        get_method(run.method).check_run(run)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    for line in [*(log or []), *filter(None, [small_batch_warning(run, dist)])]:
        print(line, flush=True)
    print(f"[{job}] run {dist.run_name!r} in {dist.run_dir}: {dist.num_workers} workers "
          f"({'GPU' if dist.use_gpu else 'CPU'}), method {run.method}, model {run.model.name}, "
          f"{run.optim.epochs} epochs ({warmup_words(run.optim)}), global batch "
          f"{run.optim.batch_size}, N = {len(view)}, K = {view.num_classes}; MLflow "
          f"{redact_uri(dist.tracking_uri) or 'off'}", flush=True)
    keys = None
    if get_method(run.method).names_samples(run) and "://" not in dist.train_source:
        keys = list(read_split_labels(dist.train_source)["key"])  # the files name each sample
    started = connect_ray()
    previous_sigterm = stop_on_sigterm()
    t0 = time.perf_counter()
    try:
        out = fit_distributed(run, dist, view, max_failures=args.max_failures,
                              cpus_per_worker=args.cpus_per_worker, callbacks=callbacks,
                              sample_keys=keys)
    except (KeyboardInterrupt, SystemExit):  # Ray Train's Ctrl-C handler aborts, then exits
        print(f"[{job}] interrupted: to resume from the run's last checkpoint, run the same "
              f"command with --run-name {dist.run_name} --run-dir {dist.run_dir}", flush=True)
        raise
    finally:
        restore_sigterm(previous_sigterm)
        if started:
            ray.shutdown()
    return summarise(out, job=job, dist=dist, view=view, seconds=time.perf_counter() - t0,
                     register_model=register)
