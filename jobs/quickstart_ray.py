"""Quickstart of the distributed stack: LCCN on scikit-learn's handwritten digits with 40%
asymmetric label noise, two Ray Train workers, the confusion actor and MLflow.

Writes the shipped digits (1,797 8x8 images) as WebDataset shards (8x8 grayscale PNG) under
the run dir, puts a label view with pair-flip noise over the training split (the CIFAR-10
asymmetric map on digit indices: 9->1, 2->0, 4->7, 3->5 at rate r; the same noise as
``jobs/quickstart.py``), and trains a small CNN: CE pre-training, then LCCN with C and z in
the confusion actor. A few minutes on 2 CPU cores. Prints the learned vs the true
transition; metrics, heat maps and the checkpoint go to MLflow (``sqlite:///<run-dir>/mlflow.db``
unless MLFLOW_TRACKING_URI is set)::

    python jobs/quickstart_ray.py [--rate 0.4] [--epochs 30] [--run-dir DIR]
    ray job submit --working-dir . -- python jobs/quickstart_ray.py --run-dir /abs/dir
    mlflow ui --backend-store-uri sqlite:///<run-dir>/mlflow.db
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from pipeline.digits import DIGIT_CLASSES, load_digits_arrays, split_indices  # noqa: E402
from pipeline.labels import LabelView  # noqa: E402
from pipeline.noise import CIFAR10_ASYM_MAP, pair_flip  # noqa: E402

JOB = "quickstart_ray"
PRESET = common.PRESETS["digits"]


def write_digits_shards(out: Path, *, seed: int, shard_size: int = 100) -> tuple[Path, Path]:
    """The digits as ``out/train`` (70%, stratified by ``seed``) and ``out/test`` (30%)
    shards: 8x8 grayscale PNG (pixel = 16 x the 0..16 intensity, capped at 255),
    ``label`` = ``clean`` = the digit. Reuses splits already written there."""
    from shards.writer import SampleRecord, WriterOptions, write_split

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
    from shards.labelview import read_split_labels

    clean = read_split_labels(train_dir)["label"]
    return pair_flip(clean, 10, CIFAR10_ASYM_MAP, rate, seed=seed)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rate", type=float, default=0.4, help="asymmetric noise rate r")
    common.add_common_args(p, PRESET, job=JOB)
    p.set_defaults(loader_workers=0, shuffle_buffer=200)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    log = common.prepare(args, job=JOB, preset=PRESET)
    if args.smoke_test:  # the digits are tiny already: only fewer epochs
        log = [f"[{JOB}] --smoke-test: 2 CPU workers, 3 epochs (1 CE), global batch 64, "
               f"a checkpoint every {args.checkpoint_every} steps"]
    data = args.run_dir / "data" / f"digits-seed{args.seed}"
    train, test = write_digits_shards(data, seed=args.seed)
    view = digits_view(train, rate=args.rate, seed=args.seed)
    log.append(f"[{JOB}] {len(view)} training digits, realised noise rate "
               f"{view.noise_rate():.3f}; shards in {data}")
    run = common.run_config(args)
    dist = common.dist_config(args, run_name=args.run_name, train=str(train), test=str(test),
                              class_names=list(common.manifest_classes(str(train))),
                              transform=PRESET.transform)
    return common.run_job(args, job=JOB, run=run, dist=dist, view=view, log=log)


if __name__ == "__main__":
    main()
