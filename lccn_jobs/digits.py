"""The job of the distributed quickstart (``jobs/quickstart_ray.py``): the shipped digits
written as shards, pair-flip noise as a label view, LCCN and then the cross-entropy
baseline on the same data and schedule, on Ray.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from lccn_jobs.cli import add_common_args, local_data_note, work_dir
from lccn_jobs.configs import check_transition_file, job_config, prepare, trusted_spec
from lccn_jobs.driver import Job, JobRun, connect_ray, dist_config, run_job
from lccn_jobs.recipes import RECIPES
from lccn_jobs.sources import manifest_classes
from pipeline.core.labels import LabelView
from pipeline.core.noise import CIFAR10_ASYM_MAP, apply_trusted, pair_flip
from pipeline.data.digits import DIGIT_CLASSES, load_digits_arrays, split_indices
from pipeline.data.split_labels import read_split_labels
from shards.writer import SampleRecord, WriterOptions, write_split

_DOC = """Quickstart of the distributed stack: LCCN vs cross-entropy on scikit-learn's handwritten
digits with asymmetric label noise, two Ray Train workers, the confusion actor and MLflow.

Writes the shipped digits (1,797 8x8 images) as WebDataset shards (8x8 grayscale PNG) under
the run dir, puts a label view with pair-flip noise over the training split (the CIFAR-10
asymmetric map on digit indices: 9->1, 2->0, 4->7, 3->5; the same noise as
``jobs/quickstart.py``), and trains a small CNN twice: LCCN (CE pre-training, then LCCN with
C and z in the confusion actor) and the plain cross-entropy baseline with the same model,
data and schedule. Prints one line per epoch, the learned vs the true transition and, at
the end, the clean test accuracy of both; metrics, heat maps and checkpoints go to MLflow
(``sqlite:///<run-dir>/mlflow.db`` unless MLFLOW_TRACKING_URI is set).

What ``--rate`` means: each training sample of the four flipped classes (9, 2, 4, 3) gets
its pair's label with probability r; the other six classes are never flipped. So r = 0.4
makes 40% of those four classes wrong and about 0.4 x 4/10 = 16% of all labels (14.9%
realised with seed 0).

    python jobs/quickstart_ray.py [--rate 0.4] [--epochs 30] [--run-dir DIR] [--no-baseline]
    ray job submit --working-dir . -- python jobs/quickstart_ray.py --run-dir /abs/dir
    mlflow ui --backend-store-uri sqlite:///<run-dir>/mlflow.db
"""

JOB = "quickstart_ray"
DATASET = "digits"


def write_digits_shards(out: Path, *, seed: int, shard_size: int = 100) -> tuple[Path, Path]:
    """The digits as ``out/train`` (70%, stratified by ``seed``) and ``out/test`` (30%)
    shards: 8x8 grayscale PNG (pixel = 16 x the 0..16 intensity, capped at 255),
    ``label`` = ``clean`` = the digit. Reuses splits already written there."""
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=seed)
    for split, rows in (("train", tr), ("test", te)):
        if (out / split / "manifest.json").is_file():
            continue
        px = np.minimum(images[rows].astype(np.int64) * 16, 255).astype(np.uint8)
        records = [SampleRecord(idx=i, label=int(labels[r]), clean=int(labels[r]),
                                key=f"digits/{int(r):04d}", pixels=px[i])
                   for i, r in enumerate(rows)]
        write_split(records, out, dataset="digits", split=split, classes=DIGIT_CLASSES,
                    options=WriterOptions(shard_size=shard_size, progress=False),
                    source={"sklearn.datasets.load_digits": {"seed": seed, "rows": len(rows)}})
    return out / "train", out / "test"


def digits_view(train_dir: Path, *, rate: float, seed: int) -> LabelView:
    """Pair-flip noise at ``rate`` over the training split's clean labels (idx order)."""
    clean = read_split_labels(train_dir)["label"]
    return pair_flip(clean, 10, CIFAR10_ASYM_MAP, rate, seed=seed)


def noise_note(view: LabelView, rate: float) -> str:
    """What the noise rate means for this view: the rate within the flipped classes and
    overall, expected and realised."""
    src = np.array(sorted(CIFAR10_ASYM_MAP))
    in_src = np.isin(view.clean, src)
    wrong = view.observed != view.clean
    share = float(in_src.mean())
    return (f"noise: rate {rate:g} flips each sample of classes {', '.join(map(str, src))} "
            f"to its pair ({', '.join(f'{a}->{b}' for a, b in sorted(CIFAR10_ASYM_MAP.items()))}); "
            f"realised {wrong[in_src].mean():.3f} within those classes, "
            f"{wrong.mean():.3f} of all labels (expected {rate:g} x {share:.2f} = "
            f"{rate * share:.3f}: the other classes are never flipped)")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_DOC.split("\n\n", 1)[1])
    p.add_argument("--rate", type=float, default=0.4,
                   help="flip probability within the four flipped classes (about 0.4 x r "
                        "of all labels, see below)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="also train the cross-entropy baseline and print it beside LCCN "
                        "(default: on, off with --smoke-test)")
    add_common_args(p, job=JOB, dataset=DATASET, method=RECIPES[DATASET].method)
    p.set_defaults(loader_workers=0, shuffle_buffer=200)
    return p


def comparison(lccn: dict, ce: dict | None, *, epochs: int) -> list[str]:
    """The closing lines: clean test accuracy of LCCN beside CE, and where to look."""
    top = {name: (s or {}).get("metrics", {}).get("test_top1") for name, s in
           (("lccn", lccn), ("ce", ce))}
    lines = []
    if ce is not None and top["ce"] is not None and top["lccn"] is not None:
        lines.append(f"[{JOB}] clean test accuracy after {epochs} epochs: CE {top['ce']:.3f}  "
                     f"LCCN {top['lccn']:.3f}  ({100 * (top['lccn'] - top['ce']):+.1f} points)")
    elif top["lccn"] is not None:
        lines.append(f"[{JOB}] clean test accuracy after {epochs} epochs: LCCN "
                     f"{top['lccn']:.3f} (no CE baseline run)")
    uri = lccn.get("tracking_uri")
    if uri:
        cmd = (f"{mlflow_command()} ui --backend-store-uri {uri}" if uri.startswith("sqlite:")
               else f"open {uri}")
        lines.append(f"[{JOB}] look at the runs (experiment {lccn.get('experiment')!r}): {cmd}")
    return lines


def mlflow_command() -> str:
    """The mlflow of this interpreter's environment (``.venv/bin/mlflow`` as a path relative
    to the working directory where it lies under it), so that the printed command works
    from a shell that has not activated the environment."""
    exe = Path(sys.executable).parent / "mlflow"
    if not exe.exists():
        return "mlflow"
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def prepare_run(args: argparse.Namespace) -> JobRun:
    """Parsed arguments -> the LCCN run's configs and label view (digits shards written,
    nothing trained yet; the CE baseline is not part of it)."""
    cfg, log = prepare(args, job=JOB, dataset=DATASET)
    if args.smoke_test:
        log = [f"[{JOB}] --smoke-test: 2 CPU workers, 3 epochs (1 CE), global batch 64, "
               f"a checkpoint every {args.checkpoint_every} steps"]
    data = work_dir(args, JOB) / "data" / f"digits-seed{args.seed}"
    train, test = write_digits_shards(data, seed=args.seed)
    view = digits_view(train, rate=args.rate, seed=args.seed)
    trusted = trusted_spec(args)
    if trusted is not None:  # LCCN+: the trusted subset of the digits (keys: their file names)
        try:
            keys = list(read_split_labels(train)["key"]) if "keys" in trusted else None
            view = apply_trusted(view, trusted, keys=keys)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        log.append(f"[{JOB}] LCCN+: {int(view.trusted.sum())} trusted digits")
    log.append(f"[{JOB}] {len(view)} training digits; shards in {data}")
    log += local_data_note(args, JOB, data)
    log.append(f"[{JOB}] {noise_note(view, args.rate)}")
    dist = dist_config(args, cfg, run_name=args.run_name, train=str(train), test=str(test),
                       class_names=list(manifest_classes(str(train))),
                       transform=cfg.recipe.transform)
    return JobRun(run=cfg.run, dist=dist, view=view, log=log)


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    jr = prepare_run(args)
    baseline = (not args.smoke_test) if args.baseline is None else args.baseline
    started = connect_ray()  # one Ray for both runs
    try:
        check_transition_file(jr.run, jr.view.num_classes)
        summary = run_job(args, job=JOB, run=jr.run, dist=jr.dist, view=jr.view,
                          log=jr.lines())
        summary["experiment"] = args.experiment
        ce = None
        if baseline and args.method == "lccn":
            args.method = "ce"
            cfg = job_config(args, DATASET)
            dist_ce = dist_config(args, cfg, run_name=f"{args.run_name}-ce",
                                  train=jr.dist.train_source, test=jr.dist.test_source,
                                  class_names=list(jr.dist.class_names),
                                  transform=cfg.recipe.transform)
            ce = run_job(args, job=JOB, run=cfg.run, dist=dist_ce, view=jr.view,
                         log=[f"[{JOB}] the cross-entropy baseline: same model, data and "
                              f"schedule"])
            args.method = "lccn"
    finally:
        if started:
            import ray

            ray.shutdown()
    summary["baseline"] = ce
    for line in comparison(summary, ce, epochs=jr.run.optim.epochs):
        print(line, flush=True)
    return summary


class DigitsJob(Job):
    """:func:`main`, :func:`get_args_parser` and :func:`prepare_run` as a
    :class:`~lccn_jobs.driver.Job` (what a sweep runs)."""

    name = JOB

    def get_args_parser(self) -> argparse.ArgumentParser:
        return get_args_parser()

    def dataset_of(self, args: argparse.Namespace) -> str:
        return DATASET

    def prepare_run(self, args: argparse.Namespace) -> JobRun:
        return prepare_run(args)

    def main(self, argv: list[str] | None = None) -> dict:
        return main(argv)


DIGITS = DigitsJob()
