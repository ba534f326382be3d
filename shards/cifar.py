"""CIFAR-10 / CIFAR-100 from the python pickle distribution -> shards.

Source layout (what ``torchvision.datasets.CIFAR10/100(download=True)`` leaves on disk)::

    cifar-10-batches-py/data_batch_1 .. data_batch_5, test_batch, batches.meta
    cifar-100-python/train, test, meta

Each batch is a pickled dict (keys may be ``bytes``, as in the official files):
``data: (N, 3072) uint8`` rows in CHW order (1024 red, 1024 green, 1024 blue values of a
32x32 image, row-major), ``labels`` (CIFAR-10) or ``fine_labels`` + ``coarse_labels``
(CIFAR-100), and ``filenames``. ``batches.meta`` holds ``label_names``; ``meta`` holds
``fine_label_names`` and ``coarse_label_names``.

Output: splits ``train`` (50,000; ``data_batch_1..5`` in order) and ``test`` (10,000). Each
image is stored as lossless PNG; ``idx`` is the position in the original order, ``label`` =
``clean`` = the class (CIFAR labels are clean; synthetic noise is a label view), ``key`` is
the pickle's filename entry, and CIFAR-100 adds ``coarse`` (the superclass) to the JSON.

The pickles are loaded with :mod:`pickle`: only convert files from a source you trust.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.data.manifest import Manifest
from shards.writer import SampleRecord, ShardError, WriterOptions, write_split

Variant = Literal["cifar10", "cifar100"]

_LAYOUT = {
    "cifar10": {
        "dir": "cifar-10-batches-py",
        "splits": {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
        "meta": "batches.meta",
    },
    "cifar100": {
        "dir": "cifar-100-python",
        "splits": {"train": ["train"], "test": ["test"]},
        "meta": "meta",
    },
}


def _str_keys(d: dict, path: Path) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ShardError(f"{path}: expected a pickled dict, got {type(d).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}


def _load_pickle(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return _str_keys(pickle.load(f, encoding="bytes"), path)
    except FileNotFoundError:
        raise ShardError(f"{path}: CIFAR file not found") from None
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ShardError(f"{path}: not a CIFAR pickle ({e})") from e


def _names(values: Sequence[Any]) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def find_root(src: str | os.PathLike, variant: Variant | None = None) -> tuple[Path, Variant]:
    """Locate the batches folder under ``src`` (or ``src`` itself); detect the variant."""
    src = Path(src)
    variants = [variant] if variant else ["cifar10", "cifar100"]
    for v in variants:
        lay = _LAYOUT[v]
        for cand in (src, src / lay["dir"]):
            if (cand / lay["meta"]).is_file() and all(
                    (cand / f).is_file() for fs in lay["splits"].values() for f in fs):
                return cand, v
    want = " or ".join(_LAYOUT[v]["dir"] for v in variants)
    raise ShardError(f"{src}: no {want} folder (with its batch and meta files) found")


def _batch_rows(path: Path, variant: Variant) -> tuple[np.ndarray, list[int], list[int] | None,
                                                      list[str]]:
    d = _load_pickle(path)
    label_key = "labels" if variant == "cifar10" else "fine_labels"
    for k in ("data", label_key, "filenames"):
        if k not in d:
            raise ShardError(f"{path}: missing key {k!r} (has {sorted(d)})")
    data = np.asarray(d["data"])
    n = len(d[label_key])
    if data.dtype != np.uint8 or data.shape != (n, 3072):
        raise ShardError(f"{path}: data must be ({n}, 3072) uint8, got {data.shape} {data.dtype}")
    if len(d["filenames"]) != n:
        raise ShardError(f"{path}: {len(d['filenames'])} filenames for {n} labels")
    coarse = None
    if variant == "cifar100":
        if "coarse_labels" not in d or len(d["coarse_labels"]) != n:
            raise ShardError(f"{path}: missing or short 'coarse_labels'")
        coarse = [int(c) for c in d["coarse_labels"]]
    return data, [int(x) for x in d[label_key]], coarse, _names(d["filenames"])


def split_records(root: Path, variant: Variant, split: str,
                  num_classes: int) -> list[SampleRecord]:
    """The records of one split: pixels ``(32, 32, 3)`` uint8 HWC, in the original order."""
    records: list[SampleRecord] = []
    for fname in _LAYOUT[variant]["splits"][split]:
        path = root / fname
        data, labels, coarse, names = _batch_rows(path, variant)
        hwc = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        for i, (lab, name) in enumerate(zip(labels, names)):
            if not 0 <= lab < num_classes:
                raise ShardError(f"{path}: row {i}: label {lab} outside [0, {num_classes})")
            extras = {"coarse": coarse[i]} if coarse is not None else {}
            records.append(SampleRecord(idx=len(records), label=lab, clean=lab, key=name,
                                        pixels=hwc[i], extras=extras, origin=f"{path} row {i}"))
    return records


def convert(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    variant: Variant | None = None,
    splits: Sequence[str] = ("train", "test"),
    shard_size: int = 1000,
    workers: int = 1,
    progress: bool = True,
) -> dict[str, Manifest]:
    """Convert CIFAR-10/100 pickles under ``src`` to ``out_dir/<split>/`` shards.

    ``variant``: ``"cifar10"``, ``"cifar100"`` or None (detect from the files). Returns the
    manifest of each split.
    """
    root, variant = find_root(src, variant)
    lay = _LAYOUT[variant]
    meta = _load_pickle(root / lay["meta"])
    name_key = "label_names" if variant == "cifar10" else "fine_label_names"
    if name_key not in meta:
        raise ShardError(f"{root / lay['meta']}: missing key {name_key!r} (has {sorted(meta)})")
    classes = _names(meta[name_key])
    source: dict[str, Any] = {"converter": "shards.cifar", "format": f"{variant}-python",
                              "root": str(root)}
    if variant == "cifar100":
        source["coarse_classes"] = _names(meta.get("coarse_label_names", []))
    opts = WriterOptions(shard_size=shard_size, workers=workers, progress=progress)
    out: dict[str, Manifest] = {}
    for split in splits:
        if split not in lay["splits"]:
            raise ShardError(f"{variant}: unknown split {split!r} (have {sorted(lay['splits'])})")
        records = split_records(root, variant, split, len(classes))
        out[split] = write_split(records, out_dir, dataset=variant, split=split, classes=classes,
                                 options=opts, source=source)
    return out


def download(root: str | os.PathLike, *, variant: Variant = "cifar10") -> Path:
    """Download the pickle distribution into ``root`` with torchvision; return its folder.

    Needs internet access. The returned folder can be passed to :func:`convert`.
    """
    from torchvision import datasets

    cls = datasets.CIFAR10 if variant == "cifar10" else datasets.CIFAR100
    for train in (True, False):
        cls(str(root), train=train, download=True)
    return find_root(root, variant)[0]
