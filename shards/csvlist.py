"""A CSV of ``path,label`` rows -> shards (original bytes kept, or resized): one's own data
where the labels live in a table rather than in class folders.

Columns (a header row is required; other columns are ignored):

``path``   the image file, relative to the CSV's folder or absolute.
``label``  the (possibly noisy) class name of the image.
``split``  optional: the split the row belongs to (``train`` when the column is absent or
           the cell is empty), e.g. ``test`` for a clean test set in the same table.
``clean``  optional: a verified class name where one is known (empty: unknown, stored as
           ``-1``); with none the labels are unverified, as web labels are, except in the
           ``verified_splits`` (``test`` by default: a test set's labels are its truth),
           whose rows keep their ``label`` as the clean label.

Classes are the sorted distinct ``label`` values of every row (so every split uses the same
label indices), or an explicit ``classes`` list (a label not in it is an error naming the
line). Every file is checked to exist before anything is written; a missing file, an empty
cell, a path listed twice in one split, a row with more cells than the header has columns
or an unterminated quote is an error naming the CSV's line. ``key`` = the
``path`` cell as written. Rows are written in a seeded random order (``shuffle_seed``) so
that every shard mixes the classes; ``idx`` = the position in that order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pipeline.core import csvrows
from pipeline.data.manifest import Manifest
from shards.writer import SampleRecord, ShardError, WriterOptions, shuffled, write_split

DEFAULT_SPLIT = "train"


def read_rows(path: str | os.PathLike) -> list[dict[str, str | int]]:
    """The CSV's rows as ``{"line", "path", "file", "label", "split", "clean"}`` (cells
    stripped; ``file`` the resolved image path, checked to exist). One clear error
    (``ShardError``) naming the line of the first bad row."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: no such file")
    rows: list[dict[str, str | int]] = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        try:
            cols, table = csvrows.dict_rows(f, path)
            missing = [c for c in ("path", "label") if c not in cols]
            if missing:
                raise ShardError(f"{path}:1: the header needs the columns path,label (missing "
                                 f"{','.join(missing)}; got {','.join(cols) or 'no header'})")
            for line, row in table:
                cell = {k: (row.get(k) or "").strip() for k in ("path", "label", "split", "clean")}
                for k in ("path", "label"):
                    if not cell[k]:
                        raise ShardError(f"{path}:{line}: empty {k}")
                file = Path(cell["path"])
                file = file if file.is_absolute() else path.parent / file
                if not file.is_file():
                    raise ShardError(f"{path}:{line}: {file}: no such file")
                rows.append({"line": line, "path": cell["path"], "file": str(file),
                             "label": cell["label"], "split": cell["split"] or DEFAULT_SPLIT,
                             "clean": cell["clean"]})
        except csvrows.CSVFormatError as e:
            raise ShardError(str(e)) from None
        except UnicodeDecodeError as e:
            raise ShardError(f"{path}: not UTF-8 text ({e})") from None
    if not rows:
        raise ShardError(f"{path}: no rows under the header")
    return rows


def convert(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    splits: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    dataset: str = "csv",
    shard_size: int = 1000,
    workers: int = 1,
    resize_short: int | None = None,
    validate: Literal["verify", "decode"] = "verify",
    skip_bad: bool = False,
    progress: bool = True,
    shuffle_seed: int | None = 0,
    verified_splits: Sequence[str] = ("test",),
    rows: list[dict[str, str | int]] | None = None,
) -> dict[str, Manifest]:
    """Convert the CSV ``src`` to ``out_dir/<split>/`` shards, one split per distinct
    ``split`` cell (``splits``: only these, each must have rows). Rows of
    ``verified_splits`` without a ``clean`` cell take their label as the clean one.
    ``rows``: :func:`read_rows` of ``src`` already read (each file is checked once)."""
    src = Path(src)
    rows = read_rows(src) if rows is None else rows
    if classes is None:
        classes = sorted({str(r["label"]) for r in rows})
    else:
        classes = list(classes)
        if len(set(classes)) != len(classes):
            raise ShardError(f"class list has duplicates: {classes}")
    index = {c: i for i, c in enumerate(classes)}
    for r in rows:
        for col in ("label", "clean"):
            if r[col] and r[col] not in index:
                raise ShardError(f"{src}:{r['line']}: {col} {r[col]!r} is not in the class "
                                 f"list ({len(classes)} classes: {', '.join(classes[:10])}"
                                 f"{', ...' if len(classes) > 10 else ''})")
    present = sorted({str(r["split"]) for r in rows})
    if splits is None:
        splits = present
    else:
        absent = [s for s in splits if s not in present]
        if absent:
            raise ShardError(f"{src}: no rows of split(s) {absent} (the split column holds "
                             f"{present})")
    opts = WriterOptions(shard_size=shard_size, workers=workers, resize_short=resize_short,
                         validate=validate, skip_bad=skip_bad, progress=progress)
    out: dict[str, Manifest] = {}
    for split in splits:
        seen: dict[str, int] = {}
        records: list[SampleRecord] = []
        for r in rows:
            if r["split"] != split:
                continue
            if r["path"] in seen:
                raise ShardError(f"{src}:{r['line']}: {r['path']} is listed twice in split "
                                 f"{split!r} (first on line {seen[r['path']]})")
            seen[str(r["path"])] = int(r["line"])
            label = index[str(r["label"])]
            if r["clean"]:
                clean = index[str(r["clean"])]
            else:
                clean = label if split in verified_splits else -1
            records.append(SampleRecord(
                idx=len(records), label=label, clean=clean, key=str(r["path"]),
                path=str(r["file"]), origin=f"{src.name}:{r['line']}"))
        if shuffle_seed is not None:
            records = shuffled(records, shuffle_seed)
        source = {"converter": "shards.csvlist", "format": "csv", "root": str(src),
                  "labels_unverified": not any(r.clean >= 0 for r in records),
                  "shuffle_seed": shuffle_seed}
        out[split] = write_split(records, out_dir, dataset=dataset, split=split,
                                 classes=classes, options=opts, source=source)
    return out
