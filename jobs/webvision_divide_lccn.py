"""DivideLCCN on WebVision (mini or full) on Ray Train: two networks, each with its own
LCCN chain (one store actor per network), trained on each other's division of the web
labels (``--method divide_lccn``, the default; ``dividemix``, ``lccn`` and ``ce`` run the
comparisons on the same shards).

The paper's WebVision recipe (Sec. 5): Inception-ResNet-v2, global batch 64, lr 0.01
divided by 10 after 40 epochs, power annealing on. The paper gives neither the epoch count,
the weight decay nor the warm-up: ours are 80 epochs (10 of them cross-entropy warm-up of
both networks), 5e-4 and 40,000 steps of the warm-up transition. DivideMix's WebVision
settings: MixMatch alpha 0.5, lambda_u 0 (--mixmatch-alpha, --lambda-u). Trains on the web labels
(``{"kind": "dataset"}``) of ``python -m shards webvision SRC --out DIR [--mini]`` and
evaluates on the WebVision validation split.

    python jobs/webvision_divide_lccn.py --data DIR/webvision [--num-workers 8 --gpu]
    ray job submit --working-dir . -- python jobs/webvision_divide_lccn.py --data /abs/webvision --run-dir /abs/runs
    python jobs/webvision_divide_lccn.py --smoke-test   # 2 CPU workers, generated images
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

JOB = "webvision_divide_lccn"
PRESET = common.PRESETS["webvision"]
SMOKE = common.SmokeData(dataset="webvision", num_classes=5, size=(40, 48), n_train=160,
                         n_test=40, shard_size=20, noisy_web_labels=True)


def get_args_parser() -> argparse.ArgumentParser:
    head, tail = __doc__.split("\n\n", 1)
    return common.dataset_parser(job=JOB, preset=PRESET, description=head, epilog=tail,
                                 noise_default='{"kind": "dataset"}',
                                 train_split="train", test_split="val")


def prepare_run(args: argparse.Namespace) -> common.JobRun:
    """Parsed arguments -> the run's configs and label view (nothing trained yet)."""
    return common.dataset_setup(args, job=JOB, preset=PRESET, smoke=SMOKE)


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    return common.dataset_main(args, job=JOB, preset=PRESET, smoke=SMOKE)


if __name__ == "__main__":
    main()
