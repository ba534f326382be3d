"""Clothing1M from its official annotation files -> shards.

Source layout (annotation files in ``<root>/annotations/`` or directly in ``<root>/``)::

    <root>/images/<d>/<dd>/<name>.jpg
    noisy_label_kv.txt        images/7/88/339645240,2782721788.jpg 9    (~1M lines)
    noisy_train_key_list.txt  images/...jpg                             (one key per line)
    clean_label_kv.txt        same "key label" format                   (72,409 lines)
    clean_train_key_list.txt, clean_val_key_list.txt, clean_test_key_list.txt
    category_names_eng.txt    14 class names in label order

Key lists may lack a trailing newline; empty lines are ignored. Splits:

- ``noisy_train``: keys of ``noisy_train_key_list.txt`` in file order; ``label`` = the noisy
  label, ``clean`` = the clean label where ``clean_label_kv.txt`` has one, else ``-1``.
- ``clean_train`` (the trusted 47,570), ``val`` (14,313), ``test`` (10,526): ``label`` =
  ``clean`` = the clean label.

``idx`` = the line order of the key list; ``key`` = the image path as listed. Malformed lines,
labels outside the class range, conflicting duplicates, keys without a label and missing
images are errors naming the file and line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Literal

from pipeline.data.manifest import Manifest
from shards.writer import SampleRecord, ShardError, WriterOptions, write_split

CLASS_FILE = "category_names_eng.txt"
CLEAN_KV = "clean_label_kv.txt"
NOISY_KV = "noisy_label_kv.txt"
SPLIT_LISTS = {
    "noisy_train": "noisy_train_key_list.txt",
    "clean_train": "clean_train_key_list.txt",
    "val": "clean_val_key_list.txt",
    "test": "clean_test_key_list.txt",
}
DEFAULT_SPLITS = ("noisy_train", "clean_train", "val", "test")


def _lines(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, stripped text) of the non-empty lines of ``path``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShardError(f"{path}: annotation file not found") from None
    except UnicodeDecodeError as e:
        raise ShardError(f"{path}: not UTF-8 text ({e})") from e
    return [(i, s) for i, line in enumerate(text.splitlines(), 1) if (s := line.strip())]


def _check_key(path: Path, lineno: int, key: str) -> str:
    p = PurePosixPath(key)
    if p.is_absolute() or ".." in p.parts:
        raise ShardError(f"{path}:{lineno}: image key {key!r} must be a relative path "
                         "without '..'")
    return key


def read_class_names(path: Path) -> list[str]:
    names = [s for _, s in _lines(path)]
    if len(names) < 2:
        raise ShardError(f"{path}: expected at least 2 class names, got {len(names)}")
    return names


def read_label_kv(path: Path, num_classes: int) -> dict[str, int]:
    """``key -> label`` from a ``key label`` file; label in ``[0, num_classes)``."""
    labels: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, s in _lines(path):
        parts = s.split()
        if len(parts) != 2:
            raise ShardError(f"{path}:{lineno}: expected '<image path> <label>', got {s!r}")
        key, lab_s = _check_key(path, lineno, parts[0]), parts[1]
        try:
            lab = int(lab_s)
        except ValueError:
            raise ShardError(f"{path}:{lineno}: label {lab_s!r} is not an integer") from None
        if not 0 <= lab < num_classes:
            raise ShardError(f"{path}:{lineno}: label {lab} outside [0, {num_classes})")
        if key in labels and labels[key] != lab:
            raise ShardError(f"{path}:{lineno}: {key} has label {lab}, but line "
                             f"{first_line[key]} gives {labels[key]}")
        labels.setdefault(key, lab)
        first_line.setdefault(key, lineno)
    return labels


def read_key_list(path: Path) -> list[tuple[int, str]]:
    """(line number, key) of a key list; one key per line, no duplicates."""
    out: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    for lineno, s in _lines(path):
        if len(s.split()) != 1:
            raise ShardError(f"{path}:{lineno}: expected one image path, got {s!r}")
        key = _check_key(path, lineno, s)
        if key in seen:
            raise ShardError(f"{path}:{lineno}: duplicate key {key} (first at line {seen[key]})")
        seen[key] = lineno
        out.append((lineno, key))
    return out


def find_annotations(root: Path) -> Path:
    for cand in (root / "annotations", root):
        if (cand / CLASS_FILE).is_file():
            return cand
    raise ShardError(f"{root}: no {CLASS_FILE} in {root / 'annotations'} or {root}")


def split_records(root: Path, ann: Path, split: str, clean_kv: dict[str, int],
                  noisy_kv: dict[str, int] | None, *, check_images: bool) -> list[SampleRecord]:
    """Records of one split in key-list order; images at ``root/<key>``."""
    list_path = ann / SPLIT_LISTS[split]
    records: list[SampleRecord] = []
    for lineno, key in read_key_list(list_path):
        origin = f"{list_path}:{lineno}"
        if split == "noisy_train":
            assert noisy_kv is not None
            if key not in noisy_kv:
                raise ShardError(f"{origin}: key {key} has no label in {ann / NOISY_KV}")
            label, clean = noisy_kv[key], clean_kv.get(key, -1)
        else:
            if key not in clean_kv:
                raise ShardError(f"{origin}: key {key} has no label in {ann / CLEAN_KV}")
            label = clean = clean_kv[key]
        img = root / key
        if check_images and not img.is_file():
            raise ShardError(f"{origin}: image {img} not found")
        records.append(SampleRecord(idx=len(records), label=label, clean=clean, key=key,
                                    path=str(img), origin=origin))
    return records


def convert(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    annotations: str | os.PathLike | None = None,
    splits: Sequence[str] = DEFAULT_SPLITS,
    shard_size: int = 1000,
    workers: int = 1,
    resize_short: int | None = None,
    validate: Literal["verify", "decode"] = "verify",
    skip_bad: bool = False,
    progress: bool = True,
) -> dict[str, Manifest]:
    """Convert Clothing1M under ``src`` (images in ``src/images``) to ``out_dir/<split>/``.

    ``annotations``: folder of the annotation files (default ``src/annotations`` if it holds
    ``category_names_eng.txt``, else ``src``). Missing images are errors before anything is
    written, unless ``skip_bad`` (then they are skipped and listed like corrupt images).
    """
    root = Path(src)
    ann = Path(annotations) if annotations is not None else find_annotations(root)
    for split in splits:
        if split not in SPLIT_LISTS:
            raise ShardError(f"clothing1m: unknown split {split!r} (have {list(SPLIT_LISTS)})")
    classes = read_class_names(ann / CLASS_FILE)
    clean_kv = read_label_kv(ann / CLEAN_KV, len(classes))
    noisy_kv = read_label_kv(ann / NOISY_KV, len(classes)) if "noisy_train" in splits else None
    opts = WriterOptions(shard_size=shard_size, workers=workers, resize_short=resize_short,
                         validate=validate, skip_bad=skip_bad, progress=progress)
    all_records = {s: split_records(root, ann, s, clean_kv, noisy_kv, check_images=not skip_bad)
                   for s in splits}
    out: dict[str, Manifest] = {}
    for split, records in all_records.items():
        source = {"converter": "shards.clothing1m", "format": "clothing1m", "root": str(root),
                  "annotations": str(ann), "key_list": SPLIT_LISTS[split],
                  "num_with_clean": sum(r.clean >= 0 for r in records)}
        out[split] = write_split(records, out_dir, dataset="clothing1m", split=split,
                                 classes=classes, options=opts, source=source)
    return out
