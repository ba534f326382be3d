"""Loader throughput: decode + augment from WebDataset shards vs torchvision ImageFolder.

Measures samples/s of one pass over the same JPEGs, with the same transform preset, with
``num_workers=0`` (all in one process, i.e. one core) and ``num_workers=1`` (one loader
process plus the training process), for

* CIFAR-10 32x32 JPEGs (the real ones, ``cifar10-jpeg.tar.gz``), preset ``cifar``;
* 341x256 JPEGs (``--big-n`` generated 500x375 images resized to a 256 short side, as a
  Clothing1M/WebVision converter with ``resize_short=256`` stores them), preset ``clothing1m``;

and for the second set once more under pillow-simd when it is importable (``--simd-path DIR``
points at a ``pip install --target DIR pillow-simd``; the shared venv is left alone).

"per CPU-s" divides the samples by the CPU seconds of the training process and its loader
workers together, so it is the per-core rate even when other jobs share the machine; "wall"
is samples / elapsed seconds. Prints a table and writes it, with the command line, to
``benchmarks/results/loader.md``.

    python benchmarks/bench_loader.py [--data DIR] [--cifar-n 10000] [--big-n 2000]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
GPU_NEEDS = {  # images/s one modern GPU trains at: assumed ranges (public figures), not measured
    "cifar": ("PreAct ResNet-32 at 32x32 (a small model)", 10000, 25000),
    "clothing1m": ("ResNet-50 at 224x224", 1000, 2000),
}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path,
                   default=Path(__file__).resolve().parents[1].parent / "shared" / "data")
    p.add_argument("--cifar-n", type=int, default=10000, help="CIFAR-10 train images to use")
    p.add_argument("--big-n", type=int, default=2000, help="generated 500x375 JPEGs")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2,
                   help="passes per configuration (PIL variants alternate); the table shows medians")
    p.add_argument("--simd-path", type=Path, default=None,
                   help="a `pip install --target` folder holding pillow-simd")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the report here (benchmarks/results/loader.md to update the "
                        "committed figures; default: print only)")
    p.add_argument("--worker-json", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    return p


# -- data preparation ---------------------------------------------------------------------------


def extract_cifar(archive: Path, dest: Path, n: int) -> Path:
    """The first ``n // 10`` training JPEGs of every class as ``dest/train/<class>/NNNN.jpg``."""
    per_class = n // 10
    got = 0
    with tarfile.open(archive, "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if (len(parts) >= 3 and parts[-3] == "train" and parts[-2] in CIFAR10_CLASSES
                    and m.isfile() and int(parts[-1].split(".")[0]) < per_class):
                out = dest / "train" / parts[-2] / parts[-1]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(m).read())
                got += 1
                if got == per_class * 10:
                    break
    if got != per_class * 10:
        raise SystemExit(f"{archive}: found {got} of {per_class * 10} training JPEGs")
    return dest


def make_big_jpegs(cifar: Path, dest: Path, n: int) -> Path:
    """``n`` 500x375 photos-like JPEGs (upscaled CIFAR + sensor-like noise), then resized to a
    256 short side (341x256, quality 90) into ``dest/train/<class>/``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    files = sorted((cifar / "train").glob("*/*.jpg"))
    for i in range(n):
        src = files[i % len(files)]
        im = Image.open(src).convert("RGB").resize((500, 375), Image.BICUBIC)
        px = np.asarray(im, np.int16) + rng.normal(0, 6, (375, 500, 3)).astype(np.int16)
        big = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        big.save(buf, format="JPEG", quality=90)  # the 500x375 "original"
        small = Image.open(buf).convert("RGB").resize((341, 256), Image.BILINEAR)
        out = dest / "train" / src.parent.name / f"{i:05d}.jpg"
        out.parent.mkdir(parents=True, exist_ok=True)
        small.save(out, format="JPEG", quality=90)
    return dest


def build_shards(tree: Path, out: Path, *, shard_size: int) -> tuple[Path, str]:
    """Shards of ``tree/train``; ``shards.imagefolder.convert`` when present, else a minimal
    writer of our own. Returns (split dir, which writer)."""
    try:
        from shards.imagefolder import convert
    except ImportError:
        convert = None
    if convert is not None:
        convert(tree, out, splits=["train"], shard_size=shard_size, progress=False)
        return out / "train", "shards.imagefolder.convert"
    import webdataset as wds

    from pipeline.data.manifest import Manifest, ShardInfo, sample_key, sha256_file

    split = out / "train"
    split.mkdir(parents=True, exist_ok=True)
    classes = sorted(p.name for p in (tree / "train").iterdir())
    files = [(c, p) for c, name in enumerate(classes) for p in sorted((tree / "train" / name).iterdir())]
    shards = []
    for s in range(0, len(files), shard_size):
        path = split / f"train-{s // shard_size:06d}.tar"
        with wds.TarWriter(str(path)) as w:
            for idx, (c, p) in enumerate(files[s:s + shard_size], start=s):
                w.write({"__key__": sample_key(idx), "jpg": p.read_bytes(),
                         "json": {"idx": idx, "label": c, "clean": c, "key": p.name}})
        shards.append(ShardInfo(path.name, len(files[s:s + shard_size]), sha256_file(path),
                                path.stat().st_size))
    Manifest(dataset="bench", split="train", classes=classes, shards=shards).save(split)
    return split, "own minimal writer"


# -- measurements ---------------------------------------------------------------------------------


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped loader workers
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(batches) -> tuple[int, float, float]:
    t0, c0 = time.perf_counter(), _cpu_now()
    n = sum(len(b[0]) for b in batches)
    return n, time.perf_counter() - t0, _cpu_now() - c0


def bench_shards(split: Path, preset: str, workers: int, batch_size: int) -> tuple[int, float, float]:
    from pipeline.data.stream import LoaderConfig, make_train_loader

    cfg = LoaderConfig(batch_size=batch_size, num_workers=workers, shuffle_buffer=1000,
                       preset=preset, seed=0)
    loader = make_train_loader(split, None, cfg, rank=0, world_size=1, epoch=0)
    return _timed(iter(loader))


def bench_imagefolder(tree: Path, preset: str, workers: int, batch_size: int) -> tuple[int, float, float]:
    import torch
    from torchvision.datasets import ImageFolder

    from pipeline.data.transforms import build_transform

    ds = ImageFolder(str(tree / "train"), transform=build_transform(preset, train=True))
    dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                     generator=torch.Generator().manual_seed(0))
    return _timed(iter(dl))


def bench_tar_read(split: Path) -> tuple[int, float, float]:
    """Reading the tar shards only (no decode): the IO ceiling."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    urls = sorted(str(p) for p in split.glob("*.tar"))
    srcs = ({"url": u, "stream": open(u, "rb")} for u in urls)
    return _timed(([(None,)] for _ in group_by_keys(tar_file_expander(srcs))))  # 1 per sample


def bench_pil_ops(tree: Path, n: int = 300) -> list[tuple[str, int, float, float]]:
    """Per-operation rates of this PIL on the 341x256 JPEGs: what pillow-simd changes."""
    from PIL import Image, ImageEnhance

    data = [p.read_bytes() for p in sorted((tree / "train").glob("*/*.jpg"))[:n]]
    im = Image.open(io.BytesIO(data[0])).convert("RGB")
    ops = [("PIL op: JPEG decode", lambda d: Image.open(io.BytesIO(d)).convert("RGB")),
           ("PIL op: resize 341x256 -> 298x224", lambda d: im.resize((298, 224), Image.BILINEAR)),
           ("PIL op: saturation blend", lambda d: ImageEnhance.Color(im).enhance(1.3))]
    def run(fn):  # one single-sample "batch" per image, as _timed counts them
        for d in data:
            fn(d)
            yield [(None,)]

    return [(name, *_timed(run(fn))) for name, fn in ops]


def run_suite(tmp: Path, args, only: str | None) -> list[dict]:
    """All measurements of this interpreter's PIL; ``only="big"`` for the pillow-simd pass."""
    import PIL
    import torch

    torch.set_num_threads(1)
    pil = f"pillow-simd {PIL.__version__}" if _is_simd() else f"pillow {PIL.__version__}"
    sets = [("cifar10 32x32", tmp / "cifar", tmp / "cifar-shards" / "train", "cifar"),
            ("341x256 (256 short side)", tmp / "big", tmp / "big-shards" / "train", "clothing1m")]
    rows = []
    for name, tree, split, preset in sets:
        if only == "big" and preset != "clothing1m":
            continue
        if preset == "clothing1m":
            for op, n, wall, cpu in bench_pil_ops(tree):
                rows.append(dict(images=name, preset=preset, loader=op, workers=0, pil=pil,
                                 n=n, wall=wall, cpu=cpu))
        n, wall, cpu = bench_tar_read(split)
        rows.append(dict(images=name, preset=preset, loader="tar read only (no decode)",
                         workers=0, pil=pil, n=n, wall=wall, cpu=cpu))
        for workers in (0, 1):
            for loader, fn, src in (("WebDataset shards (pipeline.data.stream)", bench_shards, split),
                                    ("torchvision ImageFolder", bench_imagefolder, tree)):
                n, wall, cpu = fn(src, preset, workers, args.batch_size)
                rows.append(dict(images=name, preset=preset, loader=loader, workers=workers,
                                 pil=pil, n=n, wall=wall, cpu=cpu))
                print(f"  {name:26s} {loader:34s} w={workers} {pil:22s} "
                      f"{n / wall:8.0f}/s wall {n / cpu:8.0f}/CPU-s", flush=True)
    return rows


def _is_simd() -> bool:
    import PIL

    return any(Path(PIL.__file__).parents[1].glob("pillow_simd-*.dist-info")) or "post" in PIL.__version__


def aggregate(runs: list[dict]) -> list[dict]:
    """Median rates per configuration over the repeated passes, in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["images"], r["preset"], r["loader"], r["workers"], r["pil"]), []).append(r)
    out = []
    for key, rs in groups.items():
        out.append(dict(zip(("images", "preset", "loader", "workers", "pil"), key),
                        n=rs[0]["n"], runs=len(rs),
                        wall_rate=float(np.median([r["n"] / r["wall"] for r in rs])),
                        cpu_rate=float(np.median([r["n"] / r["cpu"] for r in rs]))))
    return sorted(out, key=lambda r: (r["preset"] != "cifar", r["pil"], r["loader"], r["workers"]))


def report(rows: list[dict], *, simd_note: str, writer: str, argv: list[str], load: tuple) -> str:
    lines = [
        "# Loader throughput: WebDataset shards vs ImageFolder",
        "",
        "Command: `python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_loader.py", *argv]) + "`",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load "
        f"average {load[0]:.1f} at the start and {load[1]:.1f} at the end (other jobs shared the "
        f"cores: the per-CPU-s column is the per-core figure, wall is what this machine gave). "
        f"torch threads = 1; batch size 128; shards written by {writer}. Each pass runs in a fresh "
        f"interpreter; PIL variants alternate; medians of the passes.",
        f"pillow-simd: {simd_note}.",
        "",
        "| images | preset | loader | workers | PIL | samples | passes | samples/s wall | samples/CPU-s (per core) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['images']} | {r['preset']} | {r['loader']} | {r['workers']} | {r['pil']} "
                     f"| {r['n']} | {r['runs']} | {r['wall_rate']:.0f} | {r['cpu_rate']:.0f} |")
    lines += ["", "## Cores needed to feed one GPU", ""]
    for preset, (what, lo, hi) in GPU_NEEDS.items():
        best = [r for r in rows if r["preset"] == preset and r["loader"].startswith("WebDataset")]
        for pil in sorted({r["pil"] for r in best}):
            rate = max(r["cpu_rate"] for r in best if r["pil"] == pil)
            lines.append(f"- `{preset}` ({pil}): {rate:.0f} img/s per core (shards, best of "
                         f"workers=0/1); {what} trains at ~{lo}-{hi} img/s on one modern GPU "
                         f"-> **{lo / rate:.1f}-{hi / rate:.1f} loader cores per GPU**.")
    lines.append("")
    return "\n".join(lines)


def _child(tmp: Path, argv: list[str], *, pil_path: Path | None, only: str | None) -> list[dict]:
    """One pass of ``run_suite`` in a fresh interpreter (``pil_path`` first on its path)."""
    out = tmp / "pass.json"
    out.unlink(missing_ok=True)
    path = [str(pil_path)] if pil_path is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)])}
    cmd = [sys.executable, __file__, *argv, "--worker-json", str(out), *(["--only", only] if only else [])]
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"benchmark pass failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    if args.worker_json:  # one pass, in a child interpreter
        rows = run_suite(Path(args.worker_json).parent, args, args.only)
        args.worker_json.write_text(json.dumps(rows))
        return 0
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        extract_cifar(args.data / "cifar10-jpeg.tar.gz", tmp / "cifar", args.cifar_n)
        make_big_jpegs(tmp / "cifar", tmp / "big", args.big_n)
        _, writer = build_shards(tmp / "cifar", tmp / "cifar-shards", shard_size=1000)
        build_shards(tmp / "big", tmp / "big-shards", shard_size=250)
        print(f"prepared {args.cifar_n} CIFAR + {args.big_n} 341x256 JPEGs and their shards "
              f"({writer}) in {time.perf_counter() - t0:.0f} s", flush=True)

        variants: list[tuple[Path | None, str | None]] = [(None, None)]
        if _is_simd():
            simd_note = "this interpreter's PIL is pillow-simd"
        elif args.simd_path is None:
            simd_note = "not installed (pass --simd-path DIR holding `pip install --target DIR pillow-simd`)"
        else:
            variants.append((args.simd_path, "big"))
            simd_note = (f"from --simd-path {args.simd_path} (made with `CC=\"cc -mavx2\" pip install "
                         f"--no-deps --target DIR pillow-simd`), measured on the 341x256 set")
        runs: list[dict] = []
        for rep in range(args.repeats):
            for pil_path, only in variants:
                print(f"pass {rep + 1}/{args.repeats}, PIL from {pil_path or 'the venv'}", flush=True)
                runs += _child(tmp, argv, pil_path=pil_path, only=only)
    if args.simd_path is not None and not any("simd" in r["pil"] for r in runs):
        simd_note = f"not importable from {args.simd_path}"
    text = report(aggregate(runs), simd_note=simd_note, writer=writer, argv=argv,
                  load=(load0, os.getloadavg()[0]))
    print()
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
