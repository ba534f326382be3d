"""Conversion throughput of the image-folder converter (shards.imagefolder -> shards.writer).

Cases:
1. the real CIFAR-10 JPEG tree (60,000 32x32 JPEGs, original bytes kept), extracted to a
   temporary folder first, with 1 and 2 writer processes;
2. generated 500x375 JPEGs (smooth content plus noise, roughly photo-sized files), with
   ``--resize-short`` (re-encode to JPEG, shorter side N) and, for reference, without.

Every run writes into a fresh output folder (nothing is resumed). Prints a table; with
``--results FILE`` also writes it there with the command line (the committed
``benchmarks/results/convert.md`` is only rewritten when named)::

    python benchmarks/bench_convert.py [--data DIR] [--workers 1 2] [--generated 1000]
    python benchmarks/bench_convert.py --results benchmarks/results/convert.md
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import resource
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

from shards import imagefolder  # noqa: E402


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def generate_jpegs(root: Path, n: int, *, seed: int = 0, size=(500, 375)) -> None:
    """``root/train/c<k>/<i>.jpg``: n JPEGs of ``size`` over 10 classes (quality 90)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize(size, Image.Resampling.BICUBIC),
                         dtype=np.float32)
        img += rng.normal(0, 6, img.shape).astype(np.float32)
        out = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
        d = root / "train" / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        out.save(buf, format="JPEG", quality=90)
        (d / f"{i:06d}.jpg").write_bytes(buf.getvalue())


def run_case(name: str, src: Path, out: Path, *, workers: int, shard_size: int,
             resize_short: int | None) -> dict:
    if out.exists():
        shutil.rmtree(out)
    in_bytes = tree_bytes(src)
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    ms = imagefolder.convert(src, out, shard_size=shard_size, workers=workers,
                             resize_short=resize_short, progress=False)
    dt = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0  # the pool's processes are reaped when convert returns
    n = sum(m.num_samples for m in ms.values())
    out_bytes = sum(s.bytes for m in ms.values() for s in m.shards)
    row = {"case": name, "workers": workers, "resize": resize_short or "-", "samples": n,
           "seconds": dt, "samples_s": n / dt, "in_mb_s": in_bytes / 1e6 / dt,
           "in_mb": in_bytes / 1e6, "out_mb": out_bytes / 1e6, "cpu": cpu,
           "samples_cpu_s": n / cpu}
    print(f"  {name:<22} workers={workers} resize={row['resize']}: {n} samples in {dt:.1f} s"
          f" = {row['samples_s']:.0f} samples/s, {row['in_mb_s']:.1f} MB/s in; "
          f"{cpu:.1f} CPU s = {row['samples_cpu_s']:.0f} samples/CPU-s", flush=True)
    shutil.rmtree(out)
    return row


def table(rows: list[dict]) -> str:
    head = ("| case | workers | resize_short | samples | seconds | samples/s | MB/s (input) "
            "| CPU s | samples/CPU-s | input MB | shard MB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['case']} | {r['workers']} | {r['resize']} | {r['samples']} | {r['seconds']:.1f} "
        f"| {r['samples_s']:.0f} | {r['in_mb_s']:.1f} | {r['cpu']:.1f} "
        f"| {r['samples_cpu_s']:.0f} | {r['in_mb']:.1f} | {r['out_mb']:.1f} |\n"
        for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data",
                   help="shared data folder holding cifar10-jpeg.tar.gz")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--generated", type=int, default=1000, help="number of 500x375 JPEGs")
    p.add_argument("--resize-short", type=int, default=256)
    p.add_argument("--tmp", type=Path, default=None, help="scratch folder (default: system)")
    p.add_argument("--results", type=Path, default=None,
                   help="also write the table here (default: print only)")
    args = p.parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in
                               ["benchmarks/bench_convert.py", *(argv or sys.argv[1:])])
    rows: list[dict] = []
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench-convert-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        with tarfile.open(args.data / "cifar10-jpeg.tar.gz") as tar:
            tar.extractall(tmp / "c10", filter="data")
        t_extract = time.perf_counter() - t0
        src = next(c for c in [tmp / "c10", *(tmp / "c10").iterdir()] if (c / "train").is_dir())
        print(f"extracted cifar10-jpeg.tar.gz in {t_extract:.1f} s", flush=True)
        for w in args.workers:
            rows.append(run_case("cifar10-jpeg (60k 32x32)", src, tmp / "out", workers=w,
                                 shard_size=args.shard_size, resize_short=None))
        gen = tmp / "gen"
        t0 = time.perf_counter()
        generate_jpegs(gen, args.generated)
        print(f"generated {args.generated} 500x375 JPEGs in {time.perf_counter() - t0:.1f} s",
              flush=True)
        label = f"generated 500x375 ({args.generated})"
        for w in args.workers:
            rows.append(run_case(label, gen, tmp / "out", workers=w,
                                 shard_size=args.shard_size, resize_short=args.resize_short))
        rows.append(run_case(label, gen, tmp / "out", workers=max(args.workers),
                             shard_size=args.shard_size, resize_short=None))
    text = table(rows)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n" + text)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    md = (f"# Shard conversion throughput (image-folder converter)\n\n"
          f"Command: `{cmd}`\n\n"
          f"Machine: {cpus} CPUs, {platform.platform()}, Python {platform.python_version()}, "
          f"Pillow {PIL.__version__}. Extracting the CIFAR-10 JPEG archive took "
          f"{t_extract:.1f} s (not included below). 1-minute load average "
          f"{load_before:.1f} before, {load_after:.1f} after (other jobs share the "
          f"machine when it is above the CPU count).\n\n"
          f"samples/s and MB/s count source images read, validated (PIL open + verify), "
          f"re-encoded where resized, and written to fsynced tar shards "
          f"(shard size {args.shard_size}); times include process-pool start-up. "
          f"CPU s is the user + system time of the converter and its worker processes; "
          f"samples/CPU-s is the throughput one uncontended core would give.\n\n" + text)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(md)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
