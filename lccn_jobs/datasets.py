"""The jobs on converted shards of a dataset, as data: :class:`DatasetJob` is the one job
(data options, the recipe of the dataset and ``--method``, ``--smoke-test``'s generated
shards, the label view, the run on Ray), and :data:`CIFAR`, :data:`CLOTHING1M` and
:data:`WEBVISION` are its instances (``jobs/cifar_lccn.py``, ``jobs/clothing1m_lccn.py``,
``jobs/webvision_divide_lccn.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from lccn_jobs.cli import add_common_args, add_data_args, local_data_note, work_dir
from lccn_jobs.configs import JobConfig, check_transition_file, prepare, warmup_covers_phase
from lccn_jobs.driver import Job, JobRun, dist_config
from lccn_jobs.recipes import RECIPES
from lccn_jobs.sources import (
    SmokeData,
    check_sources,
    load_view,
    manifest_classes,
    resolve_sources,
    split_lines,
    split_manifest,
    write_synthetic_shards,
)
from shards.labelview import CIFAR10_CLASSES


def dataset_setup(args: argparse.Namespace, cfg: JobConfig, log: list[str], *, job: str,
                  smoke: SmokeData, transform: str) -> JobRun:
    """A dataset job up to the run, from its configs ``cfg`` (:func:`lccn_jobs.configs.prepare`):
    smoke data or the given shards -> label view -> the Ray Train settings (``transform``:
    the image preset); ``log``: the lines to print first. Nothing is trained."""
    if args.smoke_test:
        out = work_dir(args, job) / "smoke-data" / smoke.dataset
        train_dir, test_dir = write_synthetic_shards(
            out, dataset=smoke.dataset, num_classes=smoke.num_classes, size=smoke.size,
            n_train=smoke.n_train, n_test=smoke.n_test, seed=args.seed,
            shard_size=smoke.shard_size, noisy_web_labels=smoke.noisy_web_labels,
            classes=smoke.classes)
        args.train_shards, args.test_shards = str(train_dir), str(test_dir)
        log += local_data_note(args, job, out)
        if smoke.noise is not None:
            args.noise = smoke.noise
        log.append(f"[{job}] smoke data: {smoke.n_train}/{smoke.n_test} generated "
                   f"{smoke.size[0]}x{smoke.size[1]} images, {smoke.num_classes} classes in {out}; "
                   f"label view {args.noise}")
    train, test = resolve_sources(args)
    train_manifest = check_sources(args, train, test)
    if not args.smoke_test and not getattr(args, "data_described", False):
        # what the data holds, as a converting run says it (--data, --train-shards)
        log += split_lines(train_manifest, where=train, job=job)
        if test is not None:
            log += split_lines(split_manifest(test, args), where=test, job=job)
    try:
        view = load_view(args, train, manifest=train_manifest)
    except ValueError as e:  # ManifestError (a shard that does not match), a bad --noise spec
        raise SystemExit(f"error: {e}") from None
    run = cfg.run
    check_transition_file(run, view.num_classes)
    note = warmup_covers_phase(run, train_manifest, args.num_workers)
    dist = dist_config(args, cfg, run_name=args.run_name, train=train, test=test,
                       class_names=manifest_classes(train), transform=transform)
    return JobRun(run=run, dist=dist, view=view, log=log, manifest=train_manifest,
                  run_warnings=[f"[{job}] warning: {note}"] if note else [])


@dataclass(frozen=True)
class DatasetJob(Job):
    """A job on the converted shards of a dataset.

    name: the job's name (its script ``jobs/<name>.py``).
    doc: its ``--help`` text (the first paragraph is the description).
    noise: the default ``--noise`` label view of each dataset whose recipe the job runs
        (:data:`lccn_jobs.recipes.RECIPES`), the first the default; with more than one the
        job takes ``--dataset``.
    train_split, test_split: the split folders under ``--data``.
    smoke: what ``--smoke-test`` generates (it runs the first dataset's recipe).
    """

    name: str
    doc: str
    noise: Mapping[str, str]
    train_split: str
    test_split: str
    smoke: SmokeData = field(repr=False)

    @property
    def dataset(self) -> str:
        """The first dataset (the default, and ``--smoke-test``'s)."""
        return next(iter(self.noise))

    def dataset_of(self, args: argparse.Namespace) -> str:
        return args.dataset if len(self.noise) > 1 and not args.smoke_test else self.dataset

    def get_args_parser(self) -> argparse.ArgumentParser:
        head, tail = self.doc.split("\n\n", 1)
        p = argparse.ArgumentParser(description=head, epilog=tail,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        several = len(self.noise) > 1
        add_data_args(p, noise_default=None if several else self.noise[self.dataset],
                      noise_help=", ".join(f"{spec} ({d})" for d, spec in self.noise.items())
                      if several else self.noise[self.dataset])
        add_common_args(p, job=self.name, dataset=self.dataset,
                        method=RECIPES[self.dataset].method)
        p.set_defaults(train_split=self.train_split, test_split=self.test_split)
        if several:
            p.add_argument("--dataset", choices=tuple(self.noise), default=self.dataset,
                           help="picks the warm-up (anchor / identity) and the default noise")
        return p

    def prepare_run(self, args: argparse.Namespace) -> JobRun:
        dataset, notes = self.dataset_of(args), []
        if len(self.noise) > 1:  # --dataset: its recipe and its default noise
            if args.dataset != dataset:
                notes.append(f"[{self.name}] --smoke-test runs the {dataset} recipe on "
                             f"generated images")
            args.dataset = dataset
            if args.noise is None:
                args.noise = self.noise[dataset]
        cfg, log = prepare(args, job=self.name, dataset=dataset)
        if len(self.noise) > 1:
            log.append(f"[{self.name}] {dataset}: warm-up transition {cfg.run.lccn.warmup}")
        return dataset_setup(args, cfg, log + notes, job=self.name, smoke=self.smoke,
                             transform=cfg.recipe.transform)


_CIFAR_DOC = """LCCN on CIFAR-10 / CIFAR-100 with synthetic label noise, on Ray Train.

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

_CLOTHING1M_DOC = """LCCN on Clothing1M (real web-label noise), on Ray Train.

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

_WEBVISION_DOC = """DivideLCCN on WebVision (mini or full) on Ray Train: two networks, each with its own
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

CIFAR = DatasetJob(
    name="cifar_lccn", doc=_CIFAR_DOC,
    noise={"cifar10": '{"kind": "asymmetric", "rate": 0.4, "seed": 0}',
           "cifar100": '{"kind": "cifar100_superclass", "rate": 0.4, "seed": 0}'},
    train_split="train", test_split="test",
    # the smoke test's noise is --noise (default: CIFAR-10's), e.g. an open-set view for LCCN*
    smoke=SmokeData(dataset="cifar10", num_classes=10, size=(32, 32), classes=CIFAR10_CLASSES))

CLOTHING1M = DatasetJob(
    name="clothing1m_lccn", doc=_CLOTHING1M_DOC,
    noise={"clothing1m": '{"kind": "dataset"}'}, train_split="noisy_train", test_split="test",
    smoke=SmokeData(dataset="clothing1m", num_classes=14, size=(48, 40), n_train=224, n_test=56,
                    shard_size=28, noisy_web_labels=True))

WEBVISION = DatasetJob(
    name="webvision_divide_lccn", doc=_WEBVISION_DOC,
    noise={"webvision": '{"kind": "dataset"}'}, train_split="train", test_split="val",
    smoke=SmokeData(dataset="webvision", num_classes=5, size=(40, 48), n_train=160, n_test=40,
                    shard_size=20, noisy_web_labels=True))
