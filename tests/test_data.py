"""Tests of the shard loader (pipeline/data/stream.py) and the transform presets (pipeline/data/transforms.py).

Shards are real tar files of real CIFAR-10 JPEGs (and PNGs re-encoded from them), written
in tmp_path with ``webdataset.TarWriter`` and described by a real ``Manifest``.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import tarfile
import threading
import warnings
from dataclasses import replace
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from pipeline.core.batch import Batch
from pipeline.core.labels import LabelView
from pipeline.data.manifest import Manifest, ManifestError, ShardInfo, sample_key, sha256_file
from pipeline.data.stream import (
    LoaderConfig,
    batch_sizes,
    check_splits,
    decoded_batches,
    eval_ranks,
    greedy_partition,
    make_eval_loader,
    make_train_loader,
    plan_epoch,
)
from pipeline.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PRESETS,
    build_batch_transform,
    build_sample_transform,
    build_transform,
)

K = 10
UNEVEN = [7, 30, 3, 25, 12]


# -- fixtures and helpers -----------------------------------------------------------------------


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")


@pytest.fixture(scope="module")
def cifar_images(shared_data) -> list[tuple[bytes, int]]:
    """100 real CIFAR-10 training JPEGs as (bytes, label), classes interleaved.

    Streams ``cifar10-jpeg.tar.gz`` until it has ``train/<class>/000{0-9}.jpg`` of every
    class (much faster than extracting all 60,000 files).
    """
    want = {(c, k): None for c in range(K) for k in range(10)}
    with tarfile.open(shared_data / "cifar10-jpeg.tar.gz", "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if len(parts) >= 3 and parts[-3] == "train" and parts[-2] in CIFAR10_CLASSES:
                key = (CIFAR10_CLASSES.index(parts[-2]), int(parts[-1].split(".")[0]))
                if key in want and want[key] is None:
                    want[key] = tar.extractfile(m).read()
                    if all(v is not None for v in want.values()):
                        break
    assert all(v is not None for v in want.values()), "cifar10-jpeg.tar.gz lacks train/<c>/000k.jpg"
    return [(want[(i % K, i // K)], i % K) for i in range(100)]


def write_split(split_dir: Path, sizes: list[int], images: list[tuple[bytes, int]], *,
                corrupt: dict[int, bytes] | None = None) -> Manifest:
    """Shards ``train-00000i.tar`` holding ``sizes[i]`` samples with consecutive idx.

    Every third sample is stored as PNG, the rest as the original JPEG. ``corrupt`` replaces
    the image bytes of some idx.
    """
    split_dir.mkdir(parents=True, exist_ok=True)
    idx = 0
    for s, n in enumerate(sizes):
        with wds.TarWriter(str(split_dir / f"train-{s:06d}.tar")) as w:
            for _ in range(n):
                data, label = images[idx % len(images)]
                ext = "png" if idx % 3 == 2 else "jpg"
                if ext == "png":
                    buf = io.BytesIO()
                    Image.open(io.BytesIO(data)).save(buf, format="PNG")
                    data = buf.getvalue()
                data = (corrupt or {}).get(idx, data)
                w.write({"__key__": sample_key(idx), ext: data,
                         "json": {"idx": idx, "label": label, "clean": label, "key": f"k{idx}"}})
                idx += 1
    return save_manifest(split_dir, sizes)


def save_manifest(split_dir: Path, sizes: list[int]) -> Manifest:
    """A manifest describing the shard files as they are on disk now."""
    shards = []
    for s, n in enumerate(sizes):
        p = split_dir / f"train-{s:06d}.tar"
        shards.append(ShardInfo(p.name, n, sha256_file(p), p.stat().st_size))
    m = Manifest(dataset="cifar10", split="train", classes=[f"c{i}" for i in range(K)], shards=shards)
    m.save(split_dir)
    return m


def shifted_view(n: int, images) -> LabelView:
    """A view whose observed label is the shard label + 1 (mod K) and clean the shard label."""
    clean = np.array([images[i % len(images)][1] for i in range(n)], np.int64)
    return LabelView(observed=(clean + 1) % K, clean=clean, num_classes=K)


def run_ranks(source, view, cfg, *, world: int, epoch: int = 0, **kw) -> tuple[list, list]:
    """Every rank's batches of one epoch, and the loaders (for their stats)."""
    loaders = [make_train_loader(source, view, cfg, rank=r, world_size=world, epoch=epoch, **kw)
               for r in range(world)]
    return [list(ld) for ld in loaders], loaders


def valid_idx(batches: list[Batch]) -> np.ndarray:
    return np.concatenate([b.idx[b.valid].numpy() for b in batches])


CFG = LoaderConfig(batch_size=8, num_workers=2, shuffle_buffer=16, seed=3, preset="cifar",
                   chunk_size=4)


# -- planning -----------------------------------------------------------------------------------


def test_batch_sizes_and_greedy_partition():
    assert batch_sizes(37, 5) == [7, 8, 7, 8, 7]
    assert batch_sizes(40, 5) == [8] * 5
    for n, s in [(1, 1), (5, 5), (101, 7), (1000, 3)]:
        sz = batch_sizes(n, s)
        assert sum(sz) == n and max(sz) - min(sz) <= 1
    parts = greedy_partition([1, 0, 3, 2, 4], UNEVEN, 2)
    assert sorted(sum(parts, [])) == list(range(5))
    totals = [sum(UNEVEN[i] for i in p) for p in parts]
    assert max(totals) - min(totals) <= max(UNEVEN)


def test_shard_order_reproducible_and_changes_with_epoch():
    counts = [10] * 12
    kw = dict(world_size=2, num_workers=2, batch_size=8, seed=7)
    a, b = plan_epoch(counts, epoch=0, shuffle=True, **kw), plan_epoch(counts, epoch=0, shuffle=True, **kw)
    assert a == b
    assert plan_epoch(counts, epoch=1, shuffle=True, **kw).order != a.order
    assert plan_epoch(counts, epoch=0, shuffle=True, **{**kw, "seed": 8}).order != a.order
    assert plan_epoch(counts, epoch=5, shuffle=False, **kw).order == tuple(range(12))
    # every shard in exactly one (rank, worker) slot
    slots = [i for r in a.worker_shards for w in r for i in w]
    assert sorted(slots) == list(range(12))
    with pytest.raises(ValueError, match="3 shards cannot be split across 4 ranks"):
        plan_epoch([5, 5, 5], world_size=4, num_workers=1, batch_size=2, seed=0, epoch=0, shuffle=True)


# -- the stream ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[20] * 6, UNEVEN], ids=["even", "uneven"])
def test_every_idx_once_and_equal_batches(tmp_path, cifar_images, sizes):
    n = sum(sizes)
    write_split(tmp_path / "train", sizes, cifar_images)
    view = shifted_view(n, cifar_images)
    per_rank, loaders = run_ranks(tmp_path / "train", view, CFG, world=2)

    steps = loaders[0].steps_per_epoch
    assert steps == loaders[1].steps_per_epoch == -(-max(ld.num_samples for ld in loaders) // 8)
    for batches, ld in zip(per_rank, loaders):
        assert len(batches) == steps == len(ld)
        assert sum(len(b.idx) for b in batches) == ld.num_samples
        assert max(len(b.idx) for b in batches) - min(len(b.idx) for b in batches) <= 1
        assert ld.stats["samples"] == ld.num_samples and ld.stats["padded"] == 0
        assert ld.position == {"epoch": 0, "batch": steps}
        for b in batches:
            assert b.images.dtype == torch.float32 and b.images.shape[1:] == (3, 32, 32)
            assert b.valid.all()
    seen = np.concatenate([valid_idx(b) for b in per_rank])
    assert np.array_equal(np.sort(seen), np.arange(n))  # every idx exactly once over ranks

    # labels come from the view by idx, not from the shard (which holds clean = observed - 1)
    for b in (b for r in per_rank for b in r):
        assert torch.equal(b.observed, torch.from_numpy(view.observed[b.idx.numpy()]))
        assert torch.equal(b.clean, torch.from_numpy(view.clean[b.idx.numpy()]))
        assert (b.observed != b.clean).all()
        # per-image standardisation of the cifar preset
        assert b.images.mean(dim=(1, 2, 3)).abs().max() < 1e-4


def test_stream_reproducible_and_reshuffled_per_epoch(tmp_path, cifar_images):
    write_split(tmp_path / "train", [10] * 6, cifar_images)
    view = shifted_view(60, cifar_images)
    cfg = replace(CFG, num_workers=1)

    def stream(epoch, c=cfg):
        return list(make_train_loader(tmp_path / "train", view, c, rank=0, world_size=1, epoch=epoch))

    a, b, c = stream(0), stream(0), stream(1)
    assert all(torch.equal(x.idx, y.idx) and torch.equal(x.images, y.images) for x, y in zip(a, b))
    assert not torch.equal(torch.cat([x.idx for x in a]), torch.cat([x.idx for x in c]))
    # the in-process reader (num_workers=0) gives the same stream as one worker process
    d = stream(0, replace(cfg, num_workers=0))
    assert all(torch.equal(x.idx, y.idx) and torch.equal(x.images, y.images) for x, y in zip(a, d))
    # the caller's global torch RNG is untouched by the augmentations
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    stream(0, replace(cfg, num_workers=0))
    assert torch.equal(torch.rand(3), expected)


def test_corrupt_jpeg_and_truncated_tars_survived_and_counted(tmp_path, cifar_images):
    sizes = [10] * 6
    split = tmp_path / "train"
    good = cifar_images[4][0]
    write_split(split, sizes, cifar_images, corrupt={4: good[: len(good) // 2]})
    # shard 2: cut inside a member's data; shard 4: cut exactly at the header of its 7th sample
    p2, p4 = split / "train-000002.tar", split / "train-000004.tar"
    p2.write_bytes(p2.read_bytes()[: p2.stat().st_size // 2 + 100])
    with tarfile.open(p4) as t:
        cut = [m.offset for m in t.getmembers()][2 * 6]
    p4.write_bytes(p4.read_bytes()[:cut])
    save_manifest(split, sizes)  # the manifest describes the damaged files (sizes, sha256)
    view = shifted_view(60, cifar_images)

    per_rank, loaders = run_ranks(split, view, CFG, world=2)
    stats = {k: sum(ld.stats[k] for ld in loaders) for k in loaders[0].stats}
    assert stats["skipped_decode"] == 1
    assert stats["skipped_tar"] == 2
    assert len(per_rank[0]) == len(per_rank[1]) == loaders[0].steps_per_epoch
    seen = np.concatenate([valid_idx(b) for b in per_rank])
    assert len(np.unique(seen)) == len(seen)  # no idx twice
    lost = set(range(60)) - set(seen.tolist())
    assert 4 in lost
    assert lost - {4} <= set(range(20, 30)) | set(range(40, 50))
    assert lost & set(range(20, 30)) and lost & set(range(40, 50))
    assert set(range(46, 50)) <= lost  # everything after the cut of shard 4 is gone
    for batches, ld in zip(per_rank, loaders):
        assert ld.stats["missing"] == ld.stats["padded"] == ld.num_samples - ld.stats["samples"]
        assert sum(len(b.idx) for b in batches) == ld.num_samples  # planned sizes kept
        yielded: set[int] = set()
        for b in batches:  # padding repeats samples already yielded (or in this batch) on this rank
            yielded |= set(b.idx[b.valid].tolist())
            assert set(b.idx[~b.valid].tolist()) <= yielded
    assert sum(int((~b.valid).sum()) for r in per_rank for b in r) == len(lost)


def test_duplicate_idx_dropped_and_padded(tmp_path, cifar_images):
    split = tmp_path / "train"
    write_split(split, [10, 10], cifar_images)
    (split / "train-000001.tar").write_bytes((split / "train-000000.tar").read_bytes())  # idx 0-9 again
    save_manifest(split, [10, 10])
    cfg = replace(CFG, num_workers=0)
    loader = make_train_loader(split, shifted_view(20, cifar_images), cfg, rank=0, world_size=1, epoch=0)
    batches = list(loader)
    assert len(batches) == loader.steps_per_epoch == 3
    assert np.array_equal(np.sort(valid_idx(batches)), np.arange(10))
    assert loader.stats["skipped_duplicate"] == 10
    assert loader.stats["missing"] == loader.stats["padded"] == 10


@pytest.fixture
def split20(tmp_path, cifar_images):
    m = write_split(tmp_path / "train", [10, 10], cifar_images)
    return tmp_path / "train", m, shifted_view(20, cifar_images)


def test_manifest_mismatch_raises_before_any_batch(split20, cifar_images):
    split, manifest, view = split20
    cfg = replace(CFG, verify_checksums=True)
    make_train_loader(split, view, cfg, rank=0, world_size=1, epoch=0)  # all good
    # label view of the wrong length / wrong number of classes
    with pytest.raises(ValueError, match="label view has 19 samples but the manifest .* lists 20"):
        make_train_loader(split, shifted_view(19, cifar_images), cfg, rank=0, world_size=1, epoch=0)
    view11 = LabelView(observed=view.observed, clean=view.clean, num_classes=11)
    with pytest.raises(ValueError, match="num_classes=11 .* 10 classes"):
        make_train_loader(split, view11, cfg, rank=0, world_size=1, epoch=0)
    # wrong count in the manifest
    mpath = split / "manifest.json"
    d = json.loads(mpath.read_text())
    d["num_samples"] = 21
    mpath.write_text(json.dumps(d))
    with pytest.raises(ManifestError, match="num_samples 21 != sum over shards 20"):
        make_train_loader(split, view, cfg, rank=0, world_size=1, epoch=0)
    manifest.save(split)
    # wrong sha256 (same size): one flipped byte inside the tar's payload
    shard = split / "train-000001.tar"
    raw = bytearray(shard.read_bytes())
    raw[2000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="train-000001.tar: sha256"):
        make_train_loader(split, view, cfg, rank=0, world_size=1, epoch=0)
    # missing shard
    shard.unlink()
    with pytest.raises(ManifestError, match="train-000001.tar: shard listed in the manifest is missing"):
        make_train_loader(split, view, cfg, rank=0, world_size=1, epoch=0)


def test_too_few_shards_reduce_workers_then_raise(tmp_path, cifar_images):
    write_split(tmp_path / "train", [10, 10, 10], cifar_images)
    view = shifted_view(30, cifar_images)
    with pytest.warns(RuntimeWarning, match="data-loading processes .*--loader-workers.: using 1"):
        per_rank, loaders = run_ranks(tmp_path / "train", view, CFG, world=2)
    assert {ld.num_workers for ld in loaders} == {1, 2}
    assert np.array_equal(np.sort(np.concatenate([valid_idx(b) for b in per_rank])), np.arange(30))
    with pytest.raises(ValueError, match="3 shards cannot be split across 4 ranks"):
        make_train_loader(tmp_path / "train", view, CFG, rank=0, world_size=4, epoch=0)


def test_start_batch_resume_yields_the_remaining_batches(tmp_path, cifar_images):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    view = shifted_view(sum(UNEVEN), cifar_images)
    kw = dict(rank=1, world_size=2, epoch=2)
    full_loader = make_train_loader(tmp_path / "train", view, CFG, **kw)
    full = list(full_loader)
    k = 2
    resumed_loader = make_train_loader(tmp_path / "train", view, CFG, start_batch=k, **kw)
    assert len(resumed_loader) == len(full) - k
    resumed = list(resumed_loader)
    assert len(resumed) == len(full) - k
    for a, b in zip(full[k:], resumed):
        assert torch.equal(a.idx, b.idx) and torch.equal(a.images, b.images)
    assert resumed_loader.position == {"epoch": 2, "batch": full_loader.steps_per_epoch}
    with pytest.raises(ValueError, match="start_batch 99"):
        make_train_loader(tmp_path / "train", view, CFG, start_batch=99, **kw)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    """A local HTTP server (127.0.0.1, free port) serving ``tmp_path``; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_shards_stream_over_http(tmp_path, cifar_images, http_root):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    n = sum(UNEVEN)
    view = shifted_view(n, cifar_images)
    cfg = replace(CFG, verify_checksums=True)
    per_rank, loaders = run_ranks(f"{http_root}/train", view, cfg, world=2)  # manifest over HTTP too
    assert len(per_rank[0]) == len(per_rank[1])
    assert np.array_equal(np.sort(np.concatenate([valid_idx(b) for b in per_rank])), np.arange(n))
    assert sum(ld.stats["checksum_mismatch"] for ld in loaders) == 0
    assert sum(ld.stats["shards"] for ld in loaders) == len(UNEVEN)
    # same batches as from the local directory
    local, _ = run_ranks(tmp_path / "train", view, cfg, world=2)
    assert all(torch.equal(a.images, b.images) for a, b in zip(per_rank[0], local[0]))
    # a shard changed on the server after the manifest (same size): caught while it streams
    shard = tmp_path / "train" / "train-000001.tar"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # the tar's end-of-archive padding: every sample still reads
    shard.write_bytes(bytes(raw))
    per_rank, loaders = run_ranks(f"{http_root}/train", view, cfg, world=2)
    assert sum(ld.stats["checksum_mismatch"] for ld in loaders) == 1
    assert np.array_equal(np.sort(np.concatenate([valid_idx(b) for b in per_rank])), np.arange(n))
    (tmp_path / "train" / "train-000003.tar").unlink()
    with pytest.raises(ManifestError, match="train-000003.tar: shard listed in the manifest is not reachable"):
        make_train_loader(f"{http_root}/train", view, cfg, rank=0, world_size=2, epoch=0)


def test_eval_loader_covers_split_in_manifest_order(tmp_path, cifar_images):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    n = sum(UNEVEN)
    cfg = replace(CFG, num_workers=0)
    loaders = [make_eval_loader(tmp_path / "train", None, cfg, rank=r, world_size=2) for r in range(2)]
    per_rank = [list(ld) for ld in loaders]
    assert len(per_rank[0]) == len(per_rank[1])
    seen = np.concatenate([valid_idx(b) for b in per_rank])
    assert np.array_equal(np.sort(seen), np.arange(n))
    # no view: labels from the shards' json; eval stream has no sample shuffle
    for b in (b for r in per_rank for b in r):
        labels = torch.tensor([cifar_images[i % 100][1] for i in b.idx.tolist()])
        assert torch.equal(b.observed, labels) and torch.equal(b.clean, labels)
    for batches in per_rank:  # each rank reads its shards in manifest order, unshuffled
        assert np.all(np.diff(valid_idx(batches)) > 0)


def test_dropped_samples_are_left_out_before_decoding_and_kept_raw(tmp_path, cifar_images):
    """A drop mask (the noisy validation split) leaves its samples out of the training pass
    before their images are decoded (a corrupt one costs nothing), the plan counts only the
    kept samples (full batches, nothing padded), and the raw bytes kept decode, in this
    process, to exactly the evaluation loader's tensors."""
    sizes = [10, 7, 9, 6]
    n = sum(sizes)
    write_split(tmp_path / "train", sizes, cifar_images, corrupt={5: b"not an image"})
    m = Manifest.load(tmp_path / "train")
    drop = np.zeros(n, bool)
    drop[[0, 5, 11, 12, 20, 31]] = True
    view = shifted_view(n, cifar_images)
    src = tmp_path / "train"
    with pytest.raises(ValueError, match="first_idx"):  # a hand-made manifest: no ranges
        make_train_loader(src, view, CFG, rank=0, world_size=2, epoch=0, drop=drop)
    starts = np.cumsum([0, *sizes[:-1]])
    m = Manifest(m.dataset, m.split, m.classes,
                 [replace(s, first_idx=int(f)) for s, f in zip(m.shards, starts)])
    m.save(src)
    per_rank, loaders = run_ranks(src, view, CFG, world=2, drop=drop, keep_dropped=True)
    seen = np.concatenate([valid_idx(b) for b in per_rank])
    assert np.array_equal(np.sort(seen), np.flatnonzero(~drop))  # each kept sample once
    stats = {k: sum(ld.stats[k] for ld in loaders) for k in loaders[0].stats}
    assert stats["dropped"] == drop.sum()
    assert stats["skipped_decode"] == stats["missing"] == stats["padded"] == 0
    assert all(b.valid.all() for r in per_rank for b in r[:-1])  # full batches
    kept = [s for ld in loaders for s in ld.kept]
    assert sorted(int(s["__key__"].rsplit("/", 1)[-1]) for s in kept) == \
        np.flatnonzero(drop).tolist()
    cfg = replace(CFG, num_workers=0)
    got = {int(i): x for b in decoded_batches(kept, view, cfg, batch_size=4)
           for i, x in zip(b.idx, b.images)}
    assert sorted(got) == [0, 11, 12, 20, 31]  # idx 5 does not decode: left out, logged
    ref = {int(i): x for b in make_eval_loader(src, view, cfg) for i, x, v in
           zip(b.idx, b.images, b.valid) if v}
    for i, x in got.items():
        assert torch.equal(x, ref[i]), i
    # the evaluation loader drops them too (the plan counts what each shard keeps)
    ev = list(make_eval_loader(src, view, cfg, drop=~drop))
    assert sorted(valid_idx(ev).tolist()) == [0, 11, 12, 20, 31]


def _reverse_pixels(pixels: np.ndarray, *, idx: int, seed: int) -> np.ndarray:
    """A test open-set transform: pixels in a per-(idx, seed) random order."""
    h, w, c = pixels.shape
    perm = np.random.default_rng([seed, idx]).permutation(h * w)
    return pixels.reshape(h * w, c)[perm].reshape(h, w, c)


def test_ood_hook_replaces_marked_images(tmp_path, cifar_images):
    write_split(tmp_path / "train", [10, 10], cifar_images)
    base = shifted_view(20, cifar_images)
    ood = np.zeros(20, bool)
    ood[[3, 11, 17]] = True
    view = LabelView(observed=base.observed, clean=base.clean, num_classes=K, ood=ood)
    cfg = replace(CFG, num_workers=0, ood_seed=5)
    t = build_transform("cifar", train=False)

    def check(batches, fn):
        n_ood = 0
        for b in batches:
            for i, x in zip(b.idx.tolist(), b.images):
                # (PNG samples are lossless copies of the decoded JPEG pixels)
                px = np.asarray(Image.open(io.BytesIO(cifar_images[i][0])).convert("RGB"))
                if ood[i]:
                    px, n_ood = fn(px, idx=i, seed=5), n_ood + 1
                assert torch.allclose(x, t(Image.fromarray(px)), atol=1e-5), i
        assert n_ood == 3

    check(make_eval_loader(tmp_path / "train", view, cfg, ood_transform=_reverse_pixels),
          _reverse_pixels)
    if importlib.util.find_spec("pipeline.core.noise") is None:
        with pytest.raises(ValueError, match="3 samples as out-of-distribution"):
            make_eval_loader(tmp_path / "train", view, cfg)
    else:  # the default hook is pipeline.core.noise.shuffle_pixels
        from pipeline.core.noise import shuffle_pixels

        check(make_eval_loader(tmp_path / "train", view, cfg), shuffle_pixels)


# -- transforms ---------------------------------------------------------------------------------


def test_transform_presets_shapes_and_errors():
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (375, 500, 3), dtype=np.uint8))
    for name, p in PRESETS.items():
        img = {"digits": rgb.convert("L").resize((8, 8)), "cifar": rgb.resize((32, 32))}.get(name, rgb)
        for train in (True, False):
            x = build_transform(name, train=train)(img)
            assert x.dtype == torch.float32 and tuple(x.shape) == p.shape, (name, train)
    with pytest.raises(ValueError, match="unknown transform preset 'imagenet'.*cifar, clothing1m, digits"):
        build_transform("imagenet", train=True)
    with pytest.raises(ValueError, match="unknown transform preset"):
        LoaderConfig(preset="nope")
    # the loader's split (uint8 per sample, normalise per batch) equals the per-sample transform
    from torchvision.transforms import v2

    ref = v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.ToImage(),
                      v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    u8 = build_sample_transform("clothing1m", train=False)(rgb)
    assert u8.dtype == torch.uint8
    batch = build_batch_transform("clothing1m")(torch.stack([u8, u8.flip(-1)]))
    assert torch.allclose(batch[0], ref(rgb), atol=1e-5)
    assert torch.allclose(batch[0], build_transform("clothing1m", train=False)(rgb), atol=1e-6)
    assert torch.allclose(batch[1], batch[0].flip(-1))
    # eval is deterministic; train augments
    small = Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    ev = build_transform("cifar", train=False)
    assert torch.equal(ev(small), ev(small))
    tr = build_transform("cifar", train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [tr(small) for _ in range(8)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    # per-image standardisation; a constant image maps to zeros, not NaN
    x = ev(small)
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std(unbiased=False)) - 1) < 1e-4
    assert torch.equal(ev(Image.new("RGB", (32, 32), (9, 9, 9))), torch.zeros(3, 32, 32))


# -- integrity checks on by default, and the counters of a pass ---------------------------------


def test_same_size_corruption_is_refused_by_default(split20, cifar_images):
    """A JPEG overwritten in place with as many bytes decodes into garbage; the default
    loader refuses the shard before any batch instead of training on it."""
    split, manifest, view = split20
    assert LoaderConfig().verify_checksums is True and CFG.verify_checksums is True
    shard = split / "train-000000.tar"
    with tarfile.open(shard) as t:
        member = next(m for m in t.getmembers() if m.name.endswith(".jpg"))
    raw = bytearray(shard.read_bytes())
    start = member.offset_data + member.size // 2
    raw[start:start + 64] = bytes(64)  # same size: the manifest's size check passes
    shard.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"train-000000.tar: sha256 does not match"):
        make_train_loader(split, view, CFG, rank=0, world_size=1, epoch=0)
    # turning the check off trains on it (what the default used to do)
    off = replace(CFG, verify_checksums=False, num_workers=0)
    loader = make_train_loader(split, view, off, rank=0, world_size=1, epoch=0)
    assert sum(int(b.valid.sum()) for b in loader) == 20


def test_each_shard_is_hashed_once_per_process_until_it_changes(split20, monkeypatch):
    from pipeline.data import stream as data

    split, manifest, view = split20
    hashed = []
    real = data.sha256_file
    monkeypatch.setattr(data, "sha256_file", lambda p, **kw: (hashed.append(Path(p).name),
                                                              real(p, **kw))[1])
    for epoch in range(3):
        make_train_loader(split, view, CFG, rank=0, world_size=1, epoch=epoch)
        make_eval_loader(split, view, CFG)
    assert sorted(hashed) == ["train-000000.tar", "train-000001.tar"]
    shard = split / "train-000001.tar"
    shard.write_bytes(shard.read_bytes())  # rewritten (same bytes): checked again
    make_train_loader(split, view, CFG, rank=0, world_size=1, epoch=3)
    assert sorted(hashed) == ["train-000000.tar", "train-000001.tar", "train-000001.tar"]


def test_loader_counters_sum_over_ranks():
    from pipeline.data.stream import loader_counters

    stats = {"skipped_decode": 1, "skipped_meta": 2, "skipped_duplicate": 3, "skipped_extra": 4,
             "skipped_tar": 1, "missing": 9, "padded": 9, "checksum_mismatch": 0, "samples": 50,
             "read_retries": 2, "decode_fallback": 3}
    assert loader_counters(stats) == {"data_skipped_samples": 10.0, "data_skipped_shards": 1.0,
                                      "data_missing": 9.0, "data_padded": 9.0,
                                      "data_checksum_mismatch": 0.0, "data_read_retries": 2.0,
                                      "data_decode_fallback": 3.0}
    doubled = loader_counters(stats, all_reduce_sum=lambda t: 2 * t)
    assert doubled["data_padded"] == 18.0 and doubled["data_skipped_samples"] == 20.0


def test_two_views_are_two_augmentations_of_the_same_samples(tmp_path, cifar_images):
    """views=2 (DivideMix): the same batches (idx, labels, first view) as one view, plus a
    second, different augmentation of every image; reproducible on a re-read."""
    from pipeline.core.batch import ViewsBatch

    write_split(tmp_path / "train", [10] * 4, cifar_images)
    view = shifted_view(40, cifar_images)
    cfg = replace(CFG, num_workers=0)

    def stream(views):
        return list(make_train_loader(tmp_path / "train", view, cfg, rank=0, world_size=1,
                                      epoch=0, views=views))

    one, two, again = stream(1), stream(2), stream(2)
    assert len(one) == len(two) and all(isinstance(b, ViewsBatch) for b in two)
    for a, b, c in zip(one, two, again):
        assert torch.equal(a.idx, b.idx) and torch.equal(a.observed, b.observed)
        assert b.images.shape == b.images2.shape == a.images.shape
        assert torch.equal(b.images, c.images) and torch.equal(b.images2, c.images2)
    # pad-and-crop and flip: the two views of a batch differ
    assert all(not torch.equal(b.images, b.images2) for b in two)
    with pytest.raises(ValueError, match="views must be 1 or 2"):
        make_train_loader(tmp_path / "train", view, cfg, rank=0, world_size=1, epoch=0, views=3)


def test_class_sorted_training_shards_are_warned_about():
    """Image-folder shards (every split) and WebVision's train split written in their list's
    class-by-class order (``--keep-order``, or converted before the converters shuffled) draw
    a warning naming the folder; shuffled ones, other splits and other converters do not."""
    import warnings

    from pipeline.data.stream import ClassSortedShardsWarning, warn_if_class_sorted

    shard = [ShardInfo(name="train-000000.tar", num_samples=1, sha256="0" * 64, bytes=1)]

    def manifest(converter: str, split: str = "train", **src) -> Manifest:
        return Manifest(dataset="d", split=split, classes=["a", "b"], shards=shard,
                        source={"converter": converter, **src})

    with pytest.warns(ClassSortedShardsWarning, match=r"/data/x: the shards of d/train hold "
                      r"their samples class by class \(shards.imagefolder"):
        assert warn_if_class_sorted(manifest("shards.imagefolder"), where="/data/x")
    with pytest.warns(ClassSortedShardsWarning):
        assert warn_if_class_sorted(manifest("shards.imagefolder", "test", shuffle_seed=None),
                                    where="t")
    with pytest.warns(ClassSortedShardsWarning):
        assert warn_if_class_sorted(manifest("shards.webvision"), where="w")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_class_sorted(manifest("shards.imagefolder", shuffle_seed=0), where="")
        assert not warn_if_class_sorted(manifest("shards.webvision", "val"), where="")
        assert not warn_if_class_sorted(manifest("shards.clothing1m"), where="")
        assert not warn_if_class_sorted(manifest("shards.cifar"), where="")


def test_a_view_built_over_another_conversion_of_the_split_is_refused(tmp_path, cifar_images):
    """A label view names images by idx; another conversion (another shuffle seed or source)
    puts other images at the same idx. The view records the split's fingerprint, and the
    loader refuses it over shards with another one, naming both."""
    a = write_split(tmp_path / "a", [10, 10], cifar_images)
    b = write_split(tmp_path / "b", [10, 10], cifar_images[::-1])
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == Manifest.load(tmp_path / "a").fingerprint()  # stable on reload
    view = replace(shifted_view(20, cifar_images), split_fingerprint=a.fingerprint())
    saved = LabelView.load(view.save(tmp_path / "v.npz"))
    assert saved.split_fingerprint == a.fingerprint()
    assert saved.take(np.arange(5)).split_fingerprint is None  # a subset is not the split
    make_eval_loader(tmp_path / "a", saved, CFG)
    with pytest.raises(ValueError, match=f"other shards than {tmp_path / 'b'} .*"
                                         f"{a.fingerprint()[:12]}.*{b.fingerprint()[:12]}"):
        make_eval_loader(tmp_path / "b", saved, CFG)
    # a view saved before views recorded their split loads with a warning, unchecked
    old = replace(view, split_fingerprint=None)
    path = old.save(tmp_path / "old.npz")
    with np.load(path) as z:
        arrays = dict(z)
    meta = json.loads(bytes(arrays["meta"]).decode())
    del meta["split_fingerprint"]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **arrays)
    with pytest.warns(UserWarning, match="does not record the split"):
        assert LabelView.load(path).split_fingerprint is None


def test_splits_must_share_classes_and_the_training_split_a_shard_per_rank():
    """check_splits (every worker, and the jobs before Ray starts): the test split's class
    list is the training split's, in order; the training split has a shard for every rank,
    the test split may have fewer (the first ranks score it)."""
    def man(classes, shards):
        return Manifest(dataset="d", split="s", classes=list(classes),
                        shards=[ShardInfo(f"s-{i}.tar", 10, "0" * 64, 100) for i in range(shards)])

    check_splits(man("abc", 4), man("abc", 2), world_size=2, train_where="tr", test_where="te")
    check_splits(man("abc", 4), None, world_size=4, train_where="tr")
    with pytest.raises(ValueError, match=r"te has classes \['b', 'c'\] but the training split "
                                         r"tr has \['a', 'b', 'c'\]"):
        check_splits(man("abc", 4), man("bc", 4), world_size=1, train_where="tr",
                     test_where="te")
    check_splits(man("abc", 8), man("abc", 3), world_size=4, train_where="tr", test_where="te")
    assert [eval_ranks(man("abc", s), 4) for s in (1, 3, 4, 9)] == [1, 3, 4, 4]
    with pytest.raises(ValueError, match="tr has 2 shards, fewer than the 4 workers.*"
                                         "--shard-size at most 5"):
        check_splits(man("abc", 2), man("abc", 3), world_size=4, train_where="tr",
                     test_where="te")


def test_a_malformed_manifest_names_its_file(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "dataset": "d", "split": "s", "classes": ["a", "b"],
         "shards": [{"name": "s-0.tar", "num_samples": 3}]}))
    with pytest.raises(ManifestError, match=f"{tmp_path / 'manifest.json'}: malformed"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "split": "s"}))
    with pytest.raises(ManifestError, match="manifest.json: missing field 'shards'"):
        Manifest.load(tmp_path)


def test_the_loader_shuffles_open_set_pixels_with_the_views_pixel_seed(tmp_path, cifar_images):
    """Without an explicit ``ood_seed`` the loader uses the view's ``pixel_seed``, as the
    in-memory trainer does (pipeline.train.trainer.open_set_images): both show the same images."""
    from pipeline.core.noise import shuffle_pixels
    from pipeline.train.trainer import open_set_images

    write_split(tmp_path / "train", [10, 10], cifar_images)
    base = shifted_view(20, cifar_images)
    ood = np.zeros(20, bool)
    ood[[2, 9]] = True
    view = LabelView(observed=base.observed, clean=base.clean, num_classes=K, ood=ood,
                     spec={"kind": "open_set", "seed": 3, "pixel_seed": 7})
    assert view.pixel_seed == 7 and CFG.ood_seed is None
    cfg = replace(CFG, num_workers=0, normalize_on="device")  # batches of uint8 pixels
    shown = {}
    for b in make_eval_loader(tmp_path / "train", view, cfg):
        shown.update({i: x for i, x in zip(b.idx.tolist(), b.images)})
    raw = torch.stack([torch.from_numpy(np.array(Image.open(io.BytesIO(
        cifar_images[i][0])).convert("RGB"))).permute(2, 0, 1) for i in range(20)])
    mem = open_set_images(raw, view)
    for i in range(20):
        if ood[i]:
            px = raw[i].permute(1, 2, 0).numpy()
            want = torch.from_numpy(shuffle_pixels(px, idx=i, seed=7)).permute(2, 0, 1)
            assert torch.equal(mem[i], want)
            assert not torch.equal(want, torch.from_numpy(
                shuffle_pixels(px, idx=i, seed=0)).permute(2, 0, 1))
        assert torch.equal(shown[i], mem[i]), i  # (PNG samples: lossless copies)
