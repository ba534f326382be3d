"""WebVision converter on a generated tree in the WebVision 1.0 format (Google + Flickr lists,
val list, synsets, and an ImageNet val folder in the Kaggle LOC_val_solution.csv layout)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.manifest import Manifest
from shards import cli, webvision
from shards.writer import ShardError

N_SYNSETS = 60  # labels 50..59 exist but are outside mini-WebVision


def _jpeg(rng: np.random.Generator, size: tuple[int, int]) -> bytes:
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize(size, Image.Resampling.BILINEAR).save(buf, format="JPEG")
    return buf.getvalue()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict:
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("webvision")
    info = root / "info"
    info.mkdir()
    wnids = ["n01440764"] + [f"n{1443537 + 1000 * i:08d}" for i in range(1, N_SYNSETS)]
    info.joinpath("synsets.txt").write_text(
        "".join(f"{w} class {i}, thing {i}\n" for i, w in enumerate(wnids)))
    lists: dict[str, list[tuple[str, int]]] = {}
    for source, n in (("google", 40), ("flickr", 12)):
        entries = []
        for j in range(n):
            lab = int(rng.integers(N_SYNSETS))
            rel = f"{source}/q{lab + 1:04d}/{source[0]}{j:05d}x.jpg"
            size = (400, 300) if j % 4 == 0 else (64, 48)
            _write(root / rel, _jpeg(rng, size))
            entries.append((rel, lab))
        lists[source] = entries
        info.joinpath(f"train_filelist_{source}.txt").write_text(
            "".join(f"{r} {lab}\n" for r, lab in entries))
    lists["val"] = [(f"val{j + 1:06d}.jpg", int(rng.integers(N_SYNSETS))) for j in range(30)]
    for rel, _ in lists["val"]:
        _write(root / "val_images_256" / rel, _jpeg(rng, (80, 60)))
    info.joinpath("val_filelist.txt").write_text(
        "".join(f"{r} {lab}\n" for r, lab in lists["val"]))
    # ImageNet val in the Kaggle layout; rows not sorted by ImageId
    inet = root.parent / "imagenet"
    img_dir = inet / "ILSVRC" / "Data" / "CLS-LOC" / "val"
    rows, ids = [], rng.permutation(np.arange(1, 31))
    for i in ids:
        lab = int(rng.integers(N_SYNSETS))
        image_id = f"ILSVRC2012_val_{i:08d}"
        rows.append((image_id, lab))
        _write(img_dir / f"{image_id}.JPEG", _jpeg(rng, (90, 70)))
    (inet / "LOC_val_solution.csv").write_text(
        "ImageId,PredictionString\n"
        + "".join(f"{iid},{wnids[lab]} 1 2 50 60 {wnids[lab]} 3 4 20 30 \n" for iid, lab in rows))
    lists["imagenet_val"] = sorted(rows)
    return {"root": root, "inet": inet, "wnids": wnids, "lists": lists}


def read_split(split_dir: Path) -> list[tuple[bytes, dict]]:
    out = []
    for s in Manifest.load(split_dir).shards:
        with tarfile.open(split_dir / s.name) as tar:
            members = tar.getmembers()
            for mi, mj in zip(members[::2], members[1::2]):
                out.append((tar.extractfile(mi).read(), json.loads(tar.extractfile(mj).read())))
    return out


def test_full_webvision_with_flickr_and_imagenet(tree, tmp_path):
    ms = webvision.convert(tree["root"], tmp_path, flickr=True, imagenet_val=tree["inet"],
                           shard_size=16, progress=False, shuffle_seed=None)
    assert sorted(ms) == ["imagenet_val", "train", "val"]
    lists = tree["lists"]
    train = lists["google"] + lists["flickr"]
    assert ms["train"].num_samples == 52 and ms["train"].classes == tree["wnids"]
    assert ms["train"].source["class_descriptions"][0] == "class 0, thing 0"
    got = read_split(tmp_path / "train")
    for i, ((img, m), (rel, lab)) in enumerate(zip(got, train)):
        assert m == {"idx": i, "label": lab, "clean": -1, "key": rel}  # web labels: noisy
        assert img == (tree["root"] / rel).read_bytes()
    got = read_split(tmp_path / "val")
    assert [(m["key"], m["label"], m["clean"]) for _, m in got] == [
        (r, lab, lab) for r, lab in lists["val"]]
    got = read_split(tmp_path / "imagenet_val")
    assert [(m["key"], m["label"], m["clean"]) for _, m in got] == [
        (iid, lab, lab) for iid, lab in lists["imagenet_val"]]
    for split, m in ms.items():
        m.verify(tmp_path / split)


def test_mini_keeps_labels_below_50_in_every_split(tree, tmp_path):
    ms = webvision.convert(tree["root"], tmp_path, mini=True, imagenet_val=tree["inet"],
                           progress=False, shuffle_seed=None)
    lists = tree["lists"]
    full = {"train": lists["google"], "val": lists["val"],  # Google only
            "imagenet_val": lists["imagenet_val"]}
    for split, all_entries in full.items():
        entries = [e for e in all_entries if e[1] < 50]
        assert 0 < len(entries) < len(all_entries)
        m = ms[split]
        assert m.dataset == "mini-webvision" and m.classes == tree["wnids"][:50]
        got = read_split(tmp_path / split)
        assert [(x["key"], x["label"]) for _, x in got] == entries
        assert [x["idx"] for _, x in got] == list(range(len(entries)))  # dense after filtering


def test_cli_webvision_mini_resizes_to_256(tree, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["webvision", str(tree["root"]), "--out", str(out), "--mini",
                     "--splits", "train", "--workers", "1", "--no-progress"]) == 0
    n = sum(lab < 50 for _, lab in tree["lists"]["google"])
    assert f"mini-webvision/train: {n} samples" in capsys.readouterr().out
    got = read_split(out / "train")
    sizes = {Image.open(io.BytesIO(img)).size for img, _ in got}
    assert sizes == {(341, 256), (64, 48)}  # 400x300 -> short side 256; small kept
    # the list goes class by class; the train split is written shuffled (seed 0) by default
    listed = [(rel, lab) for rel, lab in tree["lists"]["google"] if lab < 50]
    keys = [(m["key"], m["label"]) for _, m in got]
    assert keys != listed and sorted(keys) == sorted(listed)
    assert [m["idx"] for _, m in got] == list(range(n))
    assert json.loads((out / "train" / "manifest.json").read_text())["source"]["shuffle_seed"] == 0
    assert cli.main(["webvision", str(tree["root"]), "--out", str(tmp_path / "kept"), "--mini",
                     "--splits", "train", "--workers", "1", "--no-progress",
                     "--keep-order"]) == 0
    assert [(m["key"], m["label"]) for _, m in read_split(tmp_path / "kept" / "train")] == listed


def test_webvision_errors(tree, tmp_path):
    with pytest.raises(ShardError, match="'imagenet_val' needs imagenet_val=DIR"):
        webvision.convert(tree["root"], tmp_path, splits=["imagenet_val"], progress=False)
    bad = tmp_path / "bad"
    (bad / "info").mkdir(parents=True)
    (bad / "info" / "synsets.txt").write_text((tree["root"] / "info" / "synsets.txt").read_text())
    (bad / "info" / "val_filelist.txt").write_text("val000001.jpg 3\nval000002.jpg\n")
    with pytest.raises(ShardError, match=r"val_filelist.txt:2: expected '<image path> <label>'"):
        webvision.convert(bad, tmp_path / "o", splits=["val"], progress=False)
    (bad / "info" / "val_filelist.txt").write_text("val000001.jpg 3\n")
    with pytest.raises(ShardError, match=r"val_filelist.txt:1: image .*val000001.jpg not found"):
        webvision.convert(bad, tmp_path / "o", splits=["val"], progress=False)
