"""Loader throughput: the shard stream's decode paths against torchvision's ImageFolder.

Measures samples per CPU-second (and per wall second) of one pass over the same JPEGs, with
the same transform preset, side by side in one run, for

* CIFAR-10 32x32 JPEGs (the real ones, ``cifar10-jpeg.tar.gz``), preset ``cifar``;
* 341x256 JPEGs (``--big-n`` generated 500x375 images resized to a 256 short side, as a
  Clothing1M/WebVision converter with ``resize_short=256`` stores them), preset ``clothing1m``;
* 1024x768 originals (``--draft-n``), preset ``clothing1m`` (resize 256 first): the shard
  stream with and without ``LoaderConfig.jpeg_draft`` (DCT-domain downscale);

and per set: decoding alone (PIL's ``Image.open(...).convert``, and libjpeg-turbo as the
loader's CPU path calls it: the bound), reading the tars alone, the shard stream with
``decode="cpu"`` (``num_workers`` 0 and 1) and ``decode="device"`` on the CPU (0), and
ImageFolder (0 and 1). Every configuration runs once per PIL build: this interpreter's, and
pillow-simd when ``--simd-path DIR`` holds one (``pip install --target DIR pillow-simd``,
see ``scripts/pillow_simd.sh``; the venv is left alone); ``--baseline DIR`` (an export of
another commit of the project, e.g. ``git archive COMMIT pipeline shards | tar -x -C DIR``)
adds that code's shard stream for a before/after.

"per CPU-s" divides the samples by the CPU seconds of the process and its loader workers
together, so it is the per-core rate even when other jobs share the machine; "wall" is
samples / elapsed seconds. Each pass runs in a fresh interpreter, the builds alternate,
the table shows medians. Prints the table and the targets; ``--out`` writes them.

    python benchmarks/bench_loader.py [--data DIR] [--cifar-n 10000] [--big-n 2000]
        [--draft-n 300] [--simd-path DIR] [--baseline DIR] [--repeats 2] [--out FILE]
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
if "--code" not in sys.argv:  # a baseline pass imports the project from --code DIR instead
    sys.path.insert(0, str(REPO))

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
GPU_NEEDS = {  # images/s one modern GPU trains at: assumed ranges (public figures), not measured
    "cifar": ("PreAct ResNet-32 at 32x32 (a small model)", 10000, 25000),
    "clothing1m": ("ResNet-50 at 224x224", 1000, 2000),
}
STREAM = "shard stream, decode=cpu"
DEVICE = "shard stream, decode=device (on the CPU)"
IMAGEFOLDER = "torchvision ImageFolder"
DECODE_PIL = "decode alone: PIL Image.open + convert"
DECODE_TURBO = "decode alone: libjpeg-turbo (the CPU path's decoder)"
TAR = "tar read alone (no decode)"
FLOOR = "decode + preset transform + normalise alone (no loader)"
BASELINE = "shard stream at --baseline"
# glibc's allocator: large blocks from the heap, kept after free (no page faults on every
# batch's float tensor); read from the environment when a process starts
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
MALLOC_NOTE = "MALLOC_MMAP_THRESHOLD_=256MiB"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path,
                   default=Path(__file__).resolve().parents[1].parent / "shared" / "data")
    p.add_argument("--cifar-n", type=int, default=10000, help="CIFAR-10 train images to use")
    p.add_argument("--big-n", type=int, default=2000, help="generated 341x256 JPEGs")
    p.add_argument("--draft-n", type=int, default=300,
                   help="generated 1024x768 JPEGs for the jpeg_draft rows (0: none)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2,
                   help="passes per configuration (PIL builds alternate); the table shows medians")
    p.add_argument("--simd-path", type=Path, default=None,
                   help="a `pip install --target` folder holding pillow-simd")
    p.add_argument("--baseline", type=Path, default=None,
                   help="a folder with another commit's pipeline/ and shards/: its shard stream "
                        "beside this one")
    p.add_argument("--malloc", action="store_true",
                   help=f"also measure the targets' rows with glibc's {MALLOC_NOTE} (and "
                        f"MALLOC_TRIM_THRESHOLD_=1GiB): the float batches without page faults")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the report here (benchmarks/results/loader.md to update the "
                        "committed figures; default: print only)")
    p.add_argument("--worker-json", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--code", type=Path, default=None, help=argparse.SUPPRESS)
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


def make_big_jpegs(cifar: Path, dest: Path, n: int, *, size: tuple[int, int] = (500, 375),
                   stored: tuple[int, int] | None = (341, 256)) -> Path:
    """``n`` photo-like JPEGs of ``size`` (upscaled CIFAR + sensor-like noise, quality 90),
    stored resized to ``stored`` (default: a 256 short side, as a converter with
    ``resize_short=256`` writes them; None: as generated) into ``dest/train/<class>/``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    files = sorted((cifar / "train").glob("*/*.jpg"))
    w, h = size
    for i in range(n):
        src = files[i % len(files)]
        im = Image.open(src).convert("RGB").resize((w, h), Image.BICUBIC)
        px = np.asarray(im, np.int16) + rng.normal(0, 6, (h, w, 3)).astype(np.int16)
        big = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        big.save(buf, format="JPEG", quality=90)  # the "original"
        out = dest / "train" / src.parent.name / f"{i:05d}.jpg"
        out.parent.mkdir(parents=True, exist_ok=True)
        if stored is None:
            out.write_bytes(buf.getvalue())
            continue
        small = Image.open(buf).convert("RGB").resize(stored, Image.BILINEAR)
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


def bench_shards(split: Path, preset: str, workers: int, batch_size: int, *,
                 decode: str = "cpu", jpeg_draft: bool = False) -> tuple[int, float, float]:
    from pipeline.data.stream import LoaderConfig, make_train_loader

    extra = {} if decode == "cpu" and not jpeg_draft else {"decode": decode,
                                                           "jpeg_draft": jpeg_draft}
    cfg = LoaderConfig(batch_size=batch_size, num_workers=workers, shuffle_buffer=1000,
                       preset=preset, seed=0, **extra)
    kw = {} if decode == "cpu" else {"device": "cpu"}
    loader = make_train_loader(split, None, cfg, rank=0, world_size=1, epoch=0, **kw)
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
    """Reading the tar shards only (no decode), with the stream's reader: the IO ceiling."""
    from webdataset.tariterators import group_by_keys

    from pipeline.data.tario import expand_tars

    urls = sorted(str(p) for p in split.glob("*.tar"))
    srcs = ({"url": u, "stream": open(u, "rb")} for u in urls)
    samples = group_by_keys(expand_tars(srcs, handler=lambda e: True))
    return _timed(([(None,)] for _ in samples))  # 1 per sample


def bench_decode(tree: Path, n: int) -> list[tuple[str, int, float, float]]:
    """Decoding alone, one image at a time: PIL's open + convert, and libjpeg-turbo as the
    stream's CPU path calls it."""
    from pipeline.data.jpeg import decode, decode_pil

    data = [p.read_bytes() for p in sorted((tree / "train").glob("*/*.jpg"))[:n]]

    def run(fn):
        for d in data:
            fn(d, "RGB")
            yield [(None,)]

    return [(name, *_timed(run(fn))) for name, fn in ((DECODE_PIL, decode_pil),
                                                       (DECODE_TURBO, decode))]


def bench_floor(tree: Path, preset: str, n: int, batch_size: int) -> tuple[int, float, float]:
    """The work every loader of this preset does, and nothing else: decode (the CPU path's
    decoder), the preset's training transform, stack and normalise each batch."""
    import torch

    from pipeline.data.jpeg import decode
    from pipeline.data.sample_transform import SampleTransform
    from pipeline.data.transforms import build_batch_transform, get_preset

    data = [p.read_bytes() for p in sorted((tree / "train").glob("*/*.jpg"))[:n]]
    mode, t = get_preset(preset).mode, SampleTransform(preset, train=True)
    norm = build_batch_transform(preset)

    def run():
        for i in range(0, len(data), batch_size):
            yield [norm(torch.stack([t(decode(d, mode)) for d in data[i:i + batch_size]]))]

    return _timed(run())


def bench_pil_ops(tree: Path, n: int = 300) -> list[tuple[str, int, float, float]]:
    """Per-operation rates of this PIL on the 341x256 JPEGs: what pillow-simd changes."""
    from PIL import Image, ImageEnhance

    data = [p.read_bytes() for p in sorted((tree / "train").glob("*/*.jpg"))[:n]]
    im = Image.open(io.BytesIO(data[0])).convert("RGB")
    ops = [("PIL op: resize 341x256 -> 298x224", lambda d: im.resize((298, 224), Image.BILINEAR)),
           ("PIL op: saturation blend", lambda d: ImageEnhance.Color(im).enhance(1.3)),
           ("PIL op: brightness blend", lambda d: ImageEnhance.Brightness(im).enhance(0.7))]

    def run(fn):  # one single-sample "batch" per image, as _timed counts them
        for d in data:
            fn(d)
            yield [(None,)]

    return [(name, *_timed(run(fn))) for name, fn in ops]


def _sets(tmp: Path) -> list[tuple[str, Path, Path, str]]:
    out = [("cifar10 32x32", tmp / "cifar", tmp / "cifar-shards" / "train", "cifar"),
           ("341x256 (256 short side)", tmp / "big", tmp / "big-shards" / "train", "clothing1m")]
    if (tmp / "draft-shards" / "train").is_dir():
        out.append(("1024x768 originals", tmp / "draft", tmp / "draft-shards" / "train",
                    "clothing1m"))
    return out


def run_suite(tmp: Path, args, only: str | None) -> list[dict]:
    """All measurements with this interpreter's PIL; ``only="baseline"``: the shard stream
    of the code imported from ``--code`` (a baseline pass)."""
    import PIL
    import torch

    torch.set_num_threads(1)
    pil = f"pillow-simd {PIL.__version__}" if _is_simd() else f"pillow {PIL.__version__}"
    if only == "malloc":
        pil += f" + {MALLOC_NOTE}"
    rows = []

    def add(name, preset, loader, workers, n, wall, cpu):
        rows.append(dict(images=name, preset=preset, loader=loader, workers=workers, pil=pil,
                         n=n, wall=wall, cpu=cpu))
        print(f"  {name:26s} {loader:52s} w={workers} {pil:26s} "
              f"{n / wall:8.0f}/s wall {n / cpu:8.0f}/CPU-s", flush=True)

    for name, tree, split, preset in _sets(tmp):
        if only == "baseline":
            if not name.startswith("1024"):
                add(name, preset, BASELINE, 0, *bench_shards(split, preset, 0, args.batch_size))
            continue
        if only == "malloc":  # the targets' rows only
            if not name.startswith("1024"):
                add(name, preset, FLOOR, 0, *bench_floor(tree, preset, min(2000, args.cifar_n),
                                                         args.batch_size))
                add(name, preset, STREAM, 0, *bench_shards(split, preset, 0, args.batch_size))
                add(name, preset, IMAGEFOLDER, 0, *bench_imagefolder(tree, preset, 0,
                                                                     args.batch_size))
            continue
        if name.startswith("1024"):  # the draft rows
            for draft in (False, True):
                add(name, preset, f"{STREAM}, jpeg_draft={draft}", 0,
                    *bench_shards(split, preset, 0, args.batch_size, jpeg_draft=draft))
            add(name, preset, IMAGEFOLDER, 0, *bench_imagefolder(tree, preset, 0, args.batch_size))
            continue
        for op, n, wall, cpu in bench_decode(tree, min(2000, args.cifar_n)):
            add(name, preset, op, 0, n, wall, cpu)
        add(name, preset, FLOOR, 0, *bench_floor(tree, preset, min(2000, args.cifar_n),
                                                 args.batch_size))
        if preset == "clothing1m":
            for op, n, wall, cpu in bench_pil_ops(tree):
                add(name, preset, op, 0, n, wall, cpu)
        add(name, preset, TAR, 0, *bench_tar_read(split))
        for workers in (0, 1):
            add(name, preset, STREAM, workers, *bench_shards(split, preset, workers,
                                                             args.batch_size))
            add(name, preset, IMAGEFOLDER, workers, *bench_imagefolder(tree, preset, workers,
                                                                       args.batch_size))
        add(name, preset, DEVICE, 0, *bench_shards(split, preset, 0, args.batch_size,
                                                   decode="device"))
    return rows


def _is_simd() -> bool:
    """pillow-simd's versions end in .postN (``pipeline.data.pil_build`` checks the same, with
    the distribution; a baseline commit may predate that module)."""
    import re

    import PIL

    return bool(re.search(r"\.post\d+$", PIL.__version__))


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
    return out


def _rate(rows: list[dict], images: str, loader: str, pil: str, workers: int = 0) -> float | None:
    for r in rows:
        if (r["images"], r["loader"], r["pil"], r["workers"]) == (images, loader, pil, workers):
            return r["cpu_rate"]
    return None


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, per PIL build: shard stream / ImageFolder (samples per CPU-s,
    one process each), against the decode-alone bound."""
    lines = ["## Targets (samples per CPU-s, `num_workers=0`, the same run)", "",
             "| images | PIL | shard stream | ImageFolder | ratio | target | decode alone: PIL "
             "| decode alone: libjpeg-turbo | decode + transform + normalise alone "
             "| stream / that |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    goal = {"cifar10 32x32": 1.5, "341x256 (256 short side)": 2.0}
    for images, want in goal.items():
        for pil in sorted({r["pil"] for r in rows if r["images"] == images}):
            s, f = _rate(rows, images, STREAM, pil), _rate(rows, images, IMAGEFOLDER, pil)
            d1, d2 = _rate(rows, images, DECODE_PIL, pil), _rate(rows, images, DECODE_TURBO, pil)
            fl = _rate(rows, images, FLOOR, pil)
            if s is None or f is None:
                continue
            ok = "met" if s / f >= want else "missed"
            nan = float("nan")
            lines.append(f"| {images} | {pil} | {s:.0f} | {f:.0f} | **{s / f:.2f}** | "
                         f">= {want} ({ok}) | {d1 or nan:.0f} | {d2 or nan:.0f} | {fl or nan:.0f} "
                         f"| {s / fl if fl else nan:.2f} |")
    return lines


def report(rows: list[dict], *, simd_note: str, writer: str, argv: list[str], load: tuple,
           baseline: str | None) -> str:
    lines = [
        "# Loader throughput: the shard stream's decode paths vs ImageFolder",
        "",
        "Command: `python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_loader.py", *argv]) + "`",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load "
        f"average {load[0]:.1f} at the start and {load[1]:.1f} at the end (other jobs shared the "
        f"cores: the per-CPU-s column is the per-core figure, wall is what this machine gave). "
        f"torch threads = 1; batch size 128; shards written by {writer}. Each pass runs in a fresh "
        f"interpreter; PIL builds alternate; medians of the passes.",
        f"pillow-simd: {simd_note}.",
    ]
    if baseline:
        lines.append(f"Baseline: {baseline}.")
    lines += [
        "",
        "| images | preset | loader | workers | PIL | samples | passes | samples/s wall | samples/CPU-s (per core) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['images']} | {r['preset']} | {r['loader']} | {r['workers']} | {r['pil']} "
                     f"| {r['n']} | {r['runs']} | {r['wall_rate']:.0f} | {r['cpu_rate']:.0f} |")
    lines += ["", *targets(rows), "", "## Cores needed to feed one GPU", ""]
    for preset, (what, lo, hi) in GPU_NEEDS.items():
        best = [r for r in rows if r["preset"] == preset and r["loader"] == STREAM
                and not r["images"].startswith("1024")]
        for pil in sorted({r["pil"] for r in best}):
            rate = max(r["cpu_rate"] for r in best if r["pil"] == pil)
            lines.append(f"- `{preset}` ({pil}): {rate:.0f} img/s per core (decode=cpu, best of "
                         f"workers=0/1); {what} trains at ~{lo}-{hi} img/s on one modern GPU "
                         f"-> **{lo / rate:.1f}-{hi / rate:.1f} loader cores per GPU**.")
    lines.append("")
    return "\n".join(lines)


def _child(tmp: Path, argv: list[str], *, pil_path: Path | None, only: str | None,
           code: Path | None = None) -> list[dict]:
    """One pass of ``run_suite`` in a fresh interpreter (``pil_path`` first on its path;
    ``code``: import the project from there; ``only="malloc"``: with ``MALLOC_ENV``)."""
    out = tmp / "pass.json"
    out.unlink(missing_ok=True)
    path = [str(pil_path)] if pil_path is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(code or REPO)]),
           **(MALLOC_ENV if only == "malloc" else {})}
    cmd = [sys.executable, __file__, *argv, "--worker-json", str(out),
           *(["--only", only] if only else []), *(["--code", str(code)] if code else [])]
    proc = subprocess.run(cmd, env=env, cwd=str(code or REPO))
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"benchmark pass failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
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
        if args.draft_n:
            make_big_jpegs(tmp / "cifar", tmp / "draft", args.draft_n, size=(1024, 768),
                           stored=None)
            build_shards(tmp / "draft", tmp / "draft-shards", shard_size=100)
        print(f"prepared {args.cifar_n} CIFAR + {args.big_n} 341x256 + {args.draft_n} 1024x768 "
              f"JPEGs and their shards ({writer}) in {time.perf_counter() - t0:.0f} s", flush=True)

        variants: list[tuple[Path | None, str | None, Path | None]] = [(None, None, None)]
        if _is_simd():
            simd_note = "this interpreter's PIL is pillow-simd"
        elif args.simd_path is None:
            simd_note = ("not measured (pass --simd-path DIR holding `CC=\"cc -mavx2\" pip install "
                         "--no-deps --target DIR pillow-simd`)")
        else:
            variants.append((args.simd_path, None, None))
            simd_note = (f"from --simd-path (made with `CC=\"cc -mavx2\" pip install --no-deps "
                         f"--no-binary pillow-simd --target DIR pillow-simd`), every row")
        if args.baseline is not None:
            variants.append((None, "baseline", args.baseline.resolve()))
        if args.malloc:
            variants.append((None, "malloc", None))
        runs: list[dict] = []
        for rep in range(args.repeats):
            for pil_path, only, code in variants:
                print(f"pass {rep + 1}/{args.repeats}, PIL from {pil_path or 'the venv'}"
                      f"{', baseline code' if code else ''}"
                      f"{', ' + MALLOC_NOTE if only == 'malloc' else ''}", flush=True)
                runs += _child(tmp, argv, pil_path=pil_path, only=only, code=code)
    if args.simd_path is not None and not any("simd" in r["pil"] for r in runs):
        simd_note = "not importable from --simd-path"
    baseline = None
    if args.baseline is not None:
        commit = (args.baseline / "COMMIT").read_text().strip() if (
            args.baseline / "COMMIT").is_file() else args.baseline.name
        baseline = f"the shard stream of commit {commit} (same data, same run, pillow)"
    text = report(aggregate(runs), simd_note=simd_note, writer=writer, argv=argv,
                  load=(load0, os.getloadavg()[0]), baseline=baseline)
    print()
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
