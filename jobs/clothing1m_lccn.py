"""LCCN on Clothing1M (real web-label noise), on Ray Train.

The paper's Clothing1M recipe (Sec. 5): ResNet-50 from ImageNet weights, SGD momentum 0.9,
weight decay 1e-3, global batch 32, lr 0.001 fixed for 5 epochs, warm-up of 40,000 steps
with the Eq. 8 transition, power annealing max(exp(-0.8 step/max_step), 0.5) on. Our choice:
1 of the 5 epochs is the cross-entropy pre-training. Trains on the noisy split's web labels
(the label view ``{"kind": "dataset"}``) and evaluates on the clean test split, from shards
made by ``python -m shards clothing1m SRC --out DIR``.

    python jobs/clothing1m_lccn.py --data DIR/clothing1m [--num-workers 8 --gpu]
    ray job submit --working-dir . -- python jobs/clothing1m_lccn.py --data /abs/clothing1m --run-dir /abs/runs
    python jobs/clothing1m_lccn.py --smoke-test   # 2 CPU workers, generated images, 14 classes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

JOB = "clothing1m_lccn"
PRESET = common.PRESETS["clothing1m"]
SMOKE = common.SmokeData(dataset="clothing1m", num_classes=14, size=(48, 40), n_train=224,
                         n_test=56, shard_size=28, noisy_web_labels=True)


def get_args_parser() -> argparse.ArgumentParser:
    head, tail = __doc__.split("\n\n", 1)
    return common.dataset_parser(job=JOB, preset=PRESET, description=head, epilog=tail,
                                 noise_default='{"kind": "dataset"}',
                                 train_split="noisy_train", test_split="test")


def prepare_run(args: argparse.Namespace) -> common.JobRun:
    """Parsed arguments -> the run's configs and label view (nothing trained yet)."""
    return common.dataset_setup(args, job=JOB, preset=PRESET, smoke=SMOKE)


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    return common.dataset_main(args, job=JOB, preset=PRESET, smoke=SMOKE)


if __name__ == "__main__":
    main()
