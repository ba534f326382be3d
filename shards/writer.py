"""The one shard writer every converter uses: sample records -> WebDataset tar shards + manifest.

A converter lists its samples as :class:`SampleRecord` objects in ``idx`` order and hands them
to :func:`write_split`, which writes ``<out_dir>/<split>/<split>-NNNNNN.tar`` (``shard_size``
samples each, the last one shorter) and then ``manifest.json`` (layout in
``pipeline/data/manifest.py``). Each sample of a shard holds two members, in this order::

    <idx:08d>.jpg | <idx:08d>.png   the image bytes
    <idx:08d>.json                  {"idx", "label", "clean", "key", ...extras}, sorted keys

Properties:

- **Deterministic.** The same records and options give byte-identical shards, whatever the
  number of workers: tar members carry fixed metadata (mtime 0, uid/gid 0, empty user/group
  names, mode 0444, USTAR format) and JSON is written with sorted keys.
- **Parallel.** One shard is one task of a ``ProcessPoolExecutor`` (``workers > 1``); with
  ``workers == 1`` shards are written in this process. Workers are started with "spawn": a
  script that converts with ``workers > 1`` needs the ``if __name__ == "__main__":`` guard.
  One conversion at a time may write a given split folder.
- **Resumable.** A shard is written to ``<name>.tmp``, fsynced and renamed with
  ``os.replace``; then a done-record ``.progress/<name>.json`` stores the fingerprint of the
  shard's input (its records and the encoding options) with the shard's sha256 and size. A
  rerun skips every shard whose done-record matches its input and whose file has the recorded
  size, and re-reads nothing for it. Source files are assumed not to change between runs
  (their paths, not their bytes, enter the fingerprint).
- **Atomic.** No file under a final shard name is ever incomplete. An existing
  ``manifest.json`` is removed before any shard is touched and the new one is written last,
  atomically, once every shard is done: a manifest on disk always describes complete shards.
- **Validated.** Every source image is opened and verified with PIL (``validate="decode"``
  also decodes all pixels, which catches truncated JPEGs). A bad image raises
  :class:`BadImageError` naming the file (and the list line it came from). With
  ``skip_bad=True`` the writer first scans all images (results are cached in ``.progress/``),
  drops the bad ones, renumbers ``idx`` densely in the original order, and lists the dropped
  keys in the manifest's ``source["skipped"]``.
- **Encoding.** Original bytes are kept: JPEG content is stored as ``jpg``, PNG as ``png``,
  whatever the file is called; any other format (GIF, BMP, WebP, ...) is re-encoded losslessly
  to PNG. ``pixels`` records (CIFAR) are encoded as PNG. With ``resize_short=N`` an image
  whose shorter side exceeds N is re-encoded to JPEG (``jpeg_quality``) with shorter side N
  (antialiased bilinear, as torchvision's Resize; RGB); images not larger than that keep
  their original bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import tarfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from pipeline.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, sample_key

WRITER_VERSION = 1
PROGRESS_DIR = ".progress"
RESERVED_FIELDS = frozenset({"idx", "label", "clean", "key"})
_TAR_FORMAT = tarfile.USTAR_FORMAT


class ShardError(ValueError):
    """A conversion cannot proceed: bad input list, bad record, or inconsistent options."""


class BadImageError(ShardError):
    """A source image is missing, unreadable or not a valid image."""


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One sample to write. Exactly one of ``data``, ``path`` or ``pixels`` is set.

    - ``idx``: position of the sample in its split, ``0..N-1`` in the order records are given.
    - ``label``: the dataset's own (possibly noisy) label in ``[0, K)``.
    - ``clean``: the clean label in ``[0, K)``, or ``-1`` where unknown.
    - ``key``: the original file name or key (stored in the sample's JSON).
    - ``data``: encoded image bytes; ``path``: a file to read them from (in the worker);
      ``pixels``: ``(H, W, 3)`` or ``(H, W)`` uint8 array, encoded as PNG.
    - ``extras``: more JSON fields (e.g. ``{"coarse": 3}``); must not reuse the reserved names
      ``idx``, ``label``, ``clean``, ``key``.
    - ``origin``: where the record came from, for error messages (e.g. ``"list.txt:17"``);
      not part of the output.
    """

    idx: int
    label: int
    clean: int
    key: str
    data: bytes | None = None
    path: str | None = None
    pixels: np.ndarray | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    origin: str | None = None

    def describe(self) -> str:
        where = self.path if self.path is not None else f"key {self.key!r}"
        return f"{where} (from {self.origin})" if self.origin else where


@dataclass(frozen=True)
class WriterOptions:
    """How shards are written.

    ``shard_size``: samples per shard. ``workers``: processes (1 = in this process).
    ``resize_short``: if set, images with shorter side > N are re-encoded to JPEG with shorter
    side N. ``jpeg_quality``: quality of those re-encodes (90-95). ``validate``: ``"verify"``
    (PIL open + verify) or ``"decode"`` (also decode all pixels). ``skip_bad``: drop bad images
    instead of failing. ``progress``: tqdm bar on stderr.
    """

    shard_size: int = 1000
    workers: int = 1
    resize_short: int | None = None
    jpeg_quality: int = 93
    validate: Literal["verify", "decode"] = "verify"
    skip_bad: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.shard_size < 1:
            raise ShardError(f"shard_size must be >= 1, got {self.shard_size}")
        if self.workers < 1:
            raise ShardError(f"workers must be >= 1, got {self.workers}")
        if self.resize_short is not None and self.resize_short < 1:
            raise ShardError(f"resize_short must be >= 1 or None, got {self.resize_short}")
        if not 90 <= self.jpeg_quality <= 95:
            raise ShardError(f"jpeg_quality must be in [90, 95], got {self.jpeg_quality}")
        if self.validate not in ("verify", "decode"):
            raise ShardError(f"validate must be 'verify' or 'decode', got {self.validate!r}")

    def encoding(self) -> dict[str, Any]:
        """Options that change a shard's bytes or how its images were checked; they enter
        every shard's fingerprint, so changing one rewrites the shards on a rerun."""
        return {"writer_version": WRITER_VERSION, "resize_short": self.resize_short,
                "jpeg_quality": self.jpeg_quality, "validate": self.validate}


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


# -- image handling (runs in workers) -------------------------------------------------------


def _read_bytes(rec: SampleRecord) -> bytes:
    if rec.data is not None:
        return rec.data
    try:
        with open(rec.path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise BadImageError(f"{rec.describe()}: image file not found") from None
    except OSError as e:
        raise BadImageError(f"{rec.describe()}: cannot read image ({e})") from e


def _check_image(rec: SampleRecord, data: bytes, opts: WriterOptions, *,
                 for_scan: bool = False) -> tuple[str, tuple[int, int]]:
    """Open + verify (and decode) ``data``; return (PIL format, (width, height)).

    ``for_scan``: also decode images that the write phase will decode (to resize or re-encode
    them), so that the ``skip_bad`` scan finds every image the write phase would fail on.
    """
    if not data:
        raise BadImageError(f"{rec.describe()}: empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt, size = img.format, img.size
            img.verify()
        reencoded = (opts.resize_short is not None and min(size) > opts.resize_short) or \
            fmt not in ("JPEG", "PNG")
        if opts.validate == "decode" or (for_scan and reencoded):
            with Image.open(io.BytesIO(data)) as img:
                img.load()
    except UnidentifiedImageError:  # its message names a BytesIO object, not the file
        raise BadImageError(f"{rec.describe()}: not a valid image (no image format PIL reads: "
                            f"{len(data):,} bytes starting {data[:8]!r})") from None
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, struct.error, ...)
        raise BadImageError(
            f"{rec.describe()}: not a valid image ({type(e).__name__}: {e})"
        ) from e
    return fmt, size


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")


def _resize_jpeg(data: bytes, size: tuple[int, int], short: int, quality: int) -> bytes:
    w, h = size
    scale = short / min(w, h)
    new = (max(1, round(w * scale)), max(1, round(h * scale)))
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "JPEG":
            img.draft("RGB", new)  # DCT-domain downscale to >= new size: much faster decode
        rgb = _to_rgb(img)
        out = rgb.resize(new, Image.Resampling.BILINEAR)  # antialiased, as torchvision Resize
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def encode_sample_image(rec: SampleRecord, opts: WriterOptions) -> tuple[bytes, str]:
    """Return (image bytes, ext) to store for ``rec``; raises :class:`BadImageError`."""
    if rec.pixels is not None:
        arr = np.ascontiguousarray(rec.pixels)
        if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] != 3):
            raise ShardError(f"{rec.describe()}: pixels must be (H, W[, 3]) uint8, "
                             f"got {arr.shape} {arr.dtype}")
        return _encode_png(Image.fromarray(arr)), "png"
    data = _read_bytes(rec)
    fmt, size = _check_image(rec, data, opts)
    if opts.resize_short is not None and min(size) > opts.resize_short:
        try:
            return _resize_jpeg(data, size, opts.resize_short, opts.jpeg_quality), "jpg"
        except Exception as e:
            raise BadImageError(f"{rec.describe()}: cannot decode for resizing "
                                f"({type(e).__name__}: {e})") from e
    if fmt == "JPEG":
        return data, "jpg"
    if fmt == "PNG":
        return data, "png"
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.seek(0)
            conv = img.convert("RGBA" if "A" in img.mode or "transparency" in img.info else "RGB")
        return _encode_png(conv), "png"
    except Exception as e:
        raise BadImageError(f"{rec.describe()}: cannot re-encode {fmt} to PNG "
                            f"({type(e).__name__}: {e})") from e


def sample_json(rec: SampleRecord, idx: int) -> bytes:
    meta = dict(rec.extras)
    meta.update(idx=idx, label=int(rec.label), clean=int(rec.clean), key=rec.key)
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


# -- tar writing ------------------------------------------------------------------------------


class _HashingFile:
    """File wrapper that hashes and counts what is written (what tarfile needs: write/tell)."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.nbytes += len(b)
        return self._f.write(b)

    def tell(self) -> int:
        return self.nbytes


def _tar_member(name: str, payload: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    ti = tarfile.TarInfo(name)
    ti.size = len(payload)
    ti.mtime = 0
    ti.mode = 0o444
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti, io.BytesIO(payload)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class _ShardTask:
    split_dir: str
    name: str
    records: tuple[SampleRecord, ...]
    opts: WriterOptions
    fingerprint: str


def _write_shard(task: _ShardTask) -> ShardInfo:
    """Write one shard to ``<name>.tmp``, fsync, rename, then record it as done."""
    split_dir = Path(task.split_dir)
    final = split_dir / task.name
    tmp = split_dir / (task.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            hf = _HashingFile(raw)
            with tarfile.open(fileobj=hf, mode="w", format=_TAR_FORMAT) as tar:
                for rec in task.records:
                    image, ext = encode_sample_image(rec, task.opts)
                    key = sample_key(rec.idx)
                    members = {ext: image, "json": sample_json(rec, rec.idx)}
                    for field_name in sorted(members):
                        tar.addfile(*_tar_member(f"{key}.{field_name}", members[field_name]))
            raw.flush()
            os.fsync(raw.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    info = ShardInfo(name=task.name, num_samples=len(task.records), sha256=hf.sha.hexdigest(),
                     bytes=hf.nbytes,
                     first_idx=task.records[0].idx if task.records else None)
    os.replace(tmp, final)
    _fsync_dir(split_dir)
    _write_json_atomic(split_dir / PROGRESS_DIR / (task.name + ".json"),
                       {"fingerprint": task.fingerprint, "name": info.name,
                        "num_samples": info.num_samples, "sha256": info.sha256,
                        "bytes": info.bytes, "first_idx": info.first_idx})
    return info


@dataclass(frozen=True)
class _ScanTask:
    split_dir: str
    chunk: int
    records: tuple[SampleRecord, ...]
    opts: WriterOptions
    fingerprint: str


def _scan_chunk(task: _ScanTask) -> list[tuple[int, str, str]]:
    """Validate a chunk of images; return [(idx, key, error)] of the bad ones (and cache it)."""
    bad = []
    for rec in task.records:
        if rec.pixels is not None:
            continue
        try:
            _check_image(rec, _read_bytes(rec), task.opts, for_scan=True)
        except BadImageError as e:
            bad.append((rec.idx, rec.key, str(e)))
    _write_json_atomic(Path(task.split_dir) / PROGRESS_DIR / f"scan-{task.chunk:06d}.json",
                       {"fingerprint": task.fingerprint, "bad": bad})
    return bad


# -- fingerprints and done-records ----------------------------------------------------------


def _record_identity(rec: SampleRecord) -> list[Any]:
    if rec.path is not None:
        src: Any = ["path", rec.path]
    elif rec.data is not None:
        src = ["data", hashlib.sha256(rec.data).hexdigest()]
    else:
        arr = np.ascontiguousarray(rec.pixels)
        src = ["pixels", list(arr.shape), str(arr.dtype), hashlib.sha256(arr.tobytes()).hexdigest()]
    return [rec.idx, rec.label, rec.clean, rec.key, dict(rec.extras), src]


def _fingerprint(kind: str, name: str, records: Sequence[SampleRecord], opts: WriterOptions) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([kind, name, opts.encoding()], sort_keys=True).encode())
    for rec in records:
        try:
            h.update(json.dumps(_record_identity(rec), sort_keys=True).encode())
        except TypeError as e:
            raise ShardError(f"{rec.describe()}: extras are not JSON-serialisable ({e})") from e
    return h.hexdigest()


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _done_info(split_dir: Path, name: str, fingerprint: str) -> ShardInfo | None:
    """The shard's info if its done-record matches ``fingerprint`` and the file is in place."""
    d = _load_json(split_dir / PROGRESS_DIR / (name + ".json"))
    if not d or d.get("fingerprint") != fingerprint:
        return None
    path = split_dir / name
    try:
        if path.stat().st_size != d["bytes"]:
            return None
    except OSError:
        return None
    return ShardInfo(name=name, num_samples=d["num_samples"], sha256=d["sha256"], bytes=d["bytes"],
                     first_idx=d.get("first_idx"))


# -- input checks -----------------------------------------------------------------------------


def _check_record(rec: SampleRecord, position: int, num_classes: int) -> None:
    if not isinstance(rec, SampleRecord):
        raise ShardError(f"record {position} is a {type(rec).__name__}, not a SampleRecord")
    if rec.idx != position:
        raise ShardError(f"{rec.describe()}: idx {rec.idx} at position {position}; records must "
                         "be given in idx order with idx = 0..N-1")
    n_src = (rec.data is not None) + (rec.path is not None) + (rec.pixels is not None)
    if n_src != 1:
        raise ShardError(f"{rec.describe()}: exactly one of data, path, pixels must be set")
    if not 0 <= rec.label < num_classes:
        raise ShardError(f"{rec.describe()}: label {rec.label} outside [0, {num_classes})")
    if not -1 <= rec.clean < num_classes:  # -1: unknown (an outlier is a label view's K)
        raise ShardError(f"{rec.describe()}: clean label {rec.clean} outside [-1, {num_classes})")
    clash = RESERVED_FIELDS & set(rec.extras)
    if clash:
        raise ShardError(f"{rec.describe()}: extras reuse reserved field(s) {sorted(clash)}")


def _checked(records: Iterable[SampleRecord], num_classes: int) -> Iterator[SampleRecord]:
    for position, rec in enumerate(records):
        _check_record(rec, position, num_classes)
        yield rec


def _chunks(it: Iterable[SampleRecord], size: int) -> Iterator[tuple[SampleRecord, ...]]:
    buf: list[SampleRecord] = []
    for rec in it:
        buf.append(rec)
        if len(buf) == size:
            yield tuple(buf)
            buf = []
    if buf:
        yield tuple(buf)


# -- the driver -------------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Pool initializer: end this worker as soon as the converting process is gone.

    A parent killed with SIGKILL cannot shut its pool down; its workers would wait for tasks
    forever (re-parented to PID 1), and with them multiprocessing's resource tracker. A
    daemon thread checks every ``poll_s`` seconds whether this process still has the parent
    that started it, and exits otherwise.
    """
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class _Runner:
    """Runs tasks inline (workers == 1) or on a process pool, with bounded in-flight tasks.
    Pool workers end with the process that started them, even when it is SIGKILLed."""

    def __init__(self, workers: int) -> None:
        self.pool = None
        if workers > 1:
            self.pool = cf.ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_exit_with_parent, initargs=(os.getpid(),))
        self.max_in_flight = 2 * workers
        self.pending: dict[cf.Future, int] = {}

    def __enter__(self) -> "_Runner":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.pool is not None:
            # On error, drop queued tasks; running ones finish their (atomic) shard.
            self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)

    def submit(self, fn, task, tag: int) -> list[tuple[int, Any]]:
        """Run or queue ``fn(task)``; return (tag, result) of the tasks finished meanwhile.

        Inline, ``fn`` runs now. On the pool, this waits for a task to finish once
        ``2 * workers`` are in flight, so records are consumed only a little ahead.
        """
        if self.pool is None:
            return [(tag, fn(task))]
        self.pending[self.pool.submit(fn, task)] = tag
        if len(self.pending) >= self.max_in_flight:
            return self._collect()
        return []

    def drain(self) -> list[tuple[int, Any]]:
        """Wait for every queued task; return their (tag, result)."""
        out: list[tuple[int, Any]] = []
        while self.pending:
            out += self._collect()
        return out

    def _collect(self) -> list[tuple[int, Any]]:
        done, _ = cf.wait(self.pending, return_when=cf.FIRST_COMPLETED)
        out = []
        for fut in sorted(done, key=lambda f: self.pending[f]):
            tag = self.pending.pop(fut)
            out.append((tag, fut.result()))  # re-raises a task's error here
        return out


def _length(records: Iterable[SampleRecord], num_samples: int | None) -> int | None:
    if num_samples is not None:
        return num_samples
    try:
        return len(records)  # type: ignore[arg-type]
    except TypeError:
        return None


def _clean_split_dir(split_dir: Path, split: str, num_shards: int | None) -> None:
    """Remove the manifest, stale temp files, and shards beyond ``num_shards`` (if known)."""
    (split_dir / MANIFEST_NAME).unlink(missing_ok=True)
    pat = re.compile(rf"{re.escape(split)}-(\d{{6}})\.tar")
    for p in split_dir.iterdir():
        if p.name.endswith(".tmp"):
            p.unlink()
            continue
        m = pat.fullmatch(p.name)
        if m and num_shards is not None and int(m.group(1)) >= num_shards:
            p.unlink()
            (split_dir / PROGRESS_DIR / (p.name + ".json")).unlink(missing_ok=True)


def _scan_bad(records: list[SampleRecord], split_dir: Path, opts: WriterOptions,
              bar: tqdm) -> list[tuple[int, str, str]]:
    """Validate every image (cached per chunk in .progress/scan-*.json); return the bad ones."""
    bad: list[tuple[int, str, str]] = []
    bar.set_description(f"{split_dir.name}: scan")
    results: dict[int, list] = {}
    with _Runner(opts.workers) as runner:
        for chunk_no, start in enumerate(range(0, len(records), opts.shard_size)):
            chunk = tuple(records[start:start + opts.shard_size])
            fp = _fingerprint("scan", str(chunk_no), chunk, opts)
            cached = _load_json(split_dir / PROGRESS_DIR / f"scan-{chunk_no:06d}.json")
            if cached and cached.get("fingerprint") == fp:
                results[chunk_no] = [tuple(b) for b in cached["bad"]]
                bar.update(len(chunk))
                continue
            task = _ScanTask(str(split_dir), chunk_no, chunk, opts, fp)
            for tag, res in runner.submit(_scan_chunk, task, chunk_no):
                results[tag] = res
                bar.update(min(opts.shard_size, len(records) - tag * opts.shard_size))
        for tag, res in runner.drain():
            results[tag] = res
            bar.update(min(opts.shard_size, len(records) - tag * opts.shard_size))
    for chunk_no in sorted(results):
        bad.extend(results[chunk_no])
    bar.reset()
    return bad


def shuffled(records: Sequence[SampleRecord], seed: int) -> list[SampleRecord]:
    """``records`` in a seeded random order, ``idx`` renumbered 0..N-1 in that order (the
    ``key`` still names each image). For sources listed class by class (image folders,
    WebVision's file lists): every shard then holds the classes in proportion. From
    class-sorted shards the loader cannot mix a batch: its shard shuffle moves whole shards
    and its sample buffer (1,000 by default) spans one or two of them, so most batches would
    hold one or two classes and SGD would not learn."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ShardError(f"shuffle seed must be a non-negative integer, got {seed!r}")
    perm = np.random.default_rng(int(seed)).permutation(len(records))
    return [replace(records[j], idx=i) for i, j in enumerate(perm.tolist())]


def write_split(
    records: Iterable[SampleRecord],
    out_dir: str | os.PathLike,
    *,
    dataset: str,
    split: str,
    classes: Sequence[str],
    options: WriterOptions | None = None,
    num_samples: int | None = None,
    source: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write one split as shards under ``out_dir/split`` and return its (saved) manifest.

    ``records``: the samples in ``idx`` order (``idx`` = 0..N-1); a sequence, or any iterable
    (then give ``num_samples`` for the progress bar and a count check). Records are consumed
    lazily, ``2 * workers`` shards ahead of the writers, except with ``skip_bad`` (all kept).
    ``classes``: class names, index = label. ``source``: provenance stored in the manifest.
    """
    opts = options or WriterOptions()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", split):
        raise ShardError(f"split name {split!r} must match [A-Za-z0-9_.-]+")
    num_classes = len(classes)
    if num_classes < 1:
        raise ShardError(f"{dataset}/{split}: no class names given")
    split_dir = Path(out_dir) / split
    (split_dir / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    total = _length(records, num_samples)
    stream: Iterable[SampleRecord] = _checked(records, num_classes)

    skipped: list[tuple[int, str, str]] = []
    bar = tqdm(total=total, disable=not opts.progress, unit="img", desc=f"{split}",
               dynamic_ncols=True, leave=True)
    try:
        if opts.skip_bad:
            all_recs = list(stream)
            total = len(all_recs)
            _clean_split_dir(split_dir, split, None)
            skipped = _scan_bad(all_recs, split_dir, opts, bar)
            bad_idx = {b[0] for b in skipped}
            kept = [r for r in all_recs if r.idx not in bad_idx]
            stream = [replace(r, idx=i) for i, r in enumerate(kept)] if skipped else kept
            total = len(kept)
            bar.total = total
        _clean_split_dir(split_dir, split,
                         None if total is None else math.ceil(total / opts.shard_size))
        bar.set_description(f"{split}")
        infos: dict[int, ShardInfo] = {}
        count = 0
        with _Runner(opts.workers) as runner:
            for shard_no, chunk in enumerate(_chunks(stream, opts.shard_size)):
                count += len(chunk)
                name = shard_name(split, shard_no)
                fp = _fingerprint("shard", name, chunk, opts)
                done = _done_info(split_dir, name, fp)
                if done is not None:
                    infos[shard_no] = done
                    bar.update(done.num_samples)
                    continue
                task = _ShardTask(str(split_dir), name, chunk, opts, fp)
                for tag, info in runner.submit(_write_shard, task, shard_no):
                    infos[tag] = info
                    bar.update(info.num_samples)
            for tag, info in runner.drain():
                infos[tag] = info
                bar.update(info.num_samples)
    finally:
        bar.close()
    if total is not None and count != total:
        raise ShardError(f"{dataset}/{split}: expected {total} records, got {count}")
    if count == 0:
        raise ShardError(f"{dataset}/{split}: no samples to write")
    shards = [infos[i] for i in range(len(infos))]
    if total is None:  # now known: remove shards left over from a longer earlier run
        _clean_split_dir(split_dir, split, len(shards))
    src = dict(source or {})
    src["writer"] = {**opts.encoding(), "shard_size": opts.shard_size, "skip_bad": opts.skip_bad}
    src["skipped"] = {"count": len(skipped), "keys": [b[1] for b in skipped],
                      "errors": [b[2] for b in skipped]}
    manifest = Manifest(dataset=dataset, split=split, classes=list(classes), shards=shards,
                        source=src)
    manifest.save(split_dir)
    _fsync_dir(split_dir)
    return manifest
