"""The job on one's own images (``jobs/train.py``): a class-folder tree or a CSV of
path,label converted to shards under the run dir (once for every trial of a sweep), the
images recipe with the transform of ``--image-size`` and a chain warm-up of half an epoch's
steps unless ``--warmup-steps`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
from pathlib import Path

from lccn_jobs.cli import local_data_note, normal_run_dir, work_dir
from lccn_jobs.configs import (
    check_pretrained,
    noise_phase_steps,
    prepare,
    warmup_covers_phase,
)
from lccn_jobs.datasets import DatasetJob, dataset_setup
from lccn_jobs.driver import JobRun
from lccn_jobs.sources import SmokeData, split_lines
from pipeline.data.transforms import imagenet_preset
from pipeline.train.methods import get_method
from shards import csvlist, imagefolder
from shards.writer import BadImageError, ShardError

_DOC = """Train on your own images: a class-folder tree or a CSV of path,label, any backbone, on Ray Train.

The data is one of:
  --images DIR   DIR/<class>/<image> (the commonest layout; every image in the class folder,
                 subfolders included), or DIR/<split>/<class>/<image> (then --train-split,
                 --test-split name the splits);
  --csv FILE     rows path,label (optional columns split and clean; paths relative to the
                 CSV's folder), e.g. a web crawl's table of URLs fetched to disk;
  --data ROOT    shards already converted (`lccn-shards imagefolder|csv ...`).
The folder labels (or the CSV's) are the noisy labels trained on. --test-images DIR (a
<class>/<image> tree with the training classes, labels verified) or the CSV's test rows are
the clean test set, reported at the end; without one the run is chosen and reported on the
noisy validation split carved from the training data (--val-fraction, stratified by label).
Conversion writes WebDataset shards under <run-dir>/data/ (a rerun reuses them) and shows
its progress; the images keep their bytes unless --resize-short N. Images that cannot be
read (corrupt, truncated, empty) are skipped, counted and named (--no-skip-bad: stop at the
first); files that are not images are ignored and named; an empty class folder is an error.

Defaults: LCCN on an ImageNet ResNet-50 (its weights in the torch hub cache, put there once
with `python -m pipeline.train.models fetch resnet50`; a timm or torchvision backbone's from
--weights DIR/<timm|tv>-<name>.pth, written by `python -m pipeline.train.models fetch
timm:<name> --out DIR`; --no-pretrained trains from scratch; checked before anything is
converted), 224x224
crops, batch 64, lr 0.01, 30 epochs (3 CE), lr /10 at epoch 20; any timm or torchvision
backbone by name (--model timm:convnext_tiny, --model tv:resnet18).

    python jobs/train.py --images ~/data/pets --test-images ~/data/pets-test \\
        --model timm:convnext_tiny --weights ~/weights/timm-convnext_tiny.pth --image-size 224
    python jobs/train.py --csv ~/data/crawl/labels.csv --no-pretrained --model tv:resnet18
    ray job submit --working-dir . -- python jobs/train.py --images /abs/pets --run-dir /abs/runs
    python -m tune.sweep --job train --space alpha -- --images /abs/pets --run-dir /abs/runs
    python jobs/train.py --smoke-test   # 2 CPU workers, generated images, 5 classes
"""

SMOKE_IMAGE_SIZE = 32
# the chain's warm-up (φ held at the anchor estimate) when --warmup-steps is not given: half
# an epoch's steps per worker. Half the noise phase (the paper's share: 20,000 of CIFAR's
# ~31,000 steps) left LCCN 1.34 points below CE on a from-scratch folder of real human noise,
# half an epoch level with it (benchmarks/results/cifar_real.md, the images recipe)
WARMUP_EPOCHS = 0.5


def add_own_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("own data (one of --images, --csv, --data / --train-shards)")
    g.add_argument("--images", type=Path, default=None, metavar="DIR",
                   help="DIR/<class>/<image> (or DIR/<split>/<class>/<image>): the folder "
                        "names are the (noisy) labels")
    g.add_argument("--csv", type=Path, default=None, metavar="FILE",
                   help="a CSV with columns path,label (optional: split, clean)")
    g.add_argument("--test-images", type=Path, default=None, metavar="DIR",
                   help="a clean test set: DIR/<class>/<image> with the training classes")
    g.add_argument("--image-size", type=int, default=None, metavar="N",
                   help=f"train on NxN crops (the imagenetN transform; default 224, "
                        f"{SMOKE_IMAGE_SIZE} with --smoke-test)")
    g.add_argument("--shards-out", type=Path, default=None, metavar="DIR",
                   help="where the converted shards go (default <run-dir>/data/<name>-<hash>)")
    g.add_argument("--resize-short", type=int, default=0, metavar="N",
                   help="store images with their shorter side at most N (JPEG re-encode; "
                        "0: the original bytes)")
    g.add_argument("--skip-bad", action=argparse.BooleanOptionalAction, default=True,
                   help="images that cannot be read (corrupt, truncated, empty files) are "
                        "left out of the shards, counted and named in the output and in the "
                        "split's manifest (source.skipped); --no-skip-bad stops at the first "
                        "one instead")
    g.add_argument("--convert-workers", type=int, default=1,
                   help="processes writing shards")
    g.add_argument("--shard-size", type=int, default=0, metavar="N",
                   help="images per shard (0: 1,000, fewer for a small set so that every "
                        "worker's loader processes get several shards)")


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:8]


def auto_shard_size(num_images: int, num_workers: int, loader_workers: int) -> int:
    """Images per shard: 1,000 (the WebDataset sweet spot: ~100 MB of web photos) unless
    the split is small, then few enough that every rank's loader processes get about four
    shards each (at least 16 images a shard)."""
    readers = max(1, num_workers) * max(1, loader_workers)
    return int(min(1000, max(16, math.ceil(num_images / (4 * readers)))))


def count_images(src: Path, train_split: str) -> int:
    """The training images of an image tree (flat, or its ``train_split`` folder)."""
    root = src if imagefolder.is_class_tree(src) else src / train_split
    if not root.is_dir():
        return 0
    return sum(len(imagefolder.list_class_files(root / c)[0])
               for c in imagefolder.find_splits(root))


def prepare_data(args: argparse.Namespace, root: Path | None = None, *,
                 job: str = "train") -> list[str]:
    """--images / --csv / --test-images -> shards under ``root/data`` (default the run dir;
    a sweep converts once, under its own folder, before its trials start); returns the log
    lines. Afterwards ``args`` names the converted splits (``train_shards``,
    ``test_shards``) instead of the sources, so a second call does nothing. A rerun on the
    same sources and options reuses the shards already written."""
    sources = [o for o, v in (("--images", args.images), ("--csv", args.csv),
                              ("--data", args.data), ("--train-shards", args.train_shards))
               if v is not None]
    if len(sources) > 1:
        raise SystemExit(f"error: give one of --images, --csv, --data/--train-shards, not "
                         f"{' and '.join(sources)}")
    if args.test_images is not None and args.images is None and args.csv is None:
        raise SystemExit("error: --test-images goes with --images or --csv (with --data, "
                         "convert the test set too and name it with --test-split)")
    if args.images is None and args.csv is None:
        return []
    option = "--images" if args.images is not None else "--csv"
    src = (args.images or args.csv).expanduser().resolve()
    if not (src.is_dir() if args.images is not None else src.is_file()):
        raise SystemExit(f"error: {option} {src}: no such "
                         f"{'folder' if args.images is not None else 'file'}")
    test_src = args.test_images.expanduser().resolve() if args.test_images else None
    if test_src is not None and not test_src.is_dir():
        raise SystemExit(f"error: --test-images {test_src}: no such folder")
    base = Path(root) if root is not None else work_dir(args, job)
    out = (args.shards_out or base / "data" /
           f"{src.stem}-{_digest(src, test_src, args.resize_short)}").expanduser().resolve()
    rows = None
    if args.images is not None:
        n = count_images(src, args.train_split)
    else:
        try:
            rows = csvlist.read_rows(src)  # read (and every file checked) once
        except ShardError as e:
            raise SystemExit(f"error: {e}") from None
        n = sum(1 for r in rows if r["split"] == args.train_split)
    size = args.shard_size or auto_shard_size(n, args.num_workers, args.loader_workers)
    skip_bad = getattr(args, "skip_bad", True)
    opts = dict(shard_size=size, workers=args.convert_workers,
                resize_short=args.resize_short or None, progress=True, skip_bad=skip_bad)
    train, test = args.train_split, args.test_split
    print(f"[{job}] converting {option} {src}" + (f" and --test-images {test_src}"
                                                   if test_src else "") + f" -> {out}",
          flush=True)
    log = []
    try:
        if args.images is not None:
            if imagefolder.is_class_tree(src):
                manifests = imagefolder.convert(src, out, labels_unverified=True,
                                                dataset=src.name, flat_split=train, **opts)
            else:
                if not (src / train).is_dir():
                    raise SystemExit(
                        f"error: --images {src}: neither <class>/<image> folders nor a "
                        f"training split {train!r} (its folders: "
                        f"{imagefolder.find_splits(src)}; name it with --train-split)")
                manifests = imagefolder.convert(src, out, splits=[train],
                                                labels_unverified=True, dataset=src.name,
                                                **opts)
                if (src / test).is_dir() and test_src is None:
                    manifests.update(imagefolder.convert(
                        src, out, splits=[test], dataset=src.name,
                        classes=manifests[train].classes, **opts))
        else:
            manifests = csvlist.convert(src, out, dataset=src.stem, rows=rows,
                                        verified_splits=(test,), **opts)
            if train not in manifests:
                raise SystemExit(f"error: --csv {src}: no rows of the training split "
                                 f"{train!r} (its splits: {sorted(manifests)}; name it with "
                                 f"--train-split)")
        if test_src is not None:
            if not imagefolder.is_class_tree(test_src):
                raise SystemExit(f"error: --test-images {test_src}: not a <class>/<image> "
                                 f"folder")
            manifests.update(imagefolder.convert(
                test_src, out, dataset=src.name, flat_split=test,
                classes=manifests[train].classes, **opts))
    except BadImageError as e:
        raise SystemExit(f"error: {e}" + ("" if skip_bad else
                                          " (--skip-bad leaves such images out, naming them)")
                         ) from None
    except ShardError as e:
        raise SystemExit(f"error: {e}") from None
    for split, m in sorted(manifests.items()):
        log += split_lines(m, where=out / split, job=job)
    log += local_data_note(args, job, out)
    args.data_described = True
    args.train_shards = str(out / train)
    args.test_shards = str(out / test) if test in manifests else None
    args.images = args.csv = args.test_images = None
    if args.test_shards is None:
        log.append(f"[{job}] no clean test set (--test-images, or the CSV's {test!r} rows): "
                   f"the run is chosen and reported on the noisy validation split only")
    return log


@dataclasses.dataclass(frozen=True)
class OwnImagesJob(DatasetJob):
    """A :class:`~lccn_jobs.datasets.DatasetJob` on one's own images: the own-data options,
    their conversion (:func:`prepare_data`), the image preset of ``--image-size`` and the
    warm-up from the data."""

    def get_args_parser(self) -> argparse.ArgumentParser:
        p = super().get_args_parser()
        add_own_data_args(p)
        return p

    def prepare_data(self, args: argparse.Namespace, root: Path) -> list[str]:
        return [] if args.smoke_test else prepare_data(args, root, job=self.name)

    def prepare_run(self, args: argparse.Namespace) -> JobRun:
        """Parsed arguments -> the run's configs and label view (the data converted first,
        nothing trained yet)."""
        args.run_dir = normal_run_dir(args.run_dir)
        # the model's weights before the data is converted (minutes for a large folder)
        check_pretrained(self.config(args), smoke=args.smoke_test)
        data_log = [] if args.smoke_test else prepare_data(args, job=self.name)
        if args.image_size is None:
            args.image_size = SMOKE_IMAGE_SIZE if args.smoke_test else 224
        try:
            transform = imagenet_preset(args.image_size).name
        except ValueError as e:
            raise SystemExit(f"error: --image-size: {e}") from None
        cfg, log = prepare(args, job=self.name, dataset=self.dataset)
        jr = dataset_setup(args, cfg, log + data_log, job=self.name, smoke=self.smoke,
                           transform=transform)
        if "warmup_steps" in cfg.given or args.smoke_test or jr.manifest is None \
                or not get_method(jr.run.method).needs_chain:
            return jr
        per_epoch = noise_phase_steps(jr.run, jr.manifest, args.num_workers)
        if not per_epoch:  # no noise phase: nothing to warm up
            return jr
        steps = sum(per_epoch)
        warmup = max(1, int(round(WARMUP_EPOCHS * steps / len(per_epoch))))
        jr.run = dataclasses.replace(jr.run, lccn=dataclasses.replace(jr.run.lccn,
                                                                      warmup_steps=warmup))
        jr.log.append(f"[{self.name}] warm-up: {warmup:,} steps per worker, {WARMUP_EPOCHS:g} "
                      f"of an epoch's (the noise phase: {steps:,} steps in {len(per_epoch)} "
                      f"epochs; --warmup-steps to choose)")
        note = warmup_covers_phase(jr.run, jr.manifest, args.num_workers, per_epoch=per_epoch)
        jr.run_warnings = [f"[{self.name}] warning: {note}"] if note else []
        return jr


JOB = OwnImagesJob(
    name="train", doc=_DOC, noise={"images": '{"kind": "dataset"}'}, train_split="train",
    test_split="test", smoke=SmokeData(dataset="images", num_classes=5, size=(40, 48),
                                       n_train=240, n_test=60, shard_size=30,
                                       noisy_web_labels=True))
