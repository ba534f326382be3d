"""LCCN on CIFAR-10 / CIFAR-100 with synthetic label noise, on Ray Train.

The paper's CIFAR recipe (Sec. 5): PreAct ResNet-32, SGD momentum 0.9, weight decay 5e-4,
global batch 128, 120 epochs with lr 0.5 / 0.1 / 0.01 split at epochs 40 and 80; alpha 1;
warm-up of 20,000 steps with the Eq. 8 transition (CIFAR-10) or the identity (CIFAR-100).
Our choice: the first 40 epochs (the lr 0.5 phase) are the cross-entropy pre-training.
Noise is a label view over one set of shards (``python -m shards cifar10 SRC --out DIR``).

    python jobs/cifar_lccn.py --data DIR/cifar10 [--dataset cifar10] \\
        [--noise '{"kind": "asymmetric", "rate": 0.4, "seed": 0}'] [--num-workers 2] [--gpu]
    ray job submit --working-dir . -- python jobs/cifar_lccn.py --data /abs/cifar10 --run-dir /abs/runs
    python jobs/cifar_lccn.py --smoke-test        # 2 CPU workers, generated 32x32 images
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from shards.labelview import CIFAR10_CLASSES  # noqa: E402

JOB = "cifar_lccn"
NOISE = {"cifar10": '{"kind": "asymmetric", "rate": 0.4, "seed": 0}',
         "cifar100": '{"kind": "cifar100_superclass", "rate": 0.4, "seed": 0}'}
# the smoke test's noise is --noise (default: CIFAR-10's), e.g. an open-set view for LCCN*
SMOKE = common.SmokeData(dataset="cifar10", num_classes=10, size=(32, 32),
                         classes=CIFAR10_CLASSES)


def get_args_parser() -> argparse.ArgumentParser:
    head, tail = __doc__.split("\n\n", 1)
    p = common.dataset_parser(job=JOB, preset=common.PRESETS["cifar10"], description=head,
                              epilog=tail, noise_default=NOISE["cifar10"] + " (cifar10), "
                              + NOISE["cifar100"] + " (cifar100)",
                              train_split="train", test_split="test")
    p.add_argument("--dataset", choices=("cifar10", "cifar100"), default="cifar10",
                   help="picks the warm-up (anchor / identity) and the default noise")
    p.set_defaults(warmup=None, noise=None)
    return p


def prepare_run(args: argparse.Namespace) -> common.JobRun:
    """Parsed arguments -> the run's configs and label view (nothing trained yet)."""
    dataset = "cifar10" if args.smoke_test else args.dataset
    preset = common.PRESETS[dataset]
    args.dataset = dataset
    common.resolve_recipe(args)
    if args.noise is None:
        args.noise = NOISE[dataset]
    log = [f"[{JOB}] {dataset}: warm-up transition {args.warmup}"]
    if args.smoke_test and args.dataset != "cifar10":
        log.append(f"[{JOB}] --smoke-test runs the CIFAR-10 recipe on generated images")
    return common.dataset_setup(args, job=JOB, preset=preset, smoke=SMOKE, extra_log=log)


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    jr = prepare_run(args)
    return common.run_job(args, job=JOB, run=jr.run, dist=jr.dist, view=jr.view, log=jr.lines())


if __name__ == "__main__":
    main()
