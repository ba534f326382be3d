"""Clothing1M converter on a tree built from the REAL annotation files (a subset of their keys,
small generated JPEGs at those paths, and a synthetic noisy label file)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.manifest import Manifest
from shards import cli, clothing1m
from shards.writer import ShardError

N_CHOSEN = {"clean_train": 120, "val": 90, "test": 90}
LISTS = {"clean_train": "clean_train_key_list.txt", "val": "clean_val_key_list.txt",
         "test": "clean_test_key_list.txt"}
VAL_SIZE = (320, 260)  # larger than 256: the CLI default resizes these


def _jpeg(rng: np.random.Generator, size: tuple[int, int]) -> bytes:
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize(size, Image.Resampling.BILINEAR).save(buf, format="JPEG",
                                                                        quality=85)
    return buf.getvalue()


@pytest.fixture(scope="module")
def tree(shared_data, tmp_path_factory) -> dict:
    real = shared_data / "clothing1m-annotations"
    clean_lines = real.joinpath("clean_label_kv.txt").read_text().splitlines()
    clean_kv = {k: int(v) for k, v in (ln.split() for ln in clean_lines)}
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("clothing1m")
    ann = root / "annotations"
    ann.mkdir()
    shutil.copy(real / "category_names_eng.txt", ann)
    lists: dict[str, list[str]] = {}
    for split, fname in LISTS.items():
        real_keys = real.joinpath(fname).read_text().split("\n")
        chosen = set(rng.choice(real_keys, N_CHOSEN[split], replace=False).tolist())
        lists[split] = [k for k in real_keys if k in chosen]  # the real file's order
        ann.joinpath(fname).write_text("\n".join(lists[split]))  # no trailing newline
    used = {k for keys in lists.values() for k in keys}
    ann.joinpath("clean_label_kv.txt").write_text(
        "".join(ln + "\n" for ln in clean_lines if ln.split()[0] in used))
    # noisy train: 50 trusted-set images (they have a clean label) + 50 noisy-only images
    with_clean = rng.choice(lists["clean_train"], 50, replace=False).tolist()
    noisy_only = []
    while len(noisy_only) < 50:
        d = int(rng.integers(10))
        k = (f"images/{d}/{d}{int(rng.integers(10))}/"
             f"{int(rng.integers(10**9, 4 * 10**9))},{int(rng.integers(10**9, 4 * 10**9))}.jpg")
        if k not in clean_kv and k not in noisy_only:
            noisy_only.append(k)
    noisy_keys = [str(k) for k in rng.permutation(with_clean + noisy_only)]
    noisy = {}
    for k in noisy_keys:
        c = clean_kv.get(k)
        noisy[k] = c if c is not None and rng.random() < 0.6 else int(rng.integers(14))
    extra_kv = {f"images/9/99/{i},{i}.jpg": i % 14 for i in range(10)}  # labelled, not listed
    kv_lines = [f"{k} {v}\n" for k, v in {**noisy, **extra_kv}.items()]
    ann.joinpath("noisy_label_kv.txt").write_text("".join(rng.permutation(kv_lines)))
    ann.joinpath("noisy_train_key_list.txt").write_text("\n".join(noisy_keys))
    for k in sorted(used | set(noisy_keys)):
        p = root / k
        p.parent.mkdir(parents=True, exist_ok=True)
        size = VAL_SIZE if k in lists["val"] else tuple(int(x) for x in rng.integers(24, 64, 2))
        p.write_bytes(_jpeg(rng, size))
    return {"root": root, "ann": ann, "lists": lists, "clean_kv": clean_kv,
            "noisy_keys": noisy_keys, "noisy": noisy}


def read_split(split_dir: Path) -> list[tuple[bytes, dict]]:
    out = []
    for s in Manifest.load(split_dir).shards:
        with tarfile.open(split_dir / s.name) as tar:
            members = tar.getmembers()
            for mi, mj in zip(members[::2], members[1::2]):
                assert mi.name.endswith(".jpg") and mj.name.endswith(".json")
                out.append((tar.extractfile(mi).read(), json.loads(tar.extractfile(mj).read())))
    return out


@pytest.fixture(scope="module")
def converted(tree, tmp_path_factory) -> tuple[Path, dict[str, Manifest]]:
    out = tmp_path_factory.mktemp("c1m-out")
    return out, clothing1m.convert(tree["root"], out, shard_size=40, progress=False)


def test_split_sizes_and_classes(converted, shared_data):
    out, ms = converted
    names = (shared_data / "clothing1m-annotations" / "category_names_eng.txt").read_text()
    assert {s: m.num_samples for s, m in ms.items()} == {
        "noisy_train": 100, "clean_train": 120, "val": 90, "test": 90}
    for split, m in ms.items():
        assert m.dataset == "clothing1m" and m.classes == names.split("\n")
        assert len(m.classes) == 14 and m.classes[0] == "T-Shirt"
        m.verify(out / split)


def test_noisy_train_carries_clean_labels_where_known(converted, tree):
    out, ms = converted
    samples = read_split(out / "noisy_train")
    assert [m["key"] for _, m in samples] == tree["noisy_keys"]
    n_clean = 0
    for i, (img, m) in enumerate(samples):
        key = tree["noisy_keys"][i]
        expect_clean = tree["clean_kv"].get(key, -1)
        assert m == {"idx": i, "label": tree["noisy"][key], "clean": expect_clean, "key": key}
        assert img == (tree["root"] / key).read_bytes()
        n_clean += expect_clean >= 0
    assert n_clean == 50 and ms["noisy_train"].source["num_with_clean"] == 50
    # the synthetic noise really differs from the clean label on some of them
    assert any(m["label"] != m["clean"] for _, m in samples if m["clean"] >= 0)


@pytest.mark.parametrize("split", ["clean_train", "val", "test"])
def test_clean_splits_use_clean_labels_in_list_order(converted, tree, split):
    out, _ = converted
    samples = read_split(out / split)
    assert [m["key"] for _, m in samples] == tree["lists"][split]
    for i, (img, m) in enumerate(samples):
        lab = tree["clean_kv"][m["key"]]
        assert (m["idx"], m["label"], m["clean"]) == (i, lab, lab)
        assert img == (tree["root"] / m["key"]).read_bytes()


def test_cli_resizes_to_256_by_default(tree, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["clothing1m", str(tree["root"]), "--out", str(out), "--splits", "val",
                     "test", "--workers", "1", "--no-progress"]) == 0
    assert "clothing1m/val: 90 samples" in capsys.readouterr().out
    for img, m in read_split(out / "val"):
        assert Image.open(io.BytesIO(img)).size == (315, 256)
    for img, m in read_split(out / "test"):  # small images keep their bytes
        assert img == (tree["root"] / m["key"]).read_bytes()
    assert Manifest.load(out / "val").source["writer"]["resize_short"] == 256


def _edit(tree, tmp_path, fname: str, edit) -> Path:
    ann = tmp_path / "ann"
    shutil.copytree(tree["ann"], ann)
    text = ann.joinpath(fname).read_text()
    ann.joinpath(fname).write_text(edit(text))
    return ann


def _replace_line(n: int, new: str):
    def edit(text: str) -> str:
        lines = text.split("\n")
        lines[n - 1] = new
        return "\n".join(lines)
    return edit


@pytest.mark.parametrize("fname, edit, splits, message", [
    ("noisy_label_kv.txt", _replace_line(5, "images/1/12/345.jpg"), ["noisy_train"],
     r"noisy_label_kv.txt:5: expected '<image path> <label>', got 'images/1/12/345.jpg'"),
    ("clean_label_kv.txt", _replace_line(7, "images/1/12/345.jpg seven"), ["test"],
     r"clean_label_kv.txt:7: label 'seven' is not an integer"),
    ("clean_label_kv.txt", _replace_line(3, "images/1/12/345.jpg 14"), ["val"],
     r"clean_label_kv.txt:3: label 14 outside \[0, 14\)"),
    ("noisy_train_key_list.txt", lambda t: t + "\nimages/1/12/345.jpg", ["noisy_train"],
     r"noisy_train_key_list.txt:101: key images/1/12/345.jpg has no label in .*noisy_label_kv"),
    ("clean_val_key_list.txt", lambda t: t + "\nimages/1/12/345.jpg 3", ["val"],
     r"clean_val_key_list.txt:91: expected one image path"),
    ("clean_test_key_list.txt", lambda t: t + "\n" + t.split("\n")[4], ["test"],
     r"clean_test_key_list.txt:91: duplicate key .* \(first at line 5\)"),
])
def test_malformed_annotations_name_file_and_line(tree, tmp_path, fname, edit, splits, message):
    ann = _edit(tree, tmp_path, fname, edit)
    with pytest.raises(ShardError, match=message):
        clothing1m.convert(tree["root"], tmp_path / "out", annotations=ann, splits=splits,
                           progress=False)
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_image_names_list_line(tree, tmp_path):
    # a real key that has a clean label but no image in this tree
    missing = next(k for k in tree["clean_kv"] if not (tree["root"] / k).exists())
    ann = tmp_path / "ann"
    shutil.copytree(tree["ann"], ann)
    with open(ann / "clean_label_kv.txt", "a") as f:
        f.write(f"{missing} {tree['clean_kv'][missing]}\n")
    lines = ann.joinpath("clean_test_key_list.txt").read_text().split("\n")
    lines.insert(10, missing)
    ann.joinpath("clean_test_key_list.txt").write_text("\n".join(lines))
    with pytest.raises(ShardError, match=rf"clean_test_key_list.txt:11: image .*{missing} not "):
        clothing1m.convert(tree["root"], tmp_path / "out", annotations=ann, splits=["test"],
                           progress=False)
    ms = clothing1m.convert(tree["root"], tmp_path / "out", annotations=ann, splits=["test"],
                            skip_bad=True, progress=False)
    assert ms["test"].num_samples == 90
    assert ms["test"].source["skipped"]["keys"] == [missing]


def test_key_list_line_endings(tmp_path):
    keys = ["images/0/00/1,2.jpg", "images/1/10/3,4.jpg"]
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n".join(keys))
    b.write_bytes(("\r\n".join(keys) + "\r\n").encode())
    assert clothing1m.read_key_list(a) == clothing1m.read_key_list(b) == [(1, keys[0]),
                                                                          (2, keys[1])]
