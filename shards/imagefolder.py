"""Any ``root/<split>/<class>/<file>`` image tree -> shards (original bytes kept); a plain
``root/<class>/<file>`` tree (no split folders: the commonest layout of one's own data) is
one split, ``train`` (``flat_split``), from which the jobs carve their noisy validation split.

Classes are the class folders of all converted splits together, sorted by name (so every
split uses the same label indices), or an explicit ``classes`` list (folders not in it are an
error). Within a class, image files are found recursively and sorted by their path relative
to the class folder. That class-then-file list is written in a seeded random order
(``shuffle_seed``, 0 by default; recorded in the manifest's ``source["shuffle_seed"]``) with
``idx`` = the position in it, so that every shard mixes the classes
(:func:`shards.writer.shuffled`); ``shuffle_seed=None`` keeps the list order. ``label`` =
the class index; ``clean`` = the class index too (the folders are the dataset's labels), or
``-1`` with ``labels_unverified=True`` (e.g. web-crawled folders). ``key`` =
``<class>/<file>``, relative to the split folder. Hidden files, files without an image
extension and files beside the class folders are ignored: counted in the manifest's
``source["ignored_files"]`` and named in ``source["ignored"]``. A class folder without
any image (in every converted split) is an error naming it, when the classes come from the
folders: it would be a class with no samples.

For the CIFAR-10 JPEG tree (``train|test/<class>/NNNN.jpg``) this gives 50,000 train and
10,000 test samples, labels in the standard CIFAR-10 order. ``per_class=N`` keeps the first N
files of each class (in that order) of every converted split: a class-balanced subset for a
quick run, recorded in the manifest's ``source["per_class"]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pipeline.data.images import IMAGE_EXTENSIONS
from pipeline.data.manifest import Manifest
from shards.writer import SampleRecord, ShardError, WriterOptions, shuffled, write_split


def _visible_dirs(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def list_class_files(class_dir: Path) -> tuple[list[str], list[str]]:
    """Image files under ``class_dir`` and the files ignored there (hidden, or without an
    image extension), both as relative POSIX paths, unsorted."""
    files: list[str] = []
    ignored: list[str] = []
    for dirpath, dirnames, filenames in os.walk(class_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(class_dir)
        for f in filenames:
            if f.startswith(".") or Path(f).suffix.lower() not in IMAGE_EXTENSIONS:
                ignored.append((rel_dir / f).as_posix())
                continue
            files.append((rel_dir / f).as_posix())
    return files, ignored


def scan_split(split_dir: Path, classes: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
    """``{class: image files relative to its folder}`` of one split, and the files ignored
    (relative to ``split_dir``, sorted): those of the class folders that are not images,
    and the files beside the class folders (in no class)."""
    files: dict[str, list[str]] = {}
    ignored: list[str] = [e.name for e in os.scandir(split_dir) if not e.is_dir()]
    for cls in classes:
        if (split_dir / cls).is_dir():
            files[cls], names = list_class_files(split_dir / cls)
            ignored += [f"{cls}/{n}" for n in names]
    return files, sorted(ignored)


def find_splits(src: str | os.PathLike) -> list[str]:
    """The split folders of ``src`` (its visible subfolders), sorted."""
    src = Path(src)
    if not src.is_dir():
        raise ShardError(f"{src}: not a folder")
    return _visible_dirs(src)


def is_class_tree(src: str | os.PathLike) -> bool:
    """Whether ``src`` is a ``<class>/<file>`` tree: some visible subfolder holds image
    files itself (split folders hold only class folders)."""
    src = Path(src)
    for d in find_splits(src):
        for e in os.scandir(src / d):
            if e.is_file() and not e.name.startswith(".") \
                    and Path(e.name).suffix.lower() in IMAGE_EXTENSIONS:
                return True
    return False


def split_records(split_dir: Path, files: Mapping[str, Sequence[str]], classes: Sequence[str],
                  *, labels_unverified: bool = False,
                  per_class: int | None = None) -> list[SampleRecord]:
    """Records of one split: class order, then files sorted by relative path; idx = position.

    ``files``: ``{class: paths relative to split_dir/<class>}`` (e.g. from :func:`scan_split`).
    ``per_class``: keep only the first that many files of each class.
    """
    records: list[SampleRecord] = []
    for lab, cls in enumerate(classes):
        for rel in sorted(files.get(cls, ()))[:per_class]:
            records.append(SampleRecord(
                idx=len(records), label=lab, clean=-1 if labels_unverified else lab,
                key=f"{cls}/{rel}", path=str(split_dir / cls / rel)))
    return records


def convert(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    splits: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    labels_unverified: bool = False,
    dataset: str = "imagefolder",
    shard_size: int = 1000,
    workers: int = 1,
    resize_short: int | None = None,
    validate: Literal["verify", "decode"] = "verify",
    skip_bad: bool = False,
    progress: bool = True,
    per_class: int | None = None,
    shuffle_seed: int | None = 0,
    flat_split: str = "train",
) -> dict[str, Manifest]:
    """Convert ``src/<split>/<class>/...`` to ``out_dir/<split>/`` shards, or a plain
    ``src/<class>/...`` tree (:func:`is_class_tree`) to the one split ``out_dir/<flat_split>/``.

    ``splits``: which split folders (default: every visible subfolder of ``src``; not with a
    plain class tree).
    ``classes``: class names in label order (default: sorted union of class folders).
    ``per_class``: keep the first N files of each class of each split (default: all).
    ``shuffle_seed``: write each split in this seeded random order (None: class order).
    """
    if per_class is not None and (isinstance(per_class, bool) or not isinstance(per_class, int)
                                  or per_class < 1):
        raise ShardError(f"per_class must be a positive integer, got {per_class!r}")
    src = Path(src)
    flat = is_class_tree(src)
    if flat and splits is not None:
        raise ShardError(f"{src}: a <class>/<file> tree (class folders hold the images) has no "
                         f"split folders to choose; leave out the split list {list(splits)}")
    if flat:
        splits, split_dirs = [flat_split], {flat_split: src}
    else:
        splits = list(splits) if splits is not None else find_splits(src)
        split_dirs = {s: src / s for s in splits}
    if not splits:
        raise ShardError(f"{src}: no split folders (expected {src}/<split>/<class>/<file> or "
                         f"{src}/<class>/<file>)")
    class_dirs: dict[str, list[str]] = {}
    for split in splits:
        if not split_dirs[split].is_dir():
            raise ShardError(f"{split_dirs[split]}: split folder not found")
        class_dirs[split] = _visible_dirs(split_dirs[split])
    found = sorted(set().union(*class_dirs.values()))
    derived = classes is None
    if classes is None:
        classes = found
    else:
        classes = list(classes)
        if len(set(classes)) != len(classes):
            raise ShardError(f"class list has duplicates: {classes}")
        for split, dirs in class_dirs.items():
            extra = sorted(set(dirs) - set(classes))
            if extra:
                raise ShardError(f"{split_dirs[split]}: class folder(s) {extra} not in the "
                                 f"class list")
        # a listed class may be missing from one split, not from every split of src
        anywhere = set(found) if flat else \
            set(found).union(*(_visible_dirs(src / s) for s in find_splits(src)))
        absent = [c for c in classes if c not in anywhere]
        if absent:
            raise ShardError(f"{src}: class(es) {absent} of the class list have no folder in "
                             f"any split (class folders: {sorted(anywhere)})")
    if not classes:
        raise ShardError(f"{src}: no class folders under {splits}")
    opts = WriterOptions(shard_size=shard_size, workers=workers, resize_short=resize_short,
                         validate=validate, skip_bad=skip_bad, progress=progress)
    scanned = {split: scan_split(split_dirs[split], classes) for split in splits}
    if derived:  # a class folder without images would be a class with no samples
        empty = [c for c in classes if not any(scanned[s][0].get(c) for s in splits)]
        if empty:
            where = [str(split_dirs[s] / c) for c in empty for s in splits
                     if (split_dirs[s] / c).is_dir()]
            inside = sorted(f for s in splits for f in scanned[s][1]
                            if f.split("/", 1)[0] in empty)
            raise ShardError(
                f"empty class folder(s) {', '.join(where)}: no image files "
                f"({', '.join(sorted(IMAGE_EXTENSIONS))})"
                + (f"; only {', '.join(inside[:10])}{', ...' if len(inside) > 10 else ''}"
                   if inside else "")
                + ". A folder is a class: put images in it or remove it")
    out: dict[str, Manifest] = {}
    for split in splits:
        files, ignored = scanned[split]
        records = split_records(split_dirs[split], files, classes,
                                labels_unverified=labels_unverified, per_class=per_class)
        if shuffle_seed is not None:
            records = shuffled(records, shuffle_seed)
        source = {"converter": "shards.imagefolder",
                  "format": "imagefolder-flat" if flat else "imagefolder",
                  "root": str(src), "labels_unverified": labels_unverified,
                  "ignored_files": len(ignored), "ignored": ignored,
                  "shuffle_seed": shuffle_seed}
        if per_class is not None:
            source["per_class"] = per_class
        out[split] = write_split(records, out_dir, dataset=dataset, split=split,
                                 classes=classes, options=opts, source=source)
    return out
