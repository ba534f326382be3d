"""Ray Tune sweeps over the LCCN jobs: each trial builds and fits its job's ``TorchTrainer``
(``jobs/quickstart_ray.py``, ``jobs/cifar_lccn.py``, ``jobs/clothing1m_lccn.py``,
``jobs/webvision_divide_lccn.py``) with a sampled point of a search space
(:mod:`tune.search_spaces`) put into its RunConfig.

Every epoch of a trial's Train run reaches Tune (:mod:`tune.reporting`), so ASHA stops weak
trials after 1, 2, 4, ... epochs (``--scheduler fifo``: never; ``--scheduler pbt``:
population-based training over alpha and the annealing floor, :mod:`tune.pbt`). Trials are stopped and ranked
by ``val_top1`` (max), the accuracy on the noisy validation split (``--val-fraction`` of the
training samples, against their observed labels: what a user with noisy data has); the
clean ``test_top1`` is reported beside it and never used to choose (:mod:`tune.results`).
``--metric val_nll`` ranks by the held-out negative log-likelihood of the noisy labels under
the model and its noise model instead (min), which tracked the clean accuracy across alpha
where the noisy accuracy did not (``benchmarks/results/alpha_sweep.md``).

Layout (``--sweep-dir``, absolute)::

    <sweep-dir>/tune/<name>/            Tune's experiment (trial folders named by trial id)
    <sweep-dir>/trials/<trial_id>/      the trial's run dir: data, Ray Train storage and
                                        checkpoints, results/<trial_id>.json
    <sweep-dir>/<name>/results.csv|.md  the ranked table; accuracy_vs_alpha.png
    <sweep-dir>/mlflow.db               MLflow: experiment ``lccn-sweep-<name>``, one parent
                                        run named <name>, one child run per trial (named by
                                        trial id: its params and per-epoch metrics)

An interrupted sweep (Ctrl+C, a crash of the driver) continues when run again with the same
``--name`` and ``--sweep-dir``: ``Tuner.restore`` keeps the finished trials, resumes the
unfinished ones (each from its Train run's last checkpoint) and starts the missing ones.

At most as many trials run at once as the cluster has room for: GPUs over the workers of a
trial with ``--gpu``, else CPUs over the CPUs of a trial's workers (``--max-concurrent``
lowers it). The trial driver asks for memory and no CPU, so that two workers fit on 2 CPUs.

    python -m tune.sweep --job quickstart --smoke-test [--sweep-dir DIR]   # 3 short trials
    python -m tune.sweep --job quickstart --num-samples 8 -- --epochs 30   # after --: job options
    python -m tune.sweep --job cifar --alpha-grid --name a -- --data DIR/cifar10 --gpu
    python -m tune.sweep --job clothing1m --space my_space.json -- --data DIR/clothing1m
    python -m tune.sweep --job quickstart --scheduler pbt --num-samples 4 -- --num-workers 1
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from lccn_jobs.cli import default_run_dir, local_mirror, normal_run_dir
from lccn_jobs.configs import apply_smoke
from lccn_jobs.driver import connect_ray
from pipeline.core import storage
from pipeline.core.cli import run_location
from pipeline.core.config import RunConfig
from pipeline.core.options import apply_point
from pipeline.cluster.ray_train import release_orphaned_placement_groups
from pipeline.track import plots
from pipeline.track.tracking import Tracker, add_tracking_options, tracking_uri_of
from pipeline.track.uris import redact_args, redact_uri
from pipeline.train.methods import get_method
from tune import pbt
from tune.pbt import LOG_FILE as PBT_LOG_FILE
from tune.results import rank_trials, to_csv, to_markdown
from tune.search_spaces import (
    METRIC,
    RANKING,
    REPORTED_BESIDE,
    SPACES,
    TIME_ATTR,
    get_space,
    load_space,
    sample_point,
    to_tune,
    with_alpha_grid,
)
from tune.trial import JOBS, get_job, parse_job_args, prepare_job_data, run_trial

TRIAL_MEMORY = 256 * 1024**2  # bytes the trial driver reserves (it takes no CPU)
PARENT_TAG = "sweep_role"  # tag of the parent run ("parent"); children carry mlflow.parentRunId


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--job", choices=sorted(JOBS), default="quickstart",
                   help="the job each trial runs (default quickstart: the digits)")
    p.add_argument("--space", default=None,
                   help=f"search space: a name ({', '.join(sorted(SPACES))}) or a JSON file of "
                        f"config key -> spec (default: the job's space)")
    p.add_argument("--alpha-grid", action="store_true",
                   help="sweep lccn.alpha over the paper's grid 0.01 ... 1000 (8 values, each "
                        "--num-samples times) instead of log-uniform")
    p.add_argument("--num-samples", type=int, default=None,
                   help="trials (times the size of any grid; default 8, 3 with "
                        "--smoke-test, 1 when every key is a grid or a constant)")
    p.add_argument("--scheduler", choices=("asha", "fifo", "pbt"), default="asha",
                   help="asha: stop weak trials early on val_top1; fifo: run every trial out; "
                        "pbt: population-based training, trials in the lower quantile restart "
                        "from an upper trial's checkpoint (model and the actor's C and z) with "
                        "lccn.alpha and lccn.anneal_floor perturbed (tune/pbt.py)")
    p.add_argument("--metric", choices=sorted(RANKING), default=METRIC,
                   help="what ranks trials, stops them (ASHA) and picks each one's epoch, on "
                        "the noisy validation split: val_top1 (accuracy, max; default) or "
                        "val_nll (negative log-likelihood of the noisy labels under the model "
                        "and its noise model, min), which followed alpha's effect on the clean "
                        "test accuracy where val_top1 did not "
                        "(benchmarks/results/alpha_sweep.md)")
    p.add_argument("--perturbation-interval", type=int, default=1,
                   help="PBT: epochs between two exploit/explore decisions of a trial")
    p.add_argument("--quantile-fraction", type=float, default=0.25,
                   help="PBT: the bottom (and top) fraction of the trials that is exploited "
                        "(cloned)")
    p.add_argument("--grace-period", type=int, default=1,
                   help="ASHA: epochs every trial runs before it can be stopped")
    p.add_argument("--reduction-factor", type=int, default=2,
                   help="ASHA: about 1/this of the trials go on at each rung")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="at most this many trials at once (default: what the cluster holds)")
    p.add_argument("--name", default=None,
                   help="sweep name (default sweep-<job>-<time>); an existing sweep of this "
                        "name under --sweep-dir is resumed")
    p.add_argument("--sweep-dir", type=run_location, default=None,
                   help="sweep folder on a file system every node shares, or "
                        "s3://BUCKET/PREFIX (not with --scheduler pbt; endpoint: the job's "
                        "--s3-endpoint-url, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL): "
                        "Tune's state, each trial's run dir, the table (default "
                        "$LCCN_RUNS/sweep, else ~/lccn_runs/sweep)")
    p.add_argument("--seed", type=int, default=0, help="seed of Tune's random search")
    add_tracking_options(p, store="<sweep-dir>")
    p.add_argument("--smoke-test", action="store_true",
                   help="3 trials of the job's --smoke-test (2 CPU workers, 3 epochs)")
    p.add_argument("job_args", nargs="*",
                   help="after '--': options of the job (--data, --gpu, --num-workers, "
                        "--epochs, ...)")
    return p


def max_concurrent(*, gpu: bool, num_workers: int, cpus_per_worker: float) -> int:
    """Trials at once: the cluster's GPUs over a trial's GPUs with ``gpu``, else its CPUs
    over a trial's CPUs (>= 1)."""
    import ray

    res = ray.cluster_resources()
    if gpu:
        return max(1, int(res.get("GPU", 0)) // max(1, num_workers))
    return max(1, int(res.get("CPU", 0) // max(1e-9, num_workers * cpus_per_worker)))


def expected_trials(space: dict[str, Any], num_samples: int) -> int:
    """Trials Tune makes: ``num_samples`` times the product of the grid sizes."""
    grid = math.prod(len(spec["grid"]) for spec in space.values()
                     if isinstance(spec, dict) and "grid" in spec)
    return num_samples * grid


def resolve_space(args: argparse.Namespace) -> dict[str, Any]:
    name = args.space or args.job
    if name in SPACES:
        space = get_space(name)
    elif args.space and Path(args.space).suffix == ".json":
        try:
            space = load_space(args.space)
        except ValueError as e:
            raise SystemExit(f"error: --space {e}") from None
    else:
        raise SystemExit(f"error: --space {name!r}: neither a space ({sorted(SPACES)}) nor a "
                         f".json file")
    if args.alpha_grid:
        space = with_alpha_grid(space)

    try:  # every key names a config field, every value the configs accept
        for point in edge_points(space):
            apply_point(RunConfig(), point)
    except ValueError as e:
        raise SystemExit(f"error: --space {name}: the point {point}: {e}") from None
    return space


def edge_points(space: dict[str, Any]) -> list[dict[str, Any]]:
    """Points that between them hold every value of every grid and choice and both ends of
    every range (the other keys at a sampled value): what a sweep may run, checked before
    it starts."""
    base = sample_point(space, seed=0)
    points = [base]
    for key, spec in space.items():
        if not isinstance(spec, dict):
            continue
        kind, values = next(iter(spec.items()))
        if kind == "randint":
            values = [int(values[0]), int(values[1]) - 1]  # its upper end is exclusive
        elif kind in ("uniform", "loguniform"):  # drawn in [lo, hi): hi itself never is
            values = [values[0], math.nextafter(values[1], values[0])]
        points += [{**base, key: v} for v in values]
    return points


def default_num_samples(space: dict[str, Any], *, smoke: bool) -> int:
    """Samples of the space when --num-samples is not given: 8 (3 for --smoke-test) when a
    key is drawn at random, 1 when every key is a grid or a constant (the grid is the
    sweep; more samples would only repeat its points with the same job seed)."""
    if all(not isinstance(spec, dict) or "grid" in spec for spec in space.values()):
        return 1
    return 3 if smoke else 8


def inert_keys(space: dict[str, Any], method: str) -> list[str]:
    """Keys of ``space`` that ``method`` never reads: every ``lccn.*`` key for a method
    without a Gibbs chain, except ``lccn.xi``, the clip of every single-network method's
    loss (DivideMix's losses are not clipped); for a method with a chain, its ``ignores``
    (DivideLCCN trains on co-refined targets, so neither the LCCN target nor its ramp
    reaches it)."""
    return [k for k in space if not get_method(method).reads(k)]


def parent_tracker(tracking_uri: str, experiment: str, name: str, params: dict[str, Any]):
    """The sweep's parent MLflow run: the existing one of ``experiment`` (a resumed sweep)
    or a new one named ``name``."""
    from mlflow import MlflowClient


    client = MlflowClient(tracking_uri)
    run_id = None
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        found = client.search_runs([exp.experiment_id],
                                   filter_string=f"tags.{PARENT_TAG} = 'parent'")
        run_id = found[0].info.run_id if found else None
    tracker = Tracker(tracking_uri=tracking_uri, experiment=experiment, run_name=name,
                      run_id=run_id, tags={PARENT_TAG: "parent"})
    tracker.start(params)
    return tracker


def progress_rows(trial_dir: Path) -> list[dict[str, Any]]:
    """Every result of a trial from its ``progress.csv`` (Tune cuts ``result.json``, and
    the ResultGrid's history with it, back to the checkpoint a trial restarts from: after a
    PBT exploit that is another trial's); one row per epoch, a later report of an epoch
    replacing an earlier one (the exploited trial's new lineage)."""
    import pandas as pd

    path = trial_dir / "progress.csv"
    if not path.is_file():
        return []
    try:
        rows = pd.read_csv(path).to_dict("records")
    except (OSError, ValueError):
        return []
    by_epoch: dict[Any, dict[str, Any]] = {}
    for r in rows:
        by_epoch[r.get(TIME_ATTR)] = r
    return [by_epoch[k] for k in sorted(by_epoch, key=lambda v: (v != v, v))]


def with_epoch_configs(hist: list[dict[str, Any]], records: list[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
    """A PBT trial's per-epoch results with the config each epoch ran under as
    ``config/<key>`` columns (``progress.csv`` has none): the config of the trial's latest
    start (``pbt.jsonl``: a fresh start at epoch 0, an exploit at the cloned epoch n, which
    the epochs after n ran under) before the epoch's report, at an epoch before it."""
    records = sorted(records, key=lambda r: r.get("time", 0))
    out = []
    for row in hist:
        e, t = row.get(TIME_ATTR), row.get("timestamp")
        if not isinstance(e, (int, float)) or e != e:
            out.append(row)
            continue
        fits = [r for r in records if r["epoch"] < e and (
            not isinstance(t, (int, float)) or t != t or r.get("time", 0) <= t + 1)]
        row = dict(row)
        if fits:
            row.update({f"config/{k}": v for k, v in fits[-1]["config"].items()})
        out.append(row)
    return out


def trial_records(grid, *, epochs: int, sweep_dir: Path | None = None) -> list[dict[str, Any]]:
    """One dict per trial of the ResultGrid: ``trial_id``, ``config``, ``status``
    (finished / stopped early / error / unfinished: not run to its end, in an interrupted
    sweep), ``history`` (its per-epoch results, with the config each ran under where a PBT
    trial's log under ``sweep_dir`` says), ``error``."""
    tune_status = {Path(t.path).name: t.status for t in
                   getattr(getattr(grid, "_experiment_analysis", None), "trials", None) or []
                   if getattr(t, "path", None)}
    out = []
    for res in grid:
        trial_id = Path(res.path).name
        hist = []
        if res.metrics_dataframe is not None:
            hist = res.metrics_dataframe.to_dict("records")
        elif res.metrics:
            hist = [dict(res.metrics)]
        logged = progress_rows(Path(res.path))
        if len(logged) > len(hist):  # a trial restored from a checkpoint (PBT)
            hist = logged
        log = None if sweep_dir is None else sweep_dir / "trials" / trial_id / PBT_LOG_FILE
        if log is not None and log.is_file():
            hist = with_epoch_configs(hist, [json.loads(line) for line in
                                             log.read_text().splitlines() if line.strip()])
        done = max((int(r[TIME_ATTR]) for r in hist
                    if isinstance(r.get(TIME_ATTR), (int, float)) and r[TIME_ATTR] == r[TIME_ATTR]),
                   default=0)
        status = ("error" if res.error is not None else
                  "unfinished" if tune_status.get(trial_id, "TERMINATED") != "TERMINATED" else
                  "finished" if done >= epochs else "stopped early")
        out.append({"trial_id": trial_id, "config": dict(res.config or {}),
                    "status": status, "history": hist,
                    "error": None if res.error is None else str(res.error).splitlines()[0]})
    return out


def finish_tracking(tracker, rows: list[dict[str, Any]], *, out_dir: Path,
                    metric: str = METRIC) -> None:
    """Log the files of ``out_dir`` (the table as CSV and Markdown, the accuracy-vs-alpha
    plot) to the parent run, the best trial's accuracies as its metrics, and close the
    children: rank and status as tags, a trial stopped early ``KILLED``, an errored one
    ``FAILED``."""
    client = tracker.client
    for path in sorted(out_dir.iterdir()):
        client.log_artifact(tracker.run_id, str(path))
    best = rows[0] if rows and rows[0]["rank"] is not None else None
    tracker.log_metrics({"trials": len(rows),
                         "stopped_early": sum(r["status"] == "stopped early" for r in rows),
                         "errors": sum(r["status"] == "error" for r in rows),
                         f"best_{metric}": best[metric] if best else math.nan,
                         f"best_{REPORTED_BESIDE}": (best[REPORTED_BESIDE] if best and
                                                     best[REPORTED_BESIDE] is not None
                                                     else math.nan)}, step=0)
    by_trial = {r["trial_id"]: r for r in rows}
    children = client.search_runs([tracker.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{tracker.run_id}'",
                                  order_by=["attributes.start_time DESC"])
    seen = set()
    for child in children:  # newest first
        trial_id = child.data.tags.get("tune.trial_id")
        row = by_trial.get(trial_id)
        if row is None:
            continue
        if trial_id in seen:  # a run the trial started before an interruption and restarted
            client.set_tag(child.info.run_id, "tune.superseded", "true")
            if child.info.status == "RUNNING":
                client.set_terminated(child.info.run_id, status="KILLED")
            continue
        seen.add(trial_id)
        client.set_tag(child.info.run_id, "tune.status", row["status"])
        if row["rank"] is not None:
            client.set_tag(child.info.run_id, "tune.rank", str(row["rank"]))
        if child.info.status == "RUNNING" and row["status"] != "finished":
            client.set_terminated(child.info.run_id,
                                  status="FAILED" if row["status"] == "error" else "KILLED")
    tracker.end("FINISHED")


class ReleasePlacementGroups(Callback):
    """Tune callback of the driver: every few seconds and when a trial ends, remove the
    placement groups of Train runs whose controller was killed with its trial (a trial ASHA
    stopped), so that their CPUs/GPUs go to the next trial
    (:func:`pipeline.cluster.ray_train.release_orphaned_placement_groups`)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.last = every_s, 0.0

    def _release(self) -> None:
        self.last = time.monotonic()
        removed = release_orphaned_placement_groups()
        if removed:
            print(f"[sweep] released {len(removed)} placement group(s) of stopped trials",
                  flush=True)

    def on_step_begin(self, iteration, trials, **info) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self._release()

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._release()


def main(argv: list[str] | None = None, *, callbacks: list[Any] | None = None
         ) -> dict[str, Any]:
    """Run (or resume) the sweep; returns ``{"name", "sweep_dir", "metric", "mode",
    "complete", "restored", "expected_trials", "trials": ranked table rows, "best_config",
    "best_metric", "best_test_top1", "errors", "parent_run_id", "table"}``. ``callbacks``:
    Tune callbacks of a new sweep (a restored one keeps those it was started with)."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    args = get_args_parser().parse_args(argv)
    metric, mode = args.metric, RANKING[args.metric]
    job_argv = list(args.job_args) + (["--smoke-test"] if args.smoke_test else [])
    job_args = parse_job_args(args.job, job_argv)  # refuses a bad job option now
    probe = copy.deepcopy(job_args)  # the trials' run options and schedule
    if probe.smoke_test:
        apply_smoke(probe)
    epochs = get_job(args.job).config(probe).run.optim.epochs
    if job_args.val_fraction <= 0:
        raise SystemExit("error: a sweep ranks trials on the noisy validation split: give the "
                         "job --val-fraction > 0 (default 0.05)")
    space = resolve_space(args)
    inert = inert_keys(space, job_args.method)
    if args.scheduler == "pbt":  # PBT's mutations name their keys: those stay
        inert = [k for k in inert if k not in pbt.MUTATIONS]
    if inert:  # dropped: columns that vary nothing, grids that only repeat trials
        print(f"[sweep] note: --method {job_args.method} does not read {', '.join(inert)}: "
              f"left out of the space", flush=True)
        space = {k: v for k, v in space.items() if k not in inert}
    if args.scheduler == "pbt":
        space = pbt.pbt_space(space)  # (adds the mutated keys it lacks: drawn at random)
    num_samples = args.num_samples or default_num_samples(space, smoke=args.smoke_test)
    if num_samples > 1 and default_num_samples(space, smoke=False) == 1:
        print(f"[sweep] note: every key is a grid or a constant: each of the {num_samples} "
              f"samples of a grid point is the same run", flush=True)
    n_trials = expected_trials(space, num_samples)
    name = args.name or f"sweep-{args.job}-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir = normal_run_dir(args.sweep_dir or default_run_dir("sweep"))
    endpoint = storage.endpoint(getattr(job_args, "s3_endpoint_url", None))
    if endpoint and hasattr(job_args, "s3_endpoint_url"):
        job_args.s3_endpoint_url = endpoint  # every trial's, whatever its node's environment
    if storage.is_remote(sweep_dir):
        if args.scheduler == "pbt":
            raise SystemExit(f"error: --sweep-dir {sweep_dir}: a PBT sweep hands checkpoints "
                             f"between trials on a shared file system; give one, or use "
                             f"--scheduler asha or fifo with object storage")
        problem = storage.check_bucket(sweep_dir, endpoint_url=endpoint)
        if problem:
            raise SystemExit(f"error: {problem}")
    else:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    try:
        tracking = tracking_uri_of(args, sweep_dir)
    except ValueError as e:
        raise SystemExit(f"error: --sweep-dir {e}") from None
    # data a job converts once for every trial: on this machine's disk
    local = local_mirror(sweep_dir, "sweep") if storage.is_remote(sweep_dir) else sweep_dir
    for line in prepare_job_data(args.job, job_args, local):
        print(line, flush=True)
    experiment = f"lccn-sweep-{name}"
    tune_fs, tune_root = storage.filesystem(storage.join(sweep_dir, "tune"),
                                            endpoint_url=endpoint)
    tune_fs = tune_fs if storage.is_remote(sweep_dir) else None
    exp_path = f"{tune_root}/{name}"
    restored = tune.Tuner.can_restore(exp_path, storage_filesystem=tune_fs)

    tracker = None
    if tracking:
        tracker = parent_tracker(tracking, experiment, name, {"sweep": {
            "job": args.job, "space": json.dumps(space, sort_keys=True),
            "num_samples": num_samples, "trials": n_trials, "scheduler": args.scheduler,
            "grace_period": args.grace_period, "reduction_factor": args.reduction_factor,
            "perturbation_interval": args.perturbation_interval,
            "quantile_fraction": args.quantile_fraction,
            "metric": metric, "mode": mode, "seed": args.seed,
            "job_args": " ".join(redact_args(job_argv))}})
    started = connect_ray()
    try:
        concurrent = max_concurrent(gpu=probe.gpu, num_workers=probe.num_workers,
                                    cpus_per_worker=probe.cpus_per_worker)
        if args.max_concurrent:
            concurrent = max(1, min(concurrent, args.max_concurrent))
        fn = functools.partial(pbt.run_trial if args.scheduler == "pbt" else run_trial,
                               job=args.job, job_args=job_args,
                               sweep_dir=str(sweep_dir), tracking_uri=tracking,
                               experiment=experiment,
                               parent_run_id=tracker.run_id if tracker else None)
        trainable = tune.with_resources(fn, {"cpu": 0, "memory": TRIAL_MEMORY})
        print(f"[sweep] {name}: {'resuming, ' if restored else ''}{n_trials} trials of "
              f"{args.job} ({epochs} epochs each), at most {concurrent} at once, "
              f"{args.scheduler} on {metric} ({mode}); in {sweep_dir}; MLflow "
              f"{redact_uri(tracking) or 'off'}", flush=True)
        if restored:
            tuner = tune.Tuner.restore(exp_path, trainable=trainable,
                                       resume_unfinished=True, resume_errored=True,
                                       storage_filesystem=tune_fs)
        else:
            # max_t one past the last epoch: ASHA never stops a trial at its last epoch,
            # which would kill its Train run before it writes its final results
            if args.scheduler == "asha":
                scheduler = ASHAScheduler(time_attr=TIME_ATTR, max_t=epochs + 1,
                                          grace_period=args.grace_period,
                                          reduction_factor=args.reduction_factor)
            elif args.scheduler == "pbt":
                scheduler = pbt.make_scheduler(max_t=epochs, fits=n_trials <= concurrent,
                                               interval=args.perturbation_interval,
                                               quantile=args.quantile_fraction,
                                               seed=args.seed)
            else:
                scheduler = FIFOScheduler()
            tuner = tune.Tuner(
                trainable, param_space=to_tune(space),
                tune_config=tune.TuneConfig(
                    metric=metric, mode=mode, num_samples=num_samples, scheduler=scheduler,
                    # the random search caps concurrency itself (Tune ignores
                    # max_concurrent_trials for a SearchGenerator)
                    search_alg=BasicVariantGenerator(random_state=args.seed,
                                                     max_concurrent=concurrent),
                    trial_name_creator=lambda t: t.trial_id,
                    trial_dirname_creator=lambda t: t.trial_id),
                run_config=tune.RunConfig(name=name, storage_path=tune_root,
                                          storage_filesystem=tune_fs,
                                          # PBT: keep every trial checkpoint (a cloned one
                                          # must outlive the clone's restart)
                                          checkpoint_config=tune.CheckpointConfig(
                                              num_to_keep=None),
                                          callbacks=[ReleasePlacementGroups(),
                                                     *(callbacks or [])]))
        grid = tuner.fit()
    finally:
        if started:
            ray.shutdown()

    complete = grid.num_terminated + grid.num_errors >= n_trials
    rows = rank_trials(trial_records(grid, epochs=epochs,
                                     sweep_dir=None if storage.is_remote(sweep_dir) else sweep_dir),
                       metric)
    best = rows[0] if rows and rows[0]["rank"] is not None else None
    out = {"name": name, "sweep_dir": str(sweep_dir), "metric": metric, "mode": mode,
           "complete": complete, "restored": restored, "expected_trials": n_trials,
           "trials": rows, "errors": grid.num_errors,
           "best_config": None if best is None else
           {k: best[k] for k in space if k in best},
           "best_metric": None if best is None else best[metric],
           "best_test_top1": None if best is None else best[REPORTED_BESIDE],
           "parent_run_id": tracker.run_id if tracker else None, "table": None}
    for r in rows:
        print(f"[sweep] #{r['rank'] or '-'} {r['trial_id']} {r['status']:13s} "
              f"epochs {r[TIME_ATTR]}  {metric} {_fig(r[metric])}  ({REPORTED_BESIDE} "
              f"{_fig(r[REPORTED_BESIDE])})  {json.dumps({k: r.get(k) for k in space})}",
              flush=True)
    if not complete:
        print(f"[sweep] {name}: interrupted with {grid.num_terminated + grid.num_errors} of "
              f"{n_trials} trials done; run the same command again (same --name and "
              f"--sweep-dir) to finish it", flush=True)
        if tracker is not None:
            tracker.end("KILLED")
        return out
    with storage.staged(storage.join(sweep_dir, name), endpoint_url=endpoint) as out_dir:
        (out_dir / "results.csv").write_text(to_csv(rows))
        (out_dir / "results.md").write_text(to_markdown(rows, title=f"Sweep {name} ({args.job})",
                                                        metric=metric))
        fig = plots.accuracy_vs(rows, x_key="lccn.alpha", keys=(METRIC, REPORTED_BESIDE),
                                title=f"{name}: the selected epoch of each trial")
        fig.savefig(out_dir / "accuracy_vs_alpha.png", dpi=100)
        fig.clear()
        out["table"] = str(storage.join(sweep_dir, name, "results.md"))
        if tracker is not None:
            finish_tracking(tracker, rows, out_dir=out_dir, metric=metric)
    print(f"[sweep] best by {metric}: {_fig(out['best_metric'])} ({REPORTED_BESIDE} "
          f"{_fig(out['best_test_top1'])}): {out['best_config']}; table {out['table']}",
          flush=True)
    storage.write_text(storage.join(sweep_dir, f"{name}.json"),
                       json.dumps(out, indent=1, default=str), endpoint_url=endpoint)
    return out


def _fig(value: Any) -> str:
    """A printed figure: four significant digits (the JSON and tables keep every digit)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
