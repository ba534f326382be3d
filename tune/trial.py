"""One trial of a sweep: the job a trial runs (a :class:`lccn_jobs.driver.Job` of
:data:`lccn_jobs.catalog.JOBS`, by name), its run built from a sampled point of a search
space and not started (:func:`trial_run`), and the Tune function trainable of the ASHA and
FIFO sweeps (:func:`run_trial`; the PBT trainable is :func:`tune.pbt.run_trial`). Both
:mod:`tune.sweep` and :mod:`tune.pbt` import this module; it imports neither.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from lccn_jobs.catalog import JOBS
from lccn_jobs.configs import warmup_covers_phase
from lccn_jobs.driver import Job, JobRun, run_job
from pipeline.core import storage
from pipeline.core.config import scaled_lr_values
from pipeline.core.options import apply_point
from tune.reporting import EpochReport


def get_job(job: str) -> Job:
    """The job a sweep names (``--job``): its ``get_args_parser``, ``prepare_run``,
    ``prepare_data`` and ``name``."""
    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}; known: {sorted(JOBS)}")
    return JOBS[job]


def parse_job_args(job: str, argv: list[str]) -> argparse.Namespace:
    """The options of ``job`` (its ``get_args_parser``) parsed once, by the sweep's driver;
    every trial runs a copy of them (:func:`trial_run`)."""
    return get_job(job).get_args_parser().parse_args(argv)


def prepare_job_data(job: str, job_args: argparse.Namespace, sweep_dir: Path) -> list[str]:
    """A job's data made ready once, by the sweep's driver, before any trial starts: the
    job's ``prepare_data(args, root)`` where it has one (``jobs/train.py`` converts one's
    own images under ``sweep_dir/data`` and points ``job_args`` at the shards); nothing
    for the jobs that read converted shards. Returns the lines to print."""
    if getattr(job_args, "smoke_test", False):
        return []
    return get_job(job).prepare_data(job_args, sweep_dir)


def trial_run(config: dict[str, Any], *, job: str, job_args: argparse.Namespace,
              sweep_dir: str, trial_id: str, tracking_uri: str | None, experiment: str,
              parent_run_id: str | None, run_name: str | None = None,
              extra_tags: list[tuple[str, str]] | None = None):
    """The run of one trial, built and not started: ``(Job, args, JobRun)`` of ``job``
    run with a copy of the parsed ``job_args`` (:func:`parse_job_args`) and ``config`` (a
    sampled point, keys like ``"lccn.alpha"``) applied to its RunConfig, run dir
    ``<sweep_dir>/trials/<trial_id>``, run name ``run_name`` (default the trial id; a PBT
    trial restarted from a checkpoint runs a new one) and the MLflow tags of a child of
    ``parent_run_id`` (plus ``extra_tags``)."""
    the_job = get_job(job)
    args = copy.deepcopy(job_args)
    args.run_dir = storage.join(sweep_dir, "trials", trial_id)  # a path or an s3:// prefix
    args.run_name, args.experiment = run_name or trial_id, experiment
    args.tracking_uri, args.no_tracking = tracking_uri, tracking_uri is None
    jr = the_job.prepare_run(args)
    run = apply_point(jr.run, config)
    dist = jr.dist
    if dist.lr_values and run.optim.lr != jr.run.optim.lr:  # piecewise schedule: scale it
        dist = dataclasses.replace(dist, lr_values=scaled_lr_values(dist.lr_values,
                                                                    run.optim.lr))
    tags = [("tune.trial_id", trial_id), *(extra_tags or [])]
    if parent_run_id:
        tags.append(("mlflow.parentRunId", parent_run_id))
    dist = dataclasses.replace(dist, mlflow_tags=tuple(tags))
    # the job's run warnings (the warm-up's) spoke of its own δ and schedule: the trial's
    log = [*jr.log, f"[sweep] trial {trial_id}: {json.dumps(config, default=str)}"]
    note = (warmup_covers_phase(run, jr.manifest, args.num_workers)
            if jr.manifest is not None else None)
    return the_job, args, JobRun(
        run=run, dist=dist, view=jr.view, log=log, manifest=jr.manifest,
        run_warnings=[f"[sweep] trial {trial_id}: warning: {note}"] if note else [])


def run_trial(config: dict[str, Any], **kwargs: Any) -> None:
    """Tune function trainable: the trial's run (:func:`trial_run`) fitted on Ray. The Train
    run's epoch reports go to Tune through :class:`tune.reporting.EpochReport`; nothing is
    reported after ``fit()``. A trial run again (a restored sweep) resumes its Train run from
    its last checkpoint."""
    import ray.tune

    trial_id = ray.tune.get_context().get_trial_id()
    job, args, jr = trial_run(config, trial_id=trial_id, **kwargs)
    run_job(args, job=job.name, run=jr.run, dist=jr.dist, view=jr.view, log=jr.lines(),
            callbacks=[EpochReport()])
