"""Read throughput of shards from an S3-compatible server (moto, on 127.0.0.1) vs local files.

Real CIFAR-10 JPEGs (the first ``--samples`` training images of ``cifar10-jpeg.tar.gz``)
are written as shards of ``--shard-size`` samples with ``shards.writer``, uploaded to a moto
S3 server started here (``python -m moto.server``, its own process) with
``pipeline.data.s3.upload_split``, and read back three ways from each source:

1. bytes: every shard read front to back (``pipeline.data.s3.ObjectReader`` vs ``open``), MB/s;
2. tar: the same plus WebDataset's tar reader and grouping (no decode), samples/s;
3. loader: one training epoch of ``pipeline.data.stream.make_train_loader`` (decode + augment,
   sha256 checked; in-process reader and ``--workers`` loader processes), samples/s.

Passes alternate local / s3 and each figure is the median of ``--passes``. moto is a
Python server (werkzeug), so its figures are a floor for a real object store, and on a
machine shared with other jobs the server competes with the reader for the cores.

    python benchmarks/bench_s3.py [--data DIR] [--samples 10000] [--results benchmarks/results/s3.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from pipeline.data import s3  # noqa: E402
from pipeline.data.manifest import Manifest  # noqa: E402
from pipeline.data.stream import LoaderConfig, make_train_loader  # noqa: E402


def cifar_records(archive: Path, n: int) -> list:
    """The first ``n`` training JPEGs of the archive as ``SampleRecord``s (original bytes)."""
    from shards.writer import SampleRecord

    classes = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck")
    out = []
    with tarfile.open(archive, "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and len(parts) >= 3 and parts[-3] == "train" and parts[-2] in classes:
                c = classes.index(parts[-2])
                out.append(SampleRecord(idx=len(out), label=c, clean=c, key=m.name,
                                        data=tar.extractfile(m).read()))
                if len(out) == n:
                    break
    if len(out) < n:
        raise SystemExit(f"{archive}: only {len(out)} training JPEGs, --samples {n} asked")
    return out


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("moto server did not start")


def read_bytes(urls: list[str], endpoint: str) -> int:
    total = 0
    for u in urls:
        if u.startswith("s3://"):
            f = s3.ObjectReader(u, s3=s3.client(endpoint_url=endpoint), retry=s3.Retry(0))
        else:
            f = open(u, "rb")
        with f:
            while block := f.read(1 << 20):
                total += len(block)
    return total


def read_tar(urls: list[str], endpoint: str) -> int:
    from webdataset.tariterators import group_by_keys, tar_file_expander

    def streams():
        for u in urls:
            if u.startswith("s3://"):
                yield {"url": u, "stream": s3.ObjectReader(u, s3=s3.client(endpoint_url=endpoint),
                                                           retry=s3.Retry(0))}
            else:
                yield {"url": u, "stream": open(u, "rb")}

    return sum(1 for _ in group_by_keys(tar_file_expander(streams())))


def loader_pass(source: str, cfg: LoaderConfig) -> int:
    loader = make_train_loader(source, None, cfg, rank=0, world_size=1, epoch=0)
    n = sum(int(b.valid.sum()) for b in loader)
    assert loader.stats["read_retries"] == 0 and loader.stats["missing"] == 0, loader.stats
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path(os.environ.get(
        "LCCN_SHARED_DATA", REPO.parent / "shared" / "data")),
        help="folder holding cifar10-jpeg.tar.gz (default $LCCN_SHARED_DATA)")
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--workers", type=int, default=1, help="loader processes of the 'loader' row")
    p.add_argument("--results", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_s3.py", *(argv or sys.argv[1:])])
    import torch

    torch.set_num_threads(1)
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    load0 = os.getloadavg()[0]
    from shards.writer import WriterOptions, write_split

    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        records = cifar_records(args.data / "cifar10-jpeg.tar.gz", args.samples)
        manifest = write_split(records, tmp, dataset="cifar10", split="train",
                               classes=[str(c) for c in range(10)],
                               options=WriterOptions(shard_size=args.shard_size, progress=False))
        local = Path(tmp) / "train"
        nbytes = sum(sh.bytes for sh in manifest.shards)
        proc, endpoint = start_moto()
        try:
            c = s3.client(endpoint_url=endpoint)
            c.create_bucket(Bucket="bench")
            t0 = time.perf_counter()
            s3.upload_split(local, "s3://bench/train", s3=c)
            upload_s = time.perf_counter() - t0
            remote = "s3://bench/train"
            m = Manifest.load(local)
            urls = {"local": m.urls(str(local)), "s3": m.urls(remote)}
            src = {"local": str(local), "s3": remote}
            cfgs = {w: LoaderConfig(batch_size=128, num_workers=w, shuffle_buffer=1000,
                                    preset="cifar", s3_endpoint_url=endpoint) for w in (0, args.workers)}
            rows: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.passes):
                for where in ("local", "s3"):
                    for what, fn in (("bytes (read only)", lambda: read_bytes(urls[where], endpoint)),
                                     ("tar (read + group, no decode)", lambda: read_tar(urls[where], endpoint)),
                                     *((f"loader epoch, {w} workers (decode + augment + sha256)",
                                        (lambda w=w: loader_pass(src[where], cfgs[w])))
                                       for w in sorted(set(cfgs)))):
                        t0 = time.perf_counter()
                        out = fn()
                        dt = time.perf_counter() - t0
                        want = nbytes if what.startswith("bytes") else args.samples
                        if out != want:
                            raise SystemExit(f"{where} {what}: {out} read, {want} expected")
                        rows.setdefault((what, where), []).append(dt)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    load1 = os.getloadavg()[0]

    lines = [
        "# Shard read throughput: S3-compatible server (moto) vs local files",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, "
        f"load average {load0:.1f} at the start and {load1:.1f} at the end (other jobs shared "
        "the cores). torch threads = 1. The moto server (its own process, werkzeug, "
        "http://127.0.0.1) and the reader share those cores.",
        "",
        f"Data: the first {args.samples} CIFAR-10 training JPEGs (32x32) in "
        f"{len(manifest.shards)} shards of {args.shard_size}, {nbytes / 1e6:.1f} MB in all; "
        f"upload with `pipeline.data.s3.upload_split` took {upload_s:.1f} s. Median of "
        f"{args.passes} passes, local and s3 alternating.",
        "",
        "| read | source | MB/s | samples/s | s3 / local |",
        "|---|---|---|---|---|",
    ]
    for what in dict.fromkeys(w for w, _ in rows):
        med = {where: statistics.median(rows[(what, where)]) for where in ("local", "s3")}
        for where in ("local", "s3"):
            t = med[where]
            ratio = "" if where == "local" else f"{med['local'] / t:.2f}"
            lines.append(f"| {what} | {where} | {nbytes / 1e6 / t:.1f} | {args.samples / t:.0f} | {ratio} |")
    lines += [
        "",
        "samples/s of the bytes row: the same bytes expressed as samples. sha256: local shards "
        "are hashed before the first batch once per process (so in the first pass only), s3 "
        "shards while they stream, in every pass.",
        "",
        "Reading: the raw byte rate from moto is what one Python server on a loaded 2-core "
        "machine gives, not what S3 or MinIO would; what matters for training is the loader "
        "rows, where decode and augment dominate and the s3 source costs what the ratio column "
        "says. Re-measure against your own store with `--samples` scaled up.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
