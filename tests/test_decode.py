"""Tests of the decode paths of the shard loader: JPEG bytes to PIL's pixels at libjpeg
speed (pipeline/data/jpeg.py), the presets' transforms without v2's dispatch
(pipeline/data/sample_transform.py), the tar reader (pipeline/data/tario.py), and decoding
and augmenting batches on a device (pipeline/data/device_decode.py, ``LoaderConfig.decode``),
here on the CPU.

Real CIFAR-10 JPEGs throughout (and larger JPEGs made from them), real tar shards on disk.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from test_data import (  # noqa: F401 (fixture)
    CFG,
    cifar_images,
    save_manifest,
    shifted_view,
    valid_idx,
)

from pipeline.data.device_decode import (
    JPEG,
    PIXELS,
    BatchAugment,
    DeviceDecoder,
    Payload,
    pack_payloads,
    unpack_payloads,
)
from pipeline.data.jpeg import decode, decode_draft, decode_pil, jpeg_header
from pipeline.data.manifest import sample_key
from pipeline.data.sample_transform import SampleTransform, draft_target
from pipeline.data.stream import LoaderConfig, make_eval_loader, make_train_loader
from pipeline.data.tario import tar_members
from pipeline.data.transforms import PRESETS, build_sample_transform

ROOT = Path(__file__).resolve().parents[1]


def encode(img: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos(cifar_images) -> list[bytes]:
    """JPEGs of web-photo size made from real CIFAR images: 341x256 and 500x375, quality 90."""
    out = []
    for i, (data, _) in enumerate(cifar_images[:12]):
        size = (341, 256) if i % 2 else (500, 375)
        out.append(encode(Image.open(io.BytesIO(data)).convert("RGB").resize(size, Image.BICUBIC),
                          quality=90))
    return out


# -- JPEG bytes -> PIL's pixels ------------------------------------------------------------------


def test_jpeg_decode_gives_pils_pixels_and_verdicts(cifar_images, photos):
    """libjpeg-turbo through torchvision gives PIL's bytes for every kind of JPEG the fast
    path takes; other files go through PIL (same pixels, same errors)."""
    base = Image.open(io.BytesIO(photos[0])).convert("RGB")
    variants = {
        "progressive": encode(base, progressive=True), "4:4:4": encode(base, subsampling=0),
        "4:2:2": encode(base, subsampling=1), "gray": encode(base.convert("L")),
        "gray progressive": encode(base.convert("L"), progressive=True),
    }
    fast = [d for d, _ in cifar_images] + photos + list(variants.values())
    for data in fast:
        for mode in ("RGB", "L") if data is variants["gray"] else ("RGB",):
            got = decode(data, mode)
            assert isinstance(got, torch.Tensor)  # the fast path took it
            ref = np.asarray(decode_pil(data, mode))
            hwc = got.permute(1, 2, 0).numpy()
            assert np.array_equal(hwc, ref.reshape(hwc.shape))
    # PIL's path: PNG, CMYK JPEG, colour JPEG to a grayscale preset
    for data, mode in ((encode(base, "PNG"), "RGB"), (encode(base.convert("CMYK")), "RGB"),
                       (photos[1], "L")):
        got = decode(data, mode)
        assert isinstance(got, Image.Image)
        assert np.array_equal(np.asarray(got), np.asarray(decode_pil(data, mode)))
    # cut short or not an image: PIL's verdict (its pixels, or its error)
    whole = photos[2]

    def verdict(fn, data):
        try:
            return np.asarray(fn(data, "RGB")).tobytes()
        except OSError as e:
            return type(e)

    for bad in (whole[:-2], whole[:-40], whole[: len(whole) // 2], b"not an image at all"):
        assert verdict(decode, bad) == verdict(decode_pil, bad)
    assert verdict(decode, b"not an image at all") is not None


def test_jpeg_header_reads_the_frame_without_decoding(photos):
    base = Image.open(io.BytesIO(photos[1])).convert("RGB")  # 341 x 256
    h = jpeg_header(photos[1])
    assert (h.height, h.width, h.components, h.precision, h.sof, h.complete) == \
        (256, 341, 3, 8, 0xC0, True) and h.huffman_8bit
    assert jpeg_header(encode(base, progressive=True)).sof == 0xC2
    assert jpeg_header(encode(base.convert("L"))).components == 1
    cmyk = jpeg_header(encode(base.convert("CMYK")))
    assert cmyk.components == 4 and not cmyk.huffman_8bit
    assert not jpeg_header(photos[1][: len(photos[1]) // 2]).complete
    assert jpeg_header(encode(base, "PNG")) is None and jpeg_header(b"\xff\xd8\xff") is None


def test_draft_decodes_large_jpegs_at_a_reduced_scale(photos):
    """``jpeg_draft``: a JPEG at least twice the first resize's target is decoded at 1/2
    (or less) in the DCT domain; the result stays close to the full decode + resize."""
    big = photos[0]  # 500 x 375
    t = SampleTransform("imagenet96", train=False)  # eval: resize short side 110, crop 96
    target = t.first_resize(375, 500)
    assert target == (110, 146)
    size = draft_target((375, 500), target)
    assert size == (146, 110)
    small = decode_draft(big, "RGB", size)
    assert small.size == (250, 188)  # 1/2: 1/4 would be below the target
    crop256 = SampleTransform("clothing1m", train=True).first_resize(256, 341)
    assert crop256 == (256, 341) and draft_target((256, 341), crop256) is None
    full, drafted = t(decode(big, "RGB")).float(), t(small).float()
    assert full.shape == drafted.shape == (3, 96, 96)
    assert (full - drafted).abs().mean() < 4.0  # levels of 255: the same picture


# -- the presets' transforms without v2's dispatch -----------------------------------------------


@pytest.mark.parametrize("preset", [*PRESETS, "imagenet64"])
def test_sample_transform_is_v2_bit_for_bit(preset, cifar_images, photos):
    """Every preset, train and eval, on 32 px and photo-size JPEGs, decoded to a tensor or
    to PIL: the same uint8 tensor as ``build_sample_transform`` on the PIL image, and the
    same state of torch's generator afterwards (the same draws, in the same order)."""
    mode = PRESETS[preset].mode if preset in PRESETS else "RGB"
    images = [d for d, _ in cifar_images[:6]] + photos[:4]
    for train in (True, False):
        ref = build_sample_transform(preset, train=train)
        fast = SampleTransform(preset, train=train)
        for k, data in enumerate(images):
            for as_tensor in (True, False):
                torch.manual_seed(100 + k)
                want = ref(decode_pil(data, mode)).as_subclass(torch.Tensor)
                after = torch.get_rng_state()
                torch.manual_seed(100 + k)
                got = fast(decode(data, mode) if as_tensor else decode_pil(data, mode))
                assert got.dtype == torch.uint8 and torch.equal(got, want), (preset, train, k)
                assert torch.equal(torch.get_rng_state(), after)


# -- the tar reader ------------------------------------------------------------------------------


def _tarfile_members(data: bytes) -> tuple[list, str]:
    out = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as t:
            for m in t:
                if m.isreg():
                    out.append((m.name, t.extractfile(m).read()))
    except tarfile.ReadError:
        return out, "error"
    return out, "ok"


def _fast_members(data: bytes) -> tuple[list, str]:
    out = []
    try:
        out.extend(tar_members(io.BytesIO(data)))
    except tarfile.ReadError:
        return out, "error"
    return out, "ok"


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
def test_tar_reader_reads_what_tarfile_reads(fmt, cifar_images):
    """Members, long names (ustar prefix, GNU ``L``, pax ``path``), a directory between
    them; cut at every 101st byte or with a header byte flipped: the same members and the
    same verdict (clean end or ReadError) as tarfile's stream mode."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for i, (data, _) in enumerate(cifar_images[:9]):
            name = ("deep/" * 25 if i % 4 == 0 else "") + f"{i:08d}.jpg"
            if i == 5 and fmt != tarfile.USTAR_FORMAT:
                name = "ünïcode/" + name
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), (1.5 if fmt == tarfile.PAX_FORMAT else 0)
            t.addfile(ti, io.BytesIO(data))
            if i == 3:
                d = tarfile.TarInfo("a-dir")
                d.type = tarfile.DIRTYPE
                t.addfile(d)
    data = buf.getvalue()
    assert _fast_members(data) == _tarfile_members(data) and len(_fast_members(data)[0]) == 9
    for cut in range(0, len(data), 101):
        assert _fast_members(data[:cut]) == _tarfile_members(data[:cut]), cut
    for pos in (0, 148, 2048 + 60, len(data) // 2):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        assert _fast_members(bytes(bad)) == _tarfile_members(bytes(bad)), pos


# -- decode="device" (on the CPU here) -----------------------------------------------------------


def _split(tmp_path: Path, images: list[bytes], sizes: list[int], *,
           extra: dict | None = None) -> Path:
    """Shards of ``images`` (cycled) with consecutive idx; ``extra``: idx -> (ext, bytes)."""
    split = tmp_path / "train"
    split.mkdir(parents=True, exist_ok=True)
    idx = 0
    for s, n in enumerate(sizes):
        with wds.TarWriter(str(split / f"train-{s:06d}.tar")) as w:
            for _ in range(n):
                ext, data = (extra or {}).get(idx, ("jpg", images[idx % len(images)]))
                w.write({"__key__": sample_key(idx), ext: data,
                         "json": {"idx": idx, "label": idx % 10, "clean": idx % 10}})
                idx += 1
    save_manifest(split, sizes)
    return split


DEV = replace(CFG, num_workers=0, decode="device", device_prefetch=0)


def test_device_batches_have_the_cpu_paths_shapes_ranges_and_order(tmp_path, cifar_images, photos):
    """decode="device": the same samples in the same batches as decode="cpu", images of the
    same shape and dtype, normalised alike; evaluation without resampling (the cifar
    preset) gives exactly the CPU path's tensors, with resampling (imagenet64) nearly."""
    split = _split(tmp_path / "c", [d for d, _ in cifar_images], [12, 12, 12])
    for preset, src in (("cifar", split), ("imagenet64", _split(tmp_path / "p", photos, [8, 8]))):
        cpu_cfg = replace(CFG, num_workers=0, preset=preset, batch_size=6)
        dev_cfg = replace(DEV, preset=preset, batch_size=6)
        a = list(make_train_loader(src, None, cpu_cfg, rank=0, world_size=1, epoch=1))
        b = list(make_train_loader(src, None, dev_cfg, rank=0, world_size=1, epoch=1, device="cpu"))
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x.idx, y.idx) and torch.equal(x.observed, y.observed)
            assert x.images.shape == y.images.shape and y.images.dtype == torch.float32
            assert y.images.device.type == "cpu" and y.valid.all()
            lo, hi = float(x.images.min()), float(x.images.max())
            assert lo - 0.5 <= float(y.images.min()) and float(y.images.max()) <= hi + 0.5
        ea = list(make_eval_loader(src, None, cpu_cfg))
        eb = list(make_eval_loader(src, None, dev_cfg, device="cpu"))
        for x, y in zip(ea, eb):
            if preset == "cifar":
                assert torch.equal(x.images, y.images)
            else:  # torch's antialiased bilinear against PIL's: a few levels at most
                assert (x.images - y.images).abs().mean() < 0.05
        # uint8 out when the model normalises (normalize_on="device")
        raw = next(iter(make_eval_loader(src, None, replace(dev_cfg, normalize_on="device"),
                                         device="cpu")))
        assert raw.images.dtype == torch.uint8
        assert raw.images.shape[1:] == ((3, 32, 32) if preset == "cifar" else (3, 64, 64))


def test_device_augmentation_is_the_generators_crops(cifar_images):
    """The cifar preset on a batch: every output is the zero-padded input cropped at an
    offset in [0, 8] and maybe flipped; the same generator state gives the same batch,
    another state other crops."""
    imgs = [decode(d, "RGB").contiguous() for d, _ in cifar_images[:16]]
    aug = BatchAugment("cifar", train=True)
    out = aug(imgs, generator=torch.Generator().manual_seed(5))
    assert out.shape == (16, 3, 32, 32) and out.dtype == torch.uint8
    assert torch.equal(out, aug(imgs, generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(out, aug(imgs, generator=torch.Generator().manual_seed(6)))
    flips = 0
    for x, y in zip(imgs, out):
        padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
        found = [(t, l, f) for t in range(9) for l in range(9) for f in (False, True)
                 if torch.equal(y, padded[:, t:t + 32, l:l + 32].flip(-1) if f
                                else padded[:, t:t + 32, l:l + 32])]
        assert found
        flips += found[0][2]
    assert 0 < flips < 16
    # the photo presets: random-resized crop, resize + crop + flip + colour jitter
    for preset, shape in (("imagenet64", (3, 64, 64)), ("clothing1m", (3, 224, 224))):
        photos = [decode(encode(Image.fromarray(x.permute(1, 2, 0).numpy()).resize((300, 240))),
                         "RGB") for x in imgs[:3]]
        a = BatchAugment(preset, train=True)(photos, generator=torch.Generator().manual_seed(1))
        b = BatchAugment(preset, train=True)(photos, generator=torch.Generator().manual_seed(1))
        assert a.shape == (3, *shape) and a.dtype == torch.uint8 and torch.equal(a, b)
    with pytest.raises(ValueError, match=r"ColorJitter\(hue=\.\.\.\) has no batched version"):
        from torchvision.transforms import v2

        from pipeline.data import device_decode
        device_decode._ColorJitter(v2.ColorJitter(hue=0.1))


def test_device_decode_resumes_exactly(tmp_path, cifar_images):
    """A resumed epoch (``start_batch``) yields exactly the rest of the uninterrupted one:
    the crops come from a generator per (seed, epoch, rank, batch); prefetching in a thread
    changes nothing."""
    split = _split(tmp_path, [d for d, _ in cifar_images], [10, 10, 10, 10])
    view = shifted_view(40, cifar_images)
    kw = dict(rank=1, world_size=2, epoch=3, device="cpu")
    full = list(make_train_loader(split, view, DEV, **kw))
    again = list(make_train_loader(split, view, replace(DEV, device_prefetch=2), **kw))
    resumed_loader = make_train_loader(split, view, DEV, start_batch=2, **kw)
    resumed = list(resumed_loader)
    assert len(resumed) == len(full) - 2 and resumed_loader.position["batch"] == len(full)
    for a, b in zip(full[2:], resumed):
        assert torch.equal(a.idx, b.idx) and torch.equal(a.images, b.images)
    for a, b in zip(full, again):
        assert torch.equal(a.images, b.images)
    other_epoch = list(make_train_loader(split, view, DEV, **{**kw, "epoch": 4}))
    assert not torch.equal(torch.cat([b.images for b in full]),
                           torch.cat([b.images for b in other_epoch]))
    two = list(make_train_loader(split, view, DEV, views=2, **kw))
    assert all(torch.equal(a.images, b.images) and not torch.equal(b.images, b.images2)
               for a, b in zip(full, two))


def test_files_the_device_decoder_cannot_take_fall_back_and_are_counted(tmp_path, cifar_images,
                                                                         caplog, monkeypatch):
    """A PNG and a CMYK JPEG are decoded on the CPU by the worker (counted, named in the
    log: the first few of a process); a corrupt JPEG is skipped as on the CPU path; every
    other sample arrives."""
    from pipeline.data import stream

    monkeypatch.setattr(stream, "_FALLBACKS_LOGGED", [0])
    jpgs = [d for d, _ in cifar_images]
    cmyk = encode(Image.open(io.BytesIO(jpgs[7])).convert("CMYK"))
    png = encode(Image.open(io.BytesIO(jpgs[3])), "PNG")
    split = _split(tmp_path, jpgs, [12, 12], extra={3: ("png", png), 7: ("jpg", cmyk),
                                                    9: ("jpg", jpgs[9][:300])})
    with caplog.at_level(logging.WARNING, logger="pipeline.data.stream"):
        loader = make_train_loader(split, None, DEV, rank=0, world_size=1, epoch=0, device="cpu")
        batches = list(loader)
    assert loader.stats["decode_fallback"] == 2 and loader.stats["skipped_decode"] == 1
    assert sorted(valid_idx(batches).tolist()) == [i for i in range(24) if i != 9]
    assert "00000003 (idx 3) is not a JPEG the device decoder takes (not a JPEG)" in caplog.text
    assert "(idx 7) is not a JPEG the device decoder takes (SOF 0xC0, 8-bit, 4 components)" \
        in caplog.text
    # a second pass counts them again but names no more files
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.data.stream"):
        for _ in range(2):
            again = make_train_loader(split, None, DEV, rank=0, world_size=1, epoch=1,
                                      device="cpu")
            list(again)
    assert again.stats["decode_fallback"] == 2
    assert caplog.text.count("is not a JPEG the device decoder takes") == 3  # 5 in all
    assert "further ones counted in data_decode_fallback" in caplog.text
    # the fallback's pixels are PIL's: evaluation equals the CPU path's exactly
    ev = {int(i): x for b in make_eval_loader(split, None, DEV, device="cpu")
          for i, x, v in zip(b.idx, b.images, b.valid) if v}
    ref = {int(i): x for b in make_eval_loader(split, None, replace(DEV, decode="cpu"))
           for i, x, v in zip(b.idx, b.images, b.valid) if v}
    assert ev.keys() == ref.keys() and all(torch.equal(ev[i], ref[i]) for i in ref)


def test_a_file_the_device_decoder_refuses_is_decoded_by_pil_in_the_training_process(
        cifar_images, caplog):
    """Bytes sent as a JPEG that the decoder refuses: decoded by PIL instead (counted);
    bytes nothing decodes: the row is a copy of a good one, marked not ok and counted."""
    good = [d for d, _ in cifar_images[:3]]
    png = encode(Image.open(io.BytesIO(good[1])), "PNG")
    items = [Payload(JPEG, torch.frombuffer(bytearray(d), dtype=torch.uint8), 32, 32, f"s{i}")
             for i, d in enumerate([good[0], png, b"\xff\xd8garbage", good[2]])]
    px = np.asarray(decode_pil(good[1], "RGB"))
    items.append(Payload(PIXELS, torch.from_numpy(px.copy()).reshape(-1), 32, 32, "s4"))
    items = unpack_payloads(pack_payloads(items))
    dec = DeviceDecoder("cifar", train=False, device="cpu")
    with caplog.at_level(logging.WARNING, logger="pipeline.data.device_decode"):
        (x,), ok, counts = dec(items, generator=torch.Generator())
    assert ok.tolist() == [True, True, False, True, True]
    assert counts == {"decode_fallback": 1, "skipped_decode": 1}
    assert "s1: the device decoder refused it" in caplog.text
    assert "s2: does not decode" in caplog.text
    assert np.array_equal(x[1].permute(1, 2, 0).numpy(), px) and torch.equal(x[1], x[4])
    assert torch.equal(x[0], decode(good[0], "RGB"))


def test_decode_options_are_checked():
    with pytest.raises(ValueError, match="decode must be one of cpu, device, auto"):
        LoaderConfig(decode="gpu")
    with pytest.raises(ValueError, match="device_prefetch must be >= 0"):
        LoaderConfig(device_prefetch=-1)
    from pipeline.data.stream import resolve_decode

    assert resolve_decode(LoaderConfig(), "cpu") is None
    assert resolve_decode(LoaderConfig(decode="auto"), "cpu") is None  # CPU-only: the workers
    assert resolve_decode(LoaderConfig(decode="device"), "cpu") == torch.device("cpu")
    assert resolve_decode(LoaderConfig(decode="auto"), "cuda:1") == torch.device("cuda", 1)


def test_device_decode_imports_without_webdataset_or_ray(tmp_path, cifar_images):
    """The GPU node has torch and torchvision but no WebDataset or Ray: the device decode
    and the batched augmentation import and run there."""
    jpg = tmp_path / "a.jpg"
    jpg.write_bytes(cifar_images[0][0])
    script = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('ray', 'mlflow', 'webdataset', 'boto3'):\n"
        "        raise ImportError('blocked: ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import torch\n"
        "from pipeline.data.device_decode import DeviceDecoder, Payload, JPEG\n"
        f"d = open({str(jpg)!r}, 'rb').read()\n"
        "p = Payload(JPEG, torch.frombuffer(bytearray(d), dtype=torch.uint8), 32, 32)\n"
        "dec = DeviceDecoder('cifar', train=True, device='cpu')\n"
        "(x,), ok, _ = dec([p] * 4, generator=torch.Generator())\n"
        "assert x.shape == (4, 3, 32, 32) and bool(ok.all())\n"
        "print('decoded')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "decoded" in out.stdout


def test_a_run_reads_every_split_through_the_device_decoder(tmp_path, cifar_images):
    """The training source of a distributed run with decode="device" hands the worker's
    device to every pass: training, test, and the noisy validation split decoded from the
    bytes the training pass kept."""
    from pipeline.data.manifest import Manifest
    from pipeline.train.shard_source import ShardSource

    split = _split(tmp_path / "s", [d for d, _ in cifar_images], [10, 10])
    m = Manifest.load(split)
    m = Manifest(m.dataset, m.split, m.classes,
                 [replace(s, first_idx=10 * i) for i, s in enumerate(m.shards)])
    m.save(split)
    view = shifted_view(20, cifar_images)
    held = np.zeros(20, bool)
    held[[1, 12]] = True
    src = ShardSource(train_source=str(split), test_source=str(split), view=view,
                      loader_cfg=replace(DEV, batch_size=4), rank=0, world_size=1,
                      held_out=held, device="cpu")
    train = list(src.train_batches(0))
    assert sorted(valid_idx(train).tolist()) == [i for i in range(20) if not held[i]]
    assert src.train_batches(0).loader.decode_device == torch.device("cpu")
    val = list(src.val_batches())
    assert sorted(int(i) for b in val for i in b.idx) == [1, 12]
    test = list(src.test_batches())
    assert sum(int(b.valid.sum()) for b in test) == 20
    for b in (*train, *val, *test):
        assert b.images.shape[1:] == (3, 32, 32) and b.images.dtype == torch.float32


# -- pillow-simd ---------------------------------------------------------------------------------


def test_pil_build_names_the_pil_this_interpreter_imports():
    import PIL

    from pipeline.data.pil_build import main, pil_build

    b = pil_build()
    assert b["version"] == PIL.__version__ and b["libjpeg"].startswith("libjpeg")
    assert b["simd"] == (b["distribution"] == "pillow-simd")
    assert main([]) == 0 and main(["--require-simd"]) == (0 if b["simd"] else 1)


def test_pillow_simd_setup_keeps_pillow_with_one_line_when_the_build_fails(tmp_path):
    """scripts/pillow_simd.sh in a fresh environment whose compiler fails: Pillow is put
    back, one line says why, and the check reports the build the environment has."""
    import os

    if not (ROOT / "scripts" / "pillow_simd.sh").is_file():
        pytest.fail("scripts/pillow_simd.sh is missing")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    import PIL

    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    f"pillow=={PIL.__version__}"], check=True, timeout=600,
                   capture_output=True)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "pillow_simd.sh"), str(py)],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "CC": "false", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("pillow_simd:")]
    assert len(said) == 1 and "did not build" in said[0] and PIL.__version__ in said[0]
    assert out.stdout.strip().splitlines()[-1].startswith(
        f"PIL: pillow {PIL.__version__} (not the SIMD build, libjpeg")
