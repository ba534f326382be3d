"""pipeline/data/cifar_memory.py on real CIFAR-10 JPEGs (a small tarball built from the shared one)."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn import functional as F

from pipeline.core.noise import clean_view
from pipeline.data.cifar_memory import (
    CIFAR10_CLASSES,
    RandomCropFlip,
    channel_stats,
    decode_tarball,
    load_cifar10,
    normalise,
)
from pipeline.train.trainer import TensorData


@pytest.fixture(scope="module")
def small_tarball(cifar10_jpeg_tree, tmp_path_factory):
    """3 train + 2 test images per class, same layout as the real tarball."""
    path = tmp_path_factory.mktemp("cifar-small") / "cifar10-small.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for split, n in (("train", 3), ("test", 2)):
            for c in CIFAR10_CLASSES:
                for i in range(n):
                    src = cifar10_jpeg_tree / split / c / f"{i:04d}.jpg"
                    tar.add(src, arcname=f"cifar10/{split}/{c}/{i:04d}.jpg")
    return path


def test_decode_order_labels_and_pixels(small_tarball, cifar10_jpeg_tree):
    a = decode_tarball(small_tarball)
    assert a.train_x.shape == (30, 3, 32, 32) and a.train_x.dtype == np.uint8
    assert a.test_x.shape == (20, 3, 32, 32)
    assert a.train_y.tolist() == [c for c in range(10) for _ in range(3)]
    # class-major idx: idx 3 * 7 + 2 is horse/0002.jpg, channels first
    ref = np.asarray(Image.open(cifar10_jpeg_tree / "train" / "horse" / "0002.jpg").convert("RGB"))
    assert np.array_equal(a.train_x[23], ref.transpose(2, 0, 1))


def test_cache_round_trip(small_tarball, tmp_path):
    first = load_cifar10(small_tarball, cache_dir=tmp_path)
    files = list(tmp_path.glob("cifar10-*.npz"))
    assert len(files) == 1
    again = load_cifar10(small_tarball, cache_dir=tmp_path)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert again.classes == CIFAR10_CLASSES


def test_gap_in_numbering_is_reported(cifar10_jpeg_tree, tmp_path):
    path = tmp_path / "gap.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            for c in CIFAR10_CLASSES:
                for i in ((0, 2) if c == "cat" and split == "train" else (0,)):
                    tar.add(cifar10_jpeg_tree / split / c / f"{i:04d}.jpg",
                            arcname=f"{split}/{c}/{i:04d}.jpg")
    with pytest.raises(ValueError, match=r"train/cat/ numbering has gaps.*\[1\]"):
        decode_tarball(path)


def test_normalise_and_stats(small_tarball):
    a = decode_tarball(small_tarball)
    mean, std = channel_stats(a.train_x)
    x = normalise(a.train_x, mean, std)
    assert x.dtype == torch.float32
    per_channel = x.transpose(0, 1).reshape(3, -1)
    assert torch.allclose(per_channel.mean(1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(per_channel.std(1, unbiased=False), torch.ones(3), atol=1e-5)


def test_crop_flip_matches_a_per_image_loop(small_tarball):
    a = decode_tarball(small_tarball)
    mean, std = channel_stats(a.train_x)
    x = normalise(a.train_x, mean, std)
    out = RandomCropFlip(padding=4, fill=-mean / std)(x, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the same draws, in the documented order
    dy = torch.randint(0, 9, (30,), generator=g)
    dx = torch.randint(0, 9, (30,), generator=g)
    flip = torch.rand(30, generator=g) < 0.5
    assert 0 < int(flip.sum()) < 30 and dx.unique().numel() > 1
    m, s = mean.float().view(3, 1, 1), std.float().view(3, 1, 1)
    for i in range(30):  # torchvision semantics: zero-pad the raw image, crop, flip, normalise
        raw = F.pad(torch.as_tensor(a.train_x[i]).float() / 255, (4, 4, 4, 4))
        crop = raw[:, dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
        if flip[i]:
            crop = crop.flip(-1)
        assert torch.allclose(out[i], (crop - m) / s, atol=1e-5), i


def test_tensor_data_augments_only_shuffled_passes(small_tarball):
    a = decode_tarball(small_tarball)
    x = normalise(a.train_x, *channel_stats(a.train_x))
    data = TensorData(x, clean_view(a.train_y, 10), augment=RandomCropFlip(padding=4))
    plain = torch.cat([b.images for b in data.batches(8)])
    assert torch.equal(plain, x)
    shuffled = list(data.batches(8, generator=torch.Generator().manual_seed(0)))
    idx = torch.cat([b.idx for b in shuffled])
    images = torch.cat([b.images for b in shuffled])
    assert not torch.equal(images, x[idx])
    again = torch.cat([b.images for b in data.batches(8, generator=torch.Generator().manual_seed(0))])
    assert torch.equal(images, again)
