"""CIFAR-10 held in memory: decode the JPEG tarball once, cache it, augment whole batches.

For single-process runs (benchmarks, the local trainer) where streaming shards would only
add overhead: the 60,000 32x32 images fit in ~180 MB as uint8.

Layout of the tarball (``shared/data/README.md``): ``[<top>/]train|test/<class>/NNNN.jpg``,
classes in the standard order (:data:`CIFAR10_CLASSES`, indices 0-9), files numbered
``0000..`` within each class. Sample ``idx`` of a split is class-major: all airplanes in
file order, then all automobiles, and so on (``idx = offset[class] + file number``).

Shapes and axes: images are ``(N, 3, 32, 32)`` channels first (RGB); labels ``(N,) int64``.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from pipeline.data.manifest import sha256_file

CIFAR10_CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer", "dog",
                                    "frog", "horse", "ship", "truck")
SPLITS = ("train", "test")
_MEMBER = re.compile(r"^(?:.*/)?(train|test)/([a-z]+)/(\d+)\.jpg$")


@dataclass(frozen=True)
class CifarArrays:
    """Both splits as numpy arrays.

    train_x: (50000, 3, 32, 32) uint8; train_y: (50000,) int64 in [0, 10);
    test_x: (10000, 3, 32, 32) uint8; test_y: (10000,) int64. Class-major idx order.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    classes: tuple[str, ...] = CIFAR10_CLASSES


def decode_tarball(path: str | os.PathLike, *, classes: tuple[str, ...] = CIFAR10_CLASSES,
                   size: int = 32) -> CifarArrays:
    """Decode every ``train|test/<class>/NNNN.jpg`` of the tarball at ``path``.

    Raises ValueError naming the offending member for an unknown class, a gap or duplicate
    in a class's numbering, or an image that is not ``size`` x ``size``.
    """
    path = Path(path)
    cls_index = {c: i for i, c in enumerate(classes)}
    found: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            m = _MEMBER.match(member.name)
            if m is None:
                continue
            split, cname, num = m.group(1), m.group(2), int(m.group(3))
            if cname not in cls_index:
                raise ValueError(f"{path}: member {member.name!r} has unknown class {cname!r}; "
                                 f"expected one of {classes}")
            data = tar.extractfile(member).read()
            with Image.open(io.BytesIO(data)) as im:
                arr = np.asarray(im.convert("RGB"))
            if arr.shape != (size, size, 3):
                raise ValueError(f"{path}: member {member.name!r} is {arr.shape[1]}x{arr.shape[0]}"
                                 f", expected {size}x{size}")
            slot = found.setdefault((split, cls_index[cname]), {})
            if num in slot:
                raise ValueError(f"{path}: duplicate member {member.name!r}")
            slot[num] = arr
    out: dict[str, np.ndarray] = {}
    for split in SPLITS:
        xs, ys = [], []
        for c in range(len(classes)):
            slot = found.get((split, c))
            if not slot:
                raise ValueError(f"{path}: no images for {split}/{classes[c]}/")
            nums = sorted(slot)
            if nums != list(range(len(nums))):
                missing = sorted(set(range(nums[-1] + 1)) - set(nums))[:5]
                raise ValueError(f"{path}: {split}/{classes[c]}/ numbering has gaps, "
                                 f"missing e.g. {missing}")
            xs.append(np.stack([slot[i] for i in nums]))
            ys.append(np.full(len(nums), c, dtype=np.int64))
        out[f"{split}_x"] = np.ascontiguousarray(np.concatenate(xs).transpose(0, 3, 1, 2))
        out[f"{split}_y"] = np.concatenate(ys)
    return CifarArrays(out["train_x"], out["train_y"], out["test_x"], out["test_y"],
                       tuple(classes))


def load_cifar10(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
                 ) -> CifarArrays:
    """Decoded CIFAR-10 from the JPEG tarball, through an ``.npz`` cache in ``cache_dir``.

    The cache file is named by the tarball's sha256, so a changed tarball is decoded again;
    it is written atomically (temporary file, then rename). ``cache_dir=None``: no cache.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR-10 tarball not found: {path}")
    if cache_dir is None:
        return decode_tarball(path)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir / f"cifar10-{sha256_file(path)[:16]}.npz"
    if cache.is_file():
        with np.load(cache) as z:
            return CifarArrays(z["train_x"], z["train_y"], z["test_x"], z["test_y"],
                               tuple(str(c) for c in z["classes"]))
    arrays = decode_tarball(path)
    fd, tmp = tempfile.mkstemp(suffix=".npz", dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, train_x=arrays.train_x, train_y=arrays.train_y, test_x=arrays.test_x,
                     test_y=arrays.test_y, classes=np.array(arrays.classes))
        os.replace(tmp, cache)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return arrays


def channel_stats(images: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and std ``(C,)`` float64 of uint8 ``images (N, C, H, W)`` in [0, 1]
    units (population std over all images and pixels of a channel)."""
    x = torch.as_tensor(images)
    if x.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got {tuple(x.shape)}")
    flat = x.transpose(0, 1).reshape(x.shape[1], -1).to(torch.float64) / 255.0
    return flat.mean(1), flat.std(1, unbiased=False)


def normalise(images: np.ndarray | Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 ``images (N, C, H, W)`` -> float32 ``(x / 255 - mean[c]) / std[c]``."""
    x = torch.as_tensor(images)
    m = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    if x.ndim != 4 or x.shape[1] != m.shape[1]:
        raise ValueError(f"images must be (N, {m.shape[1]}, H, W), got {tuple(x.shape)}")
    return (x.to(torch.float32) / 255.0 - m) / s


class RandomCropFlip:
    """Batched random crop after padding plus random horizontal flip, on tensors.

    ``__call__(images (B, C, H, W) float, generator) -> (B, C, H, W)``: each image is
    padded by ``padding`` px with ``fill`` (a scalar, or ``(C,)`` per channel: pass the
    normalised value of black, ``-mean / std``, to match torchvision's zero padding before
    normalisation), cropped back to ``H x W`` at an offset drawn uniformly from
    ``[0, 2 * padding]`` per axis, and mirrored left-right with probability ``flip_p``.
    One gather over the batch, no Python loop per image; randomness only from ``generator``
    (two ``randint`` and one ``rand`` draw per call).
    """

    def __init__(self, *, padding: int = 4, flip_p: float = 0.5,
                 fill: float | Tensor = 0.0) -> None:
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        if not 0.0 <= flip_p <= 1.0:
            raise ValueError(f"flip_p must lie in [0, 1], got {flip_p}")
        self.padding, self.flip_p = int(padding), float(flip_p)
        self.fill = torch.as_tensor(fill, dtype=torch.float32)

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        if images.ndim != 4:
            raise ValueError(f"images must be (B, C, H, W), got {tuple(images.shape)}")
        b, c, h, w = images.shape
        p = self.padding
        dev = images.device
        fill = self.fill.to(device=dev, dtype=images.dtype)
        if fill.ndim == 1 and fill.numel() != c:
            raise ValueError(f"fill has {fill.numel()} channels, images have {c}")
        padded = fill.view(1, -1, 1, 1).expand(b, c, h + 2 * p, w + 2 * p).clone() \
            if fill.ndim == 1 else images.new_full((b, c, h + 2 * p, w + 2 * p), float(fill))
        padded[:, :, p:p + h, p:p + w] = images
        # the draws come from ``generator`` wherever it lives (the same crops for images on
        # the host or on an accelerator); the gather runs where the images are
        dy = torch.randint(0, 2 * p + 1, (b,), generator=generator,
                           device=generator.device).to(dev, non_blocking=True)
        dx = torch.randint(0, 2 * p + 1, (b,), generator=generator,
                           device=generator.device).to(dev, non_blocking=True)
        flip = (torch.rand(b, generator=generator, device=generator.device)
                < self.flip_p).to(dev, non_blocking=True)
        rows = dy[:, None] + torch.arange(h, device=dev)                        # (B, H)
        ar = torch.arange(w, device=dev)
        cols = dx[:, None] + torch.where(flip[:, None], (w - 1) - ar, ar)       # (B, W)
        # one gather over the flattened padded planes (several times faster on CPU than
        # four-tensor advanced indexing)
        flat = (rows[:, :, None] * (w + 2 * p) + cols[:, None, :]).view(b, 1, h * w)
        out = padded.view(b, c, -1).gather(2, flat.expand(b, c, h * w))
        return out.view(b, c, h, w)
