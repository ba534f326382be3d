"""Reading tar shards with less Python per member than ``tarfile``.

``tar_members(stream)`` yields ``(name, data)`` for every regular file of an uncompressed
tar stream: ustar, GNU (``L`` long names) and pax (``x``/``g`` records ``path`` and
``size``) headers, read through a 1 MiB buffer, one parse of each 512-byte header (name,
size, type, checksum). It ends the archive where ``tarfile``'s stream mode does (a zero
block, an empty, short or invalid header after the first) and raises
``tarfile.ReadError`` where that does (an empty, short or invalid first header, member
data cut short, a bad header after a pax or long-name header). On 32 px CIFAR shards it
reads members about four times faster than ``tarfile``, whose ``TarInfo`` parsing was the
largest per-sample cost of the shard stream once the images decode at libjpeg speed.

``expand_tars(sources, handler=)`` is ``webdataset.tariterators.tar_file_expander`` on top
of it: ``{"url", "stream"}`` -> ``{"fname", "data", "__url__"}`` per member (WebDataset's
``__meta__`` files skipped) and ``{}`` after each shard; an exception goes to ``handler``
(True: go on with the next shard). A compressed shard (gzip, bzip2, xz, zstd magic) is
read by WebDataset's own iterator.

Imports: the standard library, and WebDataset for compressed shards.
"""

from __future__ import annotations

import re
import tarfile
from typing import Any, Callable, Iterator

from webdataset.tariterators import tar_file_iterator

BLOCK = 512
READ_SIZE = 1 << 20
_ZERO = bytes(BLOCK)
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
_REGULAR = (b"0", b"\x00", b"7")
_SKIP_META = re.compile(r"__[^/]*__($|/)")


class _Buffered:
    """``read(n)`` over a stream through a large buffer (exact unless at the end)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.buf, self.pos, self.eof = raw, b"", 0, False

    def _fill(self, n: int) -> None:
        parts = [self.buf[self.pos:]]
        have = len(parts[0])
        while have < n and not self.eof:
            chunk = self.raw.read(max(READ_SIZE, n - have))
            if not chunk:
                self.eof = True
                break
            parts.append(chunk)
            have += len(chunk)
        self.buf, self.pos = b"".join(parts), 0

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            self._fill(n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def peek(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            self._fill(n)
        return self.buf[self.pos:self.pos + n]


def _number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[0] & 0x40 else n
    s = field.split(b"\x00", 1)[0].strip()
    return int(s, 8) if s else 0


def _text(field: bytes) -> str:
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0:
            break
        length = int(data[pos:sp])
        key, _, value = data[sp + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _checksum_ok(hdr: bytes) -> bool:
    """The header's stored checksum is its byte sum with the field as spaces (unsigned, or
    signed as some old tars wrote it)."""
    try:
        stored = _number(hdr[148:156])
    except ValueError:
        return False
    unsigned = sum(hdr[:148]) + 256 + sum(hdr[156:])
    if stored == unsigned:
        return True
    high = sum(1 for b in hdr[:148] if b > 127) + sum(1 for b in hdr[156:] if b > 127)
    return stored == unsigned - 256 * high


def tar_members(stream: Any) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` of each regular file of an uncompressed tar stream (see the module
    docstring for where it ends and what it raises)."""
    f = stream if isinstance(stream, _Buffered) else _Buffered(stream)
    offset = 0
    pending: dict[str, str] = {}  # pax / long-name overrides for the next member
    global_pax: dict[str, str] = {}
    pad = 0  # the padding after the last member's data, skipped before the next header
    while True:
        if pad and len(f.read(pad)) < pad:
            raise tarfile.ReadError("unexpected end of data")
        pad = 0
        hdr = f.read(BLOCK)
        if len(hdr) < BLOCK or hdr == _ZERO:
            if pending:
                raise tarfile.ReadError("unexpected end of archive after an extended header")
            if offset == 0 and len(hdr) < BLOCK:
                raise tarfile.ReadError("empty file" if not hdr else "truncated header")
            return
        if not _checksum_ok(hdr):
            if pending or offset == 0:
                raise tarfile.ReadError("bad checksum")
            return
        kind = hdr[156:157]
        name = _text(hdr[0:100])
        if hdr[257:265] == b"ustar\x0000":  # POSIX ustar: a name prefix (not GNU's)
            prefix = _text(hdr[345:500])
            if prefix:
                name = f"{prefix}/{name}"
        size = _number(hdr[124:136])
        attrs = {**global_pax, **pending}
        if "size" in attrs:
            size = int(attrs["size"])
        if kind in (b"x", b"g", b"L", b"K"):
            data = f.read(size)
            if len(data) < size or len(f.read(-size % BLOCK)) < -size % BLOCK:
                raise tarfile.ReadError("unexpected end of data")
            offset += BLOCK + size + (-size % BLOCK)
            if kind == b"x":
                pending.update(_pax(data))
            elif kind == b"g":
                global_pax.update(_pax(data))
            elif kind == b"L":
                pending["path"] = data.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
            continue
        name = attrs.get("path", name)
        pending = {}
        data = f.read(size)
        if len(data) < size:
            raise tarfile.ReadError("unexpected end of data")
        pad = -size % BLOCK
        if kind not in _REGULAR:
            data = None
        offset += BLOCK + size + pad
        if data is not None and not (kind == b"\x00" and name.endswith("/")):
            yield name, data


class _Chain:
    """A stream that first returns ``head`` then reads ``raw``."""

    def __init__(self, head: bytes, raw: Any) -> None:
        self.head, self.raw = head, raw

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                out, self.head = self.head + self.raw.read(), b""
                return out
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.raw.read(n)


def expand_tars(sources: Iterator[dict], *, handler: Callable[[BaseException], bool]
                ) -> Iterator[dict]:
    """``{"url", "stream"}`` -> ``{"fname", "data", "__url__"}`` per member, ``{}`` after
    each shard (WebDataset's ``tar_file_expander`` semantics)."""
    for source in sources:
        url = source["url"]
        f = _Buffered(source["stream"])
        try:
            if f.peek(6).startswith(_COMPRESSED):
                raw = _Chain(f.read(len(f.buf) - f.pos), f.raw)
                for s in tar_file_iterator(raw, handler=handler):
                    s["__url__"] = url
                    yield s
            else:
                for fname, data in tar_members(f):
                    if "/" not in fname and fname.startswith("__") and fname.endswith("__"):
                        continue
                    if _SKIP_META.match(fname):
                        continue
                    yield {"fname": fname, "data": data, "__url__": url}
        except Exception as exn:  # noqa: BLE001 -- as WebDataset: the handler decides
            exn.args = exn.args + (url,)
            if not handler(exn):
                break
        yield {}
