"""JPEG bytes: what a file is (from its markers, without decoding it) and decoding it on the
CPU exactly as PIL does, at libjpeg-turbo's own speed.

``jpeg_header(data)`` walks the marker segments up to the first frame header (SOFn) and
returns its :class:`JpegHeader` (height, width, components, precision, the SOF marker and
whether the data ends with an EOI marker), or None when ``data`` is not a JPEG. Costs a few
microseconds: no entropy-coded data is read.

``decode(data, mode)`` is ``Image.open(BytesIO(data)).convert(mode)`` as pixels, for the
shard loader's CPU path: a baseline, extended or progressive 8-bit JPEG with 1 or 3
components (the common case) is decoded by ``torchvision.io.decode_jpeg`` (libjpeg-turbo,
the library the Pillow wheels bundle: the same integer IDCT and upsampling, so the same
bytes; the tests hold the two equal on every CIFAR-10 JPEG and on progressive, 4:4:4,
4:2:2 and grayscale encodings) and returned as a uint8 tensor ``(C, H, W)``; anything else
(PNG, CMYK, 12-bit, a grayscale preset over colour JPEGs, a file libjpeg warns about, an
image past PIL's decompression-bomb limit) goes through PIL and is returned as a PIL image,
PIL's verdict (its exception) included. Per image this saves PIL's Python-level header
parsing (~80 us at 32 px) and a copy.

``decode_draft(data, mode, size)``: PIL's DCT-domain downscale (``Image.draft``): the JPEG
decoded at 1/2, 1/4 or 1/8 scale, the smallest still at least ``size`` (w, h). Not the same
pixels as a full decode followed by a resize (libjpeg's scaled IDCT averages instead of
the bilinear filter); the loader uses it only when asked (``LoaderConfig.jpeg_draft``).

Imports: torch, torchvision, PIL only (the GPU node's device decode uses
:func:`jpeg_header` without WebDataset or Ray).
"""

from __future__ import annotations

import io
from typing import NamedTuple

import torch
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_jpeg as _public_decode_jpeg

# frame headers libjpeg-turbo (and nvJPEG) decode with Huffman coding: baseline, extended
# sequential, progressive
HUFFMAN_SOF = (0xC0, 0xC1, 0xC2)
_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM, RST0-7: markers without a segment
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG, DAC are not frames


class JpegHeader(NamedTuple):
    """The first frame header of a JPEG: ``height``, ``width``, ``components`` (1 gray,
    3 YCbCr/RGB, 4 CMYK/YCCK), ``precision`` (bits per sample), ``sof`` (the marker's
    second byte: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, others lossless,
    hierarchical or arithmetic) and ``complete`` (an EOI marker ends the data, allowing for
    trailing padding)."""

    height: int
    width: int
    components: int
    precision: int
    sof: int
    complete: bool

    @property
    def huffman_8bit(self) -> bool:
        """Baseline/extended/progressive, 8 bits, 1 or 3 components, a non-empty frame:
        what libjpeg-turbo and nvJPEG both decode."""
        return (self.sof in HUFFMAN_SOF and self.precision == 8 and self.components in (1, 3)
                and self.height > 0 and self.width > 0)


def jpeg_header(data: bytes | bytearray | memoryview) -> JpegHeader | None:
    """The frame header of ``data`` if it is a JPEG (SOI, marker segments, a SOFn), else
    None. Reads the markers only."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _NO_LENGTH:
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or the scan before any frame header
            return None
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2:
            return None
        if marker in _SOF:
            if i + 10 > n:
                return None
            tail = bytes(data[max(i, n - 64):]).rstrip(b"\x00\r\n ")
            return JpegHeader(height=(data[i + 5] << 8) | data[i + 6],
                              width=(data[i + 7] << 8) | data[i + 8], components=data[i + 9],
                              precision=data[i + 4], sof=marker,
                              complete=tail.endswith(b"\xff\xd9"))
        i += 2 + length
    return None


def decode_jpeg(data: torch.Tensor | list[torch.Tensor], *, gray: bool = False,
                device: torch.device | str = "cpu") -> torch.Tensor | list[torch.Tensor]:
    """``torchvision.io.decode_jpeg`` of one 1-D uint8 CPU tensor (or a list of them: on a
    CUDA ``device`` one nvJPEG batch) to RGB (``gray``: one channel), ``(C, H, W)`` uint8 on
    ``device``. Calls torchvision's operators directly where they exist: torchvision 0.29
    deprecates its Python decoders in favour of TorchCodec and warns on every call, which
    costs more than decoding a 32 px image. ``RuntimeError`` when libjpeg or nvJPEG refuses
    a file (a list: when any file is refused)."""
    mode = (ImageReadMode.GRAY if gray else ImageReadMode.RGB).value
    device = torch.device(device)
    ops = getattr(torch.ops, "image", None)
    if isinstance(data, list):
        if device.type == "cuda" and ops is not None and hasattr(ops, "decode_jpegs_cuda"):
            return ops.decode_jpegs_cuda(data, mode, device)
        if device.type != "cuda" and ops is not None and hasattr(ops, "decode_jpeg"):
            return [ops.decode_jpeg(d, mode, False) for d in data]
    elif device.type != "cuda" and ops is not None and hasattr(ops, "decode_jpeg"):
        return ops.decode_jpeg(data, mode, False)
    return _public_decode_jpeg(data, mode=ImageReadMode(mode), device=device)


def _fast_ok(h: JpegHeader | None, mode: str) -> bool:
    if h is None or not h.huffman_8bit:
        return False
    if h.height * h.width > 2 * (Image.MAX_IMAGE_PIXELS or float("inf")):
        return False  # PIL refuses it (DecompressionBombError): let PIL say so
    return (mode == "RGB") or (mode == "L" and h.components == 1)


def decode(data: bytes, mode: str) -> torch.Tensor | Image.Image:
    """``data`` decoded to ``mode`` ("RGB" or "L"): a uint8 tensor ``(C, H, W)`` (a view of
    HWC memory) from libjpeg-turbo where that gives PIL's pixels, else the PIL image
    ``Image.open(...).convert(mode)``; PIL's exceptions (``OSError``, ...) propagate."""
    if _fast_ok(jpeg_header(data), mode):
        try:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                               gray=mode != "RGB")
        except RuntimeError:  # libjpeg warned or failed: PIL decides (it may accept it)
            pass
    with Image.open(io.BytesIO(data)) as im:
        return im.convert(mode)  # forces the full decode


def decode_pil(data: bytes, mode: str) -> Image.Image:
    """``Image.open(BytesIO(data)).convert(mode)`` (the reference of :func:`decode`)."""
    with Image.open(io.BytesIO(data)) as im:
        return im.convert(mode)


def decode_draft(data: bytes, mode: str, size: tuple[int, int]) -> Image.Image:
    """``data`` decoded by PIL with ``draft(mode, size)``: a JPEG at least twice ``size``
    (w, h) on both sides comes out at 1/2, 1/4 or 1/8 scale (the smallest not below
    ``size``), other files at full size."""
    with Image.open(io.BytesIO(data)) as im:
        if im.format == "JPEG":
            im.draft(mode, size)
        return im.convert(mode)
