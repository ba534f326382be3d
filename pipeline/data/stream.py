"""The WebDataset streaming loader for Ray Train workers: equal batches on every rank.

``make_train_loader(source, label_view, cfg, rank=, world_size=, epoch=)`` returns a
``ShardLoader``: an iterable of ``Batch`` with exactly ``steps_per_epoch`` batches on every
rank (DDP and ``ray.train.report`` are barriers: uneven batch counts hang them), in which
every ``idx`` of the split appears exactly once per epoch over all ranks together.

Stages of one epoch (what each yields)::

    shard list           manifest order: shard i = (url, num_samples)           [main process]
    shard order          permutation of the shards from (seed, epoch); identity for eval
    split across ranks   greedy, in that order, each shard to the rank with the fewest samples
                         so far -> rank r reads n_r samples, known before reading a byte
    split across workers the rank's shards, greedy again over its DataLoader workers
                         (a "slot" = (rank, worker)); fewer workers if it has fewer shards
    -- in each DataLoader worker (or in-process when num_workers == 0) ------------------
    open                 {"url", "stream"}: a local file, an HTTP response (urllib) or an
                         s3 object stream (``pipeline.data.s3.ObjectReader``, boto3; resumes a
                         dropped connection where it broke)
    tar reading          {"fname", "data"} per tar member (``pipeline.data.tario``: tarfile's
                         semantics, less Python per member); a truncated or unreadable shard
                         ends early and is counted once in ``skipped_tar``
    group by key         {"__key__", "__url__", "jpg"|"png", "json"} raw samples
    shard count check    same; a shard that yields fewer samples than the manifest says is
                         counted in ``skipped_tar`` (a tar cut at a member boundary reads as
                         a clean end of archive)
    shuffle buffer       same, drawn from a buffer of ``cfg.shuffle_buffer`` raw samples
                         (bytes, so it is cheap to hold; 0 = off)
    check                {"idx", "bytes", "meta", "name"}: missing/invalid json or key ->
                         ``skipped_meta``; ``drop[idx]`` -> left out (``dropped``)
    -- decode="cpu" --
    decode               + "image": the pixels PIL gives in the preset's mode (a uint8 tensor
                         from libjpeg-turbo, or a PIL image; ``pipeline.data.jpeg``);
                         undecodable images -> ``skipped_decode``
    open-set noise       image replaced by ``ood_transform(pixels, idx=, seed=)`` where
                         ``label_view.ood[idx]``
    augment              "image": uint8 (C, H, W) (the preset's augmentation / eval geometry,
                         ``pipeline.data.sample_transform``: v2's draws and PIL's pixels)
    chunk                dict of stacked tensors: images (c, C, H, W) uint8, labels (c, 3) int64
                         (columns idx, observed, clean: looked up by idx for the whole chunk,
                         from the shard's json when no view is given), and "stats": counter
                         increments since the previous chunk
    -- decode="device" --
    payload              + "payload": the JPEG's bytes, or pixels decoded here for a file the
                         device decoder does not take (``decode_fallback``) and for open-set
                         samples (shuffled as above)
    chunk                packed payloads (one uint8 buffer, spans, kinds), labels, "stats"
    -- in the training process -----------------------------------------------------------
    re-batch             ``Batch`` of the planned sizes: the rank's n_r samples cut into S
                         batches, batch i ending at round((i+1) * n_r / S); duplicates of an
                         idx already seen this epoch are dropped (``skipped_duplicate``);
                         samples that never came (skipped) are made up with repeats of
                         already-yielded samples flagged ``valid=False`` (``padded``)
    device decode        decode="device": the batch's JPEGs decoded on the loader's device
                         and augmented there as a batch (``pipeline.data.device_decode``);
                         a file the decoder refuses -> PIL (``decode_fallback``)
    normalise            images -> float32 (B, C, H, W) by the preset's batch normalisation

Splitting is explicit, not ``wds.WebDataset``'s: the rank and world size are arguments (no
torch.distributed state is read; ``wds.split_by_node`` semantics, but balanced by sample
count), and WebDataset's own shard shuffle is not used (``shardshuffle=False`` in its terms)
in favour of the (seed, epoch) permutation above, which every rank computes alike. Ranks'
sample counts differ by at most one shard, so a smaller rank's batches are a little smaller
(its n_r spread over the same S steps); keep shards many and of equal size
(shards >> world_size * num_workers) to keep that small.

Counters (``loader.stats``, per rank and pass; sum them over ranks to log): ``samples``
decoded and augmented, ``shards`` opened, ``skipped_decode``/``skipped_meta`` samples,
``skipped_tar`` shards cut short, ``skipped_duplicate``/``skipped_extra`` samples dropped in
the training process, ``missing`` = n_r - samples kept, ``padded`` pad entries yielded,
``checksum_mismatch`` streamed shards whose sha256 differs from the manifest, ``read_retries``
retries of s3 requests and reads after a transient error (each also logged).

Randomness: shard order from ``numpy.random.default_rng([seed, epoch])``; the shuffle buffer
and the augmentations from a seed per (seed, epoch, rank, worker). Augmentations draw from
torch's default CPU generator inside ``torch.random.fork_rng`` with that slot's state, so
the caller's global RNG is untouched and a run is reproducible for a fixed
(seed, epoch, world_size, num_workers). With decode="device" the augmentation of batch b
draws from a ``torch.Generator`` seeded by (seed, epoch, rank, b) instead.

Data position (for checkpoints): ``loader.position`` = {"epoch", "batch"} where ``batch`` is
the number of batches handed out so far this epoch (counting skipped ``start_batch``). To
resume, build the loader of the same epoch with ``start_batch=position["batch"]``: the
stream is deterministic, so the remaining batches are exactly those the interrupted run
would have produced. The cost: the skipped batches are still read, decoded and augmented
(by the loader workers, no model step), i.e. up to one epoch of loader time; with
decode="device" they are only read (their crops do not depend on them).

Sources: a local split directory, or a base URL ``http(s)://host/path/<split>`` (manifest at
``<base>/manifest.json`` read with urllib, shards streamed with urllib) or ``s3://bucket/...``
(manifest and shards read with boto3, see ``pipeline.data.s3``: endpoint from
``cfg.s3_endpoint_url`` or ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, credentials from the
standard chain, ``cfg.s3_retries`` retries per request or shard). Checks before the first
batch: local shards exist with the manifest's sizes and, with ``cfg.verify_checksums`` (the
default), their sha256 matches the manifest (each shard hashed once per process); HTTP
shards answer HEAD with the manifest's size; s3 shards exist (HEAD) with the manifest's
size; with ``verify_checksums`` remote shards are also hashed while they stream (a mismatch
is counted in ``checksum_mismatch``; the samples are already used by then).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import group_by_keys

from pipeline.core.batch import Batch, ViewsBatch
from pipeline.core.labels import LabelView
from pipeline.core.noise import shuffle_pixels
from pipeline.data import s3
from pipeline.data.device_decode import (
    JPEG,
    PIXELS,
    DeviceDecoder,
    Payload,
    pack_payloads,
    unpack_payloads,
)
from pipeline.data.jpeg import decode as decode_image
from pipeline.data.jpeg import decode_draft, jpeg_header
from pipeline.data.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    sample_key,
    sha256_file,
)
from pipeline.data.sample_transform import SampleTransform, draft_target, hwc_pixels
from pipeline.data.tario import expand_tars
from pipeline.data.transforms import build_batch_transform, get_preset

log = logging.getLogger(__name__)

REMOTE_PREFIXES = ("http://", "https://", "s3://")
IMAGE_KEYS = ("jpg", "png", "jpeg")
STAT_KEYS = ("samples", "shards", "skipped_decode", "skipped_meta", "skipped_tar",
             "skipped_duplicate", "skipped_extra", "missing", "padded", "checksum_mismatch",
             "read_retries", "dropped", "decode_fallback")
DECODE_MODES = ("cpu", "device", "auto")
# What PIL raises on a corrupt, truncated or hostile image.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)

OodTransform = Callable[..., np.ndarray]


@dataclass(frozen=True)
class LoaderConfig:
    """Options of the shard loader (one dataclass per concern).

    batch_size:       target samples per batch on each rank (the largest rank's batches
                      have this size; smaller ranks spread theirs over as many steps).
    num_workers:      DataLoader worker processes per rank (0 = read in the training process).
    shuffle_buffer:   raw samples held per worker for shuffling (0 = no sample shuffle).
    seed:             seed of shard order, shuffle buffer and augmentations.
    preset:           ``pipeline.data.transforms`` preset name.
    verify_checksums: sha256 of every local shard before the first batch, once per shard
                      and process (a shard whose size, mtime or ctime changed is hashed
                      again); for remote shards, hash while streaming and count mismatches.
                      On by default: cost in benchmarks/results/integrity.md.
    chunk_size:       samples per tensor chunk a worker sends to the training process.
    prefetch_factor:  chunks each worker keeps ready.
    pin_memory:       pin each batch for an asynchronous CUDA copy (ignored without CUDA).
    normalize_on:     ``"host"``: batches carry float32 images normalised by the preset;
                      ``"device"``: they carry the uint8 pixels (4x fewer bytes to pin and
                      copy, no float pass in the training process) and the model wrapper
                      normalises them on the device (``pipeline.train.fastpath.wrap_model(...,
                      normalize=build_batch_transform(preset))``).
    ood_seed:         seed passed to the open-set pixel shuffle (fixed per idx across epochs);
                      None (default): the label view's ``pixel_seed``, as the in-memory
                      trainer uses.
    http_timeout_s:   socket timeout of HTTP and s3 reads; http_retries: tries to open a URL.
    s3_endpoint_url:  endpoint of an S3-compatible store (``http(s)://host:port``); None =
                      ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's
                      ``endpoint_url``, else AWS. Credentials: boto3's default chain.
    s3_retries:       retries of one s3 request after a transient error (connection
                      dropped, timeout, 429/5xx); for a shard stream, in all over the shard,
                      each resuming where the stream broke. Logged and counted
                      (``read_retries``).
    multiprocessing_context: DataLoader start method (None = platform default).
    decode:           where images are decoded and augmented. ``"cpu"`` (the default): in
                      the loader workers, with PIL's pixels (JPEGs through libjpeg-turbo
                      directly where that gives the same bytes, ``pipeline.data.jpeg``) and the
                      preset's transform without v2's per-call overhead
                      (``pipeline.data.sample_transform``: the same draws and pixels as
                      ``build_sample_transform``). ``"device"``: the workers only read the
                      tars and hand over the JPEG bytes; the training process decodes each
                      batch on the loader's ``device`` (nvJPEG on CUDA, libjpeg-turbo on the
                      CPU) and augments it there (``pipeline.data.device_decode``), with
                      parameters from a generator per (seed, epoch, rank, batch). Files the
                      device decoder cannot take are decoded on the CPU and counted in
                      ``decode_fallback``. ``"auto"``: ``"device"`` when the loader's device
                      is a CUDA device, else ``"cpu"`` (on a CPU-only node the training
                      process has no spare core to decode with: the workers do it in
                      parallel).
    jpeg_draft:       decode="cpu": a JPEG whose preset starts with a resize to at most
                      half its size on both sides is decoded at 1/2, 1/4 or 1/8 scale in the
                      DCT domain (PIL's ``draft``) and resized from there. Faster on large
                      originals; not the same pixels as a full decode (off by default).
    device_prefetch:  decode="device": batches decoded ahead of the one being trained on, in
                      a background thread of the training process (0 = decode each batch
                      when it is asked for).
    """

    batch_size: int = 128
    num_workers: int = 2
    shuffle_buffer: int = 1000
    seed: int = 0
    preset: str = "cifar"
    verify_checksums: bool = True
    chunk_size: int = 64
    prefetch_factor: int = 2
    pin_memory: bool = False
    normalize_on: str = "host"
    ood_seed: int | None = None
    http_timeout_s: float = 60.0
    http_retries: int = 3
    s3_endpoint_url: str | None = None
    s3_retries: int = 5
    multiprocessing_context: str | None = None
    decode: str = "cpu"
    jpeg_draft: bool = False
    device_prefetch: int = 2

    def __post_init__(self) -> None:
        get_preset(self.preset)  # ValueError listing the names
        for name, low in (("batch_size", 1), ("num_workers", 0), ("shuffle_buffer", 0),
                          ("chunk_size", 1), ("prefetch_factor", 1), ("http_retries", 1),
                          ("s3_retries", 0), ("device_prefetch", 0)):
            if int(getattr(self, name)) < low:
                raise ValueError(f"LoaderConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.normalize_on not in ("host", "device"):
            raise ValueError(f"LoaderConfig.normalize_on must be 'host' or 'device', got "
                             f"{self.normalize_on!r}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"LoaderConfig.decode must be one of {', '.join(DECODE_MODES)}, "
                             f"got {self.decode!r}")
        if self.s3_endpoint_url is not None and not str(self.s3_endpoint_url).startswith(
                ("http://", "https://")):
            raise ValueError("LoaderConfig.s3_endpoint_url must be an http(s):// URL, got "
                             f"{self.s3_endpoint_url!r}")


# -- planning (pure; every rank computes the same plan) ---------------------------------------


def greedy_partition(order: list[int], counts: list[int], parts: int) -> list[list[int]]:
    """Assign items, visited in ``order``, each to the part with the fewest samples so far.

    counts: samples of item i. Ties go to the lowest part. Every part's total exceeds the
    lightest part's by at most ``max(counts)``. Returns ``parts`` lists of items, each in
    visiting order.
    """
    totals = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda q: (totals[q], q))
        out[p].append(i)
        totals[p] += counts[i]
    return out


def batch_sizes(n: int, steps: int) -> list[int]:
    """``n`` samples cut into ``steps`` batches as evenly as possible.

    Batch i ends at round((i + 1) * n / steps), rounding halves up.
    """
    ends = [(2 * (i + 1) * n + steps) // (2 * steps) for i in range(steps)]
    return [e - s for s, e in zip([0, *ends[:-1]], ends)]


@dataclass(frozen=True)
class EpochPlan:
    """Which shards every (rank, worker) slot reads in one epoch, and the batch count.

    worker_shards[r][w]: shard indices (into the manifest) that worker w of rank r reads, in
    reading order. rank_samples[r]: n_r. steps: S = ceil(max_r n_r / batch_size).
    """

    order: tuple[int, ...]
    worker_shards: tuple[tuple[tuple[int, ...], ...], ...]
    rank_samples: tuple[int, ...]
    steps: int

    def batch_sizes(self, rank: int) -> list[int]:
        return batch_sizes(self.rank_samples[rank], self.steps)


def plan_epoch(counts: list[int], *, world_size: int, num_workers: int, batch_size: int,
               seed: int, epoch: int, shuffle: bool) -> EpochPlan:
    """Split shards (``counts[i]`` samples each) over ranks, then over each rank's workers.

    shuffle: permute the shard order with ``numpy.random.default_rng([seed, epoch])`` first
    (train); eval keeps the manifest order. ``num_workers`` is per rank (>= 1 here: the
    in-process reader is one slot); a rank with fewer shards gets fewer workers.
    """
    n_shards = len(counts)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n_shards < world_size:
        raise ValueError(
            f"{n_shards} shards cannot be split across {world_size} ranks: every rank needs at "
            f"least one shard (re-shard with a smaller shard_size)"
        )
    if shuffle:
        order = [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n_shards)]
    else:
        order = list(range(n_shards))
    ranks = greedy_partition(order, counts, world_size)
    workers = tuple(
        tuple(tuple(w) for w in greedy_partition(r, counts, min(num_workers, len(r))))
        for r in ranks
    )
    rank_samples = tuple(sum(counts[i] for i in r) for r in ranks)
    steps = max(1, math.ceil(max(rank_samples) / batch_size))
    for r, n in enumerate(rank_samples):
        if n < steps:
            raise ValueError(
                f"rank {r} gets {n} samples but every rank must yield {steps} batches "
                f"(shard sizes {sorted(counts, reverse=True)[:8]}...): use more, smaller shards"
            )
    return EpochPlan(tuple(order), workers, rank_samples, steps)


# -- sources and checks -----------------------------------------------------------------------


def is_remote(source: str | os.PathLike) -> bool:
    return isinstance(source, str) and source.startswith(REMOTE_PREFIXES)


def _s3_client(cfg: LoaderConfig) -> Any:
    return s3.client(endpoint_url=cfg.s3_endpoint_url, timeout_s=cfg.http_timeout_s)


def _read_url(url: str, *, cfg: LoaderConfig) -> bytes:
    if url.startswith("s3://"):
        try:
            return s3.read_bytes(url, s3=_s3_client(cfg), retry=s3.Retry(cfg.s3_retries))
        except (s3.S3Error, ValueError) as e:  # the message names the URL
            raise ManifestError(str(e)) from e
    try:
        with urllib.request.urlopen(url, timeout=cfg.http_timeout_s) as r:
            return r.read()
    except urllib.error.URLError as e:
        raise ManifestError(f"{url}: cannot read ({e})") from e


def load_manifest(source: str | os.PathLike, *, cfg: LoaderConfig) -> Manifest:
    """The manifest of a split: ``<source>/manifest.json`` on disk or at the base URL."""
    if not is_remote(source):
        return Manifest.load(source)
    url = f"{str(source).rstrip('/')}/{MANIFEST_NAME}"
    data = _read_url(url, cfg=cfg)
    with tempfile.TemporaryDirectory() as d:  # reuse Manifest.load's validation
        p = Path(d) / MANIFEST_NAME
        p.write_bytes(data)
        try:
            return Manifest.load(p)
        except ManifestError as e:
            raise ManifestError(str(e).replace(str(p), url)) from None


def _head_size(url: str, *, cfg: LoaderConfig) -> int | None:
    req = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=cfg.http_timeout_s) as r:
            length = r.headers.get("Content-Length")
    except urllib.error.URLError as e:
        raise ManifestError(f"{url}: shard listed in the manifest is not reachable ({e})") from e
    return None if length is None else int(length)


def verify_source(source: str | os.PathLike, manifest: Manifest, *, cfg: LoaderConfig) -> None:
    """Check the shards against the manifest before any batch; ``ManifestError`` names the shard.

    Local: existence and size (and sha256 with ``cfg.verify_checksums``). HTTP: HEAD answers
    with the manifest's size. s3: every key exists (HEAD) with the manifest's size; sha256
    only while streaming (``checksum_mismatch``).
    """
    if not manifest.shards:
        raise ManifestError(f"{source}: the manifest lists no shards")
    if not is_remote(source):
        manifest.verify(source, checksums=False)  # present, with the manifest's sizes
        if cfg.verify_checksums:
            for info in manifest.shards:
                verify_shard_once(Path(source) / info.name, info.sha256)
        return
    urls = manifest.urls(str(source))
    if str(source).startswith("s3://"):
        client, retry = _s3_client(cfg), s3.Retry(cfg.s3_retries)

        def s3_size(url: str) -> int:
            try:
                return s3.head(url, s3=client, retry=retry)["size"]
            except (s3.S3Error, ValueError) as e:
                raise ManifestError(f"shard listed in the manifest of {source} is not readable: "
                                    f"{e}") from e

        with ThreadPoolExecutor(max_workers=8) as pool:
            s3_sizes = list(pool.map(s3_size, urls))
        for url, size, info in zip(urls, s3_sizes, manifest.shards):
            if size != info.bytes:
                raise ManifestError(f"{url}: size {size} != manifest {info.bytes}")
        return
    with ThreadPoolExecutor(max_workers=8) as pool:
        sizes = list(pool.map(partial(_head_size, cfg=cfg), urls))
    for url, size, info in zip(urls, sizes, manifest.shards):
        if size is not None and size != info.bytes:
            raise ManifestError(f"{url}: size {size} != manifest {info.bytes}")


# Shards this process has hashed and found equal to their manifest, keyed by what would
# change if the file were rewritten: a run hashes each shard once per process, not per epoch.
_VERIFIED: set[tuple] = set()


def _file_identity(path: Path, sha256: str) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, sha256)


def verify_shard_once(path: Path, sha256: str) -> bool:
    """Raise ``ManifestError`` naming ``path`` if its sha256 is not ``sha256``; a shard this
    process already verified and that has not changed since is not read again. Returns
    whether the file was hashed now."""
    key = _file_identity(path, sha256)
    if key in _VERIFIED:
        return False
    if sha256_file(path) != sha256:
        raise ManifestError(f"{path}: sha256 does not match the manifest (the shard's bytes "
                            "changed since it was written: re-convert it or restore it)")
    _VERIFIED.add(key)
    return True


def loader_counters(stats: dict[str, int], *, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
                    | None = None, device: torch.device | str = "cpu") -> dict[str, float]:
    """The data-integrity counters of one pass, as epoch metrics (summed over ranks when
    ``all_reduce_sum`` is given; every rank must call it then):

    ``data_skipped_samples`` (undecodable images, bad json/keys, duplicate or surplus idx),
    ``data_skipped_shards`` (tars cut short or unreadable), ``data_missing`` (samples the
    plan expected that never came), ``data_padded`` (pad entries yielded in their place,
    never trained on or counted), ``data_checksum_mismatch`` (streamed remote shards whose
    sha256 differs from the manifest), ``data_read_retries`` (s3 requests and reads retried
    after a transient error), ``data_decode_fallback`` (decode="device": images decoded on
    the CPU because the device decoder does not take their format or refused them).
    """
    vals = torch.tensor([
        stats.get("skipped_decode", 0) + stats.get("skipped_meta", 0)
        + stats.get("skipped_duplicate", 0) + stats.get("skipped_extra", 0),
        stats.get("skipped_tar", 0), stats.get("missing", 0), stats.get("padded", 0),
        stats.get("checksum_mismatch", 0), stats.get("read_retries", 0),
        stats.get("decode_fallback", 0)], dtype=torch.float64)
    if all_reduce_sum is not None:
        vals = all_reduce_sum(vals.to(device)).cpu()
    keys = ("data_skipped_samples", "data_skipped_shards", "data_missing", "data_padded",
            "data_checksum_mismatch", "data_read_retries", "data_decode_fallback")
    return dict(zip(keys, vals.tolist()))


# converters whose source lists samples class by class -> the split that is (None: every split)
CLASS_SORTED_SOURCES = {"shards.imagefolder": None, "shards.webvision": "train"}


class ClassSortedShardsWarning(UserWarning):
    """The training shards were written class by class (no ``shuffle_seed`` in the
    manifest): the loader's shard shuffle and bounded sample buffer cannot mix a batch."""


def warn_if_class_sorted(manifest: Manifest, *, where: str) -> bool:
    """Warn (:class:`ClassSortedShardsWarning`, naming ``where``) and return True when the
    manifest says its split was written in its source's class-by-class order: converted
    with ``--keep-order``, or before the converters shuffled (no ``shuffle_seed``)."""
    src = manifest.source or {}
    conv = src.get("converter")
    if conv not in CLASS_SORTED_SOURCES or src.get("shuffle_seed") is not None:
        return False
    split = CLASS_SORTED_SOURCES[conv]
    if split is not None and manifest.split != split:
        return False
    warnings.warn(f"{where}: the shards of {manifest.dataset}/{manifest.split} hold their "
                  f"samples class by class ({conv} without a shuffle seed), so most training "
                  f"batches will hold one or two classes and the model will not learn; "
                  f"convert again without --keep-order (the default writes a seeded random "
                  f"order)", ClassSortedShardsWarning, stacklevel=2)
    return True


def check_splits(train: Manifest, test: Manifest | None, *, world_size: int,
                 train_where: str, test_where: str | None = None) -> None:
    """Before a run starts (``ValueError`` otherwise): the test split has the training
    split's classes in the same order (each split converted on its own sorts its own class
    folders, and a class missing from one shifts every index after it), and the training
    split has at least one shard per rank (every rank reads whole shards, and every rank
    trains). A test split may have fewer: the first ranks score it, one shard or more each
    (:func:`eval_ranks`), and the others score nothing."""
    if test is not None and list(test.classes) != list(train.classes):
        raise ValueError(f"the test split {test_where} has classes {list(test.classes)[:12]} "
                         f"but the training split {train_where} has {list(train.classes)[:12]} "
                         f"(both must list the same classes in the same order: convert the "
                         f"splits together, or give the class list)")
    if len(train.shards) < world_size:
        size = max(1, train.num_samples // world_size)
        raise ValueError(f"{train_where} has {len(train.shards)} shards, fewer than the "
                         f"{world_size} workers: every worker trains on whole shards; convert "
                         f"again with --shard-size at most {size}, or run fewer workers")


def eval_ranks(manifest: Manifest, world_size: int) -> int:
    """How many ranks score a split read whole-shard: one per shard up to ``world_size``
    (ranks from there on have none of it)."""
    return max(1, min(world_size, len(manifest.shards)))


def check_label_view(label_view: LabelView | None, manifest: Manifest, *, where: str) -> None:
    """The view must cover exactly the split's samples and classes, and (where it records
    one) have been built over this very split (``ValueError`` otherwise)."""
    if label_view is None:
        return
    fingerprint = label_view.split_fingerprint
    if fingerprint is not None and fingerprint != manifest.fingerprint():
        raise ValueError(
            f"the label view was built over other shards than {where} (split fingerprint "
            f"{fingerprint[:12]}, the manifest's {manifest.fingerprint()[:12]}): another "
            f"conversion (shuffle seed, source or options) puts other images at the same idx; "
            f"build the view over these shards (lccn-labelview --split-dir ...)")
    if len(label_view) != manifest.num_samples:
        raise ValueError(
            f"label view has {len(label_view)} samples but the manifest of {where} lists "
            f"{manifest.num_samples}"
        )
    if label_view.num_classes != manifest.num_classes:
        raise ValueError(
            f"label view has num_classes={label_view.num_classes} but the manifest of {where} "
            f"lists {manifest.num_classes} classes"
        )


# -- worker-side stages -----------------------------------------------------------------------


class _HashingReader:
    """A read-only stream that hashes what passes through it (sha256)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hash.update(data)
        return data

    def drain(self) -> str:
        while self.read(1 << 20):
            pass
        return self.hash.hexdigest()

    def close(self) -> None:
        self.raw.close()


class _SlotState:
    """Counters and the shard being read, of one (rank, worker) slot."""

    def __init__(self) -> None:
        self.stats: Counter[str] = Counter()  # increments not yet sent with a chunk
        self.logged: Counter[str] = Counter()
        self.current_url = ""
        self.bad_urls: set[str] = set()
        self.kept: list[dict] = []  # raw samples dropped before decoding, kept for the caller

    def skip(self, reason: str, msg: str, *args: Any) -> None:
        """Count one skipped sample; log the first few of each reason per slot."""
        self.stats[reason] += 1
        self.logged[reason] += 1
        if self.logged[reason] <= 5:
            log.warning(msg + ("" if self.logged[reason] < 5 else " (further ones not logged)"), *args)

    def shard_failed(self, url: str, exn: object) -> None:
        if url not in self.bad_urls:
            self.bad_urls.add(url)
            self.stats["skipped_tar"] += 1
            log.warning("%s: shard unreadable from here on, skipping its rest (%s)", url, exn)

    def tar_handler(self, exn: BaseException) -> bool:
        """wds exception handler: count the current shard as cut short and go on."""
        self.shard_failed(self.current_url, exn)
        return True

    def take_stats(self) -> dict[str, int]:
        out = dict(self.stats)
        self.stats.clear()
        return out

    def take_kept(self) -> list[dict]:
        out, self.kept = self.kept, []
        return out


def _open_stream(url: str, *, cfg: LoaderConfig, state: _SlotState | None = None) -> Any:
    if url.startswith("s3://"):
        def on_retry() -> None:
            if state is not None:
                state.stats["read_retries"] += 1

        return s3.ObjectReader(url, s3=_s3_client(cfg), retry=s3.Retry(cfg.s3_retries),
                               on_retry=on_retry)
    if url.startswith(("http://", "https://")):
        err: Exception | None = None
        for attempt in range(cfg.http_retries):
            if attempt:
                time.sleep(min(2.0 ** attempt, 10.0))
            try:
                return urllib.request.urlopen(url, timeout=cfg.http_timeout_s)
            except urllib.error.HTTPError:  # the server answered (404, 403...): no retry
                raise
            except OSError as e:  # connection refused/reset, timeout
                err = e
        raise OSError(f"{url}: could not open after {cfg.http_retries} tries ({err})")
    return open(url, "rb")


def _open_shards(sources: Iterator[dict], *, state: _SlotState, cfg: LoaderConfig,
                 hashes: dict[str, str] | None) -> Iterator[dict]:
    """{"url"} -> {"url", "stream"}; closes (and, if asked, hash-checks) each shard after use."""
    prev: tuple[str, Any] | None = None

    def finish(url: str, stream: Any) -> None:
        try:
            if isinstance(stream, _HashingReader) and url not in state.bad_urls:
                if stream.drain() != hashes[url]:
                    state.stats["checksum_mismatch"] += 1
                    log.warning("%s: sha256 of the streamed shard does not match the manifest", url)
        except OSError as e:
            state.shard_failed(url, e)
        finally:
            try:
                stream.close()
            except OSError as e:
                state.shard_failed(url, e)

    for src in sources:
        if prev is not None:
            finish(*prev)
            prev = None
        url = src["url"]
        state.current_url = url
        state.stats["shards"] += 1
        try:
            stream = _open_stream(url, cfg=cfg, state=state)
        except OSError as e:  # urllib.error.HTTPError and s3.S3Error are OSErrors
            state.shard_failed(url, e)
            continue
        if hashes is not None:
            stream = _HashingReader(stream)
        prev = (url, stream)
        yield {"url": url, "stream": stream}
    if prev is not None:
        finish(*prev)


def _check_shard_counts(samples: Iterator[dict], *, expected: dict[str, int],
                        state: _SlotState) -> Iterator[dict]:
    """Pass samples through; at the end, count shards that yielded fewer than the manifest."""
    seen: Counter[str] = Counter()
    for s in samples:
        seen[s.get("__url__", "")] += 1
        yield s
    for url, n in expected.items():
        if seen[url] < n and url not in state.bad_urls:
            state.shard_failed(url, f"{seen[url]} samples read, manifest says {n}")


def _shuffle(samples: Iterator[dict], *, bufsize: int, rng: np.random.Generator) -> Iterator[dict]:
    """Emit samples from a buffer of ``bufsize``: each new sample takes a random slot's place."""
    if bufsize <= 1:
        yield from samples
        return
    buf: list[dict] = []
    for s in samples:
        if len(buf) < bufsize:
            buf.append(s)
            continue
        j = int(rng.integers(bufsize))
        yield buf[j]
        buf[j] = s
    for j in rng.permutation(len(buf)):
        yield buf[j]


def _checked(samples: Iterator[dict], *, num_samples: int, state: _SlotState,
             drop: np.ndarray | None = None, keep_dropped: bool = False) -> Iterator[dict]:
    """Raw sample -> {"idx", "bytes", "meta", "name"} (the image's encoded bytes, the shard
    URL and key); samples without a valid json, image or key/idx match are counted and
    skipped. A sample whose ``drop[idx]`` is set is counted (``dropped``) and left out
    before its image is decoded; with ``keep_dropped`` its raw members go to ``state.kept``."""
    for s in samples:
        url, key = s.get("__url__", "?"), s.get("__key__", "?")
        img_bytes = next((s[k] for k in IMAGE_KEYS if k in s), None)
        try:
            meta = json.loads(s["json"])
            idx = int(meta["idx"])
        except (KeyError, TypeError, ValueError) as e:
            state.skip("skipped_meta", "%s: sample %s has no valid json (%r); skipped", url, key, e)
            continue
        if img_bytes is None or not 0 <= idx < num_samples or key.rsplit("/", 1)[-1] != sample_key(idx):
            state.skip("skipped_meta", "%s: sample %s (idx %d) has no image, or its key/idx is "
                       "not a match in [0, %d); skipped", url, key, idx, num_samples)
            continue
        if drop is not None and drop[idx]:
            state.stats["dropped"] += 1
            if keep_dropped:
                state.kept.append({k: v for k, v in s.items()
                                   if k in IMAGE_KEYS or k in ("json", "__key__", "__url__")})
            continue
        yield {"idx": idx, "bytes": img_bytes, "meta": meta, "name": f"{url}: sample {key}"}


def _decode(samples: Iterator[dict], *, mode: str, state: _SlotState,
            draft: Callable[[int, int], tuple[int, int] | None] | None = None) -> Iterator[dict]:
    """{"bytes", ...} -> {"idx", "image", "meta"}: the image decoded to ``mode`` with PIL's
    pixels (a uint8 (C, H, W) tensor from libjpeg-turbo, or a PIL image;
    :func:`pipeline.data.jpeg.decode`); ``draft(h, w)``: the (w, h) a JPEG of that size may
    be decoded down to (``LoaderConfig.jpeg_draft``). Undecodable images are counted in
    ``skipped_decode`` and skipped."""
    for s in samples:
        data = s.pop("bytes")
        name = s.pop("name")
        try:
            size = None
            if draft is not None:
                h = jpeg_header(data)
                size = None if h is None else draft(h.height, h.width)
            s["image"] = (decode_image(data, mode) if size is None
                          else decode_draft(data, mode, size))
        except _DECODE_ERRORS as e:
            state.skip("skipped_decode", "%s (idx %d) does not decode (%s); skipped",
                       name, s["idx"], e)
            continue
        yield s


MAX_FALLBACKS_LOGGED = 5
_FALLBACKS_LOGGED = [0]  # fallbacks logged by this process (a PNG dataset falls back every epoch)


def _payloads(samples: Iterator[dict], *, mode: str, state: _SlotState,
              ood: np.ndarray | None, ood_fn: OodTransform | None,
              ood_seed: int | None) -> Iterator[dict]:
    """decode="device": {"bytes", ...} -> {"idx", "payload": Payload, "meta"}. A JPEG the
    device decoder takes (8-bit Huffman, 1 or 3 components, ending in EOI) goes as its
    bytes; another file is decoded here on the CPU (counted in ``decode_fallback``, its
    name logged) and goes as pixels, as does an open-set sample (its pixels shuffled by
    ``ood_fn``, as :func:`_apply_ood`). Undecodable ones -> ``skipped_decode``."""
    for s in samples:
        data, name, idx = s.pop("bytes"), s.pop("name"), s["idx"]
        is_ood = ood is not None and ood[idx]
        h = None if is_ood else jpeg_header(data)
        if h is not None and h.huffman_8bit and h.complete:
            s["payload"] = Payload(JPEG, data, h.height, h.width, name)
            yield s
            continue
        try:
            px = hwc_pixels(decode_image(data, mode))
        except _DECODE_ERRORS as e:
            state.skip("skipped_decode", "%s (idx %d) does not decode (%s); skipped", name, idx, e)
            continue
        if is_ood:
            px = _ood_pixels(px, fn=ood_fn, idx=idx, seed=ood_seed)
        else:
            state.stats["decode_fallback"] += 1
            _FALLBACKS_LOGGED[0] += 1  # every file counted; the first few named, per process
            if _FALLBACKS_LOGGED[0] <= MAX_FALLBACKS_LOGGED:
                log.warning("%s (idx %d) is not a JPEG the device decoder takes (%s); decoded "
                            "on the CPU%s", name, idx,
                            "not a JPEG" if h is None else f"SOF 0x{h.sof:02X}, {h.precision}-bit, "
                            f"{h.components} components" + ("" if h.complete else ", no end marker"),
                            " (further ones counted in data_decode_fallback, not logged)"
                            if _FALLBACKS_LOGGED[0] == MAX_FALLBACKS_LOGGED else "")
        px = np.ascontiguousarray(px)
        s["payload"] = Payload(PIXELS, px.tobytes(), px.shape[0], px.shape[1], name)
        yield s


def _ood_pixels(px: np.ndarray, *, fn: OodTransform, idx: int, seed: int | None) -> np.ndarray:
    """``fn`` of (H, W, C) uint8 pixels, checked: uint8 of the same height and width."""
    out = np.asarray(fn(px, idx=idx, seed=seed))
    if out.dtype != np.uint8 or out.shape[:2] != px.shape[:2]:
        raise ValueError(f"ood_transform returned {out.dtype} {out.shape} for idx "
                         f"{idx}; expected uint8 {px.shape}")
    return out


def _labels(items: list[dict], view: LabelView | None) -> torch.Tensor:
    """(n, 3) int64 columns idx, observed, clean: looked up in the view for the whole chunk
    at once (from each shard json's ``label``/``clean`` when no view is given)."""
    idx = np.fromiter((s["idx"] for s in items), dtype=np.int64, count=len(items))
    if view is None:
        observed = [int(s["meta"]["label"]) for s in items]
        clean = [int(s["meta"].get("clean", -1)) for s in items]
        return torch.tensor(np.stack([idx, observed, clean], axis=1) if items
                            else np.zeros((0, 3), np.int64), dtype=torch.int64).reshape(-1, 3)
    out = np.empty((len(items), 3), dtype=np.int64)
    out[:, 0] = idx
    out[:, 1] = view.observed[idx]
    out[:, 2] = view.clean[idx]
    return torch.from_numpy(out)


def _apply_ood(samples: Iterator[dict], *, ood: np.ndarray | None, fn: OodTransform | None,
               seed: int) -> Iterator[dict]:
    """Replace the image of every idx with ``ood[idx]`` by ``fn(pixels (H, W, C) uint8, idx=, seed=)``."""
    for s in samples:
        if ood is not None and ood[s["idx"]]:
            px = _ood_pixels(hwc_pixels(s["image"]), fn=fn, idx=s["idx"], seed=seed)
            s["image"] = torch.from_numpy(np.ascontiguousarray(px)).permute(2, 0, 1)
        yield s


def _augment(samples: Iterator[dict], *, transform: Callable, shape: tuple[int, ...],
             preset: str, views: int = 1) -> Iterator[dict]:
    """Decoded image -> uint8 (C, H, W) tensor of the preset's shape; ``views=2`` also
    ``"image2"``, the transform applied a second time to the same image."""
    for s in samples:
        img = s.pop("image")
        for key in ("image", "image2")[:views]:
            x = transform(img)
            if tuple(x.shape) != shape or x.dtype != torch.uint8:
                raise ValueError(f"preset {preset!r} made a {x.dtype} {tuple(x.shape)} tensor "
                                 f"for idx {s['idx']}; expected uint8 {shape}")
            s[key] = x
        yield s


def _chunks(samples: Iterator[dict], *, size: int, shape: tuple[int, ...], state: _SlotState,
            rng_state: torch.Tensor, view: LabelView | None, views: int = 1,
            raw: bool = False) -> Iterator[dict]:
    """Stack ``size`` samples per chunk; every chunk carries the counters since the last one.

    All upstream work (decode, augment) runs here, inside ``fork_rng`` with this slot's own
    torch generator state, so augmentations depend on the slot seed only. ``raw``
    (decode="device"): the chunk carries packed payloads (:func:`pack_payloads`) instead
    of images.
    """
    it = iter(samples)
    done = False
    while not done:
        items = []
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng_state)
            for s in it:
                items.append(s)
                if len(items) == size:
                    break
            else:
                done = True
            rng_state = torch.get_rng_state()
        state.stats["samples"] += len(items)
        if not items and not done:
            continue
        if raw:
            chunk = pack_payloads([s["payload"] for s in items])
        else:
            chunk = {
                "images": (torch.stack([s["image"] for s in items]) if items
                           else torch.empty((0, *shape), dtype=torch.uint8)),
            }
            if views == 2:
                chunk["images2"] = (torch.stack([s["image2"] for s in items]) if items
                                    else torch.empty((0, *shape), dtype=torch.uint8))
        yield {
            **chunk,
            "labels": _labels(items, view),
            "stats": state.take_stats(),
            "kept": state.take_kept(),
        }


def _slot_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def _draft_fn(cfg: LoaderConfig, transform: SampleTransform
              ) -> Callable[[int, int], tuple[int, int] | None] | None:
    if not cfg.jpeg_draft:
        return None
    return lambda h, w: draft_target((h, w), transform.first_resize(h, w))


class _RankStream(IterableDataset):
    """The chunk stream of one rank; in DataLoader worker w it reads slot (rank, w)."""

    def __init__(self, *, urls: list[str], counts: list[int], slots: tuple[tuple[int, ...], ...],
                 hashes: dict[str, str] | None, label_view: LabelView | None, num_samples: int,
                 cfg: LoaderConfig, train: bool, shuffle_buffer: int, seed_parts: tuple[int, ...],
                 ood_transform: OodTransform | None, views: int = 1,
                 drop: np.ndarray | None = None, keep_dropped: bool = False,
                 device_decode: bool = False) -> None:
        super().__init__()
        self.views, self.drop, self.keep_dropped = views, drop, keep_dropped
        self.urls, self.counts, self.slots, self.hashes = urls, counts, slots, hashes
        self.label_view, self.num_samples, self.cfg, self.train = label_view, num_samples, cfg, train
        self.shuffle_buffer, self.seed_parts, self.ood_transform = shuffle_buffer, seed_parts, ood_transform
        self.device_decode = device_decode

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        w = 0 if info is None else info.id
        if info is not None and info.num_workers != len(self.slots):
            raise RuntimeError(f"{info.num_workers} DataLoader workers for {len(self.slots)} slots")
        shards = self.slots[w]
        cfg, preset = self.cfg, get_preset(self.cfg.preset)
        seed = _slot_seed(*self.seed_parts, w)
        rng_state = torch.Generator().manual_seed(seed).get_state()
        state = _SlotState()
        view = self.label_view
        ood = None if view is None or not view.ood.any() else view.ood
        ood_seed = _ood_seed(cfg, view, ood)
        stages = [
            [{"url": self.urls[i]} for i in shards],          # {"url"}: this slot's shards, in order
            partial(_open_shards, state=state, cfg=cfg,       # + "stream"
                    hashes=self.hashes),
            partial(expand_tars,                              # {"fname", "data"} per member
                    handler=state.tar_handler),
            partial(group_by_keys, handler=state.tar_handler),  # raw sample {"__key__", "jpg", "json"}
            partial(_check_shard_counts, state=state,         # same; short shards counted
                    expected={self.urls[i]: self.counts[i] for i in shards}),
            partial(_shuffle, bufsize=self.shuffle_buffer,    # same, shuffled within the buffer
                    rng=np.random.default_rng(seed)),
            partial(_checked, num_samples=self.num_samples,   # {"idx", "bytes", "meta", "name"};
                    state=state, drop=self.drop,              # drop[idx]: left out before
                    keep_dropped=self.keep_dropped),          # decoding
        ]
        if self.device_decode:
            stages += [
                partial(_payloads, mode=preset.mode, state=state,  # + "payload": JPEG bytes, or
                        ood=ood, ood_fn=self.ood_transform,   # pixels decoded here (other
                        ood_seed=ood_seed),                   # formats; open-set samples)
                partial(_chunks, size=cfg.chunk_size, shape=preset.shape,  # packed payloads,
                        state=state, rng_state=rng_state,     # labels (n, 3), "stats"
                        view=view, raw=True),
            ]
        else:
            transform = SampleTransform(cfg.preset, train=self.train)
            stages += [
                partial(_decode, mode=preset.mode, state=state,  # + "image": pixels in the
                        draft=_draft_fn(cfg, transform)),     # preset's mode
                partial(_apply_ood, ood=ood, fn=self.ood_transform,  # pixels shuffled if ood[idx]
                        seed=ood_seed),
                partial(_augment, transform=transform,        # "image" (and "image2"):
                        shape=preset.shape, preset=cfg.preset,  # (C, H, W) uint8
                        views=self.views),
                partial(_chunks, size=cfg.chunk_size, shape=preset.shape,  # stacked chunk,
                        state=state, rng_state=rng_state,     # labels (n, 3), "stats"
                        view=view, views=self.views),
            ]
        return iter(wds.DataPipeline(stages))


# -- the loader (training-process side) -------------------------------------------------------


def _cat(parts: list) -> Any:
    """Concatenate chunk fields: tensors along the first axis, lists of payloads."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return [x for p in parts for x in p]


def _select(v: Any, sel: torch.Tensor) -> Any:
    return v[sel] if isinstance(v, torch.Tensor) else [v[i] for i in sel.tolist()]


def resolve_decode(cfg: LoaderConfig, device: torch.device | str | None) -> torch.device | None:
    """The device a loader decodes on: None for decode="cpu" (the workers decode), else
    ``device`` (default: the current CUDA device if there is one, else the CPU); "auto" is
    "device" on a CUDA device and "cpu" otherwise."""
    if cfg.decode == "cpu":
        return None
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
    device = torch.device(device)
    if cfg.decode == "auto" and device.type != "cuda":
        return None
    if device.type == "cuda" and device.index is None:  # "cuda": the current one, by index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class ShardLoader:
    """Iterable of ``Batch`` for one rank and one epoch; ``steps_per_epoch`` batches each pass.

    Attributes: ``steps_per_epoch`` (S, the same on every rank), ``plan`` (``EpochPlan``),
    ``num_samples`` (n_r of this rank), ``num_workers`` (DataLoader workers actually used),
    ``stats`` (counters of the current/last pass, see ``STAT_KEYS``), ``position``,
    ``kept`` (the raw samples a loader made with ``keep_dropped`` left out before decoding,
    complete once a pass has ended), ``decode_device`` (None: the workers decode; else the
    device batches are decoded and augmented on). ``len(loader)`` is the number of batches
    a pass yields (S - start_batch).
    """

    def __init__(self, *, dataset: _RankStream, plan: EpochPlan, rank: int, epoch: int,
                 num_workers: int, start_batch: int, cfg: LoaderConfig, num_total: int,
                 decode_device: torch.device | None = None) -> None:
        self._dataset, self.plan, self.rank, self.epoch = dataset, plan, rank, epoch
        self.num_workers, self.start_batch, self._cfg = num_workers, start_batch, cfg
        self._num_total = num_total
        self.steps_per_epoch = plan.steps
        self.num_samples = plan.rank_samples[rank]
        self.stats: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self.kept: list[dict] = []
        self.batches_done = start_batch
        self.decode_device = decode_device
        self._decoder = (None if decode_device is None else DeviceDecoder(
            cfg.preset, train=dataset.train, device=decode_device, views=dataset.views))

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start_batch

    @property
    def position(self) -> dict[str, int]:
        """{"epoch", "batch"}: pass ``batch`` as ``start_batch`` to resume after it."""
        return {"epoch": self.epoch, "batch": self.batches_done}

    def _chunk_iter(self) -> Iterator[dict]:
        if self.num_workers == 0:
            return iter(self._dataset)
        cfg = self._cfg
        return iter(DataLoader(self._dataset, batch_size=None, num_workers=self.num_workers,
                               prefetch_factor=cfg.prefetch_factor,
                               multiprocessing_context=cfg.multiprocessing_context,
                               persistent_workers=False))

    def batch_generator(self, step: int) -> torch.Generator:
        """decode="device": the generator of batch ``step``'s augmentation parameters,
        seeded from (seed, epoch, rank, step, train): a resumed epoch draws the same."""
        seed = _slot_seed(self._cfg.seed, self.epoch, self.rank, step, int(self._dataset.train))
        return torch.Generator().manual_seed(seed)

    def _raw_batches(self) -> Iterator[tuple[int, dict, int]]:
        """(step, fields of the batch, number of valid rows) for every batch of the pass
        from ``start_batch`` on: images (decode="cpu") or payloads (decode="device")."""
        sizes = self.plan.batch_sizes(self.rank)
        n_rank = self.num_samples
        seen = np.zeros(self._num_total, dtype=bool)
        pending: list[dict[str, Any]] = []
        n_pending = accepted = 0
        last: dict[str, Any] | None = None  # the last batch made (for padding)
        step = 0
        # labels: (n, 3) int64 columns idx, observed, clean
        views = self._dataset.views
        if self._decoder is not None:
            fields = ("items", "labels")
        else:
            fields = ("images", "labels") if views == 1 else ("images", "images2", "labels")

        def take(n: int) -> dict[str, Any]:
            nonlocal pending, n_pending
            merged = {f: _cat([c[f] for c in pending]) for f in fields}
            out = {f: v[:n] for f, v in merged.items()}
            rest = {f: v[n:] for f, v in merged.items()}
            pending = [rest] if len(rest["labels"]) else []
            n_pending -= len(out["labels"])
            return out

        for chunk in self._chunk_iter():
            for k, v in chunk.pop("stats").items():
                self.stats[k] = self.stats.get(k, 0) + int(v)
            self.kept.extend(chunk.pop("kept", ()))
            if self._decoder is not None:
                chunk = {"items": unpack_payloads(chunk), "labels": chunk["labels"]}
            idx = chunk["labels"][:, 0].numpy()
            if len(idx):
                _, first = np.unique(idx, return_index=True)
                keep = np.zeros(len(idx), dtype=bool)
                keep[first] = True
                keep &= ~seen[idx]  # an idx already seen this epoch (or twice in the chunk)
                self.stats["skipped_duplicate"] += int(len(idx) - keep.sum())
                room = n_rank - accepted
                if keep.sum() > room:  # more samples than the manifest says: drop the surplus
                    extra = np.flatnonzero(keep)[room:]
                    keep[extra] = False
                    self.stats["skipped_extra"] += len(extra)
                seen[idx[keep]] = True
                if not keep.all():
                    sel = torch.from_numpy(np.flatnonzero(keep))
                    chunk = {f: _select(chunk[f], sel) for f in fields}
                accepted += int(keep.sum())
                if len(chunk["labels"]):
                    pending.append(chunk)
                    n_pending += len(chunk["labels"])
            while step < len(sizes) and n_pending >= sizes[step]:
                last = take(sizes[step])
                step += 1
                if step > self.start_batch:
                    yield step, last, sizes[step - 1]

        # The stream has ended: pad any batch it could not fill (skipped samples).
        self.stats["missing"] += n_rank - accepted
        if step < len(sizes) and n_rank > accepted:
            log.warning("rank %d epoch %d: %d of %d samples missing (%s); padding %d batches",
                        self.rank, self.epoch, n_rank - accepted, n_rank,
                        {k: v for k, v in self.stats.items() if v and k.startswith("skipped")},
                        len(sizes) - step)
        while step < len(sizes):
            n = sizes[step]
            real = take(n) if n_pending else None
            n_real = 0 if real is None else len(real["labels"])
            pool = [p for p in (real, last) if p is not None and len(p["labels"])]
            if not pool:
                raise RuntimeError(f"rank {self.rank}: no decodable sample in epoch {self.epoch}; "
                                   f"cannot pad (stats {self.stats})")
            pool_t = {f: _cat([p[f] for p in pool]) for f in fields}
            rep = torch.arange(n - n_real) % len(pool_t["labels"])
            b = {f: _cat([real[f], _select(pool_t[f], rep)]) if real is not None
                 else _select(pool_t[f], rep) for f in fields}
            self.stats["padded"] += n - n_real
            last = b if real is None else real
            step += 1
            if step > self.start_batch:
                yield step, b, n_real

    def _decode_batch(self, step: int, b: dict[str, Any], n_valid: int
                      ) -> tuple[int, dict[str, Any], torch.Tensor, Counter]:
        """decode="device": the payloads of batch ``step`` decoded and augmented."""
        views, ok, counts = self._decoder(b["items"], generator=self.batch_generator(step - 1))
        out = {"images": views[0], "labels": b["labels"]}
        if len(views) == 2:
            out["images2"] = views[1]
        valid = torch.zeros(len(ok), dtype=torch.bool)
        valid[:n_valid] = True
        return step, out, valid & ok, counts

    def _decoded(self) -> Iterator[tuple[int, dict[str, Any], torch.Tensor, Counter]]:
        raw = self._raw_batches()
        if self._decoder is None:
            for step, b, n_valid in raw:
                valid = torch.zeros(len(b["labels"]), dtype=torch.bool)
                valid[:n_valid] = True
                yield step, b, valid, Counter()
            return
        ahead = self._cfg.device_prefetch
        if ahead == 0:
            for item in raw:
                yield self._decode_batch(*item)
            return
        # decode up to `ahead` batches in a background thread while the caller trains on
        # the current one (torch and the decoders release the GIL)
        dev = self.decode_device
        init = (None if dev.type != "cuda" else partial(torch.cuda.set_device, dev))
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-decode",
                                  initializer=init)
        queue: list[Any] = []
        try:
            for item in raw:
                queue.append(pool.submit(self._decode_batch, *item))
                if len(queue) > ahead:
                    yield queue.pop(0).result()
            while queue:
                yield queue.pop(0).result()
        finally:
            for f in queue:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def __iter__(self) -> Iterator[Batch]:
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.kept = []
        self.batches_done = self.start_batch
        views = self._dataset.views
        pin = self._cfg.pin_memory and torch.cuda.is_available()
        normalise = (build_batch_transform(self._cfg.preset) if self._cfg.normalize_on == "host"
                     else (lambda x: x))
        if self._decoder is not None:
            normalise = normalise.to(self.decode_device) if isinstance(
                normalise, torch.nn.Module) else normalise

        def pinned(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory() if pin and t.device.type == "cpu" else t

        for step, b, valid, counts in self._decoded():
            for k, v in counts.items():
                self.stats[k] = self.stats.get(k, 0) + v
            if counts.get("skipped_decode"):  # rows no decoder took: now padding
                self.stats["padded"] += counts["skipped_decode"]
                self.stats["missing"] += counts["skipped_decode"]
            idx, observed, clean = b["labels"].T.contiguous()
            out: Batch | ViewsBatch
            if views == 1:
                out = Batch(normalise(b["images"]), observed, idx, clean, valid)
            else:
                out = ViewsBatch(normalise(b["images"]), normalise(b["images2"]), observed, idx,
                                 clean, valid)
            self.batches_done = step
            yield type(out)(*(pinned(t) for t in out))


# -- public constructors ----------------------------------------------------------------------


def _ood_seed(cfg: LoaderConfig, view: LabelView | None, ood: np.ndarray | None) -> int | None:
    """The open-set pixel shuffle's seed: ``cfg.ood_seed`` if set, else the view's."""
    return cfg.ood_seed if cfg.ood_seed is not None or ood is None else view.pixel_seed


def _resolve_ood(label_view: LabelView | None, fn: OodTransform | None) -> OodTransform | None:
    if label_view is None or not label_view.ood.any() or fn is not None:
        return fn
    return shuffle_pixels


def _make_loader(source: str | os.PathLike, label_view: LabelView | None, cfg: LoaderConfig, *,
                 rank: int, world_size: int, epoch: int, start_batch: int, train: bool,
                 manifest: Manifest | None, ood_transform: OodTransform | None,
                 views: int = 1, drop: np.ndarray | None = None,
                 keep_dropped: bool = False,
                 device: torch.device | str | None = None) -> ShardLoader:
    if views not in (1, 2):
        raise ValueError(f"views must be 1 or 2, got {views}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    decode_device = resolve_decode(cfg, device)
    source = source if is_remote(source) else Path(source)
    manifest = manifest if manifest is not None else load_manifest(source, cfg=cfg)
    check_label_view(label_view, manifest, where=str(source))
    verify_source(source, manifest, cfg=cfg)
    ood_fn = _resolve_ood(label_view, ood_transform)

    counts = [s.num_samples for s in manifest.shards]
    planned = counts
    if drop is not None:  # the plan counts the samples each shard keeps
        ranges = manifest.idx_ranges()
        if ranges is None:
            raise ValueError(f"{source}: dropping samples before decoding needs the shards' "
                             f"first_idx in the manifest (convert again with this version)")
        if len(drop) != manifest.num_samples:
            raise ValueError(f"drop mask of {len(drop)} for {manifest.num_samples} samples")
        planned = [n - int(drop[f:f + n].sum()) for f, n in ranges]
    plan = plan_epoch(planned, world_size=world_size, num_workers=max(1, cfg.num_workers),
                      batch_size=cfg.batch_size, seed=cfg.seed, epoch=epoch, shuffle=train)
    if not 0 <= start_batch <= plan.steps:
        raise ValueError(f"start_batch {start_batch} is outside [0, steps_per_epoch={plan.steps}]")
    slots = plan.worker_shards[rank]
    workers = 0 if cfg.num_workers == 0 else len(slots)
    if 0 < workers < cfg.num_workers:
        warnings.warn(
            f"rank {rank} reads only {sum(len(s) for s in slots)} shards in epoch {epoch}, "
            f"fewer than its {cfg.num_workers} data-loading processes (LoaderConfig."
            f"num_workers, the jobs' --loader-workers): using {workers}",
            RuntimeWarning, stacklevel=3)

    urls = [str(source / s.name) for s in manifest.shards] if isinstance(source, Path) \
        else manifest.urls(str(source))
    hashes = ({u: s.sha256 for u, s in zip(urls, manifest.shards)}
              if cfg.verify_checksums and is_remote(source) else None)
    dataset = _RankStream(
        urls=urls, counts=counts, slots=slots, hashes=hashes, label_view=label_view,
        num_samples=manifest.num_samples, cfg=cfg, train=train,
        shuffle_buffer=cfg.shuffle_buffer if train else 0,
        seed_parts=(cfg.seed, epoch, rank), ood_transform=ood_fn, views=views, drop=drop,
        keep_dropped=keep_dropped, device_decode=decode_device is not None)
    return ShardLoader(dataset=dataset, plan=plan, rank=rank, epoch=epoch, num_workers=workers,
                       start_batch=start_batch, cfg=cfg, num_total=manifest.num_samples,
                       decode_device=decode_device)


def make_train_loader(source: str | os.PathLike, label_view: LabelView | None,
                      cfg: LoaderConfig, *, rank: int, world_size: int, epoch: int,
                      start_batch: int = 0, manifest: Manifest | None = None,
                      ood_transform: OodTransform | None = None, views: int = 1,
                      drop: np.ndarray | None = None, keep_dropped: bool = False,
                      device: torch.device | str | None = None) -> ShardLoader:
    """The training stream of one rank for one epoch (see the module docstring).

    source: a split directory, or a base URL (``http(s)://``, ``s3://``) of the split.
    label_view: labels by idx, ``len == manifest.num_samples`` (None: the shard json's
      ``label``/``clean``). ood_transform: ``fn(pixels (H, W, C) uint8, *, idx, seed) ->
      (H, W, C) uint8`` for ``label_view.ood`` samples (default ``pipeline.core.noise.shuffle_pixels``).
    rank, world_size: this Ray Train worker's place (pass them in; no global state is read).
    epoch: reshuffles the shard order; start_batch: resume after that many batches.
    views: 2 yields :class:`ViewsBatch` es (the training augmentation applied twice per
      sample, from the slot's generator: the same two views on a re-read).
    drop: ``(N,) bool``, samples left out before their image is decoded (the noisy
      validation split), counted in ``stats["dropped"]``; the epoch's plan counts the
      samples each shard keeps (needs the manifest's ``first_idx``). keep_dropped: their raw
      members are collected in ``loader.kept`` (:func:`decoded_batches` turns them into
      evaluation batches).
    device: where ``cfg.decode`` "device"/"auto" decodes and augments the batches (their
      images are on it); default: the current CUDA device, else the CPU.
    Raises ``ManifestError``/``ValueError`` before any batch if the shards, manifest and
    label view disagree.
    """
    return _make_loader(source, label_view, cfg, rank=rank, world_size=world_size, epoch=epoch,
                        start_batch=start_batch, train=True, manifest=manifest,
                        ood_transform=ood_transform, views=views, drop=drop,
                        keep_dropped=keep_dropped, device=device)


def make_eval_loader(source: str | os.PathLike, label_view: LabelView | None,
                     cfg: LoaderConfig, *, rank: int = 0, world_size: int = 1,
                     manifest: Manifest | None = None,
                     ood_transform: OodTransform | None = None,
                     drop: np.ndarray | None = None,
                     device: torch.device | str | None = None) -> ShardLoader:
    """The evaluation stream of one rank: manifest shard order, no sample shuffle, the eval
    transform, and the same equal-batch guarantee (pad samples have ``valid=False``);
    ``drop`` and ``device`` as for :func:`make_train_loader`."""
    return _make_loader(source, label_view, cfg, rank=rank, world_size=world_size, epoch=0,
                        start_batch=0, train=False, manifest=manifest,
                        ood_transform=ood_transform, drop=drop, device=device)


def decoded_batches(raw: list[dict], label_view: LabelView, cfg: LoaderConfig, *,
                    batch_size: int, ood_transform: OodTransform | None = None,
                    device: torch.device | str | None = None) -> Iterator[Batch]:
    """Evaluation batches (every sample ``valid``; the last one shorter) of raw samples a
    loader kept (``ShardLoader.kept``), in this process: the same decoding, labels, open-set
    pixels, evaluation transform and normalisation as :func:`make_eval_loader` gives them
    (decoded on ``device`` for ``cfg.decode`` "device"/"auto", as there)."""
    preset = get_preset(cfg.preset)
    state = _SlotState()
    ood = None if not label_view.ood.any() else label_view.ood
    seed = _ood_seed(cfg, label_view, ood)
    ood_fn = _resolve_ood(label_view, ood_transform)
    decode_device = resolve_decode(cfg, device)
    samples = _checked(iter(raw), num_samples=len(label_view), state=state)
    if decode_device is None:
        transform = SampleTransform(cfg.preset, train=False)
        samples = _decode(samples, mode=preset.mode, state=state,
                          draft=_draft_fn(cfg, transform))
        samples = _apply_ood(samples, ood=ood, fn=ood_fn, seed=seed)
        samples = _augment(samples, transform=transform, shape=preset.shape, preset=cfg.preset)
        decoder = None
    else:
        samples = _payloads(samples, mode=preset.mode, state=state, ood=ood, ood_fn=ood_fn,
                            ood_seed=seed)
        decoder = DeviceDecoder(cfg.preset, train=False, device=decode_device)
    normalise = (build_batch_transform(cfg.preset) if cfg.normalize_on == "host"
                 else (lambda x: x))
    if decoder is not None and isinstance(normalise, torch.nn.Module):
        normalise = normalise.to(decode_device)
    items: list[dict] = []

    def emit(items: list[dict]) -> Batch | None:
        labels = _labels(items, label_view)
        if decoder is None:
            images = torch.stack([s["image"] for s in items])
        else:
            views, ok, counts = decoder([s["payload"] for s in items],
                                        generator=torch.Generator().manual_seed(0))
            state.stats.update(counts)
            images, labels = views[0][ok.to(views[0].device)], labels[ok]
            if not len(labels):
                return None
        idx, observed, clean = labels.T.contiguous()
        return Batch(normalise(images), observed, idx, clean,
                     torch.ones(len(labels), dtype=torch.bool))

    for s in samples:
        items.append(s)
        if len(items) == batch_size:
            b = emit(items)
            if b is not None:
                yield b
            items = []
    if items:
        b = emit(items)
        if b is not None:
            yield b
    lost = {k: v for k, v in state.stats.items() if k != "decode_fallback" and v}
    if lost:
        log.warning("%d kept samples did not decode: %s", sum(lost.values()), lost)
