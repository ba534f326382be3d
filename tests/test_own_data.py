"""One's own data: the CSV converter (``lccn-shards csv``), the ``imagenetN`` transform and
``jobs/train.py`` on a plain ``<class>/<image>`` folder of real CIFAR-10 JPEGs or a CSV of
them (conversion, splits, the derived warm-up, the sweep's one conversion). The job's run
on Ray is ``tests/test_jobs.py::test_ray_job_submit_train_on_an_image_folder``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data.manifest import Manifest
from pipeline.data.split_labels import read_split_labels
from pipeline.data.transforms import build_sample_transform, get_preset, imagenet_preset
from lccn_jobs.configs import noise_phase_steps
from lccn_jobs.own_images import JOB as train
from shards import cli, csvlist
from shards.writer import ShardError

REPO = Path(__file__).resolve().parents[1]

CLASSES = ("airplane", "cat", "dog")


def make_own_folder(cifar_tree: Path, out: Path, *, split: str, per_class: int) -> Path:
    """``out/<class>/<file>.jpg``: the first ``per_class`` CIFAR-10 JPEGs of three classes
    of ``split``, in a plain class-folder tree as one's own data comes (one image a level
    deeper, as a folder of subfolders does)."""
    for cls in CLASSES:
        files = sorted((cifar_tree / split / cls).iterdir())[:per_class]
        (out / cls / "more").mkdir(parents=True)
        for i, f in enumerate(files):
            shutil.copy(f, out / cls / ("more" if i == 0 else "") / f.name)
    return out


@pytest.fixture(scope="module")
def own(cifar10_jpeg_tree, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own")
    train_dir = make_own_folder(cifar10_jpeg_tree, root / "photos", split="train", per_class=40)
    test_dir = make_own_folder(cifar10_jpeg_tree, root / "photos-test", split="test",
                               per_class=10)
    rows = ["path,label,split"]
    for d, split in ((train_dir, ""), (test_dir, "test")):
        for f in sorted(d.rglob("*.jpg")):
            rows.append(f"{f.relative_to(root).as_posix()},{f.relative_to(d).parts[0]},{split}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return {"root": root, "train": train_dir, "test": test_dir, "csv": root / "labels.csv"}


# -- lccn-shards csv ---------------------------------------------------------------------------


def test_csv_converts_every_split_with_the_labels_it_lists(own, tmp_path):
    out = tmp_path / "shards"
    assert cli.main(["csv", str(own["csv"]), "--out", str(out), "--no-progress",
                     "--workers", "1", "--shard-size", "50"]) == 0
    train_m, test_m = Manifest.load(out / "train"), Manifest.load(out / "test")
    assert list(train_m.classes) == list(CLASSES) == list(test_m.classes)
    assert (train_m.num_samples, test_m.num_samples) == (120, 30)
    assert len(train_m.shards) == 3  # 120 at 50 a shard
    labels = read_split_labels(str(out / "train"))
    # every label is the class of the folder its path names; web labels: clean unknown
    for key, lab in zip(labels["key"], labels["label"]):
        assert CLASSES[lab] == Path(key).parts[1], key
    assert (np.asarray(labels["clean"]) == -1).all()
    # the test rows are verified: clean = label; rows written in a mixed order
    test_labels = read_split_labels(str(out / "test"))
    assert (np.asarray(test_labels["clean"]) == np.asarray(test_labels["label"])).all()
    assert list(labels["label"][:10]) != sorted(labels["label"][:10])


def test_csv_clean_column_and_explicit_classes(tmp_path, own):
    img = sorted(own["train"].rglob("*.jpg"))[0]
    (tmp_path / "a.jpg").write_bytes(img.read_bytes())
    (tmp_path / "b.jpg").write_bytes(img.read_bytes())
    f = tmp_path / "l.csv"
    f.write_text("label,path,clean,extra\ndog,a.jpg,cat,x\ncat,b.jpg,,y\n\n")
    m = csvlist.convert(f, tmp_path / "out", classes=["dog", "cat"], progress=False,
                        shuffle_seed=None)["train"]
    assert list(m.classes) == ["dog", "cat"]
    labels = read_split_labels(str(tmp_path / "out" / "train"))
    assert list(labels["label"]) == [0, 1] and list(labels["clean"]) == [1, -1]
    assert list(labels["key"]) == ["a.jpg", "b.jpg"]


@pytest.mark.parametrize("text, match", [
    ("file,label\na.jpg,cat\n", r"l\.csv:1: the header needs the columns path,label \(missing path"),
    ("path,label\na.jpg,cat\nnope.jpg,dog\n", r"l\.csv:3: .*nope\.jpg: no such file"),
    ("path,label\na.jpg,\n", r"l\.csv:2: empty label"),
    ("path,label\na.jpg,cat\na.jpg,dog\n", r"l\.csv:3: a\.jpg is listed twice in split 'train' "
                                          r"\(first on line 2\)"),
    ("path,label\n", r"l\.csv: no rows"),
])
def test_bad_csv_rows_name_the_line(tmp_path, own, text, match):
    (tmp_path / "a.jpg").write_bytes(sorted(own["train"].rglob("*.jpg"))[0].read_bytes())
    f = tmp_path / "l.csv"
    f.write_text(text)
    with pytest.raises(ShardError, match=match):
        csvlist.convert(f, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # nothing written before every row is checked


def test_a_label_outside_the_class_list_names_its_line(tmp_path, own):
    (tmp_path / "a.jpg").write_bytes(sorted(own["train"].rglob("*.jpg"))[0].read_bytes())
    f = tmp_path / "l.csv"
    f.write_text("path,label\na.jpg,cat\na.jpg,dog,\n".replace("a.jpg,dog", "a.jpg,bird"))
    with pytest.raises(ShardError, match=r"l\.csv:3: label 'bird' is not in the class list"):
        csvlist.convert(f, tmp_path / "out", classes=["cat", "dog"], progress=False)


# -- the imagenetN transform -------------------------------------------------------------------


def test_imagenet_preset_of_any_size(own):
    img = Image.open(sorted(own["train"].rglob("*.jpg"))[0]).convert("RGB")  # 32x32
    for size in (24, 64):
        p = get_preset(f"imagenet{size}")
        assert p.shape == (3, size, size) and p.mode == "RGB"
        for is_train in (True, False):
            x = build_sample_transform(f"imagenet{size}", train=is_train)(img)
            assert x.shape == (3, size, size) and x.dtype == torch.uint8
    y = get_preset("imagenet24").normalize()(torch.full((2, 3, 4, 4), 255, dtype=torch.uint8))
    assert torch.allclose(y[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224,
                                                      (1 - 0.406) / 0.225]), atol=1e-5)
    with pytest.raises(ValueError, match=r"image size must be an integer in \[8, 1024\], got 4"):
        imagenet_preset(4)
    with pytest.raises(ValueError, match="imagenetN"):
        get_preset("imagenet")


# -- jobs/train.py -----------------------------------------------------------------------------


def _prepare(argv: list[str]):
    args = train.get_args_parser().parse_args(argv)
    return args, train.prepare_run(args)


def test_train_job_on_a_plain_class_folder(own, tmp_path, capsys):
    argv = ["--images", str(own["train"]), "--test-images", str(own["test"]),
            "--run-dir", str(tmp_path), "--no-pretrained", "--model", "tv:resnet18",
            "--image-size", "48", "--epochs", "6", "--pretrain-epochs", "2"]
    args, jr = _prepare(argv)
    assert "converting --images" in capsys.readouterr().out
    train_dir, test_dir = Path(jr.dist.train_source), Path(jr.dist.test_source)
    assert train_dir.parent.parent == tmp_path / "data" and train_dir.name == "train"
    assert jr.dist.preset == "imagenet48" and jr.dist.class_names == CLASSES
    assert jr.run.model.name == "tv:resnet18" and jr.run.method == "lccn"
    assert len(jr.view) == 120 and jr.view.num_classes == 3
    m = Manifest.load(train_dir)
    # 120 images for 2 workers x 2 loader processes: 16-image shards, not one shard of 1,000
    assert len(m.shards) == 8 and max(s.num_samples for s in m.shards) == 16
    assert Manifest.load(test_dir).num_samples == 30
    assert (np.asarray(read_split_labels(str(test_dir))["clean"]) >= 0).all()
    assert (np.asarray(read_split_labels(str(train_dir))["clean"]) == -1).all()
    # the warm-up: half an epoch's steps per worker, said in the log
    per_epoch = noise_phase_steps(jr.run, m, 2)
    assert jr.run.lccn.warmup_steps == max(1, round(sum(per_epoch) / len(per_epoch) / 2))
    assert jr.run.lccn.warmup_steps < per_epoch[0]
    assert any("warm-up:" in line for line in jr.lines())
    # a rerun reuses the shards (same folder, the files untouched)
    before = {p: p.stat().st_mtime_ns for p in train_dir.glob("*.tar")}
    _, jr2 = _prepare(argv + ["--warmup-steps", "7"])
    assert jr2.dist.train_source == jr.dist.train_source and jr2.run.lccn.warmup_steps == 7
    assert {p: p.stat().st_mtime_ns for p in train_dir.glob("*.tar")} == before


def test_train_job_on_a_csv_and_its_test_rows(own, tmp_path):
    _, jr = _prepare(["--csv", str(own["csv"]), "--run-dir", str(tmp_path), "--no-pretrained",
                      "--model", "small_cnn", "--num-workers", "1", "--method", "ce"])
    assert Path(jr.dist.train_source).name == "train" and Path(jr.dist.test_source).name == "test"
    assert jr.dist.preset == "imagenet224" and jr.run.lccn.warmup_steps == 0  # ce: no chain
    assert len(jr.view) == 120


@pytest.mark.parametrize("argv, match", [
    (["--images", "{train}", "--csv", "{csv}"], "give one of --images, --csv, --data/--train-"
                                                "shards, not --images and --csv"),
    (["--data", "{root}", "--test-images", "{test}"], "--test-images goes with --images or --csv"),
    (["--images", "{root}/nowhere"], r"--images .*nowhere: no such folder"),
    (["--images", "{root}"], r"neither <class>/<image> folders nor a training split 'train'"),
    (["--images", "{train}", "--image-size", "2"], r"--image-size: image size must be"),
])
def test_bad_own_data_options_are_one_line(own, tmp_path, argv, match):
    argv = [a.format(**own) for a in argv] + ["--run-dir", str(tmp_path), "--no-pretrained",
                                              "--model", "small_cnn"]
    with pytest.raises(SystemExit, match=match):
        _prepare(argv)


def test_a_sweep_converts_the_data_once_for_every_trial(own, tmp_path):
    from tune.trial import parse_job_args, prepare_job_data, trial_run

    job_args = parse_job_args("train", ["--images", str(own["train"]), "--no-pretrained",
                                        "--model", "small_cnn", "--image-size", "32"])
    lines = prepare_job_data("train", job_args, tmp_path)
    assert any("train: 120 images" in line for line in lines)
    assert job_args.images is None and Path(job_args.train_shards).parent.parent == tmp_path / "data"
    _, args, jr = trial_run({"lccn.alpha": 3.0}, job="train", job_args=job_args,
                            sweep_dir=str(tmp_path), trial_id="t0", tracking_uri=None,
                            experiment="e", parent_run_id=None)
    assert jr.dist.train_source == job_args.train_shards and jr.run.lccn.alpha == 3.0
    assert not (tmp_path / "trials" / "t0" / "data").exists()  # no conversion per trial


# -- bad input through the job (issue 46) ------------------------------------------------------


def _with_bad_files(own, root: Path) -> Path:
    """A copy of the training folder with three unreadable images (random bytes named .jpg,
    an empty file, a JPEG cut after 100 bytes) and two files that are not images (one in a
    class folder, one beside the class folders)."""
    photos = root / "photos"
    shutil.copytree(own["train"], photos)
    (photos / "cat" / "broken.jpg").write_bytes(b"this is not a JPEG at all " * 4)
    (photos / "dog" / "empty.jpg").write_bytes(b"")
    real = sorted(own["train"].rglob("*.jpg"))[0].read_bytes()
    (photos / "airplane" / "cut.jpg").write_bytes(real[:100])
    (photos / "cat" / "notes.txt").write_text("not an image")
    (photos / "README.md").write_text("my photos")
    return photos


BAD_KEYS = ["airplane/cut.jpg", "cat/broken.jpg", "dog/empty.jpg"]


def test_the_job_skips_unreadable_images_naming_them_and_the_files_that_are_not_images(
        own, tmp_path, capsys):
    photos = _with_bad_files(own, tmp_path)
    argv = ["--images", str(photos), "--test-images", str(own["test"]), "--run-dir",
            str(tmp_path / "runs"), "--no-pretrained", "--model", "small_cnn",
            "--image-size", "32"]
    _, jr = _prepare(argv)
    out = capsys.readouterr().out + "\n".join(jr.lines())
    assert len(jr.view) == 120 and jr.view.num_classes == 3  # the 3 bad ones left out
    assert "[train] train: 120 images, 3 classes" in out
    assert "[train] train: skipped 3 unreadable image(s)" in out
    assert "dog/empty.jpg: empty file (0 bytes)" in out
    assert "cat/broken.jpg: not a valid image (no image format PIL reads: 104 bytes" in out
    assert "BytesIO" not in out
    assert "airplane/cut.jpg: not a valid image" in out
    assert "[train] train: ignored 2 file(s) that are not images" in out
    assert "    README.md" in out and "    cat/notes.txt" in out
    m = Manifest.load(jr.dist.train_source)
    assert sorted(m.source["skipped"]["keys"]) == BAD_KEYS and m.source["skipped"]["count"] == 3
    assert m.source["ignored"] == ["README.md", "cat/notes.txt"]
    assert not set(read_split_labels(jr.dist.train_source)["key"]) & set(BAD_KEYS)
    # opt out: the first bad image stops the conversion, and the message names the flag
    with pytest.raises(SystemExit, match=r"error: .*(cut|broken|empty)\.jpg: .*--skip-bad "
                                         r"leaves such images out"):
        _prepare(argv + ["--no-skip-bad"])


def test_a_data_run_says_what_its_shards_hold_and_what_the_converter_skipped(own, tmp_path):
    photos = _with_bad_files(own, tmp_path)
    shards_root = tmp_path / "shards"
    assert cli.main(["imagefolder", str(photos), "--out", str(shards_root), "--no-progress",
                     "--skip-bad", "--shard-size", "40"]) == 0
    _, jr = _prepare(["--data", str(shards_root), "--run-dir", str(tmp_path / "runs"),
                      "--no-pretrained", "--model", "small_cnn", "--image-size", "32"])
    lines = "\n".join(jr.lines())
    assert f"[train] train: 120 images, 3 classes in {shards_root / 'train'}" in lines
    assert "[train] train: skipped 3 unreadable image(s)" in lines and "dog/empty.jpg" in lines


def test_an_empty_class_folder_is_refused_naming_it(own, tmp_path):
    photos = tmp_path / "photos"
    shutil.copytree(own["train"], photos)
    (photos / "bird").mkdir()
    (photos / "bird" / "Thumbs.db").write_bytes(b"\0")
    with pytest.raises(SystemExit, match=rf"empty class folder\(s\) {photos / 'bird'}: no "
                                         rf"image files .*only bird/Thumbs\.db.*remove it"):
        _prepare(["--images", str(photos), "--test-images", str(own["test"]), "--run-dir",
                  str(tmp_path / "runs"), "--no-pretrained", "--model", "small_cnn"])
    assert not list((tmp_path / "runs").rglob("manifest.json"))


@pytest.mark.parametrize("body, match", [
    # an unterminated quote on line 3 swallows the rest (beyond csv's field limit)
    ('"{a},cat\n' + "{a},dog\n" * 12000, r"l\.csv:3: a quote opened on line 3 is never closed"),
    ('"{a},cat\n{a},dog\n', r"l\.csv:3: a quote opened on line 3 is never closed"),
    ("{a},dog,stray\n", r"l\.csv:3: 3 cells, but the header has 2 columns \(extra: 'stray'\)"),
])
def test_a_malformed_csv_row_stops_the_job_naming_its_line(own, tmp_path, body, match):
    img = sorted(own["train"].rglob("*.jpg"))[0]
    f = tmp_path / "l.csv"
    f.write_text("path,label\n" + f"{img},cat\n" + body.format(a=img))
    with pytest.raises(SystemExit, match=match):
        _prepare(["--csv", str(f), "--run-dir", str(tmp_path / "runs"), "--no-pretrained",
                  "--model", "small_cnn"])
    assert not (tmp_path / "runs" / "data").exists()


def test_a_label_file_with_an_unterminated_quote_names_its_line(tmp_path):
    from pipeline.core.noise import from_csv

    f = tmp_path / "labels.csv"
    f.write_text("key,label\na,0\n\"b,1\n" + "c,1\n" * 20000)
    with pytest.raises(ValueError, match=r"labels\.csv:3: a quote opened on line 3"):
        from_csv(f, ["a", "b", "c"], 2)


def test_pretrained_weights_are_checked_before_anything_is_converted(own, tmp_path,
                                                                     monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    base = ["--images", str(own["train"]), "--run-dir", str(tmp_path / "runs"),
            "--model", "timm:resnet18", "--image-size", "32"]
    with pytest.raises(SystemExit, match=r"--model timm:resnet18 with ImageNet weights "
                                         r"\(--pretrained\) needs --weights FILE.*"
                                         r"`python -m pipeline\.train\.models fetch "
                                         r"timm:resnet18 --out DIR` \(it writes "
                                         r"DIR/timm-resnet18\.pth\).*--no-pretrained"):
        _prepare(base)
    with pytest.raises(SystemExit, match=r"--weights .*nope\.pth: no such file"):
        _prepare(base + ["--weights", str(tmp_path / "nope.pth")])
    assert not (tmp_path / "runs").exists()  # nothing converted
    text = train.get_args_parser().format_help()
    assert "resnet50 only" not in text and "timm-convnext_tiny.pth" in text
