"""Per-dataset image transform presets (torchvision.transforms.v2).

Every preset maps a decoded ``PIL.Image`` (mode ``Preset.mode``) to a float32 tensor
``(C, H, W)``, channels first, ``C = 3`` (RGB) or ``1`` (grayscale). Geometric and colour
operations run on the PIL image (so pillow-simd speeds them up where installed) and end in
a uint8 tensor (``build_sample_transform``); the conversion to float and the normalisation
come last (``build_batch_transform``) and work on a whole uint8 batch ``(B, C, H, W)`` as
well, which is how the loader uses them: workers send uint8 (4x less to copy) and the
training process normalises each batch in one pass.

Presets (``build_transform(name, train=...)``):

``cifar``        train: pad 4 + random crop 32, horizontal flip; eval: none. Then
                 **per-image standardisation** (the paper, Sec. 5: each image minus its own
                 mean, divided by ``max(std, 1/sqrt(C*H*W))``, as
                 ``tf.image.per_image_standardization``), not dataset mean/std. Output (3, 32, 32).
``clothing1m``   train: resize short side 256, random crop 224, horizontal flip, colour jitter
                 on brightness ("whiteness") and saturation (the paper names the two; it
                 gives no magnitudes, ours are 0.4); eval: resize short side 256, centre crop
                 224. ImageNet mean/std. Output (3, 224, 224). (The paper's text says "resize
                 the short side to 224"; 256 -> 224 is the usual Clothing1M recipe.)
``webvision``    Inception-ResNet-v2 at its native 299: train random-resized crop 299 (scale
                 0.08-1), flip; eval resize 320, centre crop 299. Inception normalisation
                 (mean = std = 0.5). Output (3, 299, 299).
``webvision227`` the DivideMix recipe: train resize 320, random crop 227, flip; eval resize
                 320, centre crop 227. ImageNet mean/std. Output (3, 227, 227).
``digits``       8x8 grayscale (scikit-learn digits), no augmentation: resize to 8x8 (a no-op
                 for 8x8 input), scale to [0, 1]. Output (1, 8, 8).
``imagenetN``    any size N (e.g. ``imagenet224``, ``imagenet96``): one's own photos with an
                 ImageNet-style backbone (``jobs/train.py --image-size N``). Train:
                 random-resized crop N (scale 0.25-1: web photos keep their object), flip;
                 eval: resize short side round(N / 0.875), centre crop N (the usual
                 224/256 ratio). ImageNet mean/std. Output (3, N, N).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INCEPTION_MEAN = (0.5, 0.5, 0.5)
INCEPTION_STD = (0.5, 0.5, 0.5)


class PerImageStandardize(torch.nn.Module):
    """uint8 or float ``x: (..., C, H, W)`` -> float32 ``(x - mean) / max(std, 1/sqrt(C*H*W))``.

    The statistics are taken over the last three axes (all pixels and channels of one image;
    a leading batch axis is kept apart), as ``tf.image.per_image_standardization``; values
    are first scaled to [0, 1] when ``x`` is uint8. The floor on ``std`` keeps a constant
    image finite (it maps to zeros).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.as_subclass(torch.Tensor)
        x = x.to(torch.float32).div_(255.0) if x.dtype == torch.uint8 else x.to(torch.float32)
        n = x.shape[-1] * x.shape[-2] * x.shape[-3]
        mean = x.mean(dim=(-3, -2, -1), keepdim=True)
        std = x.std(dim=(-3, -2, -1), keepdim=True, unbiased=False)
        return (x - mean) / std.clamp_min(1.0 / math.sqrt(n))


class ScaleNormalize(torch.nn.Module):
    """uint8 ``x: (..., C, H, W)`` -> float32 ``(x / 255 - mean[c]) / std[c]`` per channel c.

    The same result as ``v2.ToDtype(float32, scale=True)`` then ``v2.Normalize(mean, std)``,
    in one pass that also works on a whole batch (the loader normalises batches, not samples).
    """

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        m, s = torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)
        self.register_buffer("scale", (1.0 / (255.0 * s)).float().view(-1, 1, 1), persistent=False)
        self.register_buffer("shift", (-m / s).float().view(-1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.as_subclass(torch.Tensor)
        if x.dtype != torch.uint8:
            raise TypeError(f"ScaleNormalize expects uint8 images, got {x.dtype}")
        return x.to(torch.float32).mul_(self.scale).add_(self.shift)


def _cifar(train: bool) -> list[Callable]:
    return [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if train else []


def _clothing1m(train: bool) -> list[Callable]:
    if train:
        return [v2.Resize(256), v2.RandomCrop(224), v2.RandomHorizontalFlip(),
                v2.ColorJitter(brightness=0.4, saturation=0.4)]
    return [v2.Resize(256), v2.CenterCrop(224)]


def _webvision(train: bool) -> list[Callable]:
    if train:
        return [v2.RandomResizedCrop(299), v2.RandomHorizontalFlip()]
    return [v2.Resize(320), v2.CenterCrop(299)]


def _webvision227(train: bool) -> list[Callable]:
    if train:
        return [v2.Resize(320), v2.RandomCrop(227), v2.RandomHorizontalFlip()]
    return [v2.Resize(320), v2.CenterCrop(227)]


def _digits(train: bool) -> list[Callable]:
    return [v2.Resize((8, 8))]


@dataclass(frozen=True)
class Preset:
    """One dataset's transforms.

    mode:      the PIL mode images are decoded to (``"RGB"`` or ``"L"``).
    shape:     ``(C, H, W)`` of every output.
    augment:   ``train -> [v2 transforms]`` on the PIL image (geometry, colour).
    normalize: ``() -> module`` mapping uint8 ``(..., C, H, W)`` to float32, per image or per
               batch alike.
    """

    name: str
    mode: str
    shape: tuple[int, int, int]
    augment: Callable[[bool], list[Callable]]
    normalize: Callable[[], torch.nn.Module]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("cifar", "RGB", (3, 32, 32), _cifar, PerImageStandardize),
        Preset("clothing1m", "RGB", (3, 224, 224), _clothing1m,
               lambda: ScaleNormalize(IMAGENET_MEAN, IMAGENET_STD)),
        Preset("webvision", "RGB", (3, 299, 299), _webvision,
               lambda: ScaleNormalize(INCEPTION_MEAN, INCEPTION_STD)),
        Preset("webvision227", "RGB", (3, 227, 227), _webvision227,
               lambda: ScaleNormalize(IMAGENET_MEAN, IMAGENET_STD)),
        Preset("digits", "L", (1, 8, 8), _digits, lambda: ScaleNormalize((0.0,), (1.0,))),
    )
}


MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 1024


def imagenet_preset(size: int) -> Preset:
    """The ``imagenet<size>`` preset: ImageNet-style augmentation and normalisation at
    ``size`` x ``size`` (``MIN_IMAGE_SIZE``..``MAX_IMAGE_SIZE``)."""
    if isinstance(size, bool) or not isinstance(size, int) \
            or not MIN_IMAGE_SIZE <= size <= MAX_IMAGE_SIZE:
        raise ValueError(f"image size must be an integer in [{MIN_IMAGE_SIZE}, "
                         f"{MAX_IMAGE_SIZE}], got {size!r}")
    resize = round(size / 0.875)

    def augment(train: bool) -> list[Callable]:
        if train:
            return [v2.RandomResizedCrop(size, scale=(0.25, 1.0), antialias=True),
                    v2.RandomHorizontalFlip()]
        return [v2.Resize(resize, antialias=True), v2.CenterCrop(size)]

    return Preset(f"imagenet{size}", "RGB", (3, size, size), augment,
                  lambda: ScaleNormalize(IMAGENET_MEAN, IMAGENET_STD))


def get_preset(name: str) -> Preset:
    """The ``Preset`` called ``name`` (``imagenetN``: :func:`imagenet_preset` of N);
    ``ValueError`` listing the known names otherwise."""
    if name in PRESETS:
        return PRESETS[name]
    m = re.fullmatch(r"imagenet([0-9]+)", name)
    if m:
        return imagenet_preset(int(m.group(1)))
    raise ValueError(f"unknown transform preset {name!r}; known presets: "
                     f"{', '.join(sorted(PRESETS))}, imagenetN (N = the image size)")


def build_sample_transform(preset: str, *, train: bool) -> v2.Compose:
    """PIL image -> uint8 ``(C, H, W)``: the preset's augmentation (train) or eval geometry."""
    return v2.Compose([*get_preset(preset).augment(bool(train)), v2.ToImage()])


def build_batch_transform(preset: str) -> torch.nn.Module:
    """uint8 ``(B, C, H, W)`` (or ``(C, H, W)``) -> float32 of the same shape, normalised."""
    return get_preset(preset).normalize()


def build_transform(preset: str, *, train: bool) -> v2.Compose:
    """The train (augmenting) or eval transform of ``preset``: PIL image -> ``(C, H, W)`` float32.

    Equals ``build_sample_transform`` followed by ``build_batch_transform``. Random choices
    draw from torch's default generator of the calling process; the data loader scopes that
    generator per (seed, epoch, rank, worker) so nothing global moves.
    """
    return v2.Compose([*build_sample_transform(preset, train=train).transforms,
                       build_batch_transform(preset)])
