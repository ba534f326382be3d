"""Build a label view (``.npz``) for one split of shards (no image is decoded, except for
instance-dependent noise).

Usage::

    python -m shards.labelview --split-dir out/cifar10/train \\
        --spec '{"kind": "asymmetric", "rate": 0.4, "seed": 0}' --out views/asym40.npz
    python -m shards.labelview --split-dir out/clothing1m/train --csv my_labels.csv \\
        --out views/annotators.npz

Which labels are clean (``--labels-are-clean`` / ``--no-labels-are-clean``):

- labels-are-clean (the default when ``manifest.dataset`` starts with ``cifar``): the
  dataset's ``label`` field is the clean label. Synthetic noise is applied to it; the view's
  ``clean`` is that label. A sample whose ``clean`` field is set and differs from ``label``
  is an error (the dataset is not clean then).
- otherwise (web datasets: Clothing1M, WebVision): the view's observed label is the
  dataset's ``label`` and its clean label the dataset's ``clean`` (``-1`` where unknown).
  Only ``"dataset"`` (the default spec), ``"csv"`` and ``"clean"`` (if every clean label
  is known) make sense; synthetic noise needs known clean labels.

Instance-dependent noise (``{"kind": "instance", "rate": 0.4, "seed": 0}``, Xia et al. 2020)
draws each flip from the sample's image: this kind alone decodes the split's images, resized
to ``--features-size`` pixels a side (32 by default: CIFAR's own size) and standardised per
channel, as the generator's features (N x 3 x size x size float32 in memory).

``--csv PATH`` is shorthand for ``--spec '{"kind": "csv", "path": PATH}'``; the file's keys
are the dataset's ``key`` field (``--csv-key key``, default) or the shard keys ``%08d`` of
``idx`` (``--csv-key idx``). ``--trusted '{"fraction": 0.1, "seed": 0}'`` adds an LCCN+
trusted subset to any spec. The command prints the realised noise rate and transition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.cli import prog_name
from pipeline.core.labels import LabelView
from pipeline.core.noise import format_transition, make_view, summary
from pipeline.data.manifest import Manifest, ManifestError, sample_key
from pipeline.data.split_labels import read_split_labels, tar_members

_SYNTHETIC = {"symmetric", "asymmetric", "pair_flip", "cifar100_superclass", "open_set",
              "instance"}

# The class order the CIFAR-10 asymmetric map (pipeline.core.noise.CIFAR10_ASYM_MAP) is written
# in, and the map by name: truck->automobile, bird->airplane, deer->horse, cat->dog.
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
CIFAR10_ASYM_BY_NAME = {"truck": "automobile", "bird": "airplane", "deer": "horse",
                        "cat": "dog"}


def map_classes_by_name(spec: dict[str, Any], classes: list[str], *, where: str) -> dict[str, Any]:
    """``spec`` with every ``"asymmetric"`` (CIFAR-10) part fitted to the split's class names.

    The asymmetric map is defined on class names. A split whose classes are the CIFAR-10
    names in the standard order keeps the spec as it is; the same names in another order
    get the equivalent ``"pair_flip"`` on this split's indices; any other class list is
    refused (``ValueError`` naming the split and its classes), since flipping by number
    would corrupt the wrong classes. Other kinds are returned unchanged.
    """
    kind = spec.get("kind")
    if kind == "open_set" and isinstance(spec.get("noise"), dict):
        return {**spec, "noise": map_classes_by_name(spec["noise"], classes, where=where)}
    if kind != "asymmetric":
        return spec
    names = [c.strip().lower() for c in classes]
    if names == list(CIFAR10_CLASSES):
        return spec
    if sorted(names) != sorted(CIFAR10_CLASSES):
        raise ValueError(
            f"{where}: noise kind 'asymmetric' is the CIFAR-10 map by class name "
            f"(truck->automobile, bird->airplane, deer->horse, cat->dog) but this split's "
            f"classes are {classes}; use kind 'pair_flip' with a mapping of its indices")
    mapping = {str(names.index(a)): names.index(b) for a, b in CIFAR10_ASYM_BY_NAME.items()}
    if spec.get("swap_cat_dog"):
        mapping[str(names.index("dog"))] = names.index("cat")
    out = {"kind": "pair_flip", "mapping": mapping}
    out.update({k: v for k, v in spec.items() if k in ("rate", "seed", "exact", "trusted")})
    return out


def read_split_features(split_dir: str | Path, *, size: int = 32) -> np.ndarray:
    """The features instance-dependent noise draws from: every image of the split in ``idx``
    order, RGB, resized to ``size x size`` (bilinear) when it is not already, scaled to
    [0, 1] and standardised per channel over the split; ``(N, 3 * size * size)`` float32.

    Raises ``ManifestError`` naming the shard and member of an image that does not decode
    or an ``idx`` with no image."""
    import io

    from PIL import Image

    split_dir = Path(split_dir)
    man = Manifest.load(split_dir)
    n = man.num_samples
    feats = np.zeros((n, 3, size, size), np.float32)
    seen = np.zeros(n, bool)
    for shard in man.shards:
        path = split_dir / shard.name
        try:
            tar = tarfile.open(path, "r:")
        except tarfile.TarError as e:
            raise ManifestError(f"{path}: not a readable tar archive ({e})") from None
        with tar:
            for member in tar_members(tar, path):
                name = Path(member.name).name
                stem, _, ext = name.partition(".")
                if not member.isfile() or ext.lower() not in ("jpg", "jpeg", "png", "webp"):
                    continue
                where = f"{path}: member {member.name}"
                try:
                    idx = int(stem)
                except ValueError:
                    raise ManifestError(f"{where}: not named by a sample idx") from None
                if not 0 <= idx < n:
                    raise ManifestError(f"{where}: idx {idx} is outside [0, {n})")
                try:
                    img = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                except Exception as e:  # PIL raises several types for a bad image
                    raise ManifestError(f"{where}: cannot decode the image ({e})") from None
                if img.size != (size, size):
                    img = img.resize((size, size), Image.BILINEAR)
                feats[idx] = np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0
                seen[idx] = True
    if not seen.all():
        raise ManifestError(f"{split_dir}: idx {int(np.flatnonzero(~seen)[0])} has no image")
    mean = feats.mean(axis=(0, 2, 3), keepdims=True)
    std = feats.std(axis=(0, 2, 3), keepdims=True)
    feats -= mean
    feats /= np.maximum(std, 1e-6)
    return feats.reshape(n, -1)


def build_view(split_dir: str | Path, spec: dict[str, Any], *, labels_are_clean: bool | None = None,
               csv_key: str = "key", checksums: bool = False,
               features_size: int = 32) -> LabelView:
    """The label view of ``spec`` over the split in ``split_dir`` (see the module docstring
    for ``labels_are_clean``; None picks it from ``manifest.dataset``)."""
    man = Manifest.load(split_dir)
    if labels_are_clean is None:
        labels_are_clean = man.dataset.lower().startswith("cifar")
    lab = read_split_labels(split_dir, checksums=checksums)
    if labels_are_clean:
        bad = np.flatnonzero((lab["clean"] >= 0) & (lab["clean"] != lab["label"]))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{split_dir}: idx {i} has label {int(lab['label'][i])} but clean "
                f"{int(lab['clean'][i])}; its labels are not clean "
                "(pass --no-labels-are-clean)")
        clean = lab["label"]
    else:
        clean = lab["clean"]
        if spec.get("kind") in _SYNTHETIC and (clean < 0).any():
            raise ValueError(
                f"{split_dir}: synthetic noise {spec.get('kind')!r} needs clean labels, but "
                f"{int((clean < 0).sum())} of {len(clean)} samples of dataset "
                f"{man.dataset!r} have none (pass --labels-are-clean if its labels are clean)")
    if csv_key not in ("key", "idx"):
        raise ValueError(f"csv_key must be 'key' or 'idx', got {csv_key!r}")
    keys = list(lab["key"]) if csv_key == "key" else [sample_key(i) for i in lab["idx"]]
    spec = map_classes_by_name(dict(spec), list(man.classes), where=str(split_dir))
    features = (read_split_features(split_dir, size=features_size)
                if spec.get("kind") == "instance" else None)
    view = make_view(spec, clean, man.num_classes, keys=keys, coarse=lab.get("coarse"),
                     observed=lab["label"], features=features)
    return dataclasses.replace(view, split_fingerprint=man.fingerprint())


def _parse_json_arg(text: str, what: str) -> dict[str, Any]:
    """A JSON object given inline or as the path of a ``.json`` file."""
    src = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise SystemExit(f"{what}: {text!r} is neither a JSON object nor a file")
        src = path.read_text()
    try:
        val = json.loads(src)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{what}: invalid JSON ({e})") from None
    if not isinstance(val, dict):
        raise SystemExit(f"{what}: must be a JSON object, got {val!r}")
    return val


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog_name("shards.labelview"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split-dir", required=True, type=Path,
                   help="folder with manifest.json and the split's shards")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--spec", help="noise spec as JSON, or a .json file (default "
                                    '{"kind": "dataset"}: the labels as they are)')
    src.add_argument("--csv", type=Path, help="a key,label file of observed labels")
    p.add_argument("--missing", choices=("raise", "keep"), default="raise",
                   help="with --csv: samples not in the file raise (default) or keep the "
                        "dataset's label")
    p.add_argument("--csv-key", choices=("key", "idx"), default="key",
                   help="with --csv: keys are the dataset's key field (default) or %%08d idx")
    p.add_argument("--trusted", help='trusted subset as JSON, e.g. {"fraction": 0.1, "seed": 0}')
    p.add_argument("--labels-are-clean", action=argparse.BooleanOptionalAction, default=None,
                   help="the dataset's label field is clean (default: dataset name cifar*)")
    p.add_argument("--checksums", action="store_true", help="also verify shard sha256")
    p.add_argument("--features-size", type=int, default=32, metavar="PX",
                   help="instance-dependent noise: images are resized to PX x PX for its "
                        "features (default 32)")
    p.add_argument("--out", required=True, type=Path, help="the .npz view to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.csv is not None:
        spec: dict[str, Any] = {"kind": "csv", "path": str(args.csv), "missing": args.missing}
    elif args.spec is not None:
        spec = _parse_json_arg(args.spec, "--spec")
    else:
        spec = {"kind": "dataset"}
    if args.trusted is not None:
        spec["trusted"] = _parse_json_arg(args.trusted, "--trusted")
    try:
        view = build_view(args.split_dir, spec, labels_are_clean=args.labels_are_clean,
                          csv_key=args.csv_key, checksums=args.checksums,
                          features_size=args.features_size)
    except ValueError as e:  # ManifestError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    view.save(args.out)
    print(f"wrote {args.out}: {json.dumps(view.spec, sort_keys=True)}")
    _print_summary(view)
    return 0


def _print_summary(view: LabelView) -> None:
    s = summary(view)
    print(f"samples {s['num_samples']}, classes {s['num_classes']}, known clean "
          f"{s['known_clean']}, ood {s['ood']}, trusted {s['trusted']}")
    exp = "n/a" if s["expected_rate"] is None else f"{s['expected_rate']:.4f}"
    print(f"noise rate: realised {s['realised_rate']:.4f}, expected {exp}")
    if view.transition is not None:
        print(f"max |realised T - true T| over populated rows: "
              f"{s['max_abs_transition_error']:.4f}")
        print("true T[k, j] = P(observed=j | clean=k):")
        print(format_transition(view.transition))
    if s["known_clean"]:
        print("realised T:")
        print(format_transition(view.realised_transition()))


if __name__ == "__main__":
    sys.exit(main())
