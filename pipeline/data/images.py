"""Images to predict on, as ``(key, PIL image)`` pairs in a fixed order, from the three
places a user keeps them: a folder (every image file under it, recursively, sorted by its
path relative to the folder, which is the key), a CSV with a ``path`` column (paths relative
to the CSV's folder unless absolute; the key is the path as written), or a converted split
(a folder with a ``manifest.json`` and its tar shards; the key is each sample's key, its
path in the source tree for an image folder).

A file that cannot be decoded is an error naming it (and, for a CSV, its line): a
prediction file silently missing rows is worse than none.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from pipeline.core import csvrows
from pipeline.data.manifest import Manifest

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff",
                              ".ppm", ".pgm"})
# the image members of a shard sample (shards.writer writes one of them)
SHARD_IMAGE_EXTS = ("jpg", "jpeg", "png")


def _open(data: bytes | os.PathLike | str, where: str, mode: str) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        img.load()
        return img.convert(mode)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: not a readable image ({e})") from None


def folder_images(root: str | os.PathLike, *, mode: str = "RGB"
                  ) -> Iterator[tuple[str, Image.Image]]:
    """Every image file under ``root`` (hidden files and folders skipped), sorted by its
    POSIX path relative to ``root``, which is its key."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_EXTENSIONS:
                found.append((Path(dirpath) / f).relative_to(root).as_posix())
    if not found:
        raise ValueError(f"{root}: no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    for key in sorted(found):
        yield key, _open(root / key, str(root / key), mode)


def csv_images(path: str | os.PathLike, *, mode: str = "RGB"
               ) -> Iterator[tuple[str, Image.Image]]:
    """The images a CSV lists in its ``path`` column, in its order (other columns, e.g. a
    label, are ignored); relative paths from the CSV's folder."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8-sig") as f:
        cols, table = csvrows.dict_rows(f, path)  # CSVFormatError (a ValueError): file:line
        if "path" not in cols:
            raise ValueError(f"{path}:1: needs a header with a 'path' column, got "
                             f"{cols or None}")
        for line, row in table:
            rel = (row.get("path") or "").strip()
            if not rel:
                raise ValueError(f"{path}:{line}: empty path")
            file = Path(rel) if Path(rel).is_absolute() else path.parent / rel
            if not file.is_file():
                raise FileNotFoundError(f"{path}:{line}: {file}: no such file")
            yield rel, _open(file, f"{path}:{line}: {file}", mode)


def split_images(split_dir: str | os.PathLike, *, mode: str = "RGB"
                 ) -> Iterator[tuple[str, Image.Image]]:
    """The samples of a converted split (local shards), shard by shard in the manifest's
    order; every shard must hold the samples its manifest entry counts."""
    split_dir = Path(split_dir)
    manifest = Manifest.load(split_dir)
    for info in manifest.shards:
        tar_path = split_dir / info.name
        if not tar_path.is_file():
            raise FileNotFoundError(f"{tar_path}: shard listed in the manifest is missing")
        seen = 0
        pending: dict[str, dict[str, bytes]] = {}
        with tarfile.open(tar_path) as tar:
            for member in tar:  # <idx>.jpg|png and <idx>.json, next to each other
                base, _, ext = member.name.partition(".")
                ext = ext.lower()
                if not member.isfile() or (ext not in SHARD_IMAGE_EXTS and ext != "json"):
                    continue
                got = pending.setdefault(base, {})
                got[ext] = tar.extractfile(member).read()
                image = next((e for e in SHARD_IMAGE_EXTS if e in got), None)
                if image is None or "json" not in got:
                    continue
                del pending[base]
                try:
                    key = str(json.loads(got["json"]).get("key") or base)
                except ValueError:
                    raise ValueError(f"{tar_path}:{base}.json: not JSON") from None
                seen += 1
                yield key, _open(got[image], f"{tar_path}:{base}.{image}", mode)
        if pending:
            raise ValueError(f"{tar_path}: sample {next(iter(pending))} lacks its image or "
                             f"its json")
        if seen != info.num_samples:
            raise ValueError(f"{tar_path}: {seen} images, the manifest says "
                             f"{info.num_samples}")


def input_images(source: str | os.PathLike, *, mode: str = "RGB"
                 ) -> Iterator[tuple[str, Image.Image]]:
    """:func:`split_images` for a folder with a ``manifest.json``, :func:`csv_images` for a
    ``.csv`` file, :func:`folder_images` for any other folder."""
    source = Path(source)
    if source.is_file() and source.suffix.lower() == ".csv":
        return csv_images(source, mode=mode)
    if (source / "manifest.json").is_file():
        return split_images(source, mode=mode)
    if source.is_dir():
        return folder_images(source, mode=mode)
    raise FileNotFoundError(f"{source}: neither a folder nor a .csv file")
