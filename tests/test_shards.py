"""The shared shard writer (determinism, parallel parity, resumability, atomicity, validation),
the image-folder converter and the CLI."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.manifest import Manifest, ManifestError
from shards import cli, imagefolder
from shards.writer import (
    BadImageError,
    SampleRecord,
    ShardError,
    WriterOptions,
    shard_name,
    write_split,
)

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "bird", "cat"]
SHARD = 25


def read_split(split_dir: Path) -> list[dict]:
    """Samples of a split in shard order: {"__key__", <ext>: bytes, "json": dict}."""
    out: list[dict] = []
    for s in Manifest.load(split_dir).shards:
        with tarfile.open(split_dir / s.name) as tar:
            for ti in tar.getmembers():
                key, ext = ti.name.split(".", 1)
                if not out or out[-1]["__key__"] != key:
                    out.append({"__key__": key})
                data = tar.extractfile(ti).read()
                out[-1][ext] = json.loads(data) if ext == "json" else data
    return out


def split_bytes(split_dir: Path) -> dict[str, bytes]:
    """Every shard file (final names only) of a split, by name."""
    return {p.name: p.read_bytes() for p in sorted(split_dir.glob("*.tar"))}


def stat_ids(split_dir: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in split_dir.glob("*.tar")}


def extract_subset(archive: Path, dest: Path, keep) -> Path:
    """Extract the members ``keep(split, cls, file_no)`` of the CIFAR-10 JPEG archive into
    ``dest/<split>/<class>/NNNN.jpg`` (much faster than extracting all 60,000 files)."""
    with tarfile.open(archive) as tar:
        for ti in tar:
            parts = Path(ti.name).parts
            if not ti.isfile() or len(parts) < 3 or parts[-3] not in ("train", "test"):
                continue
            split, cls, fname = parts[-3:]
            if keep(split, cls, int(Path(fname).stem)):
                (dest / split / cls).mkdir(parents=True, exist_ok=True)
                (dest / split / cls / fname).write_bytes(tar.extractfile(ti).read())
    return dest


@pytest.fixture(scope="module")
def jpeg_tree(shared_data, tmp_path_factory) -> Path:
    """A small real tree: train/<airplane|bird|cat>/0000-0039.jpg, test/<airplane|cat>/0000-0004."""
    return extract_subset(
        shared_data / "cifar10-jpeg.tar.gz", tmp_path_factory.mktemp("c10sub"),
        lambda split, cls, k: (split == "train" and cls in CLASSES and k < 40)
        or (split == "test" and cls in ("airplane", "cat") and k < 5))


@pytest.fixture(scope="module")
def jpeg_files(jpeg_tree) -> list[tuple[int, Path]]:
    """120 real CIFAR-10 JPEGs: (label, path), 40 per class of CLASSES."""
    return [(lab, jpeg_tree / "train" / c / f"{k:04d}.jpg")
            for lab, c in enumerate(CLASSES) for k in range(40)]


def make_records(jpeg_files) -> list[SampleRecord]:
    return [SampleRecord(idx=i, label=lab, clean=lab if i % 3 else -1,
                         key=f"{p.parent.name}/{p.name}", path=str(p),
                         extras={"source_row": i * 7})
            for i, (lab, p) in enumerate(jpeg_files)]


def write(records: list[SampleRecord], out: Path, **opts) -> Manifest:
    options = WriterOptions(**{"shard_size": SHARD, "progress": False, **opts})
    return write_split(records, out, dataset="t", split="train", classes=CLASSES,
                       options=options)


@pytest.fixture(scope="module")
def reference(jpeg_files, tmp_path_factory) -> Path:
    """An uninterrupted single-process conversion of the 120 records (split dir)."""
    out = tmp_path_factory.mktemp("ref")
    write(make_records(jpeg_files), out)
    return out / "train"


def test_layout_content_and_fixed_tar_metadata(reference, jpeg_files):
    m = Manifest.load(reference)
    assert [s.name for s in m.shards] == [shard_name("train", i) for i in range(5)]
    assert [s.num_samples for s in m.shards] == [25, 25, 25, 25, 20]
    assert m.num_samples == 120 and m.classes == CLASSES
    # each shard says which idx it holds (a reader plans around a subset without opening it)
    assert m.idx_ranges() == [(0, 25), (25, 25), (50, 25), (75, 25), (100, 20)]
    m.verify(reference)
    samples = read_split(reference)
    assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(120)]
    for i, (s, (lab, p)) in enumerate(zip(samples, jpeg_files)):
        assert s["jpg"] == p.read_bytes()  # original bytes kept
        assert s["json"] == {"idx": i, "label": lab, "clean": lab if i % 3 else -1,
                             "key": f"{p.parent.name}/{p.name}", "source_row": i * 7}
    with tarfile.open(reference / "train-000001.tar") as tar:
        members = tar.getmembers()
    assert [t.name for t in members[:4]] == ["00000025.jpg", "00000025.json",
                                             "00000026.jpg", "00000026.json"]
    assert {(t.mtime, t.uid, t.gid, t.uname, t.gname, t.mode) for t in members} == {
        (0, 0, 0, "", "", 0o444)}
    assert m.source["skipped"] == {"count": 0, "keys": [], "errors": []}


def test_deterministic_and_same_bytes_with_two_workers(reference, jpeg_files, tmp_path):
    write(make_records(jpeg_files), tmp_path / "again")
    write(make_records(jpeg_files), tmp_path / "par", workers=2)
    ref = split_bytes(reference)
    assert len(ref) == 5
    assert split_bytes(tmp_path / "again" / "train") == ref
    assert split_bytes(tmp_path / "par" / "train") == ref
    assert (Manifest.load(tmp_path / "par" / "train").shards == Manifest.load(reference).shards)


def _dies_after(records, n):
    for i, r in enumerate(records):
        if i == n:
            raise RuntimeError("source died")
        yield r


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_source_then_rerun_is_identical(reference, jpeg_files, tmp_path, workers):
    recs = make_records(jpeg_files)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="source died"):
        write_split(_dies_after(recs, 2 * SHARD + 3), out, dataset="t", split="train",
                    classes=CLASSES, num_samples=len(recs),
                    options=WriterOptions(shard_size=SHARD, workers=workers, progress=False))
    split = out / "train"
    ref = split_bytes(reference)
    partial = split_bytes(split)
    assert not (split / "manifest.json").exists()
    assert "train-000002.tar" not in partial
    for name, data in partial.items():  # whatever is under a final name is complete
        assert data == ref[name]
    if workers == 1:
        assert sorted(partial) == ["train-000000.tar", "train-000001.tar"]
    before = stat_ids(split)
    m = write(recs, out)
    assert split_bytes(split) == ref
    assert {k: stat_ids(split)[k] for k in before} == before  # finished shards not rewritten
    assert not list(split.glob("*.tmp"))
    m.verify(split)


def test_killed_mid_shard_leaves_no_partial_final_file(reference, jpeg_files, tmp_path):
    """SIGKILL a converter blocked inside shard 2 (reading a FIFO): only .tmp is partial."""
    recs = make_records(jpeg_files)
    fifo = tmp_path / "blocker.jpg"
    os.mkfifo(fifo)
    blocked = list(recs)
    blocked[2 * SHARD + 10] = replace(recs[2 * SHARD + 10], path=str(fifo))
    out = tmp_path / "out"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "classes": CLASSES, "shard": SHARD,
                                "records": [asdict(r) for r in blocked]}))
    code = ("import json, sys\n"
            "from shards.writer import SampleRecord, WriterOptions, write_split\n"
            "s = json.load(open(sys.argv[1]))\n"
            "recs = [SampleRecord(**r) for r in s['records']]\n"
            "write_split(recs, s['out'], dataset='t', split='train', classes=s['classes'],\n"
            "            options=WriterOptions(shard_size=s['shard'], progress=False))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(spec)], cwd=REPO)
    split = out / "train"
    try:
        deadline = time.monotonic() + 60
        while not (split / "train-000002.tar.tmp").exists():
            assert proc.poll() is None, "converter exited before reaching shard 2"
            assert time.monotonic() < deadline, "converter never reached shard 2"
            time.sleep(0.02)
        time.sleep(0.2)
        assert proc.poll() is None  # blocked on the FIFO, inside shard 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ref = split_bytes(reference)
    assert sorted(split_bytes(split)) == ["train-000000.tar", "train-000001.tar"]
    for name, data in split_bytes(split).items():
        assert data == ref[name]
    assert (split / "train-000002.tar.tmp").exists()
    assert not (split / "manifest.json").exists()
    before = stat_ids(split)
    write(recs, out)  # the real records: resumes at shard 2
    assert split_bytes(split) == ref
    assert stat_ids(split)["train-000000.tar"] == before["train-000000.tar"]
    assert not list(split.glob("*.tmp"))


def test_changed_input_rewrites_only_its_shard(reference, jpeg_files, tmp_path):
    recs = make_records(jpeg_files)
    out = tmp_path / "out"
    write(recs, out)
    split = out / "train"
    before = stat_ids(split)
    recs[60] = replace(recs[60], label=0)  # shard 2
    m = write(recs, out)
    after = stat_ids(split)
    assert [n for n in sorted(after) if after[n] != before[n]] == ["train-000002.tar"]
    assert read_split(split)[60]["json"]["label"] == 0
    m.verify(split)
    # a bigger shard size: shards beyond the new count disappear, the manifest matches
    m = write(recs, out, shard_size=50)
    assert sorted(split_bytes(split)) == [f"train-00000{i}.tar" for i in range(3)]
    m.verify(split)


def test_manifest_removed_while_a_rerun_is_incomplete(jpeg_files, tmp_path):
    recs = make_records(jpeg_files)
    out = tmp_path / "out"
    write(recs, out)
    assert (out / "train" / "manifest.json").exists()
    changed = [replace(r, clean=-1) for r in recs]
    with pytest.raises(RuntimeError):
        write_split(_dies_after(changed, 30), out, dataset="t", split="train",
                    classes=CLASSES, options=WriterOptions(shard_size=SHARD, progress=False))
    with pytest.raises(ManifestError, match="no manifest"):
        Manifest.load(out / "train")


def test_verify_detects_a_modified_shard(reference, tmp_path):
    split = tmp_path / "train"
    shutil.copytree(reference, split)
    m = Manifest.load(split)
    data = bytearray((split / "train-000003.tar").read_bytes())
    data[1000] ^= 0xFF
    (split / "train-000003.tar").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="train-000003.tar: sha256"):
        m.verify(split)


@pytest.fixture
def bad_records(jpeg_files, tmp_path) -> tuple[list[SampleRecord], dict[int, str]]:
    """60 records; idx 7 is garbage bytes, idx 33 a truncated JPEG, idx 50 missing."""
    recs = make_records(jpeg_files)[:60]
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"this is not an image" * 10)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(Path(recs[33].path).read_bytes()[:-120])
    recs[7] = replace(recs[7], path=str(garbage), key="bad/garbage.jpg")
    recs[33] = replace(recs[33], path=str(truncated), key="bad/truncated.jpg")
    recs[50] = replace(recs[50], path=str(tmp_path / "gone.jpg"), key="bad/gone.jpg",
                       origin="list.txt:51")
    return recs, {7: str(garbage), 33: str(truncated), 50: str(tmp_path / "gone.jpg")}


def test_corrupt_image_is_an_error_naming_the_file(bad_records, tmp_path):
    recs, bad = bad_records
    with pytest.raises(BadImageError, match=f"{bad[7]}: not a valid image"):
        write(recs[:20], tmp_path / "a")
    with pytest.raises(BadImageError, match="gone.jpg \\(from list.txt:51\\): image file not"):
        write([replace(r, idx=i) for i, r in enumerate(recs[40:51])], tmp_path / "b")
    # PIL verify alone passes a truncated JPEG; a full decode catches it
    ok = [replace(r, idx=i) for i, r in enumerate(recs[30:40])]
    write(ok, tmp_path / "c")
    with pytest.raises(BadImageError, match="truncated.jpg: not a valid image"):
        write(ok, tmp_path / "d", validate="decode")
    assert not list((tmp_path / "a" / "train").glob("*.tar*"))


def test_skip_bad_drops_renumbers_and_lists(bad_records, jpeg_files, tmp_path):
    recs, bad = bad_records
    m = write(recs, tmp_path / "out", skip_bad=True, validate="decode")
    assert m.num_samples == 57
    assert m.source["skipped"]["count"] == 3
    assert m.source["skipped"]["keys"] == ["bad/garbage.jpg", "bad/truncated.jpg",
                                           "bad/gone.jpg"]
    samples = read_split(tmp_path / "out" / "train")
    kept = [r for r in recs if r.idx not in bad]
    assert [s["json"]["idx"] for s in samples] == list(range(57))  # dense
    assert m.idx_ranges() is not None
    assert [s["json"]["key"] for s in samples] == [r.key for r in kept]
    assert [s["jpg"] for s in samples] == [Path(r.path).read_bytes() for r in kept]
    # a rerun re-reads nothing: scan results and shards come from .progress
    before = stat_ids(tmp_path / "out" / "train")
    m2 = write(recs, tmp_path / "out", skip_bad=True, validate="decode")
    assert m2 == m and stat_ids(tmp_path / "out" / "train") == before


def _jpeg(size, seed) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_resize_short_and_format_detection(tmp_path):
    big = _jpeg((200, 150), 0)           # resized to 80x60
    tall = _jpeg((90, 300), 1)           # resized to 60x200
    small = _jpeg((70, 50), 2)           # short side 50 <= 60: kept as is
    arr = np.random.default_rng(3).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    png_buf, bmp_buf = io.BytesIO(), io.BytesIO()
    Image.fromarray(arr).save(png_buf, format="PNG")
    Image.fromarray(arr).save(bmp_buf, format="BMP")
    datas = [big, tall, small, png_buf.getvalue(), bmp_buf.getvalue()]
    recs = [SampleRecord(idx=i, label=0, clean=0, key=f"k{i}.jpg", data=d)
            for i, d in enumerate(datas)]
    write(recs, tmp_path / "r", resize_short=60)
    s = read_split(tmp_path / "r" / "train")
    sizes = [Image.open(io.BytesIO(x.get("jpg") or x.get("png"))).size for x in s]
    assert sizes == [(80, 60), (60, 200), (70, 50), (30, 20), (30, 20)]
    assert [sorted(set(x) - {"__key__", "json"}) for x in s] == [
        ["jpg"], ["jpg"], ["jpg"], ["png"], ["png"]]
    assert Image.open(io.BytesIO(s[0]["jpg"])).format == "JPEG"
    assert s[2]["jpg"] == small and s[3]["png"] == png_buf.getvalue()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(s[4]["png"]))), arr)  # BMP -> PNG
    # without resizing everything keeps its bytes (a PNG named .jpg is stored as png)
    write(recs, tmp_path / "n")
    s = read_split(tmp_path / "n" / "train")
    assert s[0]["jpg"] == big and s[1]["jpg"] == tall and s[3]["png"] == png_buf.getvalue()


def test_bad_records_are_rejected(jpeg_files, tmp_path):
    recs = make_records(jpeg_files)[:5]
    with pytest.raises(ShardError, match="idx 3 at position 2"):
        write([recs[0], recs[1], recs[3]], tmp_path / "a")
    with pytest.raises(ShardError, match="label 3 outside"):
        write([replace(recs[0], label=3)], tmp_path / "b")
    k = len(CLASSES)  # a clean label is a class or -1 (unknown); the reader refuses K too
    with pytest.raises(ShardError, match=rf"clean label {k} outside \[-1, {k}\)"):
        write([replace(recs[0], clean=k)], tmp_path / "b2")
    with pytest.raises(ShardError, match="reserved field"):
        write([replace(recs[0], extras={"label": 1})], tmp_path / "c")
    with pytest.raises(ShardError, match="exactly one of"):
        write([replace(recs[0], data=b"x")], tmp_path / "d")
    with pytest.raises(ShardError, match="expected 9 records, got 5"):
        write_split(iter(recs), tmp_path / "e", dataset="t", split="train", classes=CLASSES,
                    num_samples=9, options=WriterOptions(progress=False))
    with pytest.raises(ShardError, match="jpeg_quality"):
        WriterOptions(jpeg_quality=80)


# -- image-folder converter ---------------------------------------------------------------------


def test_imagefolder_keeps_bytes_orders_and_labels(jpeg_tree, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(jpeg_tree, src)
    (src / "train" / "bird" / "README.txt").write_text("not an image")
    (src / "train" / "bird" / ".DS_Store").write_bytes(b"\0")
    out = tmp_path / "out"
    ms = imagefolder.convert(src, out, shard_size=50, progress=False, shuffle_seed=None)
    assert sorted(ms) == ["test", "train"]
    train, test = ms["train"], ms["test"]
    assert train.classes == test.classes == CLASSES  # sorted union of class folders
    assert (train.num_samples, test.num_samples) == (120, 10)
    assert [s.num_samples for s in train.shards] == [50, 50, 20]
    assert train.source["ignored_files"] == 2
    train.verify(out / "train")
    test.verify(out / "test")
    samples = read_split(out / "train")
    for i, s in enumerate(samples):
        cls, k = CLASSES[i // 40], i % 40
        assert s["json"] == {"idx": i, "label": i // 40, "clean": i // 40,
                             "key": f"{cls}/{k:04d}.jpg"}
        assert s["jpg"] == (src / "train" / cls / f"{k:04d}.jpg").read_bytes()
    assert [s["json"]["label"] for s in read_split(out / "test")] == [0] * 5 + [2] * 5


def test_imagefolder_converts_a_plain_class_tree_into_one_train_split(jpeg_tree, tmp_path):
    """SRC/<class>/<file> with no split folders (one's own data, as it usually comes) is the
    split ``train``: the same records as SRC/train/<class>/<file> would give; choosing
    split folders there is an error that names the layout."""
    flat = tmp_path / "flat"
    shutil.copytree(jpeg_tree / "train", flat)
    (flat / "bird" / "notes.txt").write_text("not an image")
    assert imagefolder.is_class_tree(flat) and not imagefolder.is_class_tree(jpeg_tree)
    ms = imagefolder.convert(flat, tmp_path / "out", shard_size=50, progress=False)
    assert sorted(ms) == ["train"] and ms["train"].classes == CLASSES
    assert ms["train"].num_samples == 120 and ms["train"].source["ignored_files"] == 1
    assert ms["train"].source["format"] == "imagefolder-flat"
    nested = imagefolder.convert(jpeg_tree, tmp_path / "nested", splits=["train"],
                                 shard_size=50, progress=False)["train"]
    got = [s["json"] for s in read_split(tmp_path / "out" / "train")]
    assert got == [s["json"] for s in read_split(tmp_path / "nested" / "train")]
    with pytest.raises(ShardError, match="has no split folders to choose"):
        imagefolder.convert(flat, tmp_path / "x", splits=["train"], progress=False)


def test_imagefolder_class_list_and_unverified_labels(jpeg_tree, tmp_path):
    ms = imagefolder.convert(jpeg_tree, tmp_path / "a", splits=["test"], progress=False,
                             classes=["cat", "bird", "airplane"], labels_unverified=True,
                             shuffle_seed=None)
    s = read_split(tmp_path / "a" / "test")
    assert [(x["json"]["label"], x["json"]["clean"]) for x in s] == [(0, -1)] * 5 + [(2, -1)] * 5
    assert s[0]["json"]["key"] == "cat/0000.jpg"
    assert ms["test"].classes == ["cat", "bird", "airplane"]
    with pytest.raises(ShardError, match=r"class folder\(s\) \['bird'\] not in the class list"):
        imagefolder.convert(jpeg_tree, tmp_path / "b", classes=["airplane", "cat"],
                            progress=False)
    # a listed class without a folder in any split would be an empty class: refused
    with pytest.raises(ShardError, match=r"class\(es\) \['zebra'\] of the class list have no folder"):
        imagefolder.convert(jpeg_tree, tmp_path / "c", classes=[*CLASSES, "zebra"],
                            progress=False)
    assert not (tmp_path / "c").exists()


def test_imagefolder_per_class_subset_then_the_full_test_split(jpeg_tree, tmp_path):
    """``per_class=N``: the first N files of each class, a class-balanced subset recorded in the
    manifest; the other split converted in full into the same folder afterwards."""
    out = tmp_path / "out"
    ms = imagefolder.convert(jpeg_tree, out, splits=["train"], per_class=7, progress=False,
                             shuffle_seed=None)
    assert ms["train"].num_samples == 21 and ms["train"].source["per_class"] == 7
    s = read_split(out / "train")
    assert [x["json"]["key"] for x in s[6:8]] == ["airplane/0006.jpg", "bird/0000.jpg"]
    assert [x["json"]["idx"] for x in s] == list(range(21))
    assert np.bincount([x["json"]["label"] for x in s]).tolist() == [7, 7, 7]
    ms = imagefolder.convert(jpeg_tree, out, splits=["test"], progress=False, shuffle_seed=None)
    assert ms["test"].num_samples == 10 and "per_class" not in ms["test"].source
    assert read_split(out / "train") == s  # untouched
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ShardError, match=f"per_class must be a positive integer, got {bad!r}"):
            imagefolder.convert(jpeg_tree, tmp_path / "bad", per_class=bad, progress=False)
    assert not (tmp_path / "bad").exists()


def test_imagefolder_writes_a_seeded_shuffle_so_every_shard_mixes_the_classes(jpeg_tree,
                                                                            tmp_path):
    """By default the class-by-class list is written in a seeded random order (idx = position
    in it): every shard holds every class, the same seed gives the same bytes, another seed
    another order; each image is written once, with its folder's label."""
    ms = imagefolder.convert(jpeg_tree, tmp_path / "a", splits=["train"], shard_size=40,
                             progress=False)
    assert ms["train"].source["shuffle_seed"] == 0
    a = read_split(tmp_path / "a" / "train")
    assert [x["json"]["idx"] for x in a] == list(range(120))
    keys = [x["json"]["key"] for x in a]
    assert sorted(keys) == [f"{c}/{k:04d}.jpg" for c in CLASSES for k in range(40)]
    assert keys != sorted(keys)
    for x in a:
        cls = x["json"]["key"].split("/")[0]
        assert x["json"]["label"] == x["json"]["clean"] == CLASSES.index(cls)
        assert x["jpg"] == (jpeg_tree / "train" / x["json"]["key"]).read_bytes()
    for shard in range(3):  # class order would put one class in each 40-sample shard
        labels = [x["json"]["label"] for x in a[40 * shard:40 * shard + 40]]
        assert min(np.bincount(labels, minlength=3)) >= 5
    imagefolder.convert(jpeg_tree, tmp_path / "b", splits=["train"], shard_size=40,
                        progress=False)
    assert split_bytes(tmp_path / "b" / "train") == split_bytes(tmp_path / "a" / "train")
    imagefolder.convert(jpeg_tree, tmp_path / "c", splits=["train"], shard_size=40,
                        progress=False, shuffle_seed=1)
    other = [x["json"]["key"] for x in read_split(tmp_path / "c" / "train")]
    assert other != keys and sorted(other) == sorted(keys)
    with pytest.raises(ShardError, match="shuffle seed must be a non-negative integer, got -1"):
        imagefolder.convert(jpeg_tree, tmp_path / "d", shuffle_seed=-1, progress=False)


def test_imagefolder_order_on_the_full_cifar10_tree(shared_data):
    """Listing + ordering on the real archive's 60,000 names: 50,000 train / 10,000 test."""
    files: dict[str, dict[str, list[str]]] = {"train": {}, "test": {}}
    with tarfile.open(shared_data / "cifar10-jpeg.tar.gz") as tar:
        for name in tar.getnames():
            parts = Path(name).parts
            if len(parts) >= 3 and parts[-3] in files and name.endswith(".jpg"):
                files[parts[-3]].setdefault(parts[-2], []).append(parts[-1])
    classes = sorted(files["train"])
    assert classes == sorted(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                              "horse", "ship", "truck"])
    for split, n in (("train", 50_000), ("test", 10_000)):
        recs = imagefolder.split_records(Path("root") / split, files[split], classes)
        assert len(recs) == n
        assert [r.idx for r in recs] == list(range(n))
        assert np.bincount([r.label for r in recs]).tolist() == [n // 10] * 10
        per = n // 10
        assert [r.key for r in recs[per - 1:per + 1]] == [f"airplane/{per - 1:04d}.jpg",
                                                          "automobile/0000.jpg"]


# -- CLI --------------------------------------------------------------------------------------


def test_cli_imagefolder_summary_resume_and_errors(jpeg_tree, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["imagefolder", str(jpeg_tree), "--out", str(out), "--shard-size", "50",
            "--workers", "1", "--no-progress", "--splits", "train",
            "--dataset-name", "cifar10-jpeg"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "cifar10-jpeg/train: 120 samples, 3 shards" in printed
    first = split_bytes(out / "train")
    assert cli.main(argv) == 0  # resumes: nothing to do, same bytes
    assert split_bytes(out / "train") == first
    assert cli.main(["imagefolder", str(tmp_path / "nope"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope: not a folder" in err


def test_python_dash_m_shards_runs_in_parallel(jpeg_tree, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "shards", "imagefolder", str(jpeg_tree), "--out",
                        str(out), "--workers", "2", "--shard-size", "30", "--splits", "train"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "imagefolder/train: 120 samples, 4 shards" in r.stdout
    Manifest.load(out / "train").verify(out / "train")


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def _descendants(pid: int) -> set[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _proc_stat(int(d.name))) is not None:
            parents[int(d.name)] = st[1]
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - out
        out |= frontier
    return out


def _running(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_sigkill_of_the_converter_ends_its_pool_workers(tmp_path):
    """``python -m shards ... --workers 2`` killed with SIGKILL: its pool workers and the
    resource tracker end too instead of waiting forever under PID 1."""
    rng = np.random.default_rng(0)
    for i in range(600):
        d = tmp_path / "src" / "train" / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(
            d / f"{i:04d}.jpg", quality=90)
    cmd = [sys.executable, "-m", "shards", "imagefolder", str(tmp_path / "src"), "--out",
           str(tmp_path / "out"), "--workers", "2", "--shard-size", "5", "--resize-short",
           "32", "--validate", "decode", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(children) < 3 and proc.poll() is None:  # 2 workers + the resource tracker
            assert time.monotonic() < deadline, "the pool did not start"
            children = _descendants(proc.pid)
            time.sleep(0.05)
        assert proc.poll() is None, "the conversion ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60  # a bound for the wait, not a timing check
        while any(_running(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [c for c in children if _running(c)]
        assert not alive, [Path(f"/proc/{c}/cmdline").read_bytes()[:200] for c in alive]
        assert not (tmp_path / "out" / "train" / "manifest.json").exists()
    finally:
        for c in children:
            if _running(c):
                os.kill(c, signal.SIGKILL)


def test_default_workers_leave_a_cpu_to_the_converting_process(monkeypatch):
    """Measured on 2 cores (benchmarks/results/convert.md): a pool of 2 was no faster than
    writing in-process. Default: CPUs - 1, at least 1."""
    for cpus, expected in ((1, 1), (2, 1), (4, 3), (16, 15)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)),
                            raising=False)
        args = cli.build_parser().parse_args(["imagefolder", "src", "--out", "out"])
        assert args.workers == expected, cpus
