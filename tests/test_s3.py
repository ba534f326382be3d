"""Shards read from S3-compatible object storage (pipeline/data/s3.py through pipeline/data/stream.py).

The store is a real moto S3 server (``python -m moto.server``) started by the tests on
127.0.0.1; dropped connections come from a real TCP proxy in front of it that cuts a
response after some bytes. Shards are the real CIFAR-10 JPEG tars of ``test_data``.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_data import UNEVEN, cifar_images, run_ranks, shifted_view, valid_idx, write_split  # noqa: F401

from pipeline.data import s3
from pipeline.data.manifest import ManifestError
from pipeline.data.stream import LoaderConfig, make_eval_loader, make_train_loader

CFG = LoaderConfig(batch_size=8, num_workers=0, shuffle_buffer=16, seed=3, preset="cifar",
                   chunk_size=4, http_timeout_s=10.0)


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Test credentials in the environment; nothing from the user's ~/.aws or shell."""
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


def upload(local_split, moto_url: str, bucket: str) -> str:
    """A new bucket holding ``local_split`` under ``train/``; returns its s3 URL."""
    c = s3.client(endpoint_url=moto_url)
    c.create_bucket(Bucket=bucket)
    urls = s3.upload_split(local_split, f"s3://{bucket}/train", s3=c)
    assert urls[-1] == f"s3://{bucket}/train/manifest.json" and len(urls) == len(UNEVEN) + 1
    return f"s3://{bucket}/train"


class CuttingProxy:
    """A TCP proxy to ``upstream`` that, for a request whose bytes contain a pattern of
    ``cuts`` (``{pattern: (times, after)}``, while that pattern has cuts left), forwards
    ``after`` bytes of the response and then closes the connection. Everything else passes
    through untouched."""

    def __init__(self, upstream_port: int, *, cuts: dict[bytes, tuple[int, int]]) -> None:
        self.upstream_port = upstream_port
        self.cuts = {pat: times for pat, (times, _) in cuts.items()}
        self.after = {pat: after for pat, (_, after) in cuts.items()}
        self.cut_done = 0
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            conn = {"budget": None}
            threading.Thread(target=self._up, args=(client, upstream, conn), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, conn), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, conn: dict) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    conn["budget"] = None  # a new request on a kept-alive connection
                    for pat, left in self.cuts.items():
                        if left and pat in data:
                            self.cuts[pat] -= 1
                            conn["budget"] = self.after[pat]
                            break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket, conn: dict) -> None:
        try:
            while data := src.recv(65536):
                budget = conn["budget"]
                if budget is not None and len(data) >= budget:
                    dst.sendall(data[:budget])
                    with self._lock:
                        self.cut_done += 1
                    break  # cut: close both sides mid-response
                if budget is not None:
                    conn["budget"] = budget - len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def close(self) -> None:
        self._stop = True
        self._srv.close()


def _close(*socks: socket.socket) -> None:
    for s_ in socks:
        try:
            s_.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s_.close()


@pytest.fixture
def proxy_factory(moto_url):
    made: list[CuttingProxy] = []

    def make(**kw) -> CuttingProxy:
        p = CuttingProxy(int(moto_url.rsplit(":", 1)[1]), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


# -- tests ------------------------------------------------------------------------------------


def test_training_and_eval_from_s3_match_the_local_copy(tmp_path, cifar_images, moto_url, monkeypatch):
    local = tmp_path / "train"
    write_split(local, UNEVEN, cifar_images)
    url = upload(local, moto_url, "lccn-match")
    n = sum(UNEVEN)
    view = shifted_view(n, cifar_images)
    cfg = replace(CFG, num_workers=2)  # forked loader workers (2 per rank in epoch 2), own clients

    # endpoint from the standard environment variable (as on a cluster node)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    remote, loaders = run_ranks(url, view, cfg, world=2, epoch=2)
    want, _ = run_ranks(local, view, cfg, world=2, epoch=2)
    for r in range(2):
        assert len(remote[r]) == len(want[r])
        for a, b in zip(remote[r], want[r]):
            assert torch.equal(a.idx, b.idx) and torch.equal(a.images, b.images)
            assert torch.equal(a.observed, b.observed) and torch.equal(a.valid, b.valid)
    got = np.sort(np.concatenate([valid_idx(b) for b in remote]))
    assert np.array_equal(got, np.arange(n))
    assert sum(ld.stats["shards"] for ld in loaders) == len(UNEVEN)
    assert all(ld.stats["read_retries"] == 0 and ld.stats["checksum_mismatch"] == 0
               and ld.stats["skipped_tar"] == 0 for ld in loaders)

    # endpoint from the config field, nothing in the environment
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    ev = list(make_eval_loader(url, view, replace(cfg, s3_endpoint_url=moto_url)))
    ev_local = list(make_eval_loader(local, view, cfg))
    assert len(ev) == len(ev_local)
    assert all(torch.equal(a.idx, b.idx) and torch.equal(a.images, b.images)
               for a, b in zip(ev, ev_local))


def test_missing_key_or_wrong_size_fails_naming_it(tmp_path, cifar_images, moto_url):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    url = upload(tmp_path / "train", moto_url, "lccn-missing")
    view = shifted_view(sum(UNEVEN), cifar_images)
    cfg = replace(CFG, s3_endpoint_url=moto_url)
    c = s3.client(endpoint_url=moto_url)
    c.delete_object(Bucket="lccn-missing", Key="train/train-000003.tar")
    with pytest.raises(ManifestError, match=r"s3://lccn-missing/train/train-000003\.tar: no such key"):
        make_train_loader(url, view, cfg, rank=0, world_size=1, epoch=0)
    # a shard replaced by one of another size
    c.put_object(Bucket="lccn-missing", Key="train/train-000003.tar", Body=b"x" * 10)
    with pytest.raises(ManifestError, match=r"train-000003\.tar: size 10 != manifest"):
        make_train_loader(url, view, cfg, rank=0, world_size=1, epoch=0)
    # no manifest under the prefix; a bucket that does not exist
    with pytest.raises(ManifestError, match=r"s3://lccn-missing/nope/manifest\.json: no such key"):
        make_train_loader("s3://lccn-missing/nope", view, cfg, rank=0, world_size=1, epoch=0)
    with pytest.raises(ManifestError, match=r"s3://lccn-no-bucket/train/manifest\.json: no such bucket"):
        make_train_loader("s3://lccn-no-bucket/train", view, cfg, rank=0, world_size=1, epoch=0)


def test_dropped_connection_mid_shard_resumes_and_yields_every_sample_once(
        tmp_path, cifar_images, moto_url, proxy_factory, caplog):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    url = upload(tmp_path / "train", moto_url, "lccn-drop")
    n = sum(UNEVEN)
    view = shifted_view(n, cifar_images)
    # the response of shard 1 (30 samples) is cut after 20,000 bytes once; the manifest's
    # after 600 bytes, once
    proxy = proxy_factory(cuts={b"GET /lccn-drop/train/train-000001.tar ": (1, 20_000),
                                b"GET /lccn-drop/train/manifest.json ": (1, 600)})
    cfg = replace(CFG, s3_endpoint_url=proxy.url, s3_retries=3)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.s3"):
        batches, loaders = run_ranks(url, view, cfg, world=1)
    assert proxy.cut_done == 2 and all(v == 0 for v in proxy.cuts.values())
    got = valid_idx(batches[0])
    assert len(got) == n and np.array_equal(np.sort(got), np.arange(n))  # each exactly once
    st = loaders[0].stats
    assert st["read_retries"] == 1  # the shard's resume (the manifest's retry was before)
    assert st["skipped_tar"] == st["missing"] == st["padded"] == st["checksum_mismatch"] == 0
    want, _ = run_ranks(tmp_path / "train", view, CFG, world=1)
    assert all(torch.equal(a.images, b.images) and torch.equal(a.idx, b.idx)
               for a, b in zip(batches[0], want[0]))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("s3://lccn-drop/train/train-000001.tar: read broke at byte" in m
               and "retry 1 of 3" in m for m in msgs), msgs
    assert any("s3://lccn-drop/train/manifest.json: GET failed" in m for m in msgs), msgs


def test_a_connection_that_keeps_dropping_exhausts_the_retry_budget(
        tmp_path, cifar_images, moto_url, proxy_factory, caplog):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    url = upload(tmp_path / "train", moto_url, "lccn-flaky")
    n = sum(UNEVEN)
    view = shifted_view(n, cifar_images)
    # every GET of shard 1 (the resumed, ranged ones too) is cut after 8,000 bytes
    proxy = proxy_factory(cuts={b"GET /lccn-flaky/train/train-000001.tar ": (1000, 8_000)})
    cfg = replace(CFG, s3_endpoint_url=proxy.url, s3_retries=2)
    with caplog.at_level(logging.WARNING):
        batches, loaders = run_ranks(url, view, cfg, world=1)
    st = loaders[0].stats
    assert proxy.cut_done == 3  # the first try and 2 retries
    assert st["read_retries"] == 2 and st["skipped_tar"] == 1
    got = valid_idx(batches[0])
    assert len(got) == len(set(got.tolist()))  # no sample twice
    assert st["missing"] == n - len(got) > 0 and st["padded"] == st["missing"]
    assert set(range(0, 7)) | set(range(37, n)) <= set(got.tolist())  # the other shards are whole
    msgs = [r.getMessage() for r in caplog.records]
    assert any("s3://lccn-flaky/train/train-000001.tar" in m and "after 2 retries" in m
               for m in msgs), msgs


def test_config_and_library_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match="s3_endpoint_url must be an http"):
        LoaderConfig(s3_endpoint_url="127.0.0.1:9000")
    with pytest.raises(ValueError, match="s3_retries must be >= 0"):
        LoaderConfig(s3_retries=-1)
    with pytest.raises(ValueError, match="needs a bucket and a key"):
        s3.parse_url("s3://bucket-only")
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if boto3 were not installed
    with pytest.raises(ImportError, match=r"reading s3:// sources needs boto3.*lccn-pipeline\[s3\]"):
        s3.client(endpoint_url="http://127.0.0.1:1", timeout_s=1.5)


def test_job_flag_sets_the_endpoint_of_the_run(tmp_path):
    from lccn_jobs.datasets import CIFAR
    from lccn_jobs.driver import dist_config

    args = CIFAR.get_args_parser().parse_args(
        ["--train-shards", "s3://lccn/cifar10/train", "--s3-endpoint-url", "http://127.0.0.1:9000",
         "--run-dir", str(tmp_path)])
    dist = dist_config(args, CIFAR.config(args), run_name="r", train=args.train_shards,
                       test=None, class_names=[], transform="cifar")
    assert dist.s3_endpoint_url == "http://127.0.0.1:9000"
    assert dist.train_source == "s3://lccn/cifar10/train"


def test_upload_command_puts_the_shards_then_the_manifest(tmp_path, cifar_images, moto_url, capsys):
    write_split(tmp_path / "train", UNEVEN, cifar_images)
    c = s3.client(endpoint_url=moto_url)
    c.create_bucket(Bucket="lccn-upload")
    assert s3.main(["upload", str(tmp_path / "train"), "s3://lccn-upload/c10/train/",
                    "--endpoint-url", moto_url]) == 0
    assert f"uploaded {len(UNEVEN) + 1} objects" in capsys.readouterr().out
    listed = c.list_objects_v2(Bucket="lccn-upload", Prefix="c10/train/")["Contents"]
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in listed)
    assert names == sorted([f"train-{i:06d}.tar" for i in range(len(UNEVEN))] + ["manifest.json"])
    body = c.get_object(Bucket="lccn-upload", Key="c10/train/train-000002.tar")["Body"].read()
    assert body == (tmp_path / "train" / "train-000002.tar").read_bytes()
    (tmp_path / "train" / "train-000002.tar").write_bytes(b"short")  # no longer its manifest's
    with pytest.raises(ManifestError, match=r"train-000002\.tar: size 5 != manifest"):
        s3.main(["upload", str(tmp_path / "train"), "s3://lccn-upload/c10/again",
                 "--endpoint-url", moto_url])


def test_an_object_replaced_mid_read_is_not_spliced(moto_url, proxy_factory):
    c = s3.client(endpoint_url=moto_url)
    c.create_bucket(Bucket="lccn-changed")
    old = bytes(range(256)) * 400  # 102,400 bytes
    c.put_object(Bucket="lccn-changed", Key="s/x.tar", Body=old)
    proxy = proxy_factory(cuts={b"GET /lccn-changed/s/x.tar ": (1, 30_000)})
    reader = s3.ObjectReader("s3://lccn-changed/s/x.tar", s3=s3.client(endpoint_url=proxy.url),
                             retry=s3.Retry(3, backoff_s=0.01))
    assert reader.read(1000) == old[:1000]
    c.put_object(Bucket="lccn-changed", Key="s/x.tar", Body=b"y" * len(old))  # same size, new bytes
    with pytest.raises(s3.S3Error, match=r"s3://lccn-changed/s/x\.tar: the object changed while"):
        while reader.read(4096):
            pass
    assert reader.retries == 1 and 1000 <= reader.offset < len(old)
