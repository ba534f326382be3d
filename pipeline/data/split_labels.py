"""The per-sample labels of a split of shards, read from the ``<key>.json`` members of its
tar files (no image is decoded): what label views, the label-issue report and the jobs'
sample keys are built from.

Imports: :mod:`pipeline.data.manifest`.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.manifest import Manifest, ManifestError, sample_key


def tar_members(tar: tarfile.TarFile, path: Path):
    """The members of ``tar``; a damaged archive raises ManifestError naming the shard."""
    it = iter(tar)
    while True:
        try:
            member = next(it)
        except StopIteration:
            return
        except (tarfile.TarError, EOFError, OSError) as e:
            raise ManifestError(f"{path}: damaged tar archive ({e})") from None
        yield member


def read_split_labels(split_dir: str | Path, *, checksums: bool = False) -> dict[str, np.ndarray]:
    """Per-sample labels of a split, read from the ``<key>.json`` members of its shards.

    Returns ``idx (N,) int64`` (= ``arange(N)``), ``label (N,) int64``, ``clean (N,) int64``
    (``-1`` unknown), ``key (N,) str`` (the dataset's original key), and ``coarse (N,) int64``
    when every sample has a ``coarse`` field (CIFAR-100), all indexed by ``idx``.

    Checks each shard's size against the manifest (and sha256 with ``checksums=True``), each
    shard's sample count, that a member's name is ``sample_key(idx)``, labels lie in
    ``[0, K)``, and that ``idx`` is dense in ``[0, N)`` with ``N = manifest.num_samples``.
    Raises ``ManifestError`` naming the shard (and member) at fault.
    """
    split_dir = Path(split_dir)
    man = Manifest.load(split_dir)
    man.verify(split_dir, checksums=checksums)
    n, k = man.num_samples, man.num_classes
    label = np.full(n, -2, np.int64)
    clean = np.full(n, -2, np.int64)
    coarse = np.full(n, -1, np.int64)
    has_coarse = 0
    keys: list[str | None] = [None] * n
    for shard in man.shards:
        path = split_dir / shard.name
        count = 0
        try:
            tar = tarfile.open(path, "r:")
        except tarfile.TarError as e:
            raise ManifestError(f"{path}: not a readable tar archive ({e}); re-convert the "
                                "split or restore the shard") from None
        with tar:
            for member in tar_members(tar, path):
                if not member.isfile() or not member.name.endswith(".json"):
                    continue
                where = f"{path}: member {member.name}"
                stem = Path(member.name).name[: -len(".json")]
                try:
                    raw = tar.extractfile(member).read()
                except (tarfile.TarError, EOFError, OSError) as e:
                    raise ManifestError(f"{where}: cannot read ({e})") from None
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ManifestError(f"{where}: invalid JSON ({e})") from None
                idx = _int_field(rec, "idx", where)
                if stem != sample_key(idx):
                    raise ManifestError(f"{where}: holds idx {idx}, expected the member to be "
                                        f"named {sample_key(idx)}.json")
                if not 0 <= idx < n:
                    raise ManifestError(f"{where}: idx {idx} is outside [0, {n}) "
                                        f"(manifest num_samples {n})")
                if label[idx] != -2:
                    raise ManifestError(f"{where}: idx {idx} appears twice in the split")
                lab, cl = _int_field(rec, "label", where), _int_field(rec, "clean", where)
                if not 0 <= lab < k:
                    raise ManifestError(f"{where}: label {lab} is outside [0, {k})")
                if not -1 <= cl < k:
                    raise ManifestError(f"{where}: clean {cl} is outside [-1, {k})")
                key = rec.get("key")
                if not isinstance(key, str):
                    raise ManifestError(f"{where}: 'key' must be a string, got {key!r}")
                label[idx], clean[idx], keys[idx] = lab, cl, key
                if "coarse" in rec:
                    coarse[idx] = _int_field(rec, "coarse", where)
                    has_coarse += 1
                count += 1
        if count != shard.num_samples:
            raise ManifestError(f"{path}: {count} samples, manifest says {shard.num_samples}")
    absent = np.flatnonzero(label == -2)
    if absent.size:  # unreachable when counts match and idx are unique, kept as a guard
        raise ManifestError(f"{split_dir}: idx {int(absent[0])} is missing from the shards")
    out = {"idx": np.arange(n, dtype=np.int64), "label": label, "clean": clean,
           "key": np.array(keys, dtype=str)}
    if has_coarse == n and n:
        out["coarse"] = coarse
    elif has_coarse:
        raise ManifestError(f"{split_dir}: only {has_coarse} of {n} samples have 'coarse'")
    return out


def _int_field(rec: Any, name: str, where: str) -> int:
    v = rec.get(name) if isinstance(rec, dict) else None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ManifestError(f"{where}: field {name!r} must be an int, got {v!r}")
    return v
