"""``lccn-predict`` on real CIFAR-10 JPEGs: a classifier logged to a real MLflow store
predicts a folder, a CSV and a converted split alike, as the run's evaluation transform
feeds it; bad input is one line naming the file, and no partial CSV is left."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipeline.data.transforms import build_transform
from pipeline.track.predict import ExportedClassifier, main
from pipeline.track.tracking import Tracker
from pipeline.train.export import Predictor, export_program
from pipeline.train.models import build_model

CLASSES = ("airplane", "cat")


@pytest.fixture(scope="module")
def photos(cifar10_jpeg_tree, tmp_path_factory) -> Path:
    """A user's folder: 6 test JPEGs of each of two classes, ``<class>/<file>``."""
    root = tmp_path_factory.mktemp("photos")
    for c in CLASSES:
        (root / c).mkdir()
        for f in sorted((cifar10_jpeg_tree / "test" / c).iterdir())[:6]:
            shutil.copy(f, root / c / f.name)
    return root


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[str, str, Predictor]:
    """A two-class classifier logged by the tracker to an sqlite MLflow store."""
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    torch.manual_seed(0)
    model = Predictor([build_model("cnn_wide", 2), build_model("cnn_wide", 2)], 2,
                      preset="cifar", class_names=CLASSES)
    tracker = Tracker(tracking_uri=uri, experiment="predict", run_name="r",
                      artifact_location=str(tmp / "artifacts"))
    tracker.start({})
    model_uri = tracker.log_model(model, torch.randn(2, 3, 32, 32))
    tracker.end()
    return uri, model_uri, model


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predicts_a_folder_a_csv_and_a_split_as_the_run_would(photos, logged, tmp_path):
    uri, model_uri, model = logged
    assert main([model_uri, str(photos), "--out", str(tmp_path / "folder.csv"),
                 "--tracking-uri", uri, "--batch-size", "5"]) == 0
    rows = _rows(tmp_path / "folder.csv")
    files = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.jpg"))
    assert [r["key"] for r in rows] == files
    # what the model says on the run's evaluation transform of each image
    tf = build_transform("cifar", train=False)
    x = torch.stack([tf(Image.open(photos / f).convert("RGB")) for f in files])
    conf, pred = model(x).max(1)
    assert [int(r["predicted"]) for r in rows] == pred.tolist()
    assert [r["class"] for r in rows] == [CLASSES[p] for p in pred.tolist()]
    assert [float(r["confidence"]) for r in rows] == pytest.approx(conf.tolist(), abs=1e-6)
    assert "MLFLOW_TRACKING_URI" not in os.environ   # no global MLflow state left behind

    # a CSV of path,label (relative to the CSV's folder): the same predictions by path
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\n" + "".join(f"{photos / f},{f.split('/')[0]}\n"
                                                for f in reversed(files)))
    assert main([model_uri, str(listing), "--out", str(tmp_path / "csv.csv"),
                 "--tracking-uri", uri]) == 0
    by_csv = {Path(r["key"]).relative_to(photos).as_posix(): r["predicted"]
              for r in _rows(tmp_path / "csv.csv")}
    assert by_csv == {r["key"]: r["predicted"] for r in rows}

    # the folder converted to shards (the own-data path): keys <class>/<file>, same answers
    conv = subprocess.run([sys.executable, "-m", "shards", "imagefolder", str(photos),
                           "--out", str(tmp_path / "shards"), "--shard-size", "5",
                           "--workers", "1", "--no-progress"],
                          capture_output=True, text=True)
    assert conv.returncode == 0, conv.stderr
    assert main([model_uri, str(tmp_path / "shards" / "train"), "--out",
                 str(tmp_path / "split.csv"), "--tracking-uri", uri]) == 0
    by_split = {r["key"]: r["predicted"] for r in _rows(tmp_path / "split.csv")}
    assert by_split == {r["key"]: r["predicted"] for r in rows}


def test_bad_input_is_one_line_naming_it_and_leaves_no_csv(photos, logged, tmp_path, capsys):
    uri, model_uri, _ = logged
    bad = tmp_path / "bad"
    shutil.copytree(photos, bad)
    victim = sorted((bad / "cat").iterdir())[2]
    victim.write_bytes(victim.read_bytes()[:40])      # a truncated JPEG
    out = tmp_path / "never.csv"
    assert main([model_uri, str(bad), "--out", str(out), "--tracking-uri", uri]) == 1
    err = capsys.readouterr().err
    assert f"{victim}: not a readable image" in err
    assert not out.exists() and not list(tmp_path.glob("never.csv*"))
    listing = tmp_path / "l.csv"
    listing.write_text("path\nmissing.jpg\n")
    assert main([model_uri, str(listing), "--out", str(out), "--tracking-uri", uri]) == 1
    assert f"{listing}:2: " in capsys.readouterr().err
    assert main(["runs:/0123456789abcdef/model", str(photos), "--out", str(out),
                 "--tracking-uri", uri]) == 1
    assert "cannot load the model" in capsys.readouterr().err


def test_the_exported_program_predicts_as_the_model_without_the_training_hooks(photos,
                                                                              tmp_path):
    """export_program writes a torch.export file (any batch size) and its sidecar; the
    training run's forward hooks (its divergence check) are left behind by Predictor, and
    lccn-predict reads the .pt2 with the preset and class names it records."""
    torch.manual_seed(1)
    net = build_model("small_cnn", 2)
    calls = []
    net.register_forward_hook(lambda m, a, out: calls.append(1))  # as the training run's
    model = Predictor([net], 2, preset="cifar", class_names=CLASSES)
    path = export_program(model, torch.randn(2, 3, 32, 32), tmp_path / "r-model.pt2")
    assert path.is_file() and not list(tmp_path.glob("*partial*"))
    loaded = ExportedClassifier(path)
    assert (loaded.preset, loaded.class_names, loaded.takes_uint8) == ("cifar", CLASSES, False)
    x = torch.randn(5, 3, 32, 32)
    torch.testing.assert_close(loaded(x), model(x))
    assert not calls  # neither the copy nor the program runs the hook
    out = tmp_path / "p.csv"
    assert main([str(path), str(photos), "--out", str(out)]) == 0
    rows = _rows(out)
    transform = build_transform("cifar", train=False)
    with torch.no_grad():
        for r in rows:
            img = Image.open(photos / r["key"]).convert("RGB")
            p = model(transform(img).unsqueeze(0))[0]
            assert int(r["predicted"]) == int(p.argmax()) and r["class"] in CLASSES
            assert float(r["confidence"]) == pytest.approx(float(p.max()), abs=1e-5)
    (tmp_path / "r-model.json").unlink()
    with pytest.raises(FileNotFoundError, match="sidecar is missing"):
        ExportedClassifier(path)
