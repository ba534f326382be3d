"""A job's data: its shard sources checked before Ray starts (one clear line for a path
that is not a converted split, shards that do not fit the workers), its label view (a saved
one, or a ``--noise`` spec over the training split's labels, with the LCCN+ trusted set the
options ask for), and the tiny generated shards of ``--smoke-test``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lccn_jobs.configs import trusted_spec
from pipeline.core.labels import LabelView
from pipeline.data.manifest import MANIFEST_NAME, Manifest
from pipeline.data.stream import LoaderConfig, check_label_view, check_splits, load_manifest
from shards.labelview import build_view
from shards.writer import SampleRecord, WriterOptions, write_split


def manifest_classes(train: str) -> list[str]:
    if "://" in train:
        return []
    return list(Manifest.load(train).classes)


def _source(path_or_url: str | os.PathLike | None) -> str | None:
    if path_or_url is None:
        return None
    s = str(path_or_url)
    return s if "://" in s else str(Path(s).expanduser().resolve())


def _check_local_split(path: Path, *, option: str, split: str) -> None:
    """One clear line (SystemExit) when a local split folder is not there or is no split."""
    if (path / MANIFEST_NAME).is_file():
        return
    if option == "--data":
        root = path.parent
        if not root.is_dir():
            raise SystemExit(f"error: --data {root}: no such folder")
        if (root / MANIFEST_NAME).is_file():
            raise SystemExit(f"error: --data {root} is a split folder (it holds "
                             f"{MANIFEST_NAME}); --data takes the shard root that holds "
                             f"{split}/ (or pass --train-shards {root})")
        have = sorted(p.name for p in root.iterdir() if (p / MANIFEST_NAME).is_file())
        hint = (f"its splits are {have}: pick one with --train-split" if have else
                "convert a dataset first with `python -m shards` (lccn-shards)")
        raise SystemExit(f"error: --data {root}: no split {split!r} ({path / MANIFEST_NAME} "
                         f"is missing); {hint}")
    if not path.is_dir():
        raise SystemExit(f"error: {option} {path}: no such folder")
    splits = sorted(p.name for p in path.iterdir() if (p / MANIFEST_NAME).is_file())
    if splits:
        raise SystemExit(f"error: {option} {path} is a shard root with splits {splits}, not "
                         f"a split folder; pass {option} {path / splits[0]} or --data {path}")
    raise SystemExit(f"error: {option} {path}: no {MANIFEST_NAME} (not a converted split)")


def resolve_sources(args: argparse.Namespace) -> tuple[str, str | None]:
    train = args.train_shards or (args.data / args.train_split if args.data else None)
    test = args.test_shards or (args.data / args.test_split if args.data else None)
    if train is None:
        raise SystemExit("error: give --data DIR (or --train-shards), or run --smoke-test")
    if "://" not in str(train):
        _check_local_split(Path(train).expanduser(),
                           option="--train-shards" if args.train_shards else "--data",
                           split=args.train_split)
    if test is not None and "://" not in str(test) and not Path(test).is_dir():
        print(f"note: no test split at {test}; training without evaluation", flush=True)
        test = None
    return _source(train), _source(test)


def check_sources(args: argparse.Namespace, train: str, test: str | None) -> Manifest:
    """The splits' manifests (local or remote) as every worker will check them, before Ray
    starts: the same classes, a shard per worker (one clear line otherwise). Returns the
    training split's."""
    train_manifest = split_manifest(train, args)
    try:
        check_splits(train_manifest, split_manifest(test, args) if test else None,
                     world_size=args.num_workers, train_where=train, test_where=test)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return train_manifest


def split_manifest(source: str, args: argparse.Namespace) -> Manifest:
    """The manifest of a split folder or URL (s3://, http(s)://), as the workers read it;
    one clear line (SystemExit) when it cannot be read."""
    try:
        return load_manifest(source, cfg=LoaderConfig(
            s3_endpoint_url=getattr(args, "s3_endpoint_url", None)))
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {source}: cannot read its manifest ({e})") from None


def load_view(args: argparse.Namespace, train: str, *,
              manifest: Manifest | None = None) -> LabelView:
    """--label-view (checked against the training split's ``manifest``, read when not
    given), else the --noise spec applied to the training split's labels. With --label-view
    the trusted-set options only switch LCCN+ on: the saved view carries its trusted set
    (``lccn-labelview --trusted``)."""
    if args.label_view is not None:
        view = LabelView.load(args.label_view)
        check_label_view(view, manifest or split_manifest(train, args), where=train)
        if trusted_spec(args) is not None and not view.trusted.any():
            raise SystemExit(f"error: --label-view {args.label_view} has no trusted samples, and "
                             f"the trusted-set options choose them only for a view built from "
                             f"--noise; build the view with lccn-labelview --trusted '...'")
        return view
    if "://" in train:
        raise SystemExit("error: a remote training split needs --label-view (a saved .npz; "
                         "build it with `python -m shards.labelview`)")
    try:
        spec = json.loads(args.noise)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --noise is not valid JSON ({e}): {args.noise!r}") from None
    trusted = trusted_spec(args)
    if trusted is not None:
        spec["trusted"] = trusted
    return build_view(train, spec, checksums=getattr(args, "verify_checksums", True))


NAMES_SHOWN = 20  # the bad or ignored files named in the output (the manifest names all)


def _names(items: list[str], more: str) -> list[str]:
    shown = [f"    {x}" for x in items[:NAMES_SHOWN]]
    if len(items) > NAMES_SHOWN:
        shown.append(f"    ... and {len(items) - NAMES_SHOWN:,} more ({more})")
    return shown


def split_lines(m: Manifest, *, where: Path | str, job: str) -> list[str]:
    """What a converted split holds, for the job's output: ``N images, K classes in
    <where>``, then the images left out as unreadable (``--skip-bad``) and the files that
    are not images, each named (the first :data:`NAMES_SHOWN`; the manifest names all)."""
    lines = [f"[{job}] {m.split}: {m.num_samples:,} images, {len(m.classes)} classes in {where}"]
    src = m.source or {}
    skipped = src.get("skipped") or {}
    if skipped.get("count"):
        lines.append(f"[{job}] {m.split}: skipped {skipped['count']:,} unreadable image(s) "
                     f"(listed in {where}/{MANIFEST_NAME}, source.skipped):")
        lines += _names(list(skipped.get("errors") or skipped.get("keys") or []),
                        f"{MANIFEST_NAME}")
    ignored = src.get("ignored") or []
    if src.get("ignored_files"):
        lines.append(f"[{job}] {m.split}: ignored {src['ignored_files']:,} file(s) that are "
                     f"not images (hidden, no image extension, or outside the class folders):")
        lines += _names(list(ignored), f"{MANIFEST_NAME}, source.ignored")
    return lines


# -- tiny generated shards for --smoke-test ---------------------------------------------------


@dataclass(frozen=True)
class SmokeData:
    """What ``--smoke-test`` generates for a dataset job (see :func:`write_synthetic_shards`)."""

    dataset: str
    num_classes: int
    size: tuple[int, int]
    n_train: int = 256
    n_test: int = 64
    shard_size: int = 32
    noisy_web_labels: bool = False
    noise: str | None = None  # the label view spec used in the smoke test (None: --noise)
    classes: tuple[str, ...] = ()  # class names (default class0, class1, ...)


def write_synthetic_shards(out: Path, *, dataset: str, num_classes: int, size: tuple[int, int],
                           n_train: int, n_test: int, seed: int, shard_size: int,
                           noisy_web_labels: bool,
                           classes: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Generated RGB images of ``size`` (H, W) (a class colour plus noise, encoded as PNG)
    as ``out/train`` and ``out/test`` splits. ``noisy_web_labels``: the training split
    stores a web-like noisy ``label`` (30% flipped to the next class) with ``clean`` known
    for every other sample (as Clothing1M); otherwise ``label`` = ``clean`` (as CIFAR).
    Reuses splits already written there. Returns the two split folders."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(num_classes, 3))
    classes = list(classes) or [f"class{c}" for c in range(num_classes)]
    if len(classes) != num_classes:
        raise ValueError(f"{len(classes)} class names for {num_classes} classes")
    dirs = []
    for split, n in (("train", n_train), ("test", n_test)):
        if (out / split / "manifest.json").is_file():
            dirs.append(out / split)
            continue
        labels = np.arange(n) % num_classes
        records = []
        for i, c in enumerate(labels):
            px = np.clip(colours[c] + rng.normal(0, 40, size=(*size, 3)), 0, 255).astype(np.uint8)
            label, clean = int(c), int(c)
            if noisy_web_labels and split == "train":
                if rng.random() < 0.3:
                    label = (int(c) + 1) % num_classes
                clean = int(c) if i % 2 == 0 else -1
            records.append(SampleRecord(idx=i, label=label, clean=clean, key=f"{split}/{i:05d}.png",
                                        pixels=px))
        write_split(records, out, dataset=dataset, split=split, classes=classes,
                    options=WriterOptions(shard_size=shard_size, progress=False))
        dirs.append(out / split)
    return dirs[0], dirs[1]
