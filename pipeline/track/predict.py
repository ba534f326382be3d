"""lccn-predict: a trained classifier on a user's images -> a CSV of key, predicted
class, its name and the confidence (the predicted class's probability).

The classifier is the MLflow model a tracked run logs at its end
(:class:`pipeline.train.export.Predictor`: every network, the K classes' probabilities,
the run's transform preset and class names): a ``runs:/<run id>/model`` or ``models:/``
URI of the tracking server, the model's folder on disk, or the ``torch.export`` program a
job writes at its end (``<run-dir>/models/<run>.pt2`` and its ``.json``
sidecar: no MLflow needed). The images are a folder
(recursively), a CSV with a ``path`` column, or a converted split
(:mod:`pipeline.data.images`), transformed as the run's evaluation images were (the
preset's eval geometry and normalisation).

Usage::

    lccn-predict runs:/<run id>/model ~/my_photos --out predictions.csv \\
        --tracking-uri http://mlflow.example:5000
    lccn-predict ./downloaded_model new_images.csv --out predictions.csv --preset clothing1m
    lccn-predict ~/lccn_runs/train/models/RUN.pt2 ~/my_photos --out predictions.csv

The CSV appears only when every image was predicted (written beside, then renamed).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.data.images import input_images
from pipeline.data.transforms import build_sample_transform, build_transform, get_preset
from pipeline.track.tracking import _use_tracking_uri
from pipeline.track.uris import redact_uri

HEADER = ("key", "predicted", "class", "confidence")


class ExportedClassifier(nn.Module):
    """An exported program (:func:`pipeline.train.export.export_program`) with what its
    sidecar ``<name>.json`` records:
    ``preset``, ``class_names``, ``num_classes`` and ``takes_uint8`` (the program
    normalises the images itself)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        path = Path(path)
        meta_path = path.with_suffix(".json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: the exported model's sidecar is missing "
                                    f"(it names the preset and the classes)")
        meta = json.loads(meta_path.read_text())
        self.program = torch.export.load(str(path)).module()
        self.preset = meta.get("preset")
        self.class_names = tuple(meta.get("class_names") or ())
        self.num_classes = int(meta["num_classes"])
        self.takes_uint8 = meta.get("input_dtype") == "uint8"

    def train(self, mode: bool = True) -> ExportedClassifier:
        """The program is fixed in evaluation mode (an exported module has no train())."""
        self.training = bool(mode)
        return self

    def forward(self, images: Tensor) -> Tensor:
        return self.program(images)


def load_classifier(uri: str, *, tracking_uri: str | None = None) -> Any:
    """The logged classifier at ``uri`` (a folder on disk, an MLflow model URI, or the
    run's exported ``.pt2`` program with its sidecar), on the CPU in eval mode. ``tracking_uri``: the server or store ``runs:/`` and ``models:/``
    resolve against (default ``$MLFLOW_TRACKING_URI``)."""
    import mlflow.artifacts
    import mlflow.pytorch

    local = Path(uri).expanduser()
    if local.suffix == ".pt2":  # the run's exported program (models/<run>.pt2)
        if not local.is_file():
            raise FileNotFoundError(f"{local}: no such file")
        return ExportedClassifier(local).eval()
    with tempfile.TemporaryDirectory(prefix="lccn-predict-") as tmp:
        try:
            if not local.exists():  # fetched through the given store
                store = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                # runs:/<run>/model of an MLflow 3 LoggedModel is looked up through the
                # global tracking URI, whatever tracking_uri says: set it for the call
                with (_use_tracking_uri(store) if store else contextlib.nullcontext()):
                    local = Path(mlflow.artifacts.download_artifacts(
                        artifact_uri=uri, dst_path=tmp, tracking_uri=store))
            if not (local / "MLmodel").is_file():
                raise FileNotFoundError(f"{local}: no MLmodel file (not a saved MLflow model)")
            model = mlflow.pytorch.load_model(str(local.resolve()), map_location="cpu")
        except (FileNotFoundError, OSError):
            raise
        except Exception as e:  # MLflow raises its own exception types for a bad URI
            raise ValueError(f"cannot load the model {redact_uri(uri)}: {e}") from None
    return model.eval()


def predict(model: Any, images: Iterable[tuple[str, Any]], *, preset: str,
            batch_size: int = 256, progress_every: float = 30.0
            ) -> Iterator[tuple[str, int, float]]:
    """``(key, predicted class, confidence)`` per image, in the input's order. The images
    go through ``preset``'s evaluation transform: uint8 when the model normalises them
    itself (a run normalised on the device), else normalised floats."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    on_model = getattr(model, "takes_uint8", getattr(model, "normalize", None) is not None)
    transform = (build_sample_transform(preset, train=False) if on_model
                 else build_transform(preset, train=False))
    keys: list[str] = []
    batch: list[torch.Tensor] = []
    done, t0, last = 0, time.perf_counter(), time.perf_counter()

    def flush() -> Iterator[tuple[str, int, float]]:
        with torch.no_grad():
            probs = model(torch.stack(batch))
        conf, pred = probs.max(1)
        yield from zip(keys, pred.tolist(), conf.tolist())
        keys.clear()
        batch.clear()

    for key, img in images:
        keys.append(key)
        batch.append(transform(img))
        if len(batch) == batch_size:
            done += len(batch)
            yield from flush()
            if progress_every and time.perf_counter() - last >= progress_every:
                last = time.perf_counter()
                print(f"predicted {done} images ({done / (last - t0):.0f}/s)", flush=True)
    if batch:
        yield from flush()


def write_predictions(rows: Iterable[tuple[str, int, float]], out: str | os.PathLike, *,
                      class_names: tuple[str, ...] = ()) -> int:
    """Write the CSV atomically (a temporary file beside ``out``, renamed once complete);
    returns the number of rows. ``class``: the class's name, else its index."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".partial")
    n = 0
    try:
        with os.fdopen(fd, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(HEADER)
            for key, pred, conf in rows:
                name = class_names[pred] if class_names else str(pred)
                w.writerow((key, pred, name, f"{conf:.6f}"))
                n += 1
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lccn-predict", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="runs:/<run id>/model, models:/<name>/<version>, the "
                                 "model's folder, or the run's exported program "
                                 "(<run-dir>/models/<run>.pt2)")
    p.add_argument("images", type=Path, help="a folder of images (recursively), a CSV with a "
                                             "'path' column, or a converted split folder")
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    p.add_argument("--preset", default=None,
                   help="the transform preset (default: the one the run recorded in the "
                        "model; needed for a model trained on in-memory data)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow server or store for runs:/ and models:/ URIs (default "
                        "$MLFLOW_TRACKING_URI)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    try:
        model = load_classifier(args.model, tracking_uri=args.tracking_uri)
        preset = args.preset or getattr(model, "preset", None)
        if not preset:
            raise ValueError(f"{redact_uri(args.model)} records no transform preset (a run on "
                             f"in-memory data): give --preset")
        mode = get_preset(preset).mode
        names = tuple(getattr(model, "class_names", ()) or ())
        t0 = time.perf_counter()
        n = write_predictions(predict(model, input_images(args.images, mode=mode),
                                      preset=preset, batch_size=args.batch_size),
                              args.out, class_names=names)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {n} predictions to {args.out} ({time.perf_counter() - t0:.1f}s, preset "
          f"{preset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
