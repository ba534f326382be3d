"""The `images` cell's folder maker: a class folder of real CIFAR-10 JPEGs filed under their
CIFAR-10N labels (the file name keeps the true class), and the scoring of a run's
labels.csv against it."""

from __future__ import annotations

import csv
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    return runpy.run_path(str(ROOT / "benchmarks" / "make_image_folder.py"),
                          run_name="make_image_folder")


def test_the_folder_files_each_image_under_its_human_label_and_scores_labels_csv(
        tool, shared_data, tmp_path):
    human = tool["read_labels"](shared_data / tool["HUMAN_LABELS"], "random1")
    counts = tool["make"](shared_data / "cifar10-jpeg.tar.gz", tmp_path / "f", labels=human,
                          per_class=3)
    files = sorted((tmp_path / "f" / "photos").rglob("*.jpg"))
    assert counts["images"] == len(files) == 30 and counts["test_images"] == 10000
    classes = tool["CIFAR10_CLASSES"]
    wrong = 0
    for f in files:
        cls, num = f.stem.split("-")
        assert classes[human[f"train/{cls}/{num}"]] == f.parent.name
        wrong += f.parent.name != cls
        assert f.read_bytes()[:2] == b"\xff\xd8"  # the JPEG itself
    assert counts["wrong"] == wrong
    with pytest.raises(FileExistsError, match="already holds"):
        tool["make"](shared_data / "cifar10-jpeg.tar.gz", tmp_path / "f", labels=human,
                     per_class=3)
    # a labels.csv as a run writes it: cleaning one wrong label to its true class
    rows = [{"key": f"{f.parent.name}/{f.name}", "observed": f.parent.name,
             "cleaned": f.parent.name} for f in files]
    fix = next(r for r in rows if not Path(r["key"]).name.startswith(r["observed"] + "-"))
    fix["cleaned"] = Path(fix["key"]).name.split("-")[0]
    out = tmp_path / "labels.csv"
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["key", "observed", "cleaned"])
        w.writeheader()
        w.writerows(rows)
    s = tool["score"](out)
    assert s["rows"] == 30 and s["changed"] == 1
    assert s["observed"] == pytest.approx((30 - wrong) / 30)
    assert s["cleaned"] == pytest.approx((31 - wrong) / 30)
