"""A user's folder of noisy-labelled images, made from the CIFAR-10 JPEG tarball: the input of
the `images` recipe's do-no-harm cell (``jobs/train.py --images``; cifar_real.md).

``OUT/photos/<label>/<class>-<NNNN>.jpg``: the first ``--per-class`` training JPEGs of each
class (the files the memorisation protocol trains on), each filed under its label from
``--labels`` (a CIFAR-10N column joined on the file key, or ``clean``); the file name keeps
the true class, so the job's ``labels.csv`` can be scored afterwards.
``OUT/photos-test/<class>/<NNNN>.jpg``: the 10,000 test JPEGs, clean. The JPEG bytes are
copied as they are. Usage::

    python benchmarks/make_image_folder.py --labels random1 --out FOLDER
    python jobs/train.py --images FOLDER/photos --test-images FOLDER/photos-test \\
        --model cnn_wide --no-pretrained --image-size 32 --method lccn --seed 0
    python benchmarks/make_image_folder.py --score FOLDER/photos RUN_DIR/label_issues/*/labels.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_data import DEFAULT_DATA, HUMAN_LABELS  # noqa: E402
from pipeline.data.cifar_memory import CIFAR10_CLASSES  # noqa: E402


def read_labels(path: Path, column: str) -> dict[str, int]:
    """``column`` of the CIFAR-10N label file by file key (``train/<class>/<NNNN>``)."""
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        if column not in (rows.fieldnames or []):
            raise ValueError(f"{path}: no column {column!r} (has {rows.fieldnames})")
        return {r["key"]: int(r[column]) for r in rows}


def make(tar_path: Path, out: Path, *, labels: dict[str, int] | None, per_class: int) -> dict:
    """Write the folder; returns the counts (images, wrong labels, test images)."""
    train, test = out / "photos", out / "photos-test"
    if train.exists() or test.exists():
        raise FileExistsError(f"{out} already holds photos/ or photos-test/: choose a new --out")
    n = wrong = n_test = 0
    with tarfile.open(tar_path, "r:gz") as tar:
        for m in tar:
            parts = m.name.strip("/").split("/")
            if not m.isfile() or len(parts) != 3 or not parts[2].endswith(".jpg"):
                continue
            split, cls, name = parts
            if split == "test":
                dst = test / cls / name
                n_test += 1
            elif int(name[:-4]) < per_class:
                key = f"train/{cls}/{name[:-4]}"
                label = CIFAR10_CLASSES[labels[key]] if labels is not None else cls
                wrong += label != cls
                dst = train / label / f"{cls}-{name}"
                n += 1
            else:
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(tar.extractfile(m).read())
    if n != 10 * per_class:
        raise ValueError(f"{tar_path}: {n} training JPEGs written, expected {10 * per_class}")
    return {"images": n, "wrong": wrong, "test_images": n_test}


def score(labels_csv: Path) -> dict:
    """The accuracy of a run's ``labels.csv`` (observed and cleaned) against the true class
    each file name keeps."""
    with open(labels_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{labels_csv}: no rows")
    truth = [Path(r["key"]).name.split("-")[0] for r in rows]
    if not set(truth) <= set(CIFAR10_CLASSES):
        raise ValueError(f"{labels_csv}: keys are not <class>-<NNNN>.jpg files of this folder")
    obs = sum(t == r["observed"] for t, r in zip(truth, rows)) / len(rows)
    cleaned = sum(t == r["cleaned"] for t, r in zip(truth, rows)) / len(rows)
    changed = sum(r["cleaned"] != r["observed"] for r in rows)
    return {"rows": len(rows), "observed": obs, "cleaned": cleaned, "changed": changed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", default="random1",
                   help="a column of the CIFAR-10N label file (random1, aggre) or clean")
    p.add_argument("--per-class", type=int, default=1000)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path)
    p.add_argument("--score", nargs="+", type=Path, metavar="LABELS_CSV",
                   help="score labels.csv files of runs on such a folder instead")
    args = p.parse_args(argv)
    if args.score:
        for f in args.score:
            s = score(f)
            print(f"{f}: {s['rows']} rows, observed labels {100 * s['observed']:.2f}% right, "
                  f"cleaned {100 * s['cleaned']:.2f}% ({s['changed']} changed)")
        return 0
    if args.out is None:
        p.error("--out is required to make a folder")
    labels = None if args.labels == "clean" else read_labels(args.data / HUMAN_LABELS,
                                                             args.labels)
    c = make(args.data / "cifar10-jpeg.tar.gz", args.out, labels=labels,
             per_class=args.per_class)
    print(f"{args.out}/photos: {c['images']} images, {c['wrong']} labels wrong "
          f"({100 * c['wrong'] / c['images']:.2f}%); {args.out}/photos-test: "
          f"{c['test_images']} clean test images")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
