"""A preset's per-sample transform without torchvision's v2 dispatch: the same random draws
and the same PIL operations, so the same pixels, at a fraction of the per-call cost.

``SampleTransform(preset, train=...)(image)`` maps a decoded image -- a ``PIL.Image`` in the
preset's mode, or the uint8 tensor ``(C, H, W)`` of the same pixels that
:func:`pipeline.data.jpeg.decode` gives -- to the uint8 ``(C, H, W)`` tensor
``build_sample_transform(preset, train=...)`` makes of the PIL image, drawing the same
random numbers in the same order from torch's default generator (the loader scopes it per
slot). How:

- each v2 transform's parameters come from its own ``make_params`` (torchvision's code
  draws them), then the operation runs directly: crops, pads and flips by tensor indexing
  or one PIL call (they move bytes only), resizes and colour changes by the PIL call the v2
  kernel for PIL images makes;
- an image stays a tensor until an operation needs PIL (a resize, a colour change) and
  becomes a tensor again at the end; a resize to the size an image already has is skipped,
  as v2 skips it;
- transforms or options this module does not know run as v2 runs them on the PIL image
  (exact by definition).

The tests hold it equal to the v2 transforms on real JPEGs for every preset, train and
eval, over many generator states. Imports: torch, torchvision, PIL, numpy.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageEnhance
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms import _functional_pil as FP

from pipeline.data.transforms import get_preset

# v2's interpolation -> PIL resample, as torchvision's kernels for PIL images map it
_PIL_RESAMPLE = {
    InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.NEAREST_EXACT: Image.NEAREST,
    InterpolationMode.BILINEAR: Image.BILINEAR, InterpolationMode.BICUBIC: Image.BICUBIC,
    InterpolationMode.BOX: Image.BOX, InterpolationMode.HAMMING: Image.HAMMING,
    InterpolationMode.LANCZOS: Image.LANCZOS,
}


def size_of(img: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or a ``(C, H, W)`` tensor."""
    if isinstance(img, Image.Image):
        return img.height, img.width
    return int(img.shape[-2]), int(img.shape[-1])


def to_pil(img: Any) -> Image.Image:
    """A PIL image of the same pixels (``(1, H, W)`` -> mode L, ``(3, H, W)`` -> RGB)."""
    if isinstance(img, Image.Image):
        return img
    hwc = img.permute(1, 2, 0)
    arr = hwc.numpy() if hwc.is_contiguous() else np.ascontiguousarray(hwc.numpy())
    return Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)


def to_tensor(img: Any) -> torch.Tensor:
    """uint8 ``(C, H, W)`` of a PIL image (as ``v2.ToImage``) or of a tensor."""
    if not isinstance(img, Image.Image):
        return img
    arr = np.array(img)  # a writable copy
    return torch.from_numpy(arr.reshape(arr.shape[0], arr.shape[1], -1)).permute(2, 0, 1)


def hwc_pixels(img: Any) -> np.ndarray:
    """(H, W, C) uint8 numpy pixels of a PIL image or a ``(C, H, W)`` tensor."""
    if isinstance(img, Image.Image):
        px = np.asarray(img)
        return px[:, :, None] if px.ndim == 2 else px
    return img.permute(1, 2, 0).numpy()


def crop(img: Any, top: int, left: int, height: int, width: int) -> Any:
    """``img[top:top+height, left:left+width]``, zeros where the box leaves the image (as
    ``PIL.Image.crop``, and as v2's zero pad followed by a crop)."""
    if isinstance(img, Image.Image):
        return img.crop((left, top, left + width, top + height))
    h, w = size_of(img)
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return img[:, top:top + height, left:left + width]
    out = torch.zeros((img.shape[0], height, width), dtype=img.dtype, device=img.device)
    t0, l0 = max(top, 0), max(left, 0)
    t1, l1 = min(top + height, h), min(left + width, w)
    if t1 > t0 and l1 > l0:
        out[:, t0 - top:t1 - top, l0 - left:l1 - left] = img[:, t0:t1, l0:l1]
    return out


def hflip(img: Any) -> Any:
    return img.transpose(Image.FLIP_LEFT_RIGHT) if isinstance(img, Image.Image) else img.flip(-1)


def resized_size(h: int, w: int, size: list[int], max_size: int | None) -> tuple[int, int]:
    """v2.Resize's output (height, width) for an ``h`` x ``w`` image: ``size`` of one int
    scales the short side to it (the long side truncated), two ints are (h, w)."""
    if len(size) == 2:
        return int(size[0]), int(size[1])
    short, long = (w, h) if w <= h else (h, w)
    new_short = requested = int(size[0])
    new_long = int(requested * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if w <= h else (new_short, new_long)


def _resample(t: Any) -> int | None:
    mode = t.interpolation
    if isinstance(mode, int):
        return mode
    return _PIL_RESAMPLE.get(InterpolationMode(mode))


def _resize(img: Any, h: int, w: int, resample: int) -> Any:
    if size_of(img) == (h, w):
        return img  # v2 returns the image itself
    return to_pil(img).resize((w, h), resample=resample)


def _zero_fill(t: Any) -> bool:
    fill = getattr(t, "fill", 0)
    return fill in (0, None) and getattr(t, "padding_mode", "constant") == "constant"


class _Op:
    """One v2 transform: ``__call__(img) -> img`` with v2's draws and PIL's pixels."""

    def __init__(self, t: Any) -> None:
        self.t = t

    def __call__(self, img: Any) -> Any:  # the generic path: v2 on the PIL image
        return self.t(to_pil(img))


class _RandomCrop(_Op):
    def __call__(self, img: Any) -> Any:
        p = self.t.make_params([img])
        if p["needs_pad"] and not _zero_fill(self.t):
            return self.t.transform(to_pil(img), p)
        if not (p["needs_pad"] or p["needs_crop"]):
            return img
        left, top = p["padding"][:2]  # padding: [left, top, right, bottom]
        return crop(img, p["top"] - top, p["left"] - left, p["height"], p["width"])


class _CenterCrop(_Op):
    def __call__(self, img: Any) -> Any:
        ch, cw = self.t.size
        h, w = size_of(img)
        if ch > h or cw > w:
            return self.t(to_pil(img))
        return crop(img, int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0)), ch, cw)


class _Resize(_Op):
    def __init__(self, t: Any) -> None:
        super().__init__(t)
        self.resample = _resample(t)

    def __call__(self, img: Any) -> Any:
        if self.resample is None:
            return self.t(to_pil(img))
        h, w = resized_size(*size_of(img), list(self.t.size), self.t.max_size)
        return _resize(img, h, w, self.resample)


class _RandomResizedCrop(_Op):
    def __init__(self, t: Any) -> None:
        super().__init__(t)
        self.resample = _resample(t)

    def __call__(self, img: Any) -> Any:
        p = self.t.make_params([img])
        if self.resample is None:
            return self.t.transform(to_pil(img), p)
        img = crop(img, p["top"], p["left"], p["height"], p["width"])
        return _resize(img, int(self.t.size[0]), int(self.t.size[1]), self.resample)


class _HorizontalFlip(_Op):
    def __call__(self, img: Any) -> Any:
        if torch.rand(1) >= self.t.p:  # as v2's _RandomApplyTransform
            return img
        return hflip(img)


class _ColorJitter(_Op):
    """ImageEnhance's blends as v2's PIL kernels make them; brightness blends with a black
    image of the size kept from the previous call (``ImageEnhance.Brightness`` makes a new
    one each time: the same pixels, one allocation and fill less)."""

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        self._black: Image.Image | None = None

    def _brightness(self, pil: Image.Image, factor: float) -> Image.Image:
        if "A" in pil.getbands():
            return ImageEnhance.Brightness(pil).enhance(factor)
        if self._black is None or (self._black.mode, self._black.size) != (pil.mode, pil.size):
            self._black = Image.new(pil.mode, pil.size, 0)
        return Image.blend(self._black, pil, factor)

    def __call__(self, img: Any) -> Any:
        p = self.t.make_params([img])
        pil = to_pil(img)
        for fn in p["fn_idx"].tolist():
            if fn == 0 and p["brightness_factor"] is not None:
                pil = self._brightness(pil, p["brightness_factor"])
            elif fn == 1 and p["contrast_factor"] is not None:
                pil = ImageEnhance.Contrast(pil).enhance(p["contrast_factor"])
            elif fn == 2 and p["saturation_factor"] is not None:
                pil = ImageEnhance.Color(pil).enhance(p["saturation_factor"])
            elif fn == 3 and p["hue_factor"] is not None:
                pil = FP.adjust_hue(pil, p["hue_factor"])
        return pil


_OPS: dict[type, Callable[[Any], _Op]] = {
    v2.RandomCrop: _RandomCrop, v2.CenterCrop: _CenterCrop, v2.Resize: _Resize,
    v2.RandomResizedCrop: _RandomResizedCrop, v2.RandomHorizontalFlip: _HorizontalFlip,
    v2.ColorJitter: _ColorJitter,
}


def _has_params_api(t: Any) -> bool:
    return callable(getattr(t, "make_params", None)) and callable(getattr(t, "transform", None))


class SampleTransform:
    """The preset's train or eval transform: decoded image -> uint8 ``(C, H, W)``, equal to
    ``build_sample_transform(preset, train=train)`` on the PIL image (see the module
    docstring). ``first_resize(h, w)``: the (h, w) its first operation resizes an ``h`` x
    ``w`` image to when that operation is a deterministic resize, else None (where a JPEG
    may be decoded at a reduced scale)."""

    def __init__(self, preset: str, *, train: bool) -> None:
        self.preset = get_preset(preset)
        self.transforms = list(self.preset.augment(bool(train)))
        self.ops = [(_OPS[type(t)] if type(t) in _OPS and _has_params_api(t) else _Op)(t)
                    for t in self.transforms]
        self.shape = self.preset.shape

    def __call__(self, img: Any) -> torch.Tensor:
        for op in self.ops:
            img = op(img)
        return to_tensor(img)

    def first_resize(self, h: int, w: int) -> tuple[int, int] | None:
        if not self.ops or type(self.ops[0]) is not _Resize or self.ops[0].resample is None:
            return None
        t = self.ops[0].t
        return resized_size(h, w, list(t.size), t.max_size)


def draft_target(size: tuple[int, int], target: tuple[int, int] | None) -> tuple[int, int] | None:
    """The (w, h) to pass to ``Image.draft`` for an image of ``size`` (h, w) resized to
    ``target`` (h, w): the target when it is at most half the image on both sides (a
    reduced-scale decode is then still at least the target), else None."""
    if target is None:
        return None
    (h, w), (th, tw) = size, target
    if 2 * th > h or 2 * tw > w:
        return None
    return int(math.ceil(tw)), int(math.ceil(th))
