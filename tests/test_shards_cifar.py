"""CIFAR-10/100 pickle converter on fixtures built, in the exact torchvision layout, from real
CIFAR-10 JPEGs (decoded with PIL)."""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.core.labels import LabelView
from pipeline.data.manifest import Manifest
from shards import cifar, cli
from shards.writer import ShardError

CLASSES10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
PER_CLASS = {"train": 24, "test": 8}  # 240 train (5 batches of 48), 80 test


@pytest.fixture(scope="module")
def images(shared_data) -> dict[str, list[tuple[int, str, np.ndarray]]]:
    """Real CIFAR-10 JPEGs decoded to (32, 32, 3) uint8, read straight from the archive:
    ``{split: [(label, name, hwc), ...]}`` in a fixed shuffled order (classes interleaved)."""
    found: dict[str, list] = {"train": [], "test": []}
    with tarfile.open(shared_data / "cifar10-jpeg.tar.gz") as tar:
        for ti in tar:
            parts = Path(ti.name).parts
            if not ti.isfile() or len(parts) < 3 or parts[-3] not in found:
                continue
            split, cls, fname = parts[-3:]
            k = int(Path(fname).stem)
            if k < PER_CLASS[split]:
                with Image.open(io.BytesIO(tar.extractfile(ti).read())) as im:
                    hwc = np.asarray(im.convert("RGB"))
                found[split].append((CLASSES10.index(cls), f"{cls}_s_{k:06d}.png", hwc))
    rng = np.random.default_rng(0)
    out = {}
    for split, items in found.items():
        items.sort(key=lambda t: t[1])
        assert len(items) == 10 * PER_CLASS[split]
        out[split] = [items[i] for i in rng.permutation(len(items))]
    return out


def _rows(items) -> np.ndarray:
    """(N, 3072) uint8 CHW rows, as in the CIFAR pickles."""
    return np.stack([hwc.transpose(2, 0, 1).reshape(-1) for _, _, hwc in items])


class _Py2Pickler(pickle._Pickler):
    """Writes ``bytes`` as python-2 ``str`` (BINSTRING opcodes), like the official CIFAR files:
    ``encoding="bytes"`` then loads them as bytes, torchvision's ``encoding="latin1"`` as str."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def _dump(obj, path: Path, *, py2: bool = False) -> None:
    with open(path, "wb") as f:
        if py2:
            _Py2Pickler(f, protocol=2).dump(obj)
        else:
            pickle.dump(obj, f, protocol=2)


@pytest.fixture(scope="module")
def cifar10_root(images, tmp_path_factory) -> Path:
    """``<root>/cifar-10-batches-py`` written as python-2 pickles, like the official files."""
    root = tmp_path_factory.mktemp("c10pkl")
    d = root / "cifar-10-batches-py"
    d.mkdir()
    train = images["train"]
    per = len(train) // 5
    for b in range(5):
        items = train[b * per:(b + 1) * per]
        _dump({b"batch_label": f"training batch {b + 1} of 5".encode(),
               b"labels": [lab for lab, _, _ in items], b"data": _rows(items),
               b"filenames": [n.encode() for _, n, _ in items]}, d / f"data_batch_{b + 1}",
              py2=True)
    items = images["test"]
    _dump({b"batch_label": b"testing batch 1 of 1", b"labels": [lab for lab, _, _ in items],
           b"data": _rows(items), b"filenames": [n.encode() for _, n, _ in items]},
          d / "test_batch", py2=True)
    _dump({b"num_cases_per_batch": per, b"label_names": [c.encode() for c in CLASSES10],
           b"num_vis": 3072}, d / "batches.meta", py2=True)
    return root


def fine_coarse(label: int, name: str) -> tuple[int, int]:
    """A CIFAR-100-like labelling of the CIFAR-10 images: 100 fine, 20 coarse classes."""
    k = int(name.split("_")[-1].split(".")[0])
    return label * 10 + k % 10, label * 2 + (k % 10 >= 5)


@pytest.fixture(scope="module")
def cifar100_root(images, tmp_path_factory) -> Path:
    """``<root>/cifar-100-python`` with str keys (as a python-3 pickle writes them)."""
    root = tmp_path_factory.mktemp("c100pkl")
    d = root / "cifar-100-python"
    d.mkdir()
    for split in ("train", "test"):
        items = images[split]
        fc = [fine_coarse(lab, n) for lab, n, _ in items]
        _dump({"filenames": [n for _, n, _ in items], "batch_label": f"{split} batch",
               "fine_labels": [f for f, _ in fc], "coarse_labels": [c for _, c in fc],
               "data": _rows(items)}, d / split)
    _dump({"fine_label_names": [f"fine{i:02d}" for i in range(100)],
           "coarse_label_names": [f"coarse{i:02d}" for i in range(20)]}, d / "meta")
    return root


def read_split(split_dir: Path) -> list[tuple[str, np.ndarray, dict]]:
    out = []
    for s in Manifest.load(split_dir).shards:
        with tarfile.open(split_dir / s.name) as tar:
            members = tar.getmembers()
            assert [m.name.split(".", 1)[1] for m in members] == ["json", "png"] * (
                len(members) // 2)
            for mj, mp in zip(members[::2], members[1::2]):
                meta = json.loads(tar.extractfile(mj).read())
                with Image.open(io.BytesIO(tar.extractfile(mp).read())) as im:
                    assert im.format == "PNG"
                    pix = np.asarray(im)
                out.append((mj.name.split(".")[0], pix, meta))
    return out


def test_cifar10_round_trip(cifar10_root, images, tmp_path):
    ms = cifar.convert(cifar10_root, tmp_path, shard_size=100, progress=False)
    assert sorted(ms) == ["test", "train"]
    for split, n_shards in (("train", 3), ("test", 1)):
        m, items = ms[split], images[split]
        assert m.dataset == "cifar10" and m.classes == CLASSES10
        assert m.num_samples == len(items) and len(m.shards) == n_shards
        m.verify(tmp_path / split)
        got = read_split(tmp_path / split)
        assert len(got) == len(items)
        for i, ((key, pix, meta), (lab, name, hwc)) in enumerate(zip(got, items)):
            assert key == f"{i:08d}"
            assert meta == {"idx": i, "label": lab, "clean": lab, "key": name}
            assert pix.shape == (32, 32, 3) and np.array_equal(pix, hwc)  # lossless PNG


def test_fixture_is_the_torchvision_layout(cifar10_root, cifar100_root, tmp_path, monkeypatch):
    """torchvision reads the fixtures (md5 check disabled) to the same pixels we write."""
    from torchvision import datasets
    from torchvision.datasets import cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)  # no md5 match
    cifar.convert(cifar10_root, tmp_path / "c10", shard_size=1000, progress=False)
    tv = datasets.CIFAR10(str(cifar10_root), train=True, download=False)
    got = read_split(tmp_path / "c10" / "train")
    assert tv.classes == CLASSES10
    assert np.array_equal(np.stack([p for _, p, _ in got]), tv.data)
    assert [m["label"] for _, _, m in got] == tv.targets
    cifar.convert(cifar100_root, tmp_path / "c100", splits=["test"], progress=False)
    tv = datasets.CIFAR100(str(cifar100_root), train=False, download=False)
    got = read_split(tmp_path / "c100" / "test")
    assert np.array_equal(np.stack([p for _, p, _ in got]), tv.data)
    assert [m["label"] for _, _, m in got] == tv.targets


def test_cifar100_fine_and_coarse(cifar100_root, images, tmp_path):
    split_root = cifar100_root / "cifar-100-python"  # the batches folder itself also works
    ms = cifar.convert(split_root, tmp_path, shard_size=64, progress=False)
    m = ms["train"]
    assert m.dataset == "cifar100" and m.num_classes == 100 and m.classes[7] == "fine07"
    assert m.source["coarse_classes"] == [f"coarse{i:02d}" for i in range(20)]
    assert [s.num_samples for s in m.shards] == [64, 64, 64, 48]
    got = read_split(tmp_path / "train")
    for i, ((_, pix, meta), (lab, name, hwc)) in enumerate(zip(got, images["train"])):
        fine, coarse = fine_coarse(lab, name)
        assert meta == {"idx": i, "label": fine, "clean": fine, "key": name, "coarse": coarse}
        assert np.array_equal(pix, hwc)


def test_cifar_errors(cifar10_root, tmp_path):
    with pytest.raises(ShardError, match="no cifar-100-python folder"):
        cifar.convert(cifar10_root, tmp_path, variant="cifar100", progress=False)
    bad = tmp_path / "bad" / "cifar-10-batches-py"
    bad.mkdir(parents=True)
    for f in (cifar10_root / "cifar-10-batches-py").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    with open(bad / "data_batch_3", "rb") as f:
        d = pickle.load(f, encoding="bytes")
    d[b"data"] = d[b"data"][:, :1024]
    _dump(d, bad / "data_batch_3", py2=True)
    with pytest.raises(ShardError, match=r"data_batch_3: data must be \(48, 3072\) uint8"):
        cifar.convert(bad.parent, tmp_path / "out", progress=False)


def test_cli_cifar10(cifar10_root, tmp_path, capsys):
    assert cli.main(["cifar10", str(cifar10_root), "--out", str(tmp_path), "--splits", "test",
                     "--shard-size", "30", "--workers", "1", "--no-progress"]) == 0
    assert "cifar10/test: 80 samples, 3 shards" in capsys.readouterr().out
    Manifest.load(tmp_path / "test").verify(tmp_path / "test")
    assert cli.main(["cifar100", str(cifar10_root), "--out", str(tmp_path)]) == 1
    assert "no cifar-100-python folder" in capsys.readouterr().err


def test_labelview_instance_dependent_noise_from_the_images(cifar10_root, images, tmp_path,
                                                             capsys):
    """The label-view CLI's instance-dependent noise (Xia et al.): features are the decoded
    images in idx order, standardised per channel; the view is the generator's on them, and
    its realised rate lies within 3 standard errors of the asked rate."""
    from pipeline.core.noise import instance_dependent
    from shards import labelview

    cifar.convert(cifar10_root, tmp_path, shard_size=100, progress=False)
    split = tmp_path / "train"
    feats = labelview.read_split_features(split)
    items = images["train"]
    raw = np.stack([hwc.transpose(2, 0, 1) for _, _, hwc in items]).astype(np.float32) / 255
    want = (raw - raw.mean(axis=(0, 2, 3), keepdims=True)) / raw.std(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(feats, want.reshape(len(items), -1), rtol=1e-3, atol=1e-3)

    out = tmp_path / "idn.npz"
    spec = '{"kind": "instance", "rate": 0.4, "seed": 3}'
    assert labelview.main(["--split-dir", str(split), "--spec", spec, "--out", str(out)]) == 0
    assert "noise rate: realised" in capsys.readouterr().out
    view = LabelView.load(out)
    clean = np.array([lab for lab, _, _ in items])
    ref = instance_dependent(clean, feats, 10, 0.4, seed=3)
    np.testing.assert_array_equal(view.observed, ref.observed)
    np.testing.assert_array_equal(view.clean, clean)
    n = len(clean)
    assert abs(view.noise_rate() - 0.4) <= 3 * np.sqrt(0.4 * 0.6 / n)
