"""WebVision 1.0 (and mini-WebVision) -> shards.

Source layout (the resized WebVision 1.0 release)::

    <root>/info/synsets.txt                 "n01440764 tench, Tinca tinca"; line i = label i
    <root>/info/train_filelist_google.txt   "google/q0001/<name>.jpg <label>" (relative to root)
    <root>/info/train_filelist_flickr.txt   "flickr/q0001/<name>.jpg <label>"
    <root>/info/val_filelist.txt            "val000001.jpg <label>" (relative to val_images_256/)
    <root>/val_images_256/val000001.jpg ...

Splits:

- ``train``: the Google list (plus the Flickr list after it with ``flickr=True``). The lists
  go query by query, so class by class; the split is written in a seeded random order
  (``shuffle_seed``, 0 by default, in the manifest's ``source``; ``idx`` = the position in
  it) so that every shard mixes the classes (:func:`shards.writer.shuffled`).
  ``shuffle_seed=None`` keeps the file order. Web labels are noisy: ``label`` = the list's
  label, ``clean`` = -1.
- ``val``: the WebVision validation set; ``label`` = ``clean`` = the list's label.
- ``imagenet_val`` (only with ``imagenet_val=DIR``): the ILSVRC-2012 validation images of the
  same classes, ``label`` = ``clean`` = the synset's line in ``synsets.txt``. Format (the
  Kaggle ILSVRC layout): ``DIR/LOC_val_solution.csv`` with header
  ``ImageId,PredictionString`` and rows ``ILSVRC2012_val_00008726,n02119789 255 142 454 329
  ...`` (the first token is the synset); images at ``DIR/ILSVRC/Data/CLS-LOC/val/<ImageId>.JPEG``
  if that folder exists, else ``DIR/<ImageId>.JPEG``. Rows are sorted by ``ImageId``.

``mini=True`` keeps only labels < 50 in every split (mini-WebVision: about 66k Google
training images, 2,500 WebVision val, 2,500 ImageNet val); its class list is the first 50
synsets. Class names in the manifest are the WordNet ids; the descriptions from
``synsets.txt`` are in ``source["class_descriptions"]``. ``key`` = the listed path (or the
ImageId for ImageNet). The CLI resizes to a shorter side of 256 by default.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pipeline.data.manifest import Manifest
from shards.writer import SampleRecord, ShardError, WriterOptions, shuffled, write_split

MINI_CLASSES = 50
IMAGENET_CSV = "LOC_val_solution.csv"
IMAGENET_KAGGLE_DIR = Path("ILSVRC/Data/CLS-LOC/val")


def read_synsets(path: Path) -> tuple[list[str], list[str]]:
    """(wnids, descriptions) in label order."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShardError(f"{path}: synsets file not found") from None
    wnids, desc = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        wnid, _, rest = s.partition(" ")
        if not (wnid.startswith("n") and wnid[1:].isdigit()):
            raise ShardError(f"{path}:{lineno}: expected '<wnid> <description>', got {s!r}")
        wnids.append(wnid)
        desc.append(rest.strip())
    if len(set(wnids)) != len(wnids):
        raise ShardError(f"{path}: duplicate synset ids")
    return wnids, desc


def read_filelist(path: Path, num_classes: int, *, limit: int) -> list[tuple[int, str, int]]:
    """(line number, relative path, label) of a ``<path> <label>`` list, labels < ``limit``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShardError(f"{path}: file list not found") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        parts = s.split()
        if len(parts) != 2:
            raise ShardError(f"{path}:{lineno}: expected '<image path> <label>', got {s!r}")
        try:
            lab = int(parts[1])
        except ValueError:
            raise ShardError(f"{path}:{lineno}: label {parts[1]!r} is not an integer") from None
        if not 0 <= lab < num_classes:
            raise ShardError(f"{path}:{lineno}: label {lab} outside [0, {num_classes})")
        rel = parts[0]
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ShardError(f"{path}:{lineno}: path {rel!r} must be relative without '..'")
        if lab < limit:
            out.append((lineno, rel, lab))
    return out


def read_imagenet_val(dir_: Path, wnids: Sequence[str], *,
                      limit: int) -> list[tuple[str, str, int, str]]:
    """(ImageId, image path, label, origin) of the ImageNet val images with label < limit."""
    csv_path = dir_ / IMAGENET_CSV
    img_dir = dir_ / IMAGENET_KAGGLE_DIR if (dir_ / IMAGENET_KAGGLE_DIR).is_dir() else dir_
    label_of = {w: i for i, w in enumerate(wnids)}
    try:
        f = open(csv_path, newline="", encoding="utf-8")
    except FileNotFoundError:
        raise ShardError(f"{csv_path}: ImageNet validation list not found") from None
    rows = []
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
            raise ShardError(f"{csv_path}:1: expected header 'ImageId,PredictionString', "
                             f"got {header}")
        for lineno, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) != 2 or not row[1].split():
                raise ShardError(f"{csv_path}:{lineno}: expected '<ImageId>,<wnid> ...', "
                                 f"got {','.join(row)!r}")
            image_id, wnid = row[0].strip(), row[1].split()[0]
            if wnid not in label_of:
                raise ShardError(f"{csv_path}:{lineno}: synset {wnid} is not in synsets.txt")
            lab = label_of[wnid]
            if lab < limit:
                rows.append((image_id, str(img_dir / f"{image_id}.JPEG"), lab,
                             f"{csv_path}:{lineno}"))
    rows.sort()
    ids = [r[0] for r in rows]
    if len(set(ids)) != len(ids):
        raise ShardError(f"{csv_path}: duplicate ImageId rows")
    return rows


def _records(entries: list[tuple[str, str, int, str]], *, clean_known: bool,
             check_images: bool) -> list[SampleRecord]:
    """Records from (key, image path, label, origin) entries, in order."""
    records = []
    for key, img, lab, origin in entries:
        if check_images and not os.path.isfile(img):
            raise ShardError(f"{origin}: image {img} not found")
        records.append(SampleRecord(idx=len(records), label=lab, clean=lab if clean_known else -1,
                                    key=key, path=img, origin=origin))
    return records


def convert(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    mini: bool = False,
    flickr: bool = False,
    imagenet_val: str | os.PathLike | None = None,
    splits: Sequence[str] | None = None,
    shard_size: int = 1000,
    workers: int = 1,
    resize_short: int | None = None,
    validate: Literal["verify", "decode"] = "verify",
    skip_bad: bool = False,
    progress: bool = True,
    shuffle_seed: int | None = 0,
) -> dict[str, Manifest]:
    """Convert WebVision under ``src`` to ``out_dir/<split>/`` shards.

    ``splits``: default ``train``, ``val`` and, if ``imagenet_val`` is given, ``imagenet_val``.
    Missing images are errors before anything is written, unless ``skip_bad``.
    """
    root = Path(src)
    info = root / "info"
    wnids, desc = read_synsets(info / "synsets.txt")
    limit = MINI_CLASSES if mini else len(wnids)
    if limit > len(wnids):
        raise ShardError(f"{info / 'synsets.txt'}: {len(wnids)} synsets, mini needs {limit}")
    splits = list(splits) if splits is not None else (
        ["train", "val"] + (["imagenet_val"] if imagenet_val is not None else []))
    known = {"train", "val", "imagenet_val"}
    for s in splits:
        if s not in known:
            raise ShardError(f"webvision: unknown split {s!r} (have {sorted(known)})")
    if "imagenet_val" in splits and imagenet_val is None:
        raise ShardError("webvision: split 'imagenet_val' needs imagenet_val=DIR")
    classes = wnids[:limit]
    check = not skip_bad
    entries: dict[str, list[SampleRecord]] = {}
    for split in splits:
        if split == "train":
            lists = ["train_filelist_google.txt"]
            if flickr:
                lists.append("train_filelist_flickr.txt")
            ents = []
            for name in lists:
                lp = info / name
                ents += [(rel, str(root / rel), lab, f"{lp}:{n}")
                         for n, rel, lab in read_filelist(lp, len(wnids), limit=limit)]
            entries[split] = _records(ents, clean_known=False, check_images=check)
        elif split == "val":
            lp = info / "val_filelist.txt"
            ents = [(rel, str(root / "val_images_256" / rel), lab, f"{lp}:{n}")
                    for n, rel, lab in read_filelist(lp, len(wnids), limit=limit)]
            entries[split] = _records(ents, clean_known=True, check_images=check)
        else:
            ents = read_imagenet_val(Path(imagenet_val), wnids, limit=limit)
            entries[split] = _records(ents, clean_known=True, check_images=check)
    dataset = "mini-webvision" if mini else "webvision"
    opts = WriterOptions(shard_size=shard_size, workers=workers, resize_short=resize_short,
                         validate=validate, skip_bad=skip_bad, progress=progress)
    out: dict[str, Manifest] = {}
    for split, records in entries.items():
        source = {"converter": "shards.webvision", "format": "webvision-1.0", "root": str(root),
                  "mini": mini, "flickr": flickr, "class_descriptions": desc[:limit]}
        if split == "imagenet_val":
            source["imagenet_val"] = str(imagenet_val)
        if split == "train":
            source["shuffle_seed"] = shuffle_seed
            if shuffle_seed is not None:
                records = shuffled(records, shuffle_seed)
        out[split] = write_split(records, out_dir, dataset=dataset, split=split,
                                 classes=classes, options=opts, source=source)
    return out
