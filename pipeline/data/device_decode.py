"""Decoding and augmenting whole batches on the training device (``LoaderConfig.decode =
"device"``): the loader workers hand over JPEG bytes, the training process decodes each
batch with ``torchvision.io.decode_jpeg`` (nvJPEG on a CUDA device, libjpeg-turbo on the
CPU) and applies the preset's augmentation to the batch on that device.

Payloads. A worker sends each sample as a :class:`Payload`: the JPEG's bytes (``JPEG``),
or, for a file the device decoder should not see (not a JPEG, not 8-bit Huffman-coded
with 1 or 3 components, no end marker; or an open-set sample whose pixels were shuffled),
its pixels decoded on the CPU by PIL (``PIXELS``, ``(H, W, C)`` uint8 bytes). A chunk
carries them packed (:func:`pack_payloads`: one uint8 buffer and an ``(n, 4)`` int64 table
of offset, length, height and width; the kind in a separate ``(n,)`` column), so the
DataLoader moves one buffer per chunk, not one per image.

Decoding (:meth:`DeviceDecoder.decode`): the JPEGs of a batch in one call (on CUDA one
nvJPEG batch); when the call fails, each file alone, and a file the device decoder
refuses is decoded by PIL on the CPU instead (counted in ``decode_fallback``, one log
line each up to a limit). A file that no decoder takes is counted in ``skipped_decode``
and its row is filled with a copy of a good row of the batch and marked invalid.

Augmentation (:class:`BatchAugment`): the preset's torchvision v2 list (``Preset.augment``)
read as batched operations: ``Resize`` (antialiased bilinear, per source size),
``CenterCrop``, ``RandomCrop`` (zero padding), ``RandomResizedCrop`` (scale, ratio and the
centre-crop fallback as v2), ``RandomHorizontalFlip`` and ``ColorJitter`` (brightness,
contrast, saturation in a random order per sample; hue is refused). Every per-sample
parameter is drawn on the CPU from the ``torch.Generator`` passed in, in a fixed order (op
by op, all samples at once), so the same generator state gives the same crops on any
device; the loader seeds one generator per (seed, epoch, rank, batch), which makes a
resumed epoch see the same crops without re-reading the batches it skips. Pixels stay
uint8 through crops and flips, become float32 at the first resize or colour change, and
are rounded back to uint8 at the end: the output is what the CPU path gives (uint8
``(B, C, H, W)``), normalised afterwards where the loader normalises today. Not the CPU
path's pixels: torch's resampling and colour arithmetic differ from PIL's by a few levels,
and the random parameters come from another generator.

Imports: torch, torchvision, PIL, numpy and :mod:`pipeline.data` modules without
WebDataset or Ray (a GPU node that lacks them can still import and test this).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms import InterpolationMode, v2

from pipeline.data.jpeg import decode, decode_jpeg
from pipeline.data.sample_transform import crop, resized_size, to_tensor
from pipeline.data.transforms import get_preset

log = logging.getLogger(__name__)

JPEG, PIXELS = 0, 1
MAX_LOGGED = 5  # fallback lines logged per decoder


class Payload(NamedTuple):
    """One sample as a worker hands it over: ``kind`` (``JPEG`` bytes or decoded
    ``PIXELS``), ``data`` (the bytes; in the training process a 1-D uint8 CPU tensor),
    ``height``, ``width`` (pixels; for a JPEG from its frame header) and ``name`` (shard
    URL and key, for log lines)."""

    kind: int
    data: Any
    height: int
    width: int
    name: str = ""


def pack_payloads(items: list[Payload]) -> dict[str, Any]:
    """Payloads -> ``{"payload": (total,) uint8, "spans": (n, 4) int64 (offset, length,
    height, width), "kinds": (n,) uint8, "names": [str]}``."""
    blobs = [p.data if isinstance(p.data, (bytes, bytearray)) else p.data.numpy().tobytes()
             for p in items]
    buf = bytearray(b"".join(blobs))
    data = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    lengths = np.array([len(b) for b in blobs], np.int64)
    spans = np.zeros((len(items), 4), np.int64)
    if items:
        spans[:, 0] = np.cumsum(lengths) - lengths
        spans[:, 1] = lengths
        spans[:, 2] = [p.height for p in items]
        spans[:, 3] = [p.width for p in items]
    return {"payload": data, "spans": torch.from_numpy(spans),
            "kinds": torch.tensor([p.kind for p in items], dtype=torch.uint8),
            "names": [p.name for p in items]}


def unpack_payloads(packed: dict[str, Any]) -> list[Payload]:
    """The inverse of :func:`pack_payloads` (each ``data`` a view of the buffer)."""
    spans, kinds = packed["spans"].tolist(), packed["kinds"].tolist()
    parts = torch.split(packed["payload"], [s[1] for s in spans]) if spans else ()
    return [Payload(k, d, s[2], s[3], n)
            for k, d, s, n in zip(kinds, parts, spans, packed["names"])]


# -- batched augmentation ------------------------------------------------------------------------


def _uniform(g: torch.Generator, n: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    return torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo


def _offsets(g: torch.Generator, room: np.ndarray) -> np.ndarray:
    """Uniform integers in [0, room[i]] (room >= 0), one per sample."""
    u = _uniform(g, len(room)).numpy()
    return np.minimum(np.floor(u * (room + 1)).astype(np.int64), room)


def _interp(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(C, H, W) or (B, C, H, W) -> float32 at (h, w): antialiased bilinear (v2 Resize)."""
    batched = x.dim() == 4
    y = x if batched else x[None]
    y = F.interpolate(y.float(), size=(h, w), mode="bilinear", antialias=True,
                      align_corners=False)
    return y if batched else y[0]


def _stack(images: Any) -> torch.Tensor:
    return images if isinstance(images, torch.Tensor) else torch.stack(list(images))


def _uniform_size(images: Any) -> bool:
    if isinstance(images, torch.Tensor):
        return True
    return len({tuple(x.shape) for x in images}) <= 1


def _sizes(images: Any) -> np.ndarray:
    if isinstance(images, torch.Tensor):
        return np.tile(np.array(images.shape[-2:], np.int64), (len(images), 1))
    return np.array([x.shape[-2:] for x in images], np.int64).reshape(-1, 2)


class _BatchOp:
    """One v2 transform over a batch: ``images`` (a (B, C, H, W) tensor, or a list of
    (C, H, W) tensors of different sizes) -> the same kind, parameters from ``g``."""

    def __init__(self, t: Any) -> None:
        self.t = t

    def __call__(self, images: Any, g: torch.Generator) -> Any:
        raise NotImplementedError


def _check_bilinear(t: Any, preset: str) -> None:
    mode = t.interpolation
    try:
        bilinear = InterpolationMode(mode) == InterpolationMode.BILINEAR
    except ValueError:  # a PIL resample code or an unknown name
        bilinear = False
    if not bilinear:
        raise ValueError(f"preset {preset!r}: {type(t).__name__} with {mode} interpolation has "
                         f"no batched version (decode='device' resamples bilinearly); use "
                         f"decode='cpu'")


class _Resize(_BatchOp):
    def __call__(self, images: Any, g: torch.Generator) -> Any:
        sizes = _sizes(images)
        out: list[torch.Tensor | None] = [None] * len(sizes)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (h, w) in enumerate(sizes.tolist()):
            groups.setdefault((h, w), []).append(i)
        for (h, w), members in groups.items():
            th, tw = resized_size(h, w, list(self.t.size), self.t.max_size)
            if (th, tw) == (h, w):
                for i in members:
                    out[i] = images[i]
                continue
            if isinstance(images, torch.Tensor) and len(members) == len(sizes):
                return _interp(images, th, tw)
            if len(members) > 1:
                y = _interp(torch.stack([images[i] for i in members]), th, tw)
                for k, i in enumerate(members):
                    out[i] = y[k]
            else:
                out[members[0]] = _interp(images[members[0]], th, tw)
        if any(x.dtype != out[0].dtype for x in out):  # some resized (float), some not
            out = [x.float() for x in out]
        return out


class _CenterCrop(_BatchOp):
    def __call__(self, images: Any, g: torch.Generator) -> Any:
        ch, cw = self.t.size
        sizes = _sizes(images)
        return [crop(x, int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0)), ch, cw)
                for x, (h, w) in zip(images, sizes.tolist())]


class _RandomCrop(_BatchOp):
    def __call__(self, images: Any, g: torch.Generator) -> Any:
        t = self.t
        ch, cw = t.size
        pl, pr, pt, pb = t.padding if t.padding is not None else (0, 0, 0, 0)
        if t.padding_mode != "constant" or t.fill not in (0, None):
            raise ValueError(f"RandomCrop with padding_mode={t.padding_mode!r}, fill={t.fill!r} "
                             f"has no batched version; use decode='cpu'")
        sizes = _sizes(images)
        ph = sizes[:, 0] + pt + pb
        pw = sizes[:, 1] + pl + pr
        ptop = np.full(len(sizes), pt, np.int64)
        pleft = np.full(len(sizes), pl, np.int64)
        if t.pad_if_needed:  # as v2: pad both sides by the shortfall
            dh, dw = np.maximum(ch - ph, 0), np.maximum(cw - pw, 0)
            ptop, pleft, ph, pw = ptop + dh, pleft + dw, ph + 2 * dh, pw + 2 * dw
        if (ph < ch).any() or (pw < cw).any():
            i = int(np.flatnonzero((ph < ch) | (pw < cw))[0])
            raise ValueError(f"RandomCrop of {(ch, cw)} is larger than a padded image of size "
                             f"{(int(ph[i]), int(pw[i]))}")
        top = _offsets(g, ph - ch) - ptop
        left = _offsets(g, pw - cw) - pleft
        if isinstance(images, torch.Tensor) or _uniform_size(images):
            x = _stack(images)
            h, w = x.shape[-2:]
            lo_t, lo_l = int(max(0, -top.min())), int(max(0, -left.min()))
            hi_t = int(max(0, (top + ch).max() - h))
            hi_l = int(max(0, (left + cw).max() - w))
            x = F.pad(x, (lo_l, hi_l, lo_t, hi_t)) if lo_t or lo_l or hi_t or hi_l else x
            rows = torch.as_tensor(top + lo_t, device=x.device)[:, None] + torch.arange(
                ch, device=x.device)
            cols = torch.as_tensor(left + lo_l, device=x.device)[:, None] + torch.arange(
                cw, device=x.device)
            b = torch.arange(len(x), device=x.device)[:, None, None]
            # (B, ch, cw, C) -> (B, C, ch, cw)
            return x.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
        return [crop(x, int(a), int(b), ch, cw) for x, a, b in zip(images, top, left)]


class _RandomResizedCrop(_BatchOp):
    TRIES = 10

    def params(self, sizes: np.ndarray, g: torch.Generator) -> np.ndarray:
        """(B, 4) int64 top, left, height, width, as v2.RandomResizedCrop draws them (ten
        tries of scale and log-ratio, then the central crop within the ratio bounds)."""
        t, n = self.t, len(sizes)
        height, width = sizes[:, 0].astype(np.float64), sizes[:, 1].astype(np.float64)
        area = (height * width)[:, None]
        scale = _uniform(g, n * self.TRIES, *t.scale).numpy().reshape(n, self.TRIES)
        logr = _uniform(g, n * self.TRIES, math.log(t.ratio[0]),
                        math.log(t.ratio[1])).numpy().reshape(n, self.TRIES)
        ar = np.exp(logr)
        w = np.round(np.sqrt(area * scale * ar)).astype(np.int64)
        h = np.round(np.sqrt(area * scale / ar)).astype(np.int64)
        ok = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
        first = ok.argmax(axis=1)
        found = ok.any(axis=1)
        rows = np.arange(n)
        ch, cw = h[rows, first], w[rows, first]
        # fallback: the whole image, or its central part within the ratio bounds
        in_ratio = width / height
        lo, hi = min(t.ratio), max(t.ratio)
        fw = np.where(in_ratio < lo, width, np.where(in_ratio > hi, np.round(height * hi), width))
        fh = np.where(in_ratio < lo, np.round(width / lo), height)
        ch = np.where(found, ch, fh.astype(np.int64))
        cw = np.where(found, cw, fw.astype(np.int64))
        top = np.where(found, _offsets(g, sizes[:, 0] - ch), (sizes[:, 0] - ch) // 2)
        left = np.where(found, _offsets(g, sizes[:, 1] - cw), (sizes[:, 1] - cw) // 2)
        return np.stack([top, left, ch, cw], axis=1)

    def __call__(self, images: Any, g: torch.Generator) -> Any:
        oh, ow = self.t.size
        p = self.params(_sizes(images), g)
        return [_interp(crop(x, int(a), int(b), int(c), int(d)), oh, ow)
                for x, (a, b, c, d) in zip(images, p.tolist())]


class _HorizontalFlip(_BatchOp):
    def __call__(self, images: Any, g: torch.Generator) -> Any:
        flip = _uniform(g, len(images)) < self.t.p
        if isinstance(images, torch.Tensor) or _uniform_size(images):
            x = _stack(images)
            m = flip.to(x.device)[:, None, None, None]
            return torch.where(m, x.flip(-1), x)
        return [x.flip(-1) if f else x for x, f in zip(images, flip.tolist())]


_GRAY = (19595 / 65536, 38470 / 65536, 7471 / 65536)  # PIL's "L" weights


def _gray(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) float -> (B, 1, H, W) luma (C = 1: itself)."""
    if x.shape[1] == 1:
        return x
    w = torch.tensor(_GRAY, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * w).sum(dim=1, keepdim=True)


class _ColorJitter(_BatchOp):
    def __init__(self, t: Any) -> None:
        super().__init__(t)
        if t.hue is not None:
            raise ValueError("ColorJitter(hue=...) has no batched version; use decode='cpu'")

    def __call__(self, images: Any, g: torch.Generator) -> Any:
        t = self.t
        x = _stack(images).float()
        n = len(x)
        order = torch.argsort(torch.rand(n, 3, generator=g), dim=1)  # a permutation per sample
        factors = [None if r is None else _uniform(g, n, *r).float()
                   for r in (t.brightness, t.contrast, t.saturation)]
        for k in range(3):  # the k-th operation of every sample; the others' factor is 1
            for op, f in enumerate(factors):
                sel = order[:, k] == op
                if f is None or not bool(sel.any()):
                    continue
                f4 = torch.where(sel, f, torch.ones_like(f)).to(x.device)[:, None, None, None]
                if op == 0:  # brightness: blend with black
                    x.mul_(f4)
                else:  # contrast: blend with the mean luma; saturation: with the luma
                    ref = _gray(x)
                    ref = ref.mean(dim=(1, 2, 3), keepdim=True) if op == 1 else ref
                    x.sub_(ref).mul_(f4).add_(ref)
                x.clamp_(0.0, 255.0)
        return x


_BATCH_OPS = {v2.Resize: _Resize, v2.CenterCrop: _CenterCrop, v2.RandomCrop: _RandomCrop,
              v2.RandomResizedCrop: _RandomResizedCrop,
              v2.RandomHorizontalFlip: _HorizontalFlip, v2.ColorJitter: _ColorJitter}


class BatchAugment:
    """The preset's train (or eval) transform over a batch on its device: decoded uint8
    ``(C, H, W)`` images (a list, sizes may differ) -> uint8 ``(B, C, H, W)`` of the
    preset's shape. ``ValueError`` at construction for a transform without a batched
    version (naming it)."""

    def __init__(self, preset: str, *, train: bool) -> None:
        self.preset = get_preset(preset)
        self.ops: list[_BatchOp] = []
        for t in self.preset.augment(bool(train)):
            cls = _BATCH_OPS.get(type(t))
            if cls is None:
                raise ValueError(f"preset {preset!r}: {type(t).__name__} has no batched "
                                 f"version for decode='device'; use decode='cpu'")
            if cls in (_Resize, _RandomResizedCrop):
                _check_bilinear(t, preset)
            self.ops.append(cls(t))

    def __call__(self, images: list[torch.Tensor], *, generator: torch.Generator) -> torch.Tensor:
        x: Any = list(images)
        for op in self.ops:
            x = op(x, generator)
        if not _uniform_size(x):
            raise ValueError(f"preset {self.preset.name!r} left images of sizes "
                             f"{sorted({tuple(i.shape) for i in x})[:4]}; expected "
                             f"{self.preset.shape}")
        x = _stack(x)
        if x.dtype != torch.uint8:
            x = x.round_().clamp_(0, 255).to(torch.uint8)
        if tuple(x.shape[1:]) != self.preset.shape:
            raise ValueError(f"preset {self.preset.name!r} made {tuple(x.shape[1:])} images on "
                             f"the device; expected {self.preset.shape}")
        return x.contiguous()


# -- decoding -------------------------------------------------------------------------------------


def _tensor(data: Any) -> torch.Tensor:
    """1-D uint8 CPU tensor of a payload's bytes."""
    if isinstance(data, torch.Tensor):
        return data
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _bytes(data: Any) -> bytes:
    return data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)


def _reason(e: BaseException) -> str:
    """An exception's last line, cut short (decoders may quote the whole file)."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[-1][:160]


class DeviceDecoder:
    """Decode a batch of payloads on ``device`` and augment it (``views`` times, each
    view's parameters drawn after the previous one's from the same generator).

    ``__call__(payloads, generator=) -> (views, ok, counts)``: ``views`` a tuple of uint8
    ``(B, C, H, W)`` on the device, ``ok`` a ``(B,)`` bool CPU tensor (False: no decoder
    took the file; its row holds a copy of a good row), ``counts`` the batch's
    ``decode_fallback`` and ``skipped_decode`` increments.
    """

    def __init__(self, preset: str, *, train: bool, device: torch.device | str,
                 views: int = 1) -> None:
        self.preset = get_preset(preset)
        self.augment = BatchAugment(preset, train=train)
        self.device = torch.device(device)
        self.views = views
        self.gray = self.preset.mode == "L"
        self.channels = self.preset.shape[0]
        self.logged: Counter[str] = Counter()

    def _note(self, reason: str, msg: str, *args: Any) -> None:
        self.logged[reason] += 1
        if self.logged[reason] <= MAX_LOGGED:
            log.warning(msg + (" (further ones not logged)" if self.logged[reason] == MAX_LOGGED
                               else ""), *args)

    def _pixels(self, p: Payload) -> torch.Tensor:
        x = _tensor(p.data).view(p.height, p.width, -1).permute(2, 0, 1)
        return x.to(self.device, non_blocking=False)

    def _cpu_fallback(self, p: Payload, counts: Counter[str], err: str) -> torch.Tensor | None:
        try:
            img = to_tensor(decode(_bytes(p.data), self.preset.mode))
        except Exception as e:  # noqa: BLE001 -- PIL's many errors: the file is bad
            counts["skipped_decode"] += 1
            self._note("skipped_decode", "%s: does not decode on the device (%s) nor with PIL "
                       "(%s); skipped", p.name or "a sample", err, _reason(e))
            return None
        counts["decode_fallback"] += 1
        self._note("decode_fallback", "%s: the device decoder refused it (%s); decoded on the "
                   "CPU", p.name or "a sample", err)
        return img.to(self.device)

    def decode(self, payloads: list[Payload], counts: Counter[str]) -> list[torch.Tensor | None]:
        """Each payload as uint8 ``(C, H, W)`` on the device (None: undecodable)."""
        out: list[torch.Tensor | None] = [None] * len(payloads)
        jpegs = [i for i, p in enumerate(payloads) if p.kind == JPEG]
        for i, p in enumerate(payloads):
            if p.kind == PIXELS:
                out[i] = self._pixels(p)
        if jpegs:
            try:
                decoded = decode_jpeg([_tensor(payloads[i].data) for i in jpegs],
                                      gray=self.gray, device=self.device)
                for i, x in zip(jpegs, decoded):
                    out[i] = x
            except RuntimeError:  # one file or more refused: find them
                for i in jpegs:
                    try:
                        out[i] = decode_jpeg([_tensor(payloads[i].data)], gray=self.gray,
                                             device=self.device)[0]
                    except RuntimeError as e:
                        out[i] = self._cpu_fallback(payloads[i], counts, _reason(e))
        for i, x in enumerate(out):
            if x is not None and x.shape[0] != self.channels:
                out[i] = x[:1] if self.channels == 1 else x.expand(self.channels, -1, -1)
        return out

    def __call__(self, payloads: list[Payload], *, generator: torch.Generator
                 ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, Counter[str]]:
        counts: Counter[str] = Counter()
        images = self.decode(payloads, counts)
        ok = torch.tensor([x is not None for x in images], dtype=torch.bool)
        if not bool(ok.any()):
            raise RuntimeError(f"no image of a batch of {len(images)} decoded "
                               f"({dict(counts)})")
        good = next(x for x in images if x is not None)
        images = [good if x is None else x for x in images]
        views = tuple(self.augment(images, generator=generator) for _ in range(self.views))
        return views, ok, counts
