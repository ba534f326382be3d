"""The job scripts: paper presets, configs built from the command line, and
``ray job submit`` of the quickstart against a head node this test starts."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from lccn_jobs import digits as quickstart_ray
from lccn_jobs import driver, recipes, reporting, sources
from lccn_jobs.configs import prepare, warmup_covers_phase
from lccn_jobs.datasets import CIFAR as cifar_lccn
from lccn_jobs.datasets import CLOTHING1M as clothing1m_lccn
from lccn_jobs.datasets import WEBVISION as webvision_divide_lccn

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")


def _configs(job, argv):
    """The job's configs (``lccn_jobs.configs.JobConfig``) of ``argv`` and their run."""
    cfg = job.config(job.get_args_parser().parse_args(argv))
    return cfg, cfg.run


def test_cifar_preset_is_the_papers():
    cfg, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.model.name == "preact_resnet32" and run.optim.batch_size == 128
    assert run.optim.epochs == 120 and run.optim.milestones == (40, 80)
    assert cfg.lr_values == (0.5, 0.1, 0.01) and run.optim.weight_decay == 5e-4
    # the paper's 20,000 warm-up steps; the estimate is the anchor-point one, not the
    # paper's Eq. 8, which collapses from a weak start (docs/fidelity.md; --warmup eq8)
    assert run.lccn.warmup_steps == 20_000 and run.lccn.warmup == "anchor"
    assert run.lccn.alpha == 1.0 and not run.lccn.anneal
    _, run100 = _configs(cifar_lccn, ["--data", "/x", "--dataset", "cifar100"])
    assert run100.lccn.warmup == "identity"


def test_a_recipe_value_the_method_never_reads_stays_out():
    """The digits recipe's LCCN target and ramp (sample, 0) are for LCCN; run with
    divide_lccn, which never reads them, the job keeps the library's defaults, and given on
    the command line they reach the config (where DivideLCCN refuses them)."""
    _, run = _configs(quickstart_ray.DIGITS, [])
    assert (run.lccn.targets, run.lccn.ramp_epochs) == ("sample", 0.0)
    _, run = _configs(quickstart_ray.DIGITS, ["--method", "divide_lccn"])
    assert (run.lccn.targets, run.lccn.ramp_epochs) == ("posterior", 1.0)
    _, run = _configs(quickstart_ray.DIGITS, ["--method", "divide_lccn", "--targets", "map"])
    assert run.lccn.targets == "map"


def test_weight_average_is_off_in_the_recipes_and_an_option_of_every_job():
    _, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.optim.ema_decay == 0.0
    cfg, run = _configs(cifar_lccn, ["--data", "/x", "--ema-decay", "0.9999"])
    assert run.optim.ema_decay == 0.9999 and "ema_decay" in cfg.given
    _, run = _configs(webvision_divide_lccn, ["--data", "/x", "--ema-decay", "0.999"])
    assert run.optim.ema_decay == 0.999
    with pytest.raises(SystemExit, match="ema_decay must be in"):
        _configs(cifar_lccn, ["--data", "/x", "--ema-decay", "1"])


def test_norm_weight_decay_is_an_option_of_every_job_and_reaches_the_optimiser():
    from pipeline.train.members import param_groups
    from pipeline.train.models import build_model

    # the presets leave the normalisation layers and biases out of the penalty (the paper's
    # released code); DivideMix's own recipe keeps its authors' one penalty; the option wins
    for module, argv in ((cifar_lccn, []), (clothing1m_lccn, []), (webvision_divide_lccn, [])):
        _, run = _configs(module, ["--data", "/x", *argv])
        assert run.optim.norm_weight_decay == 0.0, module
    _, run = _configs(cifar_lccn, ["--data", "/x", "--method", "dividemix"])
    assert run.optim.norm_weight_decay is None
    cfg, run = _configs(cifar_lccn, ["--data", "/x", "--norm-weight-decay", "0"])
    assert run.optim.norm_weight_decay == 0.0 and "norm_weight_decay" in cfg.given
    groups = param_groups(build_model(run.model.name, 10), run.optim.weight_decay,
                          run.optim.norm_weight_decay)
    assert [g["weight_decay"] for g in groups] == [run.optim.weight_decay, 0.0]
    _, run = _configs(webvision_divide_lccn, ["--data", "/x", "--norm-weight-decay", "1e-5"])
    assert run.optim.norm_weight_decay == 1e-5
    with pytest.raises(SystemExit, match="norm_weight_decay must be >= 0"):
        _configs(cifar_lccn, ["--data", "/x", "--norm-weight-decay", "-1"])


def test_refresh_steps_is_an_option_of_the_lccn_jobs():
    _, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.lccn.refresh_steps == 1
    _, run = _configs(cifar_lccn, ["--data", "/x", "--refresh-steps", "200"])
    assert run.lccn.refresh_steps == 200
    with pytest.raises(SystemExit, match="refresh_steps must be an integer >= 1"):
        _configs(cifar_lccn, ["--data", "/x", "--refresh-steps", "0"])


def test_warmup_prior_is_an_option_of_the_lccn_jobs():
    _, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.lccn.warmup_prior == "model"
    _, run = _configs(webvision_divide_lccn, ["--data", "/x", "--warmup-prior", "deconvolved"])
    assert run.lccn.warmup_prior == "deconvolved"
    with pytest.raises(SystemExit):
        _configs(cifar_lccn, ["--data", "/x", "--warmup-prior", "clean"])


def test_collapse_val_drop_reaches_the_monitor():
    _, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.monitor.val_drop == 0.10 and not run.monitor.stop
    _, run = _configs(cifar_lccn, ["--data", "/x", "--collapse-val-drop", "0.3"])
    assert run.monitor.val_drop == 0.3


def test_bn_momentum_is_an_option_of_every_job_and_reaches_every_batch_norm_layer():
    from torch import nn

    from pipeline.train.models import build_model

    _, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.model.bn_momentum is None
    cfg, run = _configs(cifar_lccn, ["--data", "/x", "--bn-momentum", "0.003"])
    assert run.model.bn_momentum == 0.003 and "bn_momentum" in cfg.given
    model = build_model(run.model.name, 10, bn_momentum=run.model.bn_momentum)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) > 10 and {m.momentum for m in bns} == {0.003}
    _, run = _configs(webvision_divide_lccn, ["--data", "/x", "--bn-momentum", "0.01"])
    assert run.model.bn_momentum == 0.01
    with pytest.raises(SystemExit, match=r"bn_momentum must lie in \(0, 1\].*0\.997 is 0\.003"):
        _configs(cifar_lccn, ["--data", "/x", "--bn-momentum", "1.5"])


def test_init_from_is_resolved_before_any_worker_starts(tmp_path):
    import torch

    ckpt = tmp_path / "train" / "ce" / "checkpoint_000003"
    ckpt.mkdir(parents=True)
    torch.save({"models": [], "global_step": 3}, ckpt / "state.pt")
    (ckpt / "meta.json").write_text(json.dumps({"global_step": 3}))

    def dist(where):
        args = cifar_lccn.get_args_parser().parse_args(
            ["--data", "/x", "--no-tracking", "--run-dir", str(tmp_path / "new"),
             "--init-from", str(where)])
        return driver.dist_config(args, cifar_lccn.config(args), run_name="r",
                                  train="/x/train", test=None, class_names=[],
                                  transform="cifar")

    assert dist(tmp_path).init_from == str((ckpt / "state.pt").resolve())
    with pytest.raises(SystemExit, match="--init-from .*nowhere: no state.pt"):
        dist(tmp_path / "nowhere")
    # a run resuming from its own checkpoints ignores it, resolvable or not
    (tmp_path / "new" / "train" / "r" / "checkpoint_000001").mkdir(parents=True)
    assert dist(tmp_path / "nowhere").init_from is None


def test_web_presets_are_the_papers():
    args = clothing1m_lccn.get_args_parser().parse_args(["--data", "/x"])
    cfg = clothing1m_lccn.config(args)
    run = cfg.run
    assert run.model.name == "resnet50" and cfg.pretrained
    assert (run.optim.batch_size, run.optim.lr, run.optim.epochs) == (32, 0.001, 5)
    assert run.optim.milestones == () and run.optim.weight_decay == 1e-3
    assert run.lccn.warmup_steps == 40_000 and run.lccn.anneal
    assert args.train_split == "noisy_train" and json.loads(args.noise) == {"kind": "dataset"}
    args = webvision_divide_lccn.get_args_parser().parse_args(["--data", "/x"])
    run = webvision_divide_lccn.config(args).run
    assert run.model.name == "inception_resnet_v2" and run.optim.batch_size == 64
    assert run.optim.lr == 0.01 and run.optim.milestones == (40,) and run.optim.lr_decay == 0.1
    assert run.lccn.anneal and args.test_split == "val"


def test_webvision_job_runs_divide_lccn_with_dividemix_web_settings():
    _, run = _configs(webvision_divide_lccn, ["--data", "/x"])
    assert run.method == "divide_lccn"
    assert run.divide.mixmatch_alpha == 0.5 and run.divide.lambda_u == 0.0
    assert run.divide.p_threshold == 0.5 and not run.divide.conf_penalty
    _, run = _configs(webvision_divide_lccn, ["--data", "/x", "--method", "dividemix",
                                              "--lambda-u", "25", "--conf-penalty"])
    assert run.method == "dividemix" and run.divide.lambda_u == 25 and run.divide.conf_penalty
    _, run = _configs(cifar_lccn, ["--data", "/x"])
    assert run.method == "lccn" and run.divide.mixmatch_alpha == 4.0  # DivideMix's CIFAR


@pytest.mark.parametrize("module, dataset, extra", [
    (cifar_lccn, "cifar10", []), (cifar_lccn, "cifar100", ["--dataset", "cifar100"]),
    (clothing1m_lccn, "clothing1m", []), (webvision_divide_lccn, "webvision", [])])
def test_every_method_runs_its_recipe_from_the_presets_table(module, dataset, extra):
    """The configs a job builds for each --method are the recipe of docs/methods.md's
    presets table (recipes.recipe): DivideMix's own schedule for dividemix/divide_lccn
    where it has one, the dataset's for the rest; an option on the command line wins."""
    from pipeline.core.config import RunConfig
    from pipeline.core.options import value_at
    from pipeline.train.methods import get_method, registered

    for method in registered():
        cfg, run = _configs(module, ["--data", "/x", "--method", method, *extra])
        r = recipes.recipe(dataset, method)
        assert cfg.recipe is r and cfg.lr_values == r.lr_values
        assert cfg.pretrained == r.pretrained
        # every value the recipe names, but those the method never reads (the library's)
        for path, value in r.point.items():
            if path == "method":
                assert run.method == method
            elif path in get_method(method).ignores:
                assert value_at(run, path) == value_at(RunConfig(), path)
            else:
                assert value_at(run, path) == value, (dataset, method, path)
        # and the library's default for every field it does not name
        assert (run.lccn.alpha, run.divide.temperature, run.optim.lr_decay) == (1.0, 0.5, 0.1)
    if dataset.startswith("cifar"):
        _, run = _configs(module, ["--data", "/x", "--method", "dividemix", *extra])
        assert (run.model.name, run.optim.epochs, run.optim.batch_size) == \
            ("preact_resnet18", 300, 64)
        _, run = _configs(module, ["--data", "/x", "--method", "dividemix", "--epochs", "70",
                                   "--lambda-u", "0", *extra])
        assert run.optim.epochs == 70 and run.divide.lambda_u == 0 and run.optim.lr == 0.02
    if dataset == "clothing1m":
        _, run = _configs(module, ["--data", "/x", "--method", "dividemix"])
        assert run.divide.conf_penalty and run.optim.epochs == 80
        _, run = _configs(module, ["--data", "/x", "--method", "dividemix",
                                   "--no-conf-penalty"])
        assert not run.divide.conf_penalty


def test_lr_values_become_the_phase_learning_rates(tmp_path):
    """--lr-values 0.5 0.1 0.01 with milestones 40 80 gives exactly those rates."""
    import torch

    from pipeline.cluster.worker import DistConfig, _scheduler

    cfg, run = _configs(cifar_lccn, ["--data", "/x"])
    dist = DistConfig(run_name="r", run_dir=str(tmp_path), train_source=str(tmp_path),
                      lr_values=cfg.lr_values)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=run.optim.lr)
    sched = _scheduler(opt, run, dist)
    rates = []
    for _ in range(120):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates[0] == rates[39] == pytest.approx(0.5)
    assert rates[40] == rates[79] == pytest.approx(0.1)
    assert rates[80] == rates[119] == pytest.approx(0.01)


@pytest.mark.parametrize("argv, lr, milestones, values", [
    (["--lr", "0.1"], 0.1, [40, 80], [0.1, 0.02, 0.002]),  # the recipe's phases from --lr
    (["--lr", "0.1", "--lr-decay", "0.5"], 0.1, [40, 80], []),  # 0.1, 0.05, 0.025
    (["--milestones", "60"], 0.5, [60], []),  # the recipe's lr, /10 at epoch 60
    (["--lr-values", "0.2", "0.02", "0.002"], 0.5, [40, 80], [0.2, 0.02, 0.002]),
    ([], 0.5, [40, 80], [0.5, 0.1, 0.01]),
])
def test_schedule_options_replace_the_recipes_piecewise_rates(argv, lr, milestones, values):
    """The CIFAR recipe runs per-phase rates (0.5 / 0.1 / 0.01); --lr scales them, and
    --milestones or --lr-decay without --lr-values replace them with lr x lr-decay at each
    milestone: no schedule option is silently ignored."""
    cfg, run = _configs(cifar_lccn, ["--data", "/x", *argv])
    assert (run.optim.lr, list(run.optim.milestones)) == (pytest.approx(lr), milestones)
    assert list(cfg.lr_values) == pytest.approx(values)


def test_a_warm_up_that_outlasts_the_lccn_phase_is_warned_about():
    """δ at least the LCCN phase's steps per worker: Eq. 7 never reads the counts, and an α
    sweep would compare identical chains. The steps are the loader's: 1,000 images in three
    shards (334, 333, 333), 2 workers, global batch 64 (32 per worker): one rank reads two
    shards, 667 samples -> 21 steps an epoch (the held-out validation samples leave the
    batches, not the count), 2 LCCN epochs of 3 -> 42."""
    from pipeline.data.manifest import Manifest, ShardInfo

    man = Manifest(dataset="d", split="train", classes=list("abcdefghij"),
                   shards=[ShardInfo(f"s-{i}.tar", n, "0" * 64, 100)
                           for i, n in enumerate((334, 333, 333))])
    argv = ["--data", "/x", "--epochs", "3", "--pretrain-epochs", "1", "--milestones", "1",
            "--lr-values", "0.1", "0.01", "--batch-size", "64"]
    _, run = _configs(cifar_lccn, argv)  # the preset's δ: 20,000 steps
    note = warmup_covers_phase(run, man, 2)
    assert note is not None and "20,000 covers the whole LCCN phase (2 epochs, 42 steps per " \
                                "worker)" in note and "one epoch: 21" in note
    _, run = _configs(cifar_lccn, argv + ["--warmup-steps", "41"])
    assert warmup_covers_phase(run, man, 2) is None
    _, run = _configs(cifar_lccn, argv + ["--warmup-steps", "42"])
    assert warmup_covers_phase(run, man, 2) is not None
    _, run = _configs(cifar_lccn, argv + ["--method", "ce"])  # no chain, nothing to say
    assert warmup_covers_phase(run, man, 2) is None
    _, run = _configs(cifar_lccn, argv[:5] + ["3"] + argv[6:])  # all CE: no LCCN phase
    assert run.optim.pretrain_epochs == run.optim.epochs
    assert warmup_covers_phase(run, man, 2) is None


def _log(argv: list[str]) -> str:
    args = cifar_lccn.get_args_parser().parse_args(argv)
    return "\n".join(prepare(args, job="j", dataset="cifar10")[1])


def test_the_preset_note_says_when_the_command_line_changed_the_schedule():
    assert "preset cifar10: the first 40 epochs (lr 0.5) are the CE pre-training" in \
        _log(["--data", "/x"])
    log = _log(["--data", "/x", "--epochs", "2", "--pretrain-epochs", "1"])
    assert "preset cifar10, with --epochs --pretrain-epochs from the command line (the " \
           "preset itself: the first 40 epochs" in log


def test_own_images_from_scratch_warm_up_for_a_third_of_the_run():
    """The images recipe's 3 CE epochs are for an ImageNet backbone; with --no-pretrained a
    third of the epochs are CE unless --pretrain-epochs is given, and the job says so."""
    from lccn_jobs.own_images import JOB as own_images

    def run(*extra):
        args = own_images.get_args_parser().parse_args(
            ["--images", "/x", "--model", "cnn_wide", "--run-dir", "/tmp/x", *extra])
        cfg, log = prepare(args, job="train", dataset="images")
        return cfg.run.optim.epochs, cfg.run.optim.pretrain_epochs, "\n".join(log)

    assert run()[:2] == (30, 3)
    epochs, pre, log = run("--no-pretrained")
    assert (epochs, pre) == (30, 10)
    assert ("--no-pretrained: the cross-entropy warm-up is 10 of the 30 epochs (the images "
            "recipe's 3 are for an ImageNet backbone; --pretrain-epochs to choose)") in log
    assert run("--no-pretrained", "--epochs", "12")[:2] == (12, 4)
    epochs, pre, log = run("--no-pretrained", "--pretrain-epochs", "5")
    assert (epochs, pre) == (30, 5) and "cross-entropy warm-up is" not in log


def test_fewer_epochs_than_the_pre_training_is_one_clear_line():
    with pytest.raises(SystemExit, match=r"--epochs 5 is fewer than --pretrain-epochs 40 "
                                         r"\(the cifar10 recipe's\)"):
        _configs(cifar_lccn, ["--data", "/x", "--epochs", "5"])
    with pytest.raises(SystemExit, match=r"--epochs 2 is fewer than --pretrain-epochs 5, "):
        _configs(cifar_lccn, ["--data", "/x", "--epochs", "2", "--pretrain-epochs", "5"])
    # --smoke-test sets its own schedule, and says which given options it replaced
    args = cifar_lccn.get_args_parser().parse_args(["--smoke-test", "--epochs", "1",
                                                    "--run-dir", "/tmp/x"])
    cfg, log = prepare(args, job="j", dataset="cifar10")
    assert (cfg.run.optim.epochs, cfg.run.optim.pretrain_epochs) == (3, 1)
    assert "(these replace --epochs from the command line)" in "\n".join(log)


def test_sigterm_takes_the_ctrl_c_path():
    """After stop_on_sigterm, SIGTERM runs whatever SIGINT handler is installed (Ray Train's
    graceful abort while a run trains), and without one raises KeyboardInterrupt."""
    import signal

    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    seen = []
    try:
        assert driver.stop_on_sigterm() == old_term  # what run_job restores afterwards
        signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs between bytecodes of the main thread
        assert seen == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def test_lr_values_that_do_not_fit_the_milestones_are_refused_before_ray():
    with pytest.raises(SystemExit, match="needs one rate per phase, len.--milestones. . 1 = 3"):
        _configs(cifar_lccn, ["--data", "/x", "--lr-values", "0.1", "0.01"])


def test_a_saved_view_over_other_shards_and_trusted_flags_it_cannot_honour(tmp_path):
    """--label-view: a view built over another conversion of the split (same N and K, other
    images at each idx) is refused before Ray starts; the trusted-set options do not choose
    a trusted set inside a saved view, so one without trusted samples is refused with them."""
    from shards.labelview import build_view

    def smoke(name, seed):
        return sources.write_synthetic_shards(tmp_path / name, dataset="cifar10", num_classes=10,
                                             size=(32, 32), n_train=64, n_test=16, seed=seed,
                                             shard_size=16, noisy_web_labels=False,
                                             classes=cifar_lccn.smoke.classes)

    tr_a, te_a = smoke("a", 0)
    tr_b, _ = smoke("b", 1)
    view = build_view(tr_a, {"kind": "symmetric", "rate": 0.4, "seed": 0})
    view.save(tmp_path / "view.npz")
    base = ["--train-shards", str(tr_a), "--test-shards", str(te_a), "--run-dir",
            str(tmp_path / "run"), "--label-view", str(tmp_path / "view.npz"),
            "--num-workers", "1"]
    jr = cifar_lccn.prepare_run(cifar_lccn.get_args_parser().parse_args(base))
    assert jr.view.split_fingerprint == view.split_fingerprint is not None
    other = list(base)
    other[1] = str(tr_b)
    with pytest.raises(SystemExit, match="built over other shards than .*b/train"):
        cifar_lccn.prepare_run(cifar_lccn.get_args_parser().parse_args(other))
    with pytest.raises(SystemExit, match="view.npz has no trusted samples"):
        cifar_lccn.prepare_run(cifar_lccn.get_args_parser().parse_args(
            [*base, "--trusted-fraction", "0.5"]))


def test_quickstart_ray_builds_the_trusted_set_it_is_asked_for(tmp_path):
    args = quickstart_ray.get_args_parser().parse_args(
        ["--run-dir", str(tmp_path), "--trusted-fraction", "0.25"])
    jr = quickstart_ray.prepare_run(args)
    assert jr.run.lccn.use_trusted
    assert abs(jr.view.trusted.mean() - 0.25) < 0.01


def test_smoke_shards_and_views(tmp_path):
    """The generated smoke splits load as a CIFAR-like view (noise applied to clean labels)
    and a web-like view (noisy labels, half the clean labels known)."""
    from pipeline.data.manifest import Manifest
    from shards.labelview import build_view

    tr, te = sources.write_synthetic_shards(tmp_path / "c", dataset="cifar10", num_classes=10,
                                           size=(32, 32), n_train=64, n_test=16, seed=0,
                                           shard_size=16, noisy_web_labels=False,
                                           classes=cifar_lccn.smoke.classes)
    assert Manifest.load(tr).num_samples == 64 and len(Manifest.load(te).shards) == 1
    view = build_view(tr, json.loads(cifar_lccn.noise["cifar10"]))
    assert (view.clean >= 0).all() and view.transition is not None
    tr, _ = sources.write_synthetic_shards(tmp_path / "w", dataset="clothing1m", num_classes=14,
                                          size=(24, 20), n_train=56, n_test=28, seed=0,
                                          shard_size=28, noisy_web_labels=True)
    view = build_view(tr, {"kind": "dataset"})
    assert (view.clean == -1).sum() == 28 and view.noise_rate() > 0


def test_cifar_trusted_clean_samples_and_labelled_outliers_from_flags(tmp_path):
    """--trusted N --trusted-outliers M (the paper: 5,000 and 500) build the LCCN*+ view:
    N in-distribution samples and M pixel-shuffled ones trusted, LCCN+ and LCCN* on."""
    spec = '{"kind": "open_set", "count": 40, "seed": 0}'
    args = cifar_lccn.get_args_parser().parse_args(
        ["--smoke-test", "--run-dir", str(tmp_path), "--noise", spec, "--outlier",
         "--trusted", "30", "--trusted-outliers", "6"])
    jr = cifar_lccn.prepare_run(args)
    v = jr.view
    assert int((v.trusted & ~v.ood).sum()) == 30 and int((v.trusted & v.ood).sum()) == 6
    assert v.spec["trusted"] == {"count": 30, "outliers": 6, "seed": 0, "per_class": True,
                                 "include_ood": True}
    assert jr.run.lccn.use_trusted and jr.run.lccn.outlier


@pytest.mark.parametrize("argv, match", [
    (["--trusted-outliers", "5"], "--trusted-outliers needs --outlier"),
    (["--trusted", "5", "--trusted-fraction", "0.1"], "one way of choosing the trusted set"),
    (["--trusted-keys", "/nonexistent/list.txt"], "no such file"),
    # config values out of range
    (["--ema-decay", "1"], r"error: OptimConfig.ema_decay must be in \[0, 1\), got 1.0"),
    (["--alpha", "0"], "error: alpha must be > 0, got 0.0"),
])
def test_bad_flags_give_one_clear_line(tmp_path, argv, match):
    args = cifar_lccn.get_args_parser().parse_args(["--smoke-test", "--run-dir",
                                                    str(tmp_path), *argv])
    with pytest.raises(SystemExit, match=match):
        cifar_lccn.prepare_run(args)


def test_clothing1m_trusted_set_from_the_clean_train_key_list(tmp_path):
    """--trusted-keys clean_train_key_list.txt: the noisy-train samples listed there (with
    their clean label known) are trusted; the smoke split's keys stand in for the list."""
    from pipeline.data.split_labels import read_split_labels

    args = clothing1m_lccn.get_args_parser().parse_args(["--smoke-test", "--run-dir",
                                                         str(tmp_path)])
    jr = clothing1m_lccn.prepare_run(args)  # writes the smoke shards
    labels = read_split_labels(jr.dist.train_source)
    known = np.flatnonzero(labels["clean"] >= 0)
    listed = tmp_path / "clean_train_key_list.txt"
    listed.write_text("\n".join([labels["key"][i] for i in known[::3]] + ["images/not/here.jpg"]))
    args = clothing1m_lccn.get_args_parser().parse_args(
        ["--smoke-test", "--run-dir", str(tmp_path), "--trusted-keys", str(listed)])
    jr = clothing1m_lccn.prepare_run(args)
    assert np.flatnonzero(jr.view.trusted).tolist() == known[::3].tolist()
    assert jr.run.lccn.use_trusted and not jr.run.lccn.outlier


def test_quickstart_says_what_the_noise_rate_means(tmp_path):
    """rate r flips r of the four source classes, about 0.4 r of all labels."""
    train, _ = quickstart_ray.write_digits_shards(tmp_path, seed=0)
    view = quickstart_ray.digits_view(train, rate=0.4, seed=0)
    note = quickstart_ray.noise_note(view, 0.4)
    src = np.isin(view.clean, [2, 3, 4, 9])
    within = (view.observed != view.clean)[src].mean()
    assert abs(within - 0.4) < 0.05 and abs(view.noise_rate() - 0.4 * src.mean()) < 0.03
    assert f"realised {within:.3f} within those classes" in note
    assert f"{view.noise_rate():.3f} of all labels" in note
    assert "2->0, 3->5, 4->7, 9->1" in note
    assert "0.4 x r" in quickstart_ray.get_args_parser().format_help()


def test_quickstart_closes_with_lccn_beside_ce_and_the_mlflow_command():
    lccn = {"metrics": {"test_top1": 0.934}, "tracking_uri": "sqlite:////r/mlflow.db",
            "experiment": "lccn-quickstart_ray"}
    lines = quickstart_ray.comparison(lccn, {"metrics": {"test_top1": 0.871}}, epochs=30)
    assert lines[0].endswith("CE 0.871  LCCN 0.934  (+6.3 points)")
    assert lines[1].endswith(f"{quickstart_ray.mlflow_command()} ui --backend-store-uri "
                             f"sqlite:////r/mlflow.db")
    # the environment's own mlflow: the printed command works without activating it
    assert Path(quickstart_ray.mlflow_command()).parent.resolve() == \
        Path(sys.executable).parent.resolve()
    assert "no CE baseline" in quickstart_ray.comparison(lccn, None, epochs=30)[0]


def test_progress_line_per_epoch():
    from pipeline.cluster.ray_train import progress_line

    row = {"epoch": 9.0, "loss": 0.25, "val_top1": 0.7, "test_top1": 0.9,
           "label_recovery": 0.95, "transition_error": float("nan"), "epoch_time": 4.04}
    line = progress_line(row, run_name="r", epochs=30, pretrain_epochs=8, method="lccn")
    assert line == ("[r] epoch 10/30 lccn loss 0.250  val_top1 0.700  test_top1 0.900  "
                    "label_recovery 0.950  4.0 s")
    row.update(data_skipped_shards=1.0, data_padded=12.0, data_missing=12.0,
               data_skipped_samples=0.0)
    assert progress_line(row, run_name="r", epochs=30, pretrain_epochs=8, method="lccn") \
        .endswith("4.0 s  data: skipped_shards 1  missing 12  padded 12")
    row["epoch"] = 7.0
    assert "epoch 8/30 ce " in progress_line(row, run_name="r", epochs=30, pretrain_epochs=8,
                                             method="lccn")


def test_summary_leaves_out_what_was_not_measured():
    """A run on the dataset's labels has no true transition: its transition error is NaN
    and must not be printed or written (NaN is not JSON either)."""
    metrics = {"test_top1": 0.71, "transition_error": float("nan"), "staleness": 0.0,
               "images_per_s": float("inf"), "epoch": 4.0}
    line = reporting.summary_line(metrics)
    assert line == "test_top1 0.71  staleness 0"
    assert reporting.measured(metrics) == {"test_top1": 0.71, "staleness": 0.0, "epoch": 4.0}
    json.dumps(reporting.measured(metrics), allow_nan=False)


def test_bad_data_paths_give_one_clear_line(tmp_path, capsys):
    """A missing --data folder, a split folder given as --data, a shard root given as
    --train-shards, a root without converted splits, and a corrupt shard each end the job
    with one line naming the path (SystemExit with a message: no traceback), before Ray."""
    tr, _ = sources.write_synthetic_shards(tmp_path / "c10", dataset="cifar10", num_classes=10,
                                          size=(8, 8), n_train=40, n_test=10, seed=0,
                                          shard_size=10, noisy_web_labels=False,
                                          classes=cifar_lccn.smoke.classes)
    (tmp_path / "raw" / "cifar-10-batches-py").mkdir(parents=True)
    base = ["--no-tracking", "--run-dir", str(tmp_path / "runs")]
    cases = [
        (["--data", str(tmp_path / "missing")], f"--data {tmp_path / 'missing'}: no such folder"),
        (["--data", str(tr)], f"--data {tr} is a split folder"),
        (["--train-shards", str(tmp_path / "c10")],
         f"--train-shards {tmp_path / 'c10'} is a shard root with splits ['test', 'train']"),
        (["--data", str(tmp_path / "raw")], "convert a dataset first"),
        (["--data", str(tmp_path / "c10"), "--train-split", "val"], "its splits are ['test', 'train']"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            cifar_lccn.main([*argv, *base])
        assert isinstance(e.value.code, str) and e.value.code.startswith("error: "), argv
        assert message in e.value.code and "\n" not in e.value.code, (argv, e.value.code)
    # same size, other bytes: the manifest's size check passes, the label read does not
    shard = sorted(tr.glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[:100] = b"x" * 100
    shard.write_bytes(bytes(data))
    for workers in ("2", "1"):  # one test shard for 2 workers: the first scores it
        with pytest.raises(SystemExit) as e:
            cifar_lccn.main(["--data", str(tmp_path / "c10"), "--num-workers", workers, *base])
        assert e.value.code.startswith("error: ") and str(shard) in e.value.code, e.value.code


# -- `ray job submit` against a head node started here ------------------------------------------


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def ray_head():
    """``ray start --head --block`` on free ports with a private temp dir, in its own process
    group, shared by this module's job submissions; teardown stops exactly that cluster
    (its process group, then any process whose command line names its temp dir). ``ray stop
    --force`` is not used: it would stop every Ray cluster on the machine, other people's
    included."""
    if not RAY.exists():
        pytest.fail(f"no ray CLI next to {sys.executable}")
    tmp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths are limited
    gcs, dash, client, agent, agent_grpc, metrics, rt_env = _free_ports(7)
    # token authentication with a token of this test only (not ~/.ray/auth_token): the
    # cluster and the `ray job submit` client both read it from RAY_AUTH_TOKEN_PATH
    from ray._private.authentication.authentication_token_generator import (
        generate_new_authentication_token,
    )

    token = Path(tmp) / "auth_token"
    token.write_text(generate_new_authentication_token())
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # as in an activated venv: `python` in the job's entrypoint is this interpreter
    env["PATH"] = f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(RAY), "start", "--head", "--block", "--num-cpus=2", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={rt_env}", f"--temp-dir={tmp}", "--disable-usage-stats"]
    log = open(Path(tmp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                    break
            except urllib.error.HTTPError:  # answering (401 without the token): it is up
                break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"head node did not come up: {(Path(tmp) / 'ray-start.log').read_text()[-2000:]}")
            time.sleep(1)
        yield {"address": url, "env": env, "temp_dir": tmp}
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        _kill_leftovers(tmp)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_leftovers(marker: str) -> None:
    """SIGKILL, by pid, the processes whose command line contains ``marker`` (our temp dir)."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(pid_dir.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.ray
def test_ray_job_submit_quickstart_smoke(ray_head, tmp_path):
    run_dir = tmp_path / "runs"
    cmd = [str(RAY), "job", "submit", "--address", ray_head["address"], "--working-dir",
           str(REPO), "--", "python", "jobs/quickstart_ray.py", "--smoke-test",
           "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ray_head["env"], timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[quickstart_ray] done in" in out, out[-4000:]
    # one progress line per epoch (rank 0, once), not Ray's raw report dicts
    assert "Reporting training result" not in out
    assert [out.count(f"] epoch {e}/3 ") for e in (1, 2, 3)] == [1, 1, 1], out[-4000:]
    assert "not writable" not in out
    found = sorted((run_dir / "results").glob("quickstart_ray-lccn-smoke-*.json"))
    assert len(found) == 1, found  # a new, timestamped run name when none is given
    result = json.loads(found[0].read_text())
    assert result["epoch"] == 3 and result["mlflow_run_id"]
    # the data counters of every epoch are in the result file (clean generated shards: 0)
    assert [r["data_padded"] for r in result["history"]] == [0.0, 0.0, 0.0]
    assert (run_dir / "mlflow.db").is_file()
    assert abs(sum(result["transition"][0]) - 1) < 1e-9


@pytest.mark.ray
def test_ray_job_submit_webvision_divide_lccn_smoke(ray_head, tmp_path):
    """DivideLCCN on 2 Ray Train workers (generated WebVision-like shards, the webvision
    transform): two networks, one store actor per network, the division pass gathered over
    both ranks (every idx exactly once, or the run fails), MLflow on."""
    run_dir = tmp_path / "runs"
    cmd = [str(RAY), "job", "submit", "--address", ray_head["address"], "--working-dir",
           str(REPO), "--", "python", "jobs/webvision_divide_lccn.py", "--smoke-test",
           "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ray_head["env"], timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "method divide_lccn" in out and "[webvision_divide_lccn] done in" in out, out[-4000:]
    found = sorted((run_dir / "results").glob("webvision_divide_lccn-divide_lccn-smoke-*.json"))
    assert len(found) == 1, found
    result = json.loads(found[0].read_text())
    hist = result["history"]
    assert result["epoch"] == 3 and [r["phase"] for r in hist] == [0.0, 1.0, 1.0]
    for r in hist[1:]:  # each network's division and chain, every noise epoch
        for key in ("division_labelled", "division_labelled_net2", "chain_gap",
                    "z_agreement", "z_agreement_net2"):
            assert 0 <= r[key] <= 1, (key, r[key])
    m = result["metrics"]
    assert m["store_duplicates_chain0"] == m["store_duplicates_chain1"] == 0
    assert abs(sum(result["transition"][0]) - 1) < 1e-9 and result["mlflow_run_id"]


@pytest.mark.ray
def test_ray_job_submit_train_on_an_image_folder(ray_head, cifar10_jpeg_tree, tmp_path):
    """The own-data path end to end: a plain <class>/<image> folder of real JPEGs and a
    clean test folder -> jobs/train.py under `ray job submit` (conversion on the driver, 2
    Ray Train workers, LCCN) -> the logged model predicts the test folder (lccn-predict)."""
    from test_own_data import make_own_folder

    photos = make_own_folder(cifar10_jpeg_tree, tmp_path / "photos", split="train",
                             per_class=40)
    test = make_own_folder(cifar10_jpeg_tree, tmp_path / "photos-test", split="test",
                           per_class=10)
    run_dir = tmp_path / "runs"
    cmd = [str(RAY), "job", "submit", "--address", ray_head["address"], "--working-dir",
           str(REPO), "--", "python", "jobs/train.py", "--images", str(photos),
           "--test-images", str(test), "--run-dir", str(run_dir), "--no-pretrained",
           "--model", "small_cnn", "--image-size", "32", "--epochs", "3",
           "--pretrain-epochs", "1", "--loader-workers", "0", "--run-name", "own"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ray_head["env"], timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[train] train: 120 images, 3 classes" in out and "[train] done in" in out, out[-4000:]
    result = json.loads((run_dir / "results" / "own.json").read_text())
    assert result["epoch"] == 3 and 0 <= result["metrics"]["test_top1"] <= 1
    assert "[train] warm-up: " in out  # derived from the data

    from pipeline.track import predict

    preds = tmp_path / "pred.csv"
    assert predict.main([f"runs:/{result['mlflow_run_id']}/model", str(test), "--out",
                         str(preds), "--tracking-uri", f"sqlite:///{run_dir / 'mlflow.db'}"]) == 0
    rows = preds.read_text().splitlines()
    assert rows[0] == "key,predicted,class,confidence" and len(rows) == 31
    assert {r.split(",")[2] for r in rows[1:]} <= {"airplane", "cat", "dog"}
    # the same classifier as a torch.export program beside the results: the same predictions
    exported = run_dir / "models" / "own.pt2"
    assert result["files"]["model"] == str(exported) and exported.is_file()
    assert json.loads(exported.with_suffix(".json").read_text())["class_names"] == \
        ["airplane", "cat", "dog"]
    # the job's last lines say which weights each export holds
    final = run_dir / "models" / "own-final.pt2"
    assert result["files"]["model_final"] == str(final) and final.is_file()
    assert f"[train] model: {exported} (selected epoch " in out, out[-3000:]
    assert f"[train] final model: {final} (final epoch 3; torch.export" in out, out[-3000:]
    again = tmp_path / "pred2.csv"
    assert predict.main([str(exported), str(test), "--out", str(again)]) == 0
    for a, b in zip(rows[1:], again.read_text().splitlines()[1:]):
        assert a.split(",")[:3] == b.split(",")[:3]
        assert abs(float(a.split(",")[3]) - float(b.split(",")[3])) < 1e-4


def test_a_few_images_per_gpu_are_warned_about_with_the_scaled_lr():
    """The Clothing1M recipe's global batch 32 on 8 GPUs is 4 images per GPU: the job says
    so, with the batch and the linearly scaled lr that reach 16 per GPU; one GPU, or CPUs,
    get no warning."""
    _, run = _configs(clothing1m_lccn, ["--data", "/x"])
    dist = driver.DistConfig(run_name="r", run_dir="/r", train_source="/s", num_workers=8,
                             use_gpu=True)
    text = driver.small_batch_warning(run, dist)
    assert run.optim.batch_size == 32 and "4 images per GPU" in text
    assert (f"--batch-size 128 with the lr scaled linearly (--scale-lr: --lr "
            f"{run.optim.lr * 4:g}" in text and "--sync-bn" in text)
    assert driver.small_batch_warning(run, dataclasses.replace(dist, num_workers=1)) is None
    assert driver.small_batch_warning(run, dataclasses.replace(dist, use_gpu=False)) is None


def test_scale_lr_applies_the_linear_rule_and_sync_bn_needs_gpus():
    """--scale-lr: the recipe's lr (and its lr phases) times --batch-size / the recipe's
    batch, the same however often the configs are built; with --lr it is refused.
    --sync-bn reaches DistConfig on GPU workers and is refused on CPUs with one line."""
    _, run0 = _configs(clothing1m_lccn, ["--data", "/x"])
    _, run = _configs(clothing1m_lccn, ["--data", "/x", "--batch-size", "128", "--scale-lr"])
    assert run.optim.batch_size == 128 and run.optim.lr == pytest.approx(run0.optim.lr * 4)
    args = cifar_lccn.get_args_parser().parse_args(["--data", "/x", "--batch-size", "256",
                                                    "--scale-lr"])
    cfg, again = cifar_lccn.config(args), cifar_lccn.config(args)  # no second scaling
    _, plain = _configs(cifar_lccn, ["--data", "/x"])
    factor = 256 / plain.optim.batch_size
    assert cfg == again and cfg.run.optim.lr == pytest.approx(plain.optim.lr * factor)
    assert list(cfg.lr_values) == pytest.approx([0.5 * factor, 0.1 * factor, 0.01 * factor])
    with pytest.raises(SystemExit, match="--scale-lr scales the recipe's lr"):
        _configs(cifar_lccn, ["--data", "/x", "--lr", "0.2", "--scale-lr"])

    def dist(argv):
        args = cifar_lccn.get_args_parser().parse_args(["--data", "/x", *argv])
        return driver.dist_config(args, cifar_lccn.config(args), run_name="r", train="/s",
                                  test=None, class_names=[], transform="cifar")

    with pytest.raises(SystemExit, match="--sync-bn needs --gpu"):
        dist(["--sync-bn"])
    synced = dist(["--sync-bn", "--gpu"])
    assert synced.sync_bn and synced.use_gpu
    with pytest.raises(ValueError, match="sync_bn needs GPU workers"):
        dataclasses.replace(synced, use_gpu=False)
    assert synced.decode == "cpu"  # LoaderConfig.decode: unchanged unless asked
    assert dist(["--gpu", "--decode", "auto"]).decode == "auto"


def test_sync_bn_converts_the_batch_norm_layers_in_place_keeping_the_parameters(monkeypatch):
    """What a GPU worker does with --sync-bn before DDP: every BatchNorm becomes a
    SyncBatchNorm over the same parameter and buffer tensors (the optimiser built before
    keeps training them; the checkpoint keys are unchanged). With one worker nothing changes."""
    import ray.train.torch
    import torch

    from pipeline.cluster.ray_train import RaySession
    from pipeline.train.models import build_model

    model = build_model("cnn_wide", 10)
    params, keys = [id(p) for p in model.parameters()], list(model.state_dict())
    monkeypatch.setattr(ray.train.torch, "prepare_model", lambda m: m)
    session = RaySession.__new__(RaySession)
    session.rank, session.world_size, session.sync_bn = 0, 2, True
    out = session.prepare_model(model)
    assert out is model and [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == keys
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    assert kinds == {torch.nn.SyncBatchNorm}
    single = build_model("cnn_wide", 10)
    session.world_size = 1
    session.prepare_model(single)
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in single.modules())


def test_weights_reach_the_run_by_their_absolute_path(tmp_path, monkeypatch):
    """--weights (a pretrained timm/torchvision backbone's file) reaches ModelConfig as an
    absolute path (the workers chdir elsewhere); a missing file or no --pretrained is one
    line naming the fix."""
    (tmp_path / "w.pth").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    _, run = _configs(clothing1m_lccn, ["--data", "/x", "--model", "timm:convnext_tiny",
                                        "--pretrained", "--weights", "w.pth"])
    assert run.model.name == "timm:convnext_tiny"
    assert run.model.weights == str(tmp_path / "w.pth")
    with pytest.raises(SystemExit, match="no such file.*pipeline.train.models fetch"):
        _configs(clothing1m_lccn, ["--data", "/x", "--pretrained", "--weights", "nope.pth"])
    with pytest.raises(SystemExit, match="--weights is read with --pretrained"):
        _configs(clothing1m_lccn, ["--data", "/x", "--no-pretrained", "--weights", "w.pth"])


def test_an_unsupported_uri_as_run_or_sweep_dir_is_one_clear_line(capsys):
    """``--run-dir gs://bucket/runs`` used to become the local folder ``<cwd>/gs:/bucket/runs``
    without a word; an s3:// prefix is taken as it is, another scheme is refused naming it."""
    from tune import sweep

    for parser, flag in ((cifar_lccn.get_args_parser(), "--run-dir"),
                         (sweep.get_args_parser(), "--sweep-dir")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "gs://bucket/runs"])
        err = capsys.readouterr().err
        assert (f"argument {flag}: gs://bucket/runs: gs:// is not supported for a run "
                f"directory; use s3://BUCKET/PREFIX") in err
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "s3://"])
        assert "an s3 location needs a bucket" in capsys.readouterr().err
        for given in ("s3://bucket/runs/", "s3://bucket//runs"):  # pyarrow: no empty parts
            assert getattr(parser.parse_args([flag, given]),
                           flag[2:].replace("-", "_")) == "s3://bucket/runs"
    assert cifar_lccn.get_args_parser().parse_args(["--run-dir", "/mnt/runs"]).run_dir == \
        Path("/mnt/runs")


def test_a_run_dir_in_object_storage_needs_a_tracking_store_and_a_bucket(tmp_path, moto_url,
                                                                         monkeypatch):
    """The default MLflow store (sqlite in the run dir) cannot live in a bucket: one line
    before anything runs; a missing bucket is one line too, before Ray starts."""
    monkeypatch.setenv("LCCN_RUNS", str(tmp_path))
    base = ["--run-dir", "s3://no-such-bucket/runs", "--s3-endpoint-url", moto_url,
            "--smoke-test", "--no-baseline"]
    with pytest.raises(SystemExit, match="the default MLflow store is a sqlite file in that "
                                         "folder, which object storage cannot hold"):
        quickstart_ray.main(base)
    with pytest.raises(SystemExit, match="s3://no-such-bucket/runs: no bucket 'no-such-bucket'"):
        quickstart_ray.main([*base, "--no-tracking"])
