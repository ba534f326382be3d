"""The sidecar manifest of one split of WebDataset shards, and its checks.

Layout of a converted dataset::

    <out_dir>/<split>/<split>-000000.tar ...   WebDataset shards
    <out_dir>/<split>/manifest.json            this file

Each sample of a shard holds ``__key__`` = ``f"{idx:08d}"``, the image bytes under ``jpg``
or ``png`` (the original encoding unless a resize was asked), and ``json``::

    {"idx": int, "label": int, "clean": int (-1 if unknown), "key": str, ...extra}

``label`` is the dataset's own (possibly noisy) label, ``clean`` its clean label where the
dataset has one, ``key`` the original file name or key. Extra fields are allowed
(``coarse`` for CIFAR-100). ``idx`` is stable and dense in ``[0, num_samples)``.

A shard's ``first_idx`` (written by :mod:`shards.writer`; absent from older manifests and
hand-made ones) says that it holds exactly the samples ``first_idx .. first_idx +
num_samples - 1``: a reader can then tell how many samples of a subset of idx (the noisy
validation split) each shard holds without opening it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


class ManifestError(ValueError):
    """A manifest does not match the shards on disk (missing shard, checksum, count)."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_samples: int
    sha256: str
    bytes: int
    first_idx: int | None = None


@dataclass(frozen=True)
class Manifest:
    dataset: str
    split: str
    classes: list[str]
    shards: list[ShardInfo]
    source: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def idx_ranges(self) -> list[tuple[int, int]] | None:
        """``[(first_idx, num_samples)]`` per shard when every shard records its
        ``first_idx`` and the ranges tile ``[0, num_samples)`` in order; else None."""
        out, at = [], 0
        for s in self.shards:
            if s.first_idx is None or s.first_idx != at:
                return None
            out.append((s.first_idx, s.num_samples))
            at += s.num_samples
        return out

    def fingerprint(self) -> str:
        """sha256 over the split's classes and its shards' names, sample counts and sha256.
        A label view records the fingerprint of the split it was built over, and a run
        refuses a view whose split's fingerprint differs: another conversion of the same
        images (another shuffle seed, another source) puts other images at the same idx.
        The writer is byte-deterministic, so converting the same source with the same
        options again gives the same fingerprint."""
        h = hashlib.sha256(json.dumps(list(self.classes)).encode())
        for s in self.shards:
            h.update(f"\n{s.name}\t{s.num_samples}\t{s.sha256}".encode())
        return h.hexdigest()

    def to_json(self) -> str:
        d = asdict(self)
        d["num_samples"] = self.num_samples
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    def save(self, split_dir: str | os.PathLike) -> Path:
        """Write ``manifest.json`` atomically into ``split_dir``."""
        split_dir = Path(split_dir)
        path = split_dir / MANIFEST_NAME
        fd, tmp = tempfile.mkstemp(dir=split_dir, prefix=".manifest", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; readers may be other users
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, split_dir_or_file: str | os.PathLike) -> "Manifest":
        p = Path(split_dir_or_file)
        path = p / MANIFEST_NAME if p.is_dir() else p
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ManifestError(f"{path}: no manifest (was the split converted?)") from None
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: invalid JSON ({e})") from e
        if d.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"{path}: unsupported format_version {d.get('format_version')}")
        try:
            shards = [ShardInfo(**s) for s in d["shards"]]
            m = cls(dataset=d["dataset"], split=d["split"], classes=list(d["classes"]),
                    shards=shards, source=d.get("source", {}))
        except KeyError as e:
            raise ManifestError(f"{path}: missing field {e}") from None
        except TypeError as e:
            raise ManifestError(f"{path}: malformed manifest ({e})") from None
        if "num_samples" in d and d["num_samples"] != m.num_samples:
            raise ManifestError(
                f"{path}: num_samples {d['num_samples']} != sum over shards {m.num_samples}"
            )
        return m

    def urls(self, base: str) -> list[str]:
        """Shard locations under ``base`` (a local directory or an ``http(s)://``/``s3://`` prefix)."""
        base = str(base).rstrip("/")
        return [f"{base}/{s.name}" for s in self.shards]

    def verify(self, split_dir: str | os.PathLike, *, checksums: bool = True) -> None:
        """Check every local shard exists with the recorded size (and sha256).

        Raises ``ManifestError`` naming the first shard that does not match.
        """
        split_dir = Path(split_dir)
        for s in self.shards:
            path = split_dir / s.name
            if not path.is_file():
                raise ManifestError(f"{path}: shard listed in the manifest is missing")
            size = path.stat().st_size
            if size != s.bytes:
                raise ManifestError(f"{path}: size {size} != manifest {s.bytes}")
            if checksums and sha256_file(path) != s.sha256:
                raise ManifestError(f"{path}: sha256 does not match the manifest")


def sha256_file(path: str | os.PathLike, *, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sample_key(idx: int) -> str:
    """The ``__key__`` of sample ``idx`` in a shard."""
    return f"{idx:08d}"
