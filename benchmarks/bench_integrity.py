"""What the default integrity checks cost: sha256 of every shard against its manifest.

On the real CIFAR-10 JPEG tree converted to shards (train split, 50,000 images), measures

1. hashing every training shard once (what a run pays per process: the loader of each rank
   hashes each shard once, then only when a shard's size/mtime/ctime changes);
2. building a loader again in the same process (cached: no hashing);
3. the driver's label read (``shards.labelview.read_split_labels``) without and with the
   checksum pass;
4. one training epoch of the shard stream (decode + augment, 1 rank, in-process reader),
   the work the hashing is compared with.

Prints a Markdown table; ``--results FILE`` also writes it there.

    python benchmarks/bench_integrity.py [--data DIR] [--results benchmarks/results/integrity.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from pipeline.data import stream as data  # noqa: E402
from pipeline.data.manifest import Manifest  # noqa: E402
from pipeline.data.split_labels import read_split_labels  # noqa: E402
from pipeline.data.stream import LoaderConfig, make_train_loader  # noqa: E402
from shards import imagefolder  # noqa: E402


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path(os.environ.get(
        "LCCN_SHARED_DATA", REPO.parent / "shared" / "data")),
        help="folder holding cifar10-jpeg.tar.gz (default $LCCN_SHARED_DATA)")
    p.add_argument("--results", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in
                               ["benchmarks/bench_integrity.py", *(argv or sys.argv[1:])])
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        tmp = Path(tmp)
        with tarfile.open(args.data / "cifar10-jpeg.tar.gz") as tar:
            tar.extractall(tmp / "c10", filter="data")
        src = next(c for c in [tmp / "c10", *(tmp / "c10").iterdir()] if (c / "train").is_dir())
        imagefolder.convert(src, tmp / "shards", splits=["train"], workers=1, progress=False)
        split = tmp / "shards" / "train"
        man = Manifest.load(split)
        mb = sum(s.bytes for s in man.shards) / 1e6
        n = man.num_samples
        rows = []

        def verify():
            data._VERIFIED.clear()
            data.verify_source(split, man, cfg=LoaderConfig())

        _, wall, cpu = timed(verify)
        rows.append(("sha256 of every shard (first loader of a process)", wall, cpu,
                     f"{mb / wall:.0f} MB/s"))
        _, wall, cpu = timed(lambda: data.verify_source(split, man, cfg=LoaderConfig()))
        rows.append(("the same, later loaders of that process (cached)", wall, cpu, ""))
        _, wall, cpu = timed(lambda: read_split_labels(split, checksums=False))
        rows.append(("driver: label read, no checksums", wall, cpu, ""))
        _, wall, cpu = timed(lambda: read_split_labels(split, checksums=True))
        rows.append(("driver: label read with checksums (the jobs' default)", wall, cpu, ""))
        cfg = LoaderConfig(batch_size=128, num_workers=0, shuffle_buffer=1000, preset="cifar",
                           verify_checksums=False)

        def epoch():
            loader = make_train_loader(split, None, cfg, rank=0, world_size=1, epoch=0)
            return sum(len(b.idx) for b in loader)

        count, wall_epoch, cpu_epoch = timed(epoch)
        rows.append((f"one training epoch of the stream ({count} samples, decode + augment)",
                     wall_epoch, cpu_epoch, f"{count / wall_epoch:.0f} samples/s"))
    hash_wall = rows[0][1]
    table = ("| what | wall s | CPU s | rate |\n|---|---|---|---|\n"
             + "".join(f"| {w} | {s:.2f} | {c:.2f} | {r} |\n" for w, s, c, r in rows))
    share = 100 * hash_wall / wall_epoch
    md = (f"# Integrity checks: what sha256 verification costs\n\n"
          f"Command: `{cmd}`\n\n"
          f"Machine: {os.cpu_count()} CPUs, {platform.platform()}, Python "
          f"{platform.python_version()}; 1-minute load average {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after (a shared VM). CIFAR-10 train split: {n} JPEGs in "
          f"{len(man.shards)} shards, {mb:.1f} MB (files in the page cache, as right after "
          f"conversion or a first epoch).\n\n{table}\n"
          f"Hashing every shard once costs {share:.1f}% of one epoch of the stream on this "
          f"split. Each rank's loader pays it once per process (the first epoch, or the first "
          f"epoch after a restart); later epochs only stat the files. The driver's label "
          f"read adds the same hashing once before the run starts, where a corrupt shard "
          f"stops the job with one line naming it.\n")
    print(md)
    if args.results is not None:
        args.results.write_text(md)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
