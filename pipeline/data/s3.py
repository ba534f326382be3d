"""Reading ``s3://bucket/key`` shards and manifests with boto3, for AWS S3 and S3-compatible
stores (MinIO, Ceph RGW, R2, ...).

Why boto3 and not s3fs: the loader streams each shard front to back once, in DataLoader
worker processes that are forked from the training process. boto3 is synchronous and its
client is made per process here (a client made before a fork is never used after it); s3fs
runs an asyncio loop on a thread (aiobotocore), which does not survive a fork, and adds
nothing for a sequential read. boto3 also resolves the endpoint, region and credentials
from the standard places by itself.

Where things come from:

- endpoint: ``LoaderConfig.s3_endpoint_url`` if set, else botocore's own resolution:
  ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the ``endpoint_url`` of the profile in
  ``~/.aws/config``, else AWS itself.
- credentials and region: the default boto3 chain (``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws/``,
  web identity / IRSA, the instance profile, ...; ``AWS_REGION`` or ``AWS_DEFAULT_REGION``).

Retries: botocore's own retries are switched off so that every retry is ours, bounded by
``LoaderConfig.s3_retries`` per request (per shard for a shard stream), logged (WARNING) and
counted. Transient errors are connection failures, timeouts, a stream cut short and HTTP
429/5xx answers; 403/404/412 are not retried. A shard stream that breaks mid-read resumes
with a ranged GET from the byte it had reached, conditional on the object's ETag
(``If-Match``), so the bytes the tar reader sees are exactly the object's, once, or the
read fails after the budget with an ``OSError`` naming the key, the offset and the cause.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.data.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger(__name__)

# HTTP statuses and S3 error codes worth another try.
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_RETRY_CODES = {"RequestTimeout", "RequestTimeoutException", "SlowDown", "Throttling",
                "ThrottlingException", "InternalError", "ServiceUnavailable", "RequestLimitExceeded"}

_ENV_KEYS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
             "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


class S3Error(OSError):
    """An s3 object could not be read; the message names the ``s3://`` URL."""


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as e:
        raise ImportError(
            f"reading s3:// sources needs boto3, which is not installed ({e}); install it with "
            "`pip install 'lccn-pipeline[s3]'` (or `pip install boto3`)") from None
    return boto3


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); ``ValueError`` naming the URL if it is not one."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or not key:
        raise ValueError(f"{url!r}: an s3 URL needs a bucket and a key (s3://BUCKET/KEY)")
    return bucket, key


def client(*, endpoint_url: str | None = None, timeout_s: float = 60.0) -> Any:
    """The s3 client of this process for these settings (made once per process and settings;
    thread-safe, never shared across a fork)."""
    # The environment is part of the key: botocore reads the endpoint and the credentials
    # from it when the client is made.
    key = (os.getpid(), endpoint_url or None, float(timeout_s),
           *(os.environ.get(v) for v in _ENV_KEYS))
    with _clients_lock:
        c = _clients.get(key)
        if c is None:
            boto3 = _boto3()
            from botocore.config import Config

            cfg = Config(retries={"total_max_attempts": 1}, connect_timeout=timeout_s,
                         read_timeout=timeout_s, max_pool_connections=16)
            c = _clients[key] = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url or None, config=cfg)
        return c


def _status(e: BaseException) -> tuple[int | None, str]:
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict):
        return None, ""
    return (resp.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            str(resp.get("Error", {}).get("Code", "")))


def is_transient(e: BaseException) -> bool:
    """Whether another try may succeed: connection trouble, timeouts, a cut stream, 429/5xx."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(e, ClientError):
        status, code = _status(e)
        return status in _RETRY_STATUS or code in _RETRY_CODES
    if isinstance(e, BotoCoreError):
        # EndpointConnectionError, ConnectionClosedError, Read/ConnectTimeoutError,
        # ResponseStreamingError, IncompleteReadError: all network-level.
        return not isinstance(e, _permanent_botocore())
    return isinstance(e, (OSError, _ShortRead)) or type(e).__module__.startswith("urllib3")


def _from_the_store(e: BaseException) -> bool:
    """An error of the request (botocore's), as opposed to a bug in the caller."""
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(e, (BotoCoreError, ClientError))


def _permanent_botocore() -> tuple[type, ...]:
    from botocore.exceptions import (
        NoCredentialsError,
        NoRegionError,
        ParamValidationError,
    )

    return (NoCredentialsError, NoRegionError, ParamValidationError)


class _ShortRead(Exception):
    """The body ended before the object's length (a connection closed without an error)."""


def _describe(url: str, e: BaseException) -> str:
    from botocore.exceptions import ClientError, NoCredentialsError

    status, code = _status(e)
    if isinstance(e, ClientError) and (status == 404 or code in ("NoSuchKey", "NoSuchBucket", "404")):
        what = "bucket" if code == "NoSuchBucket" else "key"
        return f"{url}: no such {what} ({code or status})"
    if isinstance(e, ClientError) and status == 403:
        return (f"{url}: access denied ({code}); check the credentials (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID, the instance profile) and the bucket policy")
    if isinstance(e, ClientError) and status == 412:
        return (f"{url}: the object changed while it was being read (its ETag no longer "
                "matches); re-upload the split with its manifest")
    if isinstance(e, NoCredentialsError):
        return (f"{url}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or run where an instance profile / service account provides them)")
    return f"{url}: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class Retry:
    """How many retries a request may make and how long to wait between them."""

    retries: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def wait(self, attempt: int) -> None:
        time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))


def _call(url: str, fn: Callable[[], Any], *, retry: Retry, what: str,
          on_retry: Callable[[], None] | None = None) -> Any:
    """``fn()`` with up to ``retry.retries`` retries of transient errors; ``S3Error`` after."""
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 -- classified below
            if not is_transient(e):
                if _from_the_store(e):
                    raise S3Error(_describe(url, e)) from e
                raise
            attempt += 1
            if attempt > retry.retries:
                raise S3Error(f"{url}: {what} failed after {retry.retries} retries "
                              f"({type(e).__name__}: {e})") from e
            log.warning("%s: %s failed (%s: %s); retry %d of %d", url, what, type(e).__name__,
                        e, attempt, retry.retries)
            if on_retry is not None:
                on_retry()
            retry.wait(attempt)


def head(url: str, *, s3: Any, retry: Retry) -> dict:
    """``{"size", "etag"}`` of an object; ``S3Error`` naming the URL (missing key, denied...)."""
    bucket, key = parse_url(url)
    r = _call(url, lambda: s3.head_object(Bucket=bucket, Key=key), retry=retry, what="HEAD")
    return {"size": int(r["ContentLength"]), "etag": r.get("ETag")}


def read_bytes(url: str, *, s3: Any, retry: Retry) -> bytes:
    """A whole (small) object, e.g. a manifest; retried as one request."""
    bucket, key = parse_url(url)

    def get() -> bytes:
        r = s3.get_object(Bucket=bucket, Key=key)
        data = r["Body"].read()
        if len(data) != r["ContentLength"]:
            raise _ShortRead(f"{len(data)} of {r['ContentLength']} bytes")
        return data

    return _call(url, get, retry=retry, what="GET")


class ObjectReader:
    """A read-only, sequential file object over one s3 object that survives dropped
    connections: a read that fails with a transient error (or a body that ends early)
    reopens the object at the current offset with ``Range`` + ``If-Match: <etag>`` and goes
    on, up to ``retry.retries`` times in all; then ``S3Error`` (an ``OSError``). The first
    GET happens in the constructor, so a missing key fails there, naming the key."""

    def __init__(self, url: str, *, s3: Any, retry: Retry,
                 on_retry: Callable[[], None] | None = None) -> None:
        self.url, self._s3, self._retry, self._on_retry = url, s3, retry, on_retry
        self._bucket, self._key = parse_url(url)
        self.retries = 0
        self.offset = 0
        self.size: int | None = None
        self._etag: str | None = None
        self._body: Any = None
        self._open()

    def _open(self) -> None:
        def get() -> Any:
            kw: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
            if self.offset:
                kw["Range"] = f"bytes={self.offset}-"
                if self._etag:
                    kw["IfMatch"] = self._etag
            return self._s3.get_object(**kw)

        r = self._call(get, "GET" if not self.offset else f"GET from byte {self.offset}")
        if self._etag is None:
            self._etag, self.size = r.get("ETag"), int(r["ContentLength"])
        self._body = r["Body"]

    def _count_retry(self) -> None:
        self.retries += 1
        if self._on_retry is not None:
            self._on_retry()

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        # The retry budget is per object, shared by reopening and reading.
        left = Retry(self._retry.retries - self.retries, self._retry.backoff_s,
                     self._retry.max_backoff_s)
        return _call(self.url, fn, retry=left, what=what, on_retry=self._count_retry)

    def read(self, n: int = -1) -> bytes:
        if self._body is None:
            raise ValueError(f"{self.url}: read from a closed reader")
        if self.size is not None and self.offset >= self.size:
            return b""
        while True:
            try:
                data = self._body.read() if n is None or n < 0 else self._body.read(n)
                if not data and self.size is not None and self.offset < self.size:
                    raise _ShortRead(f"stream ended at byte {self.offset} of {self.size}")
                self.offset += len(data)
                return data
            except Exception as e:  # noqa: BLE001 -- classified below
                if not is_transient(e):
                    if _from_the_store(e):
                        raise S3Error(_describe(self.url, e)) from e
                    raise
                if self.retries >= self._retry.retries:
                    raise S3Error(f"{self.url}: read failed at byte {self.offset} of {self.size} "
                                  f"after {self._retry.retries} retries ({type(e).__name__}: {e})"
                                  ) from e
                self._count_retry()
                log.warning("%s: read broke at byte %d of %s (%s: %s); resuming there, retry %d "
                            "of %d", self.url, self.offset, self.size, type(e).__name__, e,
                            self.retries, self._retry.retries)
                self._retry.wait(self.retries)
                self._close_body()
                self._open()

    def _close_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001 -- a broken connection may fail to close
                pass

    def close(self) -> None:
        self._close_body()
        self._body = None

    def __enter__(self) -> "ObjectReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def upload_split(split_dir: str | os.PathLike, url: str, *, s3: Any) -> list[str]:
    """Upload a converted split (its shards, then ``manifest.json`` last, so a reader never
    sees a manifest whose shards are not all there) under the prefix ``url``. Each shard is
    sent with its manifest sha256 as ``ChecksumSHA256``, which AWS S3 verifies on receipt.
    Returns the uploaded URLs."""
    import base64
    from pathlib import Path


    split_dir = Path(split_dir)
    manifest = Manifest.load(split_dir)
    manifest.verify(split_dir, checksums=False)
    base = url.rstrip("/")
    bucket, prefix = parse_url(base + "/" + MANIFEST_NAME)
    prefix = prefix[: -len(MANIFEST_NAME)]
    out = []
    for info in manifest.shards:
        with open(split_dir / info.name, "rb") as f:
            s3.put_object(Bucket=bucket, Key=prefix + info.name, Body=f,
                          ChecksumSHA256=base64.b64encode(bytes.fromhex(info.sha256)).decode())
        out.append(f"{base}/{info.name}")
    s3.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME,
                  Body=(split_dir / MANIFEST_NAME).read_bytes())
    out.append(f"{base}/{MANIFEST_NAME}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.data.s3 upload SPLIT_DIR s3://BUCKET/PREFIX/SPLIT [--endpoint-url URL]``"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.data.s3",
                                description="upload a converted split to s3 (shards, then the manifest)")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upload", help="upload SPLIT_DIR's shards and manifest.json under URL")
    up.add_argument("split_dir")
    up.add_argument("url", help="s3://BUCKET/PREFIX/SPLIT")
    up.add_argument("--endpoint-url", default=None,
                    help="S3-compatible endpoint (default: AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL or AWS)")
    args = p.parse_args(argv)
    urls = upload_split(args.split_dir, args.url, s3=client(endpoint_url=args.endpoint_url))
    print(f"uploaded {len(urls)} objects under {args.url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
