"""``python -m shards <dataset> SRC --out DIR [options]``: convert a dataset to tar shards.

Subcommands: ``cifar10``, ``cifar100``, ``imagefolder``, ``csv`` (rows ``path,label``),
``clothing1m``, ``webvision``.
Common options: ``--out``, ``--shard-size`` (default 1000), ``--workers`` (default: one
fewer than the CPUs this process may use, at least 1), ``--no-progress``; for image datasets also ``--resize-short N``
(``0`` = keep the original bytes), ``--validate verify|decode`` and ``--skip-bad``.
``clothing1m`` and ``webvision`` resize to a shorter side of 256 by default (the usual
preprocessing for these web datasets: ~10x smaller shards, and training crops 224 anyway);
``imagefolder`` and ``csv`` keep originals by default. ``imagefolder``, ``csv`` (every split) and ``webvision``
(its train split) list images class by class; they write them in a seeded random order
(``--shuffle-seed``, default 0; ``--keep-order`` for the listed order), so that every shard
mixes the classes. A rerun with the same options resumes: finished shards are skipped.

Prints one line per split and returns 0; a conversion error prints ``error: ...`` and
returns 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from pipeline.core.cli import prog_name
from pipeline.data.manifest import Manifest
from shards import cifar, clothing1m, csvlist, imagefolder, webvision
from shards.writer import ShardError

WEB_RESIZE_SHORT = 256


def _default_workers() -> int:
    """One fewer writer process than the CPUs this process may use (the converting process
    itself reads, orders and fsyncs), at least 1 (= in this process, no pool). Measured on
    2 cores (benchmarks/results/convert.md): 2 pool workers were no faster than 1 in-process
    writer on CIFAR-10 and slower when resizing."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


def _common(p: argparse.ArgumentParser, *, images: bool, resize_default: int = 0) -> None:
    p.add_argument("src", help="source dataset root")
    p.add_argument("--out", required=True, help="output folder (gets <out>/<split>/...)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (1000)")
    p.add_argument("--workers", type=int, default=_default_workers(),
                   help=f"writer processes (default {_default_workers()}: one fewer than "
                        "the available CPUs; 1 writes in this process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    if images:
        p.add_argument("--resize-short", type=int, default=resize_default, metavar="N",
                       help="re-encode images with shorter side > N to JPEG with shorter side "
                            f"N; 0 keeps original bytes (default {resize_default})")
        p.add_argument("--validate", choices=("verify", "decode"), default="verify",
                       help="image check: PIL verify (default) or a full decode")
        p.add_argument("--skip-bad", action="store_true",
                       help="skip corrupt/missing images (listed in the manifest) "
                            "instead of failing")


def _order(p: argparse.ArgumentParser, which: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shuffle-seed", type=int, default=0, metavar="S",
                   help=f"write {which} in the random order of seed S, so that every shard "
                        "mixes the classes (default 0)")
    g.add_argument("--keep-order", dest="shuffle_seed", action="store_const", const=None,
                   help="write in the listed order (class by class) instead")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or prog_name("shards"),
                                     description="Convert a dataset to WebDataset tar shards.")
    sub = parser.add_subparsers(dest="dataset", required=True)

    for name in ("cifar10", "cifar100"):
        p = sub.add_parser(name, help=f"{name.upper()} python pickles (cifar-*-batches-py)")
        _common(p, images=False)
        p.add_argument("--splits", nargs="+", default=["train", "test"])
        p.add_argument("--download", action="store_true",
                       help="download the pickles into SRC first (needs internet)")

    p = sub.add_parser("imagefolder", help="SRC/<split>/<class>/<file> tree, or SRC/<class>/<file> "
                                            "(one split, train)")
    _common(p, images=True)
    p.add_argument("--splits", nargs="+", help="split folders (default: all)")
    p.add_argument("--classes", nargs="+", help="class names in label order (default: sorted)")
    p.add_argument("--labels-unverified", action="store_true",
                   help="folder labels are noisy: store clean=-1")
    p.add_argument("--dataset-name", default="imagefolder", help="dataset name in manifests")
    _order(p, "every split")
    p.add_argument("--per-class", type=int, default=None, metavar="N",
                   help="keep the first N images of each class of each split (a class-balanced "
                        "subset; default: all)")

    p = sub.add_parser("csv", help="a CSV with columns path,label (optional split, clean); "
                                    "paths relative to the CSV's folder")
    _common(p, images=True)
    p.add_argument("--splits", nargs="+", help="values of the split column to convert "
                                               "(default: all; rows without one are train)")
    p.add_argument("--classes", nargs="+", help="class names in label order (default: the "
                                                "sorted distinct labels)")
    p.add_argument("--dataset-name", default="csv", help="dataset name in manifests")
    _order(p, "every split")

    p = sub.add_parser("clothing1m", help="Clothing1M (images/ + annotation files)")
    _common(p, images=True, resize_default=WEB_RESIZE_SHORT)
    p.add_argument("--annotations", help="annotation folder (default SRC/annotations or SRC)")
    p.add_argument("--splits", nargs="+", default=["noisy_train", "clean_train", "val", "test"])

    p = sub.add_parser("webvision", help="WebVision 1.0 / mini-WebVision")
    _common(p, images=True, resize_default=WEB_RESIZE_SHORT)
    p.add_argument("--mini", action="store_true", help="labels < 50 only (mini-WebVision)")
    p.add_argument("--flickr", action="store_true", help="add the Flickr training list")
    p.add_argument("--imagenet-val", metavar="DIR",
                   help="ImageNet val folder with LOC_val_solution.csv (adds split imagenet_val)")
    p.add_argument("--splits", nargs="+", help="default: train val [imagenet_val]")
    _order(p, "the train split")
    return parser


def _run(args: argparse.Namespace) -> dict[str, Manifest]:
    common = dict(shard_size=args.shard_size, workers=args.workers,
                  progress=not args.no_progress)
    if args.dataset in ("cifar10", "cifar100"):
        if args.download:
            cifar.download(args.src, variant=args.dataset)
        return cifar.convert(args.src, args.out, variant=args.dataset, splits=args.splits,
                             **common)
    common.update(resize_short=args.resize_short or None, validate=args.validate,
                  skip_bad=args.skip_bad)
    if args.dataset == "imagefolder":
        return imagefolder.convert(args.src, args.out, splits=args.splits, classes=args.classes,
                                   labels_unverified=args.labels_unverified,
                                   dataset=args.dataset_name, per_class=args.per_class,
                                   shuffle_seed=args.shuffle_seed, **common)
    if args.dataset == "csv":
        return csvlist.convert(args.src, args.out, splits=args.splits, classes=args.classes,
                               dataset=args.dataset_name, shuffle_seed=args.shuffle_seed,
                               **common)
    if args.dataset == "clothing1m":
        return clothing1m.convert(args.src, args.out, annotations=args.annotations,
                                  splits=args.splits, **common)

    return webvision.convert(args.src, args.out, mini=args.mini, flickr=args.flickr,
                             imagenet_val=args.imagenet_val, splits=args.splits,
                             shuffle_seed=args.shuffle_seed, **common)


def _summary(manifests: dict[str, Manifest], out: str, seconds: float,
             write: Callable[[str], object]) -> None:
    for split, m in manifests.items():
        mb = sum(s.bytes for s in m.shards) / 1e6
        skipped = m.source.get("skipped", {}).get("count", 0)
        write(f"{m.dataset}/{split}: {m.num_samples} samples, {len(m.shards)} shards, "
              f"{mb:.1f} MB, {m.num_classes} classes, {skipped} skipped -> "
              f"{os.path.join(out, split)}")
    write(f"done in {seconds:.1f} s")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.shard_size < 1 or args.workers < 1:
        print("error: --shard-size and --workers must be >= 1", file=sys.stderr)
        return 2
    if getattr(args, "resize_short", 0) < 0:
        print("error: --resize-short must be >= 0", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        manifests = _run(args)
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _summary(manifests, args.out, time.perf_counter() - t0, print)
    return 0
