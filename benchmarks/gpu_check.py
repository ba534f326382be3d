"""One-GPU check of the training step: what one CUDA device does with this pipeline.

Measures, on the first CUDA device, with the library's defaults (``PerfConfig``: bf16
autocast, channels-last, cuDNN autotuning, in-memory data and augmentation on the device):

1. CIFAR-10 PreAct ResNet-32 (batch 128, 50,000 training images = 391 steps, then the
   10,000-image test pass): epoch time for CE and for LCCN, and LCCN's step time over CE's.
   Real CIFAR-10 when ``--cifar`` names the JPEG tarball, random images of the same shape
   otherwise (the timing does not depend on the pixels).
2. ResNet-50 at 224 px, batch 128, images/s of this pipeline's step (``train_one_epoch``
   with the CE method, ``wrap_model``) against a plain torchvision loop with the same
   precision and layout, on synthetic in-memory data; and through the real shard loader on
   JPEG shards written here (``shards.writer``), for several decode-worker counts.
3. Peak GPU memory of each part. ``--compile`` adds a ``torch.compile`` timing of (1).
4. One CE epoch of (1) under float16 autocast with a ``GradScaler`` (``--amp fp16``, the
   path of GPUs without bf16): its loss and accuracy beside the bf16 epoch, its time.
5. Decode on the device (``LoaderConfig.decode="device"``): ResNet-50 from the same JPEG
   shards with the JPEGs decoded by nvJPEG and augmented on the GPU, at most 4 loader
   workers (``--decode-workers``), against this pipeline's synthetic in-GPU-memory rate
   (target: >= 0.9x on one H200), beside ``decode="cpu"`` with as many workers; the CPU
   seconds the training process and its workers spent per 1,000 images (loader cores per
   GPU). ``--decode-check`` runs only this part (and the synthetic rate it is measured
   against): the measurement for a short device session.
   SyncBatchNorm (``--sync-bn``) is not exercised here: it synchronises across processes,
   one per GPU, and NCCL refuses two ranks on one device; the CPU tests cover its
   conversion.

Needs: a CUDA build of PyTorch with a GPU, torchvision, numpy, pillow, and (for the shard
part) webdataset + braceexpand (pure Python; ``benchmarks/gpu_check.sh`` installs them
from ``.whl/`` when present). Exits with status 2 and one line when something is missing.

    bash benchmarks/gpu_check.sh [--cifar PATH/cifar10-jpeg.tar.gz] [--out FILE.md]
    bash benchmarks/gpu_check.sh --decode-check --out benchmarks/results/gpu-decode.md \
        --json benchmarks/results/gpu-decode.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core.options import add_options  # noqa: E402 (the config only: no torch)


def fail(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def preflight(need_shards: bool, device: str) -> None:
    try:
        import torch
    except ImportError:
        fail("PyTorch is not installed (need a CUDA build of torch)")
    if device == "cuda" and not torch.cuda.is_available():
        fail(f"no CUDA device visible to torch {torch.__version__} (cuda build: "
             f"{torch.version.cuda}); this check needs one GPU")
    missing = []
    for mod in ("torchvision", "numpy", "PIL"):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if need_shards:
        for mod in ("webdataset", "braceexpand"):
            try:
                importlib.import_module(mod)
            except ImportError:
                missing.append(mod)
    if missing:
        fail(f"missing Python packages: {', '.join(missing)} (pure-Python wheels can be "
             "installed offline: pip install --no-index --no-deps <wheel files>; "
             "--no-shards skips the shard part)")


def log(msg: str) -> None:
    print(msg, flush=True)


# -- 1. CIFAR-10 ResNet-32 -------------------------------------------------------------------


def cifar_data(path: Path | None, n_train: int = 50000, n_test: int = 10000):
    import numpy as np
    import torch

    from pipeline.core.noise import asymmetric_cifar10, clean_view
    from pipeline.data.cifar_memory import RandomCropFlip, channel_stats, load_cifar10, normalise
    from pipeline.train.trainer import TensorData

    if path is not None:
        arrays = load_cifar10(path)
        tx, ty, vx, vy = arrays.train_x, arrays.train_y, arrays.test_x, arrays.test_y
        what = f"real CIFAR-10 ({path.name})"
    else:
        g = np.random.default_rng(0)
        tx = g.integers(0, 256, (n_train, 3, 32, 32), dtype=np.uint8)
        ty = np.repeat(np.arange(10), n_train // 10)
        vx = g.integers(0, 256, (n_test, 3, 32, 32), dtype=np.uint8)
        vy = np.repeat(np.arange(10), n_test // 10)
        what = "random CIFAR-shaped images"
    mean, std = channel_stats(tx)
    aug = RandomCropFlip(padding=4, fill=-mean / std)
    train = TensorData(normalise(tx, mean, std), asymmetric_cifar10(ty, 0.5, seed=0),
                       augment=aug)
    test = TensorData(normalise(vx, mean, std), clean_view(vy, 10))
    del torch
    return train, test, what


def _reset_peak(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float:
    import torch
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def cifar_epochs(train, test, method: str, epochs: int, perf, device: str, *,
                 pretrain: int = 1, warmup_steps: int = 391, on_row=None) -> list[dict]:
    import torch

    from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig
    from pipeline.train.trainer import LocalTrainer

    cfg = RunConfig(method=method, seed=0, model=ModelConfig("preact_resnet32"),
                    val_fraction=0.0, perf=perf, check_invariants=False,
                    optim=OptimConfig(epochs=epochs, pretrain_epochs=pretrain, batch_size=128,
                                      lr=0.1),
                    lccn=LCCNConfig(warmup_steps=warmup_steps))
    _reset_peak(device)
    trainer = LocalTrainer(cfg, train, test, device=device)
    rows = []

    def show(e: int, r: dict) -> None:
        r = dict(r, peak_mem_gib=_peak(device))
        rows.append(r)
        if on_row is not None:
            on_row(rows)
        log(f"  resnet32 {method:4s} epoch {e + 1}/{epochs} phase {int(r['phase'])}: "
            f"{r['epoch_time']:.2f} s/epoch, {1e3 * r['step_time']:.2f} ms/step, sampler "
            f"{1e3 * r['sampler_time']:.3f} ms, sync {1e3 * r['sync_time']:.3f} ms, test "
            f"{r['test_top1']:.3f}")

    trainer.fit(on_epoch=show)
    return rows


# -- 2. ResNet-50 -----------------------------------------------------------------------------


def resnet50_ours(images, labels, steps: int, batch: int, perf, device: str
                  ) -> tuple[float, float]:
    import torch

    from pipeline.core.labels import LabelView
    from pipeline.train.fastpath import configure_backends, wrap_model
    from pipeline.train.loop import train_one_epoch
    from pipeline.train.models import build_model
    from pipeline.train.trainer import TensorData

    configure_backends(perf, device)
    base = build_model("resnet50", 1000, seed=0).to(device)
    fwd = wrap_model(base, perf, device)
    opt = torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4,
                          fused=device == "cuda" or None)
    y = labels.cpu().numpy()
    data = TensorData(images, LabelView(y, y, 1000))
    gen = torch.Generator().manual_seed(0)
    _reset_peak(device)
    # warm-up pass (cuDNN autotuning, allocator), then the timed one
    for timed in (False, True):
        sub = data.take(range(batch * (min(3, steps) if not timed else steps)))
        _sync(device)
        t0 = time.perf_counter()
        train_one_epoch(fwd, sub.batches(batch, generator=gen), opt, device=device)
        _sync(device)
        dt = time.perf_counter() - t0
    return batch * steps / dt, _peak(device)


def resnet50_plain(images, labels, steps: int, batch: int, device: str) -> tuple[float, float]:
    """The reference: torchvision's ResNet-50 in the textbook loop, same precision/layout."""
    import torch
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(0)
    cuda = device == "cuda"
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4,
                          fused=cuda or None)
    gen = torch.Generator().manual_seed(0)
    _reset_peak(device)
    for timed in (False, True):
        n = steps if timed else min(3, steps)
        _sync(device)
        t0 = time.perf_counter()
        order = torch.randperm(images.shape[0], generator=gen)
        for s in range(n):
            idx = order[s * batch:(s + 1) * batch].to(device, non_blocking=True)
            x = images[idx]
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(model(x).float(), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        _sync(device)
        dt = time.perf_counter() - t0
    return batch * steps / dt, _peak(device)


def write_jpeg_shards(out: Path, n: int, cifar: Path | None) -> Path:
    import numpy as np
    from PIL import Image

    from shards.writer import SampleRecord, WriterOptions, write_split

    g = np.random.default_rng(0)
    if cifar is not None:
        from pipeline.data.cifar_memory import load_cifar10
        src = load_cifar10(cifar).train_x[:n].transpose(0, 2, 3, 1)
    else:
        src = g.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)

    def records():
        for i in range(n):
            # photo-like 320x320 JPEGs (a CIFAR image upscaled), about the size of a web image
            img = Image.fromarray(src[i]).resize((320, 320), Image.BICUBIC)
            import io
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            yield SampleRecord(idx=i, label=i % 10, clean=i % 10, key=f"{i:06d}",
                               data=buf.getvalue())

    write_split(records(), out, dataset="gpu-check", split="train",
                classes=[str(c) for c in range(10)], num_samples=n,
                options=WriterOptions(shard_size=256, workers=8, progress=False))
    return out / "train"


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (the loader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def resnet50_shards(split: Path, workers: int, batch: int, perf, device: str,
                    decode: str = "cpu") -> dict:
    import torch

    from pipeline.data.stream import LoaderConfig, make_train_loader
    from pipeline.data.transforms import build_batch_transform
    from pipeline.train.fastpath import configure_backends, wrap_model
    from pipeline.train.loop import train_one_epoch
    from pipeline.train.models import build_model

    configure_backends(perf, device)
    base = build_model("resnet50", 10, seed=0).to(device)
    fwd = wrap_model(base, perf, device, normalize=build_batch_transform("clothing1m"))
    opt = torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9,
                          fused=device == "cuda" or None)
    cfg = LoaderConfig(batch_size=batch, num_workers=workers, preset="clothing1m",
                       pin_memory=device == "cuda", normalize_on="device", shuffle_buffer=256,
                       verify_checksums=False, decode=decode)
    stamps: list[float] = []

    def tick() -> None:
        stamps.append(time.perf_counter())

    loader = make_train_loader(split, None, cfg, rank=0, world_size=1, epoch=0, device=device)
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    train_one_epoch(fwd, loader, opt, device=device, after_step=tick)
    _sync(device)
    stamps.append(time.perf_counter())
    cpu, wall = _cpu_seconds() - c0, stamps[-1] - t0
    skip = 3  # loader start-up and cuDNN autotuning
    timed = len(stamps) - 1 - skip
    rate = batch * timed / (stamps[-1] - stamps[skip]) if timed > 0 else float("nan")
    n = batch * (len(stamps) - 1)
    return {"workers": workers, "decode": decode, "images_per_s": rate,
            "steps": len(stamps) - 1, "cpu_s_per_1000": 1000 * cpu / max(n, 1),
            "cores_busy": cpu / wall if wall > 0 else float("nan"),
            "decode_fallback": int(loader.stats.get("decode_fallback", 0)),
            "skipped_decode": int(loader.stats.get("skipped_decode", 0))}


def decode_part(res: dict, args, split: Path, batch: int, perf, dev: str) -> None:
    """Part 5: decode="device" (and "cpu" beside it) from the shards, against the
    synthetic rate of this pipeline (``res["resnet50_synthetic"]``)."""
    rows = []
    synth = res["resnet50_synthetic"]["ours_images_per_s"]
    runs = [("device", w) for w in args.decode_workers] + [("cpu", max(args.decode_workers))]
    for decode, w in runs:
        r = resnet50_shards(split, w, batch, perf, dev, decode=decode)
        r["ratio_to_synthetic"] = r["images_per_s"] / synth
        rows.append(r)
        log(f"[5] ResNet-50 from JPEG shards, decode={decode}, {w} loader workers: "
            f"{r['images_per_s']:.0f} img/s (x{r['ratio_to_synthetic']:.3f} synthetic), "
            f"{r['cpu_s_per_1000']:.2f} CPU-s per 1000 images, {r['cores_busy']:.1f} cores "
            f"busy, fallbacks {r['decode_fallback']}")
        res["resnet50_decode"] = rows
        _save(res, args)


def synthetic_rate(res: dict, args, batch: int, steps: int, perf, dev: str) -> None:
    import torch

    g = torch.Generator(device=dev).manual_seed(0)
    images = torch.randn(batch * steps, 3, 224, 224, device=dev, generator=g)
    labels = torch.randint(0, 1000, (batch * steps,), device=dev, generator=g)
    plain, mem_plain = resnet50_plain(images, labels, steps, batch, dev)
    ours, mem_ours = resnet50_ours(images, labels.cpu(), steps, batch, perf, dev)
    res["resnet50_synthetic"] = {"plain_images_per_s": plain, "ours_images_per_s": ours,
                                 "ratio": ours / plain, "plain_peak_mem_gib": mem_plain,
                                 "ours_peak_mem_gib": mem_ours, "batch": batch, "steps": steps}
    log(f"[2] ResNet-50 224px synthetic: plain loop {plain:.0f} img/s, this pipeline "
        f"{ours:.0f} img/s (x{ours / plain:.3f})")
    del images, labels
    if dev == "cuda":
        torch.cuda.empty_cache()
    _save(res, args)


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cifar", type=Path, default=None, help="cifar10-jpeg.tar.gz (optional)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    p.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    add_options(p, ("--epochs",), defaults={"--epochs": 3},
                notes={"--epochs": "ResNet-32 epochs per method"})
    p.add_argument("--r50-steps", type=int, default=30)
    p.add_argument("--shard-images", type=int, default=6144)
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8, 14])
    p.add_argument("--no-shards", action="store_true")
    p.add_argument("--decode-workers", type=int, nargs="+", default=[2, 4],
                   help="part 5: loader workers for decode='device' (the largest also for "
                        "decode='cpu' beside it)")
    p.add_argument("--decode-check", action="store_true",
                   help="run only part 5 (decode on the device) and the synthetic ResNet-50 "
                        "rate it is compared with")
    p.add_argument("--time-compile", action="store_true", help="also time torch.compile")
    p.add_argument("--compile-mode", default=None,
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="run part 1 only, compiled (PerfConfig.compile), as one LCCN run of "
                        "--epochs epochs whose first half is CE")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: run every part on the CPU at --tiny sizes (tests the script)")
    p.add_argument("--tiny", action="store_true", help="small sizes (CPU smoke run)")
    args = p.parse_args()
    if args.decode_check and args.no_shards:
        fail("--decode-check reads JPEG shards; it cannot run with --no-shards")
    preflight(need_shards=not args.no_shards, device=args.device)
    dev = args.device
    if args.tiny:
        args.workers, args.epochs, args.decode_workers = [1], min(args.epochs, 2), [1]

    import torch

    from pipeline.core.config import PerfConfig

    t_all = time.perf_counter()
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sms, mem = torch.cuda.get_device_name(0), props.multi_processor_count, \
            props.total_memory / 2**30
    else:
        name, sms, mem = f"CPU ({platform.processor() or platform.machine()})", 0, float("nan")
    res: dict = {"device": name, "torch": torch.__version__,
                 "cuda": torch.version.cuda, "sm": sms,
                 "gpu_mem_gib": mem, "cpus": os.cpu_count(),
                 "host": platform.node(), "argv": sys.argv[1:]}
    log(f"gpu_check on {res['device']} (torch {res['torch']}, CUDA {res['cuda']}, "
        f"{res['cpus']} CPUs)")
    perf = PerfConfig()
    batch, steps = (128, args.r50_steps) if not args.tiny else (2, 2)
    n_shard = args.shard_images if not args.tiny else 8

    if args.decode_check:  # part 5 only
        res["decode_check"] = True
        synthetic_rate(res, args, batch, steps, perf, dev)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            split = write_jpeg_shards(Path(tmp), n_shard, args.cifar)
            res["shards_written_s"] = time.perf_counter() - t0
            decode_part(res, args, split, batch, perf, dev)
        res["wall_s"] = time.perf_counter() - t_all
        _save(res, args)
        log(f"done in {res['wall_s']:.0f} s")
        return

    # 1. ResNet-32
    train, test, what = (cifar_data(args.cifar) if not args.tiny
                         else cifar_data(None, n_train=250, n_test=100))
    res["cifar_data"] = what
    log(f"[1] CIFAR-10 PreAct ResNet-32 on {what}, {len(train)} train / {len(test)} test")
    if args.compile_mode is not None:
        cperf = replace(perf, compile=args.compile_mode)
        res["compile_mode"] = args.compile_mode
        res["resnet32_lccn_compiled"] = cifar_epochs(
            train, test, "lccn", args.epochs, cperf, dev, pretrain=args.epochs // 2,
            warmup_steps=50, on_row=lambda rows: _save(dict(res, resnet32_lccn_compiled=rows),
                                                       args))
        res["wall_s"] = time.perf_counter() - t_all
        _save(res, args)
        log(f"done in {res['wall_s']:.0f} s")
        return
    res["resnet32_ce"] = cifar_epochs(train, test, "ce", args.epochs, perf, dev)
    res["resnet32_lccn"] = cifar_epochs(train, test, "lccn", args.epochs, perf, dev)
    # float16 convolutions are slow on a CPU: the smoke run's fp16 epoch is 30 images
    half = (train, test) if not args.tiny else cifar_data(None, n_train=30, n_test=20)[:2]
    res["resnet32_ce_fp16"] = cifar_epochs(*half, "ce", 1, replace(perf, amp="fp16"), dev)
    fp16 = res["resnet32_ce_fp16"][-1]
    if not (fp16["loss"] == fp16["loss"] and abs(fp16["loss"]) < float("inf")):
        res["fp16_error"] = f"float16 CE epoch ended with loss {fp16['loss']}"
    log(f"[1] CE epoch 1 under fp16 autocast + GradScaler: loss {fp16['loss']:.3f} (bf16: "
        f"{res['resnet32_ce'][0]['loss']:.3f}), test {fp16['test_top1']:.3f} (bf16: "
        f"{res['resnet32_ce'][0]['test_top1']:.3f}), {fp16['epoch_time']:.2f} s")
    if args.time_compile:
        try:
            res["resnet32_ce_compiled"] = cifar_epochs(
                train, test, "ce", args.epochs, replace(perf, compile="default"), dev)
        except Exception as exc:  # report, do not lose the other figures
            res["resnet32_ce_compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
    _save(res, args)

    # 2. ResNet-50, synthetic in-memory
    synthetic_rate(res, args, batch, steps, perf, dev)

    # 3. ResNet-50 through the shard loader
    if not args.no_shards:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            split = write_jpeg_shards(Path(tmp), n_shard, args.cifar)
            res["shards_written_s"] = time.perf_counter() - t0
            rows = []
            for w in args.workers:
                r = resnet50_shards(split, w, batch, perf, dev)
                rows.append(r)
                log(f"[3] ResNet-50 from JPEG shards, {w} decode workers: "
                    f"{r['images_per_s']:.0f} img/s over {r['steps']} steps")
                _save(dict(res, resnet50_shards=rows), args)
            res["resnet50_shards"] = rows
            # 5. the same shards decoded on the device
            decode_part(res, args, split, batch, perf, dev)
    res["wall_s"] = time.perf_counter() - t_all
    _save(res, args)
    log(f"done in {res['wall_s']:.0f} s")


def _save(res: dict, args: argparse.Namespace) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1, default=str))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(res))


def _last(rows: list[dict], phase: int) -> dict | None:
    sel = [r for r in rows if int(r["phase"]) == phase]
    return sel[-1] if sel else None


def report(res: dict) -> str:
    lines = [f"# GPU check: {res['device']}", "",
             f"torch {res['torch']}, CUDA {res['cuda']}, {res['sm']} SMs, "
             f"{res['gpu_mem_gib']:.0f} GiB, {res['cpus']} CPUs. Command: "
             f"`bash benchmarks/gpu_check.sh {' '.join(res['argv'])}`.", ""]
    comp = res.get("resnet32_lccn_compiled")
    if comp:
        lines += [f"## CIFAR-10 PreAct ResNet-32 with torch.compile(mode={res['compile_mode']!r}) "
                  f"({res['cifar_data']}, batch 128, 391 steps + 10,000-image test pass; one "
                  "LCCN run, its first half CE; the first epoch of each phase compiles)", "",
                  "| phase | epoch | epoch time (s) | step (ms) | sampler (ms) | store sync (ms) "
                  "| peak GPU memory (GiB) |", "|---|---|---|---|---|---|---|"]
        for r in comp:
            lines.append(f"| {'LCCN' if r['phase'] else 'CE'} | {int(r['epoch']) + 1} | "
                         f"{r['epoch_time']:.2f} | {1e3 * r['step_time']:.2f} | "
                         f"{1e3 * r['sampler_time']:.3f} | {1e3 * r['sync_time']:.3f} | "
                         f"{r['peak_mem_gib']:.2f} |")
        ce_c, lc_c = _last(comp, 0), _last(comp, 1)
        if ce_c is not None and lc_c is not None:
            lines += ["", f"LCCN step / CE step (last epoch of each phase): "
                      f"**{lc_c['step_time'] / ce_c['step_time']:.3f}**."]
    ce, lc = res.get("resnet32_ce"), res.get("resnet32_lccn")
    if ce and lc:
        ce_last, lc_last = ce[-1], _last(lc, 1)
        lines += [f"## CIFAR-10 PreAct ResNet-32 ({res['cifar_data']}, batch 128, 391 steps "
                  "+ 10,000-image test pass)", "",
                  "| run | epoch | epoch time (s) | step (ms) | sampler (ms) | store sync (ms) "
                  "| peak GPU memory (GiB) |", "|---|---|---|---|---|---|---|"]
        for name, rows in (("CE", ce), ("LCCN", lc), ("CE compiled",
                                                     res.get("resnet32_ce_compiled") or [])):
            for r in rows:
                lines.append(f"| {name}{' (LCCN phase)' if r['phase'] else ''} | "
                             f"{int(r['epoch']) + 1} | {r['epoch_time']:.2f} | "
                             f"{1e3 * r['step_time']:.2f} | {1e3 * r['sampler_time']:.3f} | "
                             f"{1e3 * r['sync_time']:.3f} | {r['peak_mem_gib']:.2f} |")
        if lc_last is not None:
            ratio = lc_last["step_time"] / ce_last["step_time"]
            lines += ["", f"LCCN step / CE step (last epochs): **{ratio:.3f}**; CE epoch incl. "
                      f"test: **{ce_last['epoch_time']:.2f} s**, so 120 epochs take "
                      f"{120 * ce_last['epoch_time'] / 60:.1f} min."]
        fp16, bf16 = res.get("resnet32_ce_fp16"), ce[0]
        if fp16:
            f = fp16[-1]
            lines += ["", f"CE epoch 1 under float16 autocast with a GradScaler (`--amp fp16`): "
                      f"loss {f['loss']:.3f} against {bf16['loss']:.3f} under bf16, test "
                      f"{f['test_top1']:.3f} against {bf16['test_top1']:.3f}, "
                      f"{f['epoch_time']:.2f} s against {bf16['epoch_time']:.2f} s"
                      + (f"; **{res['fp16_error']}**" if res.get("fp16_error") else ".")]
        if res.get("resnet32_ce_compiled_error"):
            lines += ["", f"torch.compile failed: `{res['resnet32_ce_compiled_error']}`"]
    r50 = res.get("resnet50_synthetic")
    if r50:
        lines += ["", "## ResNet-50, 224 px, batch 128, bf16 autocast, channels-last", "",
                  "| data | loop | images/s | peak GPU memory (GiB) |", "|---|---|---|---|",
                  f"| synthetic, in GPU memory | plain torchvision loop | "
                  f"{r50['plain_images_per_s']:.0f} | {r50['plain_peak_mem_gib']:.1f} |",
                  f"| synthetic, in GPU memory | this pipeline (`train_one_epoch`) | "
                  f"{r50['ours_images_per_s']:.0f} | {r50['ours_peak_mem_gib']:.1f} |", "",
                  f"Ratio this pipeline / plain loop: **{r50['ratio']:.3f}**."]
        for r in res.get("resnet50_shards", []):
            lines.insert(len(lines) - 2, f"| JPEG shards (320 px, resize 256, crop 224, "
                         f"flip, jitter), {r['workers']} decode workers | this pipeline | "
                         f"{r['images_per_s']:.0f} | |")
    dec = res.get("resnet50_decode")
    if dec and r50:
        synth = r50["ours_images_per_s"]
        lines += ["", "## ResNet-50 from JPEG shards, decoded on the device "
                  "(`LoaderConfig.decode`)", "",
                  "320 px JPEGs, clothing1m preset (resize 256, random crop 224, flip, colour "
                  f"jitter), batch {r50['batch']}; against this pipeline's synthetic rate "
                  f"({synth:.0f} images/s). CPU-s per 1,000 images: the training process and its "
                  "loader workers together.", "",
                  "| decode | loader workers | images/s | / synthetic | CPU-s per 1,000 images "
                  "| cores busy | decode fallbacks |", "|---|---|---|---|---|---|---|"]
        for r in dec:
            lines.append(f"| {r['decode']} | {r['workers']} | {r['images_per_s']:.0f} | "
                         f"{r['ratio_to_synthetic']:.3f} | {r['cpu_s_per_1000']:.2f} | "
                         f"{r['cores_busy']:.1f} | {r['decode_fallback']} |")
        best = max((r for r in dec if r["decode"] == "device"), default=None,
                   key=lambda r: r["ratio_to_synthetic"])
        if best is not None:
            met = "met" if best["ratio_to_synthetic"] >= 0.9 else "missed"
            lines += ["", f"decode=device, {best['workers']} loader workers: "
                      f"**{best['ratio_to_synthetic']:.3f} x synthetic** (target >= 0.9 with at "
                      f"most 4 workers: {met})."]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
