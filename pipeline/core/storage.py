"""Where a run keeps its files: a folder on a file system every node shares, or a prefix
in S3-compatible object storage (``s3://bucket/prefix``).

A *location* is a ``str`` or a :class:`~pathlib.Path`: an absolute path, or an ``s3://``
URI. Joining keeps the kind (:func:`join`). Every read, listing, write and delete goes
through a pyarrow file system, the layer Ray Train's own storage uses, so the checkpoint
files Ray Train writes under ``storage_path`` and the ones this project reads back
(discovery, pruning, resume checks) are seen the same way on both kinds.

Object storage, what it needs:

- endpoint: ``endpoint_url`` where a caller passes one (the jobs' ``--s3-endpoint-url``),
  else the standard resolution: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, else AWS
  itself (the bucket's region is looked up).
- credentials: the standard chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_PROFILE`` and ``~/.aws``, web identity, the instance profile), on every node.
- a key is written by one PUT, which is atomic: a reader sees the whole object or none.
  Local writes go through a temporary file and a rename for the same guarantee.

Imports: the standard library and pyarrow (a dependency of Ray Train).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Union

from pyarrow import fs as pafs

Location = Union[str, os.PathLike]

SCHEMES = ("s3",)
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


class StorageError(OSError):
    """A location cannot be used; the message names it."""


def scheme(loc: Location) -> str | None:
    """``"s3"`` for ``s3://...``, None for a path."""
    m = _URI.match(str(loc))
    return m.group(1).lower() if m else None


def is_remote(loc: Location) -> bool:
    return scheme(loc) is not None


def check_location(value: str, *, what: str = "the directory") -> str:
    """``value`` if it is a path or a supported URI with a bucket (trailing slashes
    dropped); ``ValueError`` with one line otherwise."""
    m = _URI.match(value)
    if not m:
        return value
    if m.group(1).lower() not in SCHEMES:
        raise ValueError(
            f"{value}: {m.group(1)}:// is not supported for {what}; use s3://BUCKET/PREFIX "
            f"(AWS or an S3-compatible store) or a path on a file system every node shares")
    rest = re.sub(r"/+", "/", m.group(2)).strip("/")  # pyarrow refuses empty components
    if not rest:
        raise ValueError(f"{value}: an s3 location needs a bucket (s3://BUCKET/PREFIX)")
    return f"s3://{rest}"


def join(loc: Location, *parts: str) -> Location:
    """``loc`` with ``parts`` appended: a Path for a path, a URI for a URI."""
    if is_remote(loc):
        return "/".join([str(loc).rstrip("/"), *(p.strip("/") for p in parts)])
    return Path(loc).joinpath(*parts)


def name(loc: Location) -> str:
    """The last component of a location (or of a pyarrow path ``bucket/key``)."""
    return str(loc).rstrip("/").rsplit("/", 1)[-1]


# The AWS SDK's default fails a request that transfers nothing for 3 s; a busy
# S3-compatible server (MinIO on a loaded node) can pause longer than that, and a failed
# checkpoint upload fails the run.
REQUEST_TIMEOUT_S, CONNECT_TIMEOUT_S = 60.0, 10.0


def endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint a process uses: ``endpoint_url`` if given, else
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else None (AWS itself)."""
    return (endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


@functools.lru_cache(maxsize=None)
def _s3(bucket: str, url: str | None) -> pafs.FileSystem:
    opts = {"request_timeout": REQUEST_TIMEOUT_S, "connect_timeout": CONNECT_TIMEOUT_S}
    if url:
        return pafs.S3FileSystem(endpoint_override=url, **opts)
    return pafs.S3FileSystem(region=pafs.resolve_s3_region(bucket), **opts)  # AWS itself


_LOCAL = pafs.LocalFileSystem()


def filesystem(loc: Location, *, endpoint_url: str | None = None
               ) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system of ``loc`` and the path on it (``bucket/key`` for s3; the
    absolute path for a local folder): what Ray Train's ``storage_filesystem`` and
    ``storage_path`` take."""
    if not is_remote(loc):
        return _LOCAL, os.path.abspath(os.fspath(loc))
    path = check_location(str(loc))[len("s3://"):]
    try:
        return _s3(path.split("/", 1)[0], endpoint(endpoint_url)), path
    except OSError as e:
        raise StorageError(f"{loc}: {e}") from None


def _info(loc: Location, endpoint_url: str | None) -> pafs.FileInfo:
    fs, path = filesystem(loc, endpoint_url=endpoint_url)
    return fs.get_file_info(path)


def is_file(loc: Location, *, endpoint_url: str | None = None) -> bool:
    return _info(loc, endpoint_url).type == pafs.FileType.File


def exists(loc: Location, *, endpoint_url: str | None = None) -> bool:
    return _info(loc, endpoint_url).type != pafs.FileType.NotFound


def list_dirs(loc: Location, prefix: str = "", *, endpoint_url: str | None = None
              ) -> list[str]:
    """The names of the folders directly under ``loc`` that start with ``prefix``, sorted;
    [] when ``loc`` is not there."""
    fs, path = filesystem(loc, endpoint_url=endpoint_url)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
    return sorted(i.base_name for i in infos
                  if i.type == pafs.FileType.Directory and i.base_name.startswith(prefix))


def read_bytes(loc: Location, *, endpoint_url: str | None = None) -> bytes:
    """The bytes of a file; ``FileNotFoundError``/``OSError`` naming it otherwise."""
    if not is_remote(loc):
        return Path(loc).read_bytes()
    fs, path = filesystem(loc, endpoint_url=endpoint_url)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{loc}: no such object") from None
    except OSError as e:
        raise OSError(f"{loc}: {e}") from None


def read_text(loc: Location, *, endpoint_url: str | None = None) -> str:
    return read_bytes(loc, endpoint_url=endpoint_url).decode()


def write_bytes(loc: Location, data: bytes, *, endpoint_url: str | None = None) -> None:
    """Write a whole file at once: a reader never sees part of it."""
    if not is_remote(loc):
        p = Path(loc)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, p)
        return
    fs, path = filesystem(loc, endpoint_url=endpoint_url)
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_text(loc: Location, text: str, *, endpoint_url: str | None = None) -> None:
    write_bytes(loc, text.encode(), endpoint_url=endpoint_url)


def delete_dir(loc: Location, *, endpoint_url: str | None = None) -> None:
    """Delete a folder and everything under it; nothing if it is not there."""
    fs, path = filesystem(loc, endpoint_url=endpoint_url)
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass


def upload(local: str | os.PathLike, loc: Location, *, endpoint_url: str | None = None
           ) -> None:
    """Copy a local file or folder (recursively) to ``loc`` (for a path: a copy there)."""
    fs, path = filesystem(loc, endpoint_url=endpoint_url)
    if fs is _LOCAL:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(os.fspath(local), path, source_filesystem=_LOCAL,
                    destination_filesystem=fs)


@contextlib.contextmanager
def staged(loc: Location, *, endpoint_url: str | None = None) -> Iterator[Path]:
    """A local folder whose files end up at ``loc``: ``loc`` itself for a path (created);
    for an s3 prefix a temporary folder, uploaded to it when the block ends without an
    error."""
    if not is_remote(loc):
        Path(loc).mkdir(parents=True, exist_ok=True)
        yield Path(loc)
        return
    with tempfile.TemporaryDirectory(prefix="lccn-staged-") as tmp:
        yield Path(tmp)
        upload(tmp, loc, endpoint_url=endpoint_url)


def check_bucket(loc: Location, *, endpoint_url: str | None = None) -> str | None:
    """For an s3 location, one line when its bucket cannot be reached or is not there
    (no credentials, a wrong endpoint, a typo); None when it is (and for a path)."""
    if not is_remote(loc):
        return None
    bucket = check_location(str(loc))[len("s3://"):].split("/", 1)[0]
    try:
        fs, _ = filesystem(loc, endpoint_url=endpoint_url)  # AWS: looks the region up
        kind = fs.get_file_info(bucket).type
    except OSError as e:
        return f"{loc}: the bucket {bucket!r} cannot be reached ({str(e)[:300]})"
    if kind == pafs.FileType.NotFound:
        return f"{loc}: no bucket {bucket!r} at {endpoint(endpoint_url) or 'AWS'} (create it first)"
    return None
