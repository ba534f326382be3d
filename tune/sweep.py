"""Ray Tune sweep over the LCCN quickstart: each trial builds and fits the same
``TorchTrainer`` as ``jobs/quickstart_ray.py`` (through :func:`jobs.common.run_job`, i.e.
:func:`pipeline.ray_train.fit_distributed`) with a sampled point of a search space
(:mod:`tune.search_spaces`) put into its RunConfig.

Layout (``--sweep-dir``, absolute)::

    <sweep-dir>/tune/<name>/<trial_id>/     Tune's trial folders (trials named by trial id)
    <sweep-dir>/trials/<trial_id>/          the trial's run dir: shards, Ray Train storage,
                                            results/<trial_id>.json
    <sweep-dir>/mlflow.db                   one MLflow store; experiment ``lccn-sweep-<name>``,
                                            one MLflow run per trial, named by trial id

Trials are ranked by one metric, ``test_top1`` (max), the final test top-1 of the trial's
run. The Tune function reports once, after ``fit()`` (mid-epoch checkpoint reports carry no
test metric, so Train reports are not forwarded). At most ``max(1, GPUs // workers)`` trials
run at once with ``--gpu``, one on the CPU. The trial driver asks for no CPU (only memory,
``{"cpu": 0}`` alone is refused) so that its two Train workers fit on a 2-CPU machine.

    python -m tune.sweep --smoke-test [--sweep-dir DIR]      # 2 trials of the digits smoke
    python -m tune.sweep --num-samples 8 -- --epochs 30      # after "--": quickstart options

Only the ``digits`` space is wired to a job so far; the other spaces are data for the
dataset jobs (``jobs/cifar_lccn.py`` ...).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "jobs"))
sys.path.insert(0, str(REPO))

from tune.search_spaces import METRIC, MODE, SPACES, apply_point, get_space  # noqa: E402

TRIAL_MEMORY = 256 * 1024**2  # bytes the trial driver reserves (it takes no CPU)


def run_trial(config: dict[str, Any], *, job_argv: list[str], sweep_dir: str,
              tracking_uri: str | None, experiment: str) -> None:
    """Tune function trainable: one quickstart run with ``config`` (a sampled point, keys
    like ``"lccn.alpha"``) applied to its RunConfig. Reports ``{METRIC: ...}`` and the run's
    other final float metrics once, after ``fit()``."""
    import ray.tune

    for path in (str(REPO), str(REPO / "jobs")):  # pickled by value when run as __main__
        if path not in sys.path:
            sys.path.insert(0, path)
    import common
    import quickstart_ray as qs

    trial_id = ray.tune.get_context().get_trial_id()
    argv = list(job_argv) + ["--run-dir", str(Path(sweep_dir) / "trials" / trial_id),
                             "--run-name", trial_id, "--experiment", experiment]
    argv += ["--tracking-uri", tracking_uri] if tracking_uri else ["--no-tracking"]
    args = qs.get_args_parser().parse_args(argv)
    log = common.prepare(args, job=qs.JOB, preset=qs.PRESET)
    data = args.run_dir / "data" / f"digits-seed{args.seed}"
    train, test = qs.write_digits_shards(data, seed=args.seed)
    view = qs.digits_view(train, rate=args.rate, seed=args.seed)
    run = apply_point(common.run_config(args), config)
    log.append(f"[sweep] trial {trial_id}: {json.dumps(config, default=str)} -> lccn "
               f"{run.lccn}")
    dist = common.dist_config(args, run_name=trial_id, train=str(train), test=str(test),
                              class_names=common.manifest_classes(str(train)),
                              transform=qs.PRESET.transform)
    summary = common.run_job(args, job=qs.JOB, run=run, dist=dist, view=view, log=log)
    metrics = {k: float(v) for k, v in summary["metrics"].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if METRIC not in metrics:
        raise RuntimeError(f"trial {trial_id}: the run reported no {METRIC!r} (got "
                           f"{sorted(metrics)}); is there a test split?")
    metrics["seconds"] = float(summary["seconds"])
    ray.tune.report(metrics)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dataset", choices=sorted(SPACES), default="digits",
                   help="search space (and job) to sweep; only digits runs so far")
    p.add_argument("--num-samples", type=int, default=8, help="trials")
    p.add_argument("--name", default=None, help="sweep name (default sweep-<dataset>-<time>)")
    p.add_argument("--sweep-dir", type=Path, default=None,
                   help="absolute sweep folder (default $LCCN_RUNS or ~/lccn_runs/sweep)")
    p.add_argument("--seed", type=int, default=0, help="seed of Tune's random search")
    p.add_argument("--gpu", action="store_true", help="trials train on GPUs (passes --gpu)")
    p.add_argument("--num-workers", type=int, default=2, help="Ray Train workers per trial")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow URI (default sqlite:///<sweep-dir>/mlflow.db)")
    p.add_argument("--no-tracking", action="store_true")
    p.add_argument("--smoke-test", action="store_true",
                   help="2 trials of the digits quickstart --smoke-test on the CPU")
    p.add_argument("job_args", nargs="*", help="after '--': options of jobs/quickstart_ray.py")
    return p


def max_concurrent(*, gpu: bool, num_workers: int) -> int:
    """Trials at once: the GPUs of the cluster over the GPUs a trial takes (>= 1); 1 on CPU."""
    import ray

    if not gpu:
        return 1
    return max(1, int(ray.cluster_resources().get("GPU", 0)) // max(1, num_workers))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep; returns ``{"name", "sweep_dir", "metric", "mode", "best_config",
    "best_metric", "trials": [{"trial_id", "config", METRIC, "error"}], "errors": int}``."""
    import common
    import ray
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from pipeline.tracking import default_tracking_uri

    args = get_args_parser().parse_args(argv)
    if args.dataset != "digits":
        raise SystemExit(f"error: --dataset {args.dataset}: only the digits quickstart is wired "
                         f"to a sweep so far (the {args.dataset} space is in "
                         f"tune/search_spaces.py)")
    if args.smoke_test:
        args.num_samples, args.gpu = 2, False
    job_argv = list(args.job_args) + ["--num-workers", str(args.num_workers)]
    job_argv += ["--smoke-test"] if args.smoke_test else []
    job_argv += ["--gpu"] if args.gpu else []
    name = args.name or f"sweep-{args.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir = (args.sweep_dir or common.default_run_dir("sweep")).expanduser().resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    tracking = None if args.no_tracking else (args.tracking_uri or default_tracking_uri(sweep_dir))
    space = get_space(args.dataset)

    started = common.connect_ray()
    try:
        concurrent = max_concurrent(gpu=args.gpu, num_workers=args.num_workers)
        print(f"[sweep] {name}: {args.num_samples} trials of {args.dataset}, at most "
              f"{concurrent} at once, metric {METRIC} ({MODE}); in {sweep_dir}; MLflow "
              f"{tracking or 'off'}", flush=True)
        fn = functools.partial(run_trial, job_argv=job_argv, sweep_dir=str(sweep_dir),
                               tracking_uri=tracking, experiment=f"lccn-sweep-{name}")
        tuner = tune.Tuner(
            tune.with_resources(fn, {"cpu": 0, "memory": TRIAL_MEMORY}),
            param_space=space,
            tune_config=tune.TuneConfig(
                metric=METRIC, mode=MODE, num_samples=args.num_samples,
                # the random search caps concurrency itself (Tune ignores
                # max_concurrent_trials for a SearchGenerator)
                search_alg=BasicVariantGenerator(random_state=args.seed,
                                                 max_concurrent=concurrent),
                trial_name_creator=lambda t: t.trial_id,
                trial_dirname_creator=lambda t: t.trial_id),
            run_config=tune.RunConfig(name=name, storage_path=str(sweep_dir / "tune")))
        grid = tuner.fit()
    finally:
        if started:
            ray.shutdown()

    trials = []
    for res in grid:
        trials.append({"trial_id": (res.metrics or {}).get("trial_id"),
                       "config": dict(res.config or {}),
                       METRIC: (res.metrics or {}).get(METRIC),
                       "error": None if res.error is None else str(res.error)})
    done = [t for t in trials if isinstance(t[METRIC], float) and not math.isnan(t[METRIC])]
    best = max(done, key=lambda t: t[METRIC]) if done else None
    out = {"name": name, "sweep_dir": str(sweep_dir), "metric": METRIC, "mode": MODE,
           "best_config": None if best is None else best["config"],
           "best_metric": None if best is None else best[METRIC],
           "trials": trials, "errors": grid.num_errors}
    for t in trials:
        print(f"[sweep] trial {t['trial_id']}: {METRIC} {t[METRIC]}  {t['config']}"
              + (f"  ERROR {t['error'].splitlines()[0]}" if t["error"] else ""), flush=True)
    print(f"[sweep] best {METRIC} {out['best_metric']}: {out['best_config']}", flush=True)
    (sweep_dir / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
