"""The CIFAR benchmark's protocols on real CIFAR-10 JPEGs at tiny sizes: the pre-training
handed from a CE process to an LCCN process (the GPU script's four runs) computes exactly
what one process sharing it computes, and the restart protocol runs LCCN's whole schedule
again from CE's final weights."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(ROOT / "benchmarks" / "bench_cifar.py"), run_name="bench_cifar")


def _argv(shared_data, out, cache, *extra):
    return ["--data", str(shared_data), "--cache", str(cache), "--out", str(out),
            "--settings", "sym0.5", "--seeds", "0", "--train-size", "200", "--model",
            "small_cnn", "--epochs", "3", "--pretrain-epochs", "1", "--milestones", "2",
            "--warmup-steps", "1", *extra]


def _tests(entry):
    return [r["test_top1"] for r in entry["history"]], [r["loss"] for r in entry["history"]]


def test_pretraining_handed_between_processes_is_the_shared_one(bench, shared_data, tmp_path,
                                                                 one_thread):
    cache, state = tmp_path / "cache", tmp_path / "state" / "sym0.5.pt"
    one = bench["main"](_argv(shared_data, tmp_path / "one", cache, "--tag=-one"))[0]
    ce = bench["main"](_argv(shared_data, tmp_path / "two", cache, "--methods", "ce",
                             "--pretrain-out", str(state), "--tag=-ce"))[0]
    assert state.is_file() and not state.with_name("sym0.5.pt.partial").exists()
    lccn = bench["main"](_argv(shared_data, tmp_path / "two", cache, "--methods", "lccn",
                               "--pretrain-from", str(state), "--tag=-lccn"))[0]
    assert _tests(ce["methods"]["ce"]) == _tests(one["methods"]["ce"])
    assert _tests(lccn["methods"]["lccn"]) == _tests(one["methods"]["lccn"])
    assert lccn["methods"]["lccn"]["phi"] == one["methods"]["lccn"]["phi"]
    # a state of another pre-training length is refused, naming the file
    with pytest.raises(ValueError, match=r"sym0\.5\.pt holds 1 pre-training epochs"):
        bench["main"](_argv(shared_data, tmp_path / "bad", cache, "--methods", "lccn",
                            "--pretrain-from", str(state), "--pretrain-epochs", "0"))
    with pytest.raises(ValueError, match=r"sym0\.5\.pt was written by another protocol: lr "
                                         r"0\.1 there, 0\.2 here"):
        bench["main"](_argv(shared_data, tmp_path / "bad", cache, "--methods", "lccn",
                            "--pretrain-from", str(state), "--lr", "0.2"))
    with pytest.raises(SystemExit):
        bench["main"](_argv(shared_data, tmp_path / "bad", cache, "--pretrain-from", str(state)))


def test_restart_runs_the_whole_schedule_again_from_ces_final_weights(bench, shared_data,
                                                                      tmp_path, one_thread):
    cache = tmp_path / "cache"
    g = bench["fit_pair"].__globals__
    base, seen = g["LocalTrainer"], []

    class Recording(base):  # what each trainer's network is when its fit() starts
        def fit(self, **kw):
            seen.append((self, {k: v.clone() for k, v in self.model.state_dict().items()},
                         len(self.optimizer.state)))
            return super().fit(**kw)

    g["LocalTrainer"] = Recording
    try:
        r = bench["main"](_argv(shared_data, tmp_path / "r", cache, "--restart", "--ema-decay",
                                "0.9"))[0]
    finally:
        g["LocalTrainer"] = base
    (ce_t, _, _), (lc_t, lc_start, lc_momenta) = seen
    # LCCN starts from CE's final weights and average, with fresh momentum
    for k, v in ce_t.model.state_dict().items():
        assert torch.equal(lc_start[k], v), k
    assert lc_momenta == 0
    ce, lc = r["methods"]["ce"]["history"], r["methods"]["lccn"]["history"]
    assert len(ce) == 3 and len(lc) == 6
    assert r["methods"]["lccn"]["summary"]["selected_epoch"] in (4, 5, 6)  # its own epochs
    assert [x["epoch"] for x in lc[3:]] == [3, 4, 5] and [x["phase"] for x in lc[3:]] == [1.0] * 3
    # the same learning rates again: 0.1, 0.1, then x0.1 after epoch 2 of each run
    assert [x["lr"] for x in lc[3:]] == pytest.approx([x["lr"] for x in ce])
    # the GPU script's path: CE writes its final state, LCCN restarts from it elsewhere
    state = tmp_path / "state.pt"
    bench["main"](_argv(shared_data, tmp_path / "h", cache, "--restart", "--ema-decay", "0.9",
                        "--methods", "ce", "--pretrain-out", str(state)))
    handed = bench["main"](_argv(shared_data, tmp_path / "h", cache, "--restart", "--ema-decay",
                                 "0.9", "--methods", "lccn", "--pretrain-from", str(state)))[0]
    assert _tests(handed["methods"]["lccn"]) == _tests(r["methods"]["lccn"])
    control = bench["main"](_argv(shared_data, tmp_path / "c", cache, "--restart",
                                  "--restart-control", "--ema-decay", "0.9"))[0]
    assert set(control["methods"]) == {"ce", "ce_restart"}
    again = control["methods"]["ce_restart"]["history"]
    assert [(x["test_top1"], x["loss"]) for x in again[:3]] == [(x["test_top1"], x["loss"])
                                                               for x in ce]  # the same CE
    assert [x["phase"] for x in again[3:]] == [0.0] * 3
    assert torch.isfinite(torch.tensor([x["test_top1"] for x in again])).all()
    with pytest.raises(SystemExit):
        bench["main"](_argv(shared_data, tmp_path / "c", cache, "--restart-control"))


def test_per_image_standardisation_and_bn_momentum_reach_every_network(bench, shared_data,
                                                                      tmp_path, one_thread):
    """``--normalise image``: the images stay uint8 in memory, are cropped and flipped,
    and every network (CE's, LCCN's) sees each image standardised by its own mean and
    deviation, as the paper's code; ``--bn-momentum`` reaches all their batch-norm layers;
    the label view is the same as with the default normalisation."""
    cache = tmp_path / "cache"
    g = bench["fit_pair"].__globals__
    base, inputs, trainers = g["LocalTrainer"], [], []

    class Recording(base):
        def fit(self, **kw):
            trainers.append(self)
            self.model.register_forward_pre_hook(lambda mod, a: inputs.append(a[0].detach()))
            return super().fit(**kw)

    g["LocalTrainer"] = Recording
    try:
        img = bench["main"](_argv(shared_data, tmp_path / "i", cache, "--normalise", "image",
                                  "--bn-momentum", "0.003"))[0]
    finally:
        g["LocalTrainer"] = base
    chan = bench["main"](_argv(shared_data, tmp_path / "c", cache))[0]
    assert img["true_transition"] == chan["true_transition"]
    # the instance-dependent view draws from the channel-normalised images in both modes
    parse = bench["get_args_parser"]().parse_args
    loaded = {mode: bench["load_data"](parse(_argv(shared_data, tmp_path, cache, "--normalise",
                                                   mode, "--settings", "idn0.4")))
              for mode in ("image", "channel")}
    assert loaded["image"].train_x.dtype == torch.uint8
    assert torch.equal(loaded["image"].features, loaded["channel"].features)
    views = [bench["noisy_view"]("idn0.4", d.train_y, d.features, 0) for d in loaded.values()]
    assert (views[0].observed == views[1].observed).all() and views[0].noise_rate() > 0.2
    assert len(trainers) == 2 and len(inputs) > 10
    for x in inputs:
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 32, 32)
        flat = x.flatten(1)
        assert torch.allclose(flat.mean(1), torch.zeros(len(x)), atol=1e-4)
        assert torch.allclose(flat.std(1, unbiased=False), torch.ones(len(x)), atol=1e-3)
    for t in trainers:
        bns = [m for m in t.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert bns and {m.momentum for m in bns} == {0.003}
    for entry in img["methods"].values():
        assert all(0 <= r["test_top1"] <= 1 for r in entry["history"])


def test_oracle_phi_samples_with_the_views_true_transition_for_the_whole_phase(
        bench, shared_data, tmp_path, one_thread):
    r = bench["main"](_argv(shared_data, tmp_path / "o", tmp_path / "cache", "--oracle-phi",
                            "--methods", "lccn"))[0]
    lccn = r["methods"]["lccn"]
    assert lccn["phi_init"] == r["true_transition"]  # the truth, not the anchor estimate
    steps = lccn["history"][-1]["global_step"] - lccn["history"][0]["global_step"]
    assert lccn["config"]["lccn"]["warmup_steps"] >= steps  # no step samples with counts
    plain = bench["main"](_argv(shared_data, tmp_path / "p", tmp_path / "cache",
                                "--methods", "lccn"))[0]["methods"]["lccn"]
    assert plain["phi_init"] != r["true_transition"]
    with pytest.raises(SystemExit):  # no LCCN run for the truth to change
        bench["main"](_argv(shared_data, tmp_path / "c", tmp_path / "cache", "--oracle-phi",
                            "--methods", "ce"))


def test_bench_imports_without_the_cluster_packages():
    """The GPU node runs this script with only a CUDA PyTorch image."""
    import subprocess

    code = ("import builtins, runpy, sys\n"
            "real = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    if name.split('.')[0] in ('ray', 'mlflow', 'webdataset', 'boto3', 'cleanlab'):\n"
            "        raise ImportError('blocked: ' + name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            f"sys.argv = ['bench_cifar.py', '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(ROOT / 'benchmarks' / 'bench_cifar.py')!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-2000:]


def test_lr_values_reach_both_networks_of_dividemix(bench):
    """``--lr-values`` sets the piecewise schedule of every network of the method, not only
    the first (DivideMix trains two)."""
    import argparse

    import numpy as np

    from pipeline.core.config import ModelConfig, OptimConfig, RunConfig
    from pipeline.core.labels import LabelView
    from pipeline.train.trainer import LocalTrainer, TensorData

    y = np.arange(40) % 4
    data = TensorData(torch.zeros(40, 1, 8, 8), LabelView(y, y, 4))
    run = RunConfig(method="dividemix", model=ModelConfig("small_cnn", 1),
                    optim=OptimConfig(epochs=4, pretrain_epochs=1, lr=0.1, milestones=(2,)))
    trainer = LocalTrainer(run, data, data)
    args = argparse.Namespace(lr_values=[0.3, 0.03], milestones=[2], lr=0.1)
    bench["_set_schedule"](args, trainer, offset=0)
    members = trainer.engine.members
    assert len(members) == 2
    for epoch, want in enumerate([0.3, 0.3, 0.03, 0.03]):
        for m in members:
            assert m.optimizer.param_groups[0]["lr"] == pytest.approx(want), (epoch, m)
            m.scheduler.step()


def test_methods_bench_runs_dividemix_with_the_authors_asymmetric_choices():
    """Under asymmetric noise DivideMix and DivideLCCN take the authors' choices (the
    confidence penalty in the warm-up, lambda_u 0); elsewhere the library's defaults; a
    flag given wins in both."""
    from pipeline.core.config import DivideConfig

    methods = runpy.run_path(str(ROOT / "benchmarks" / "bench_cifar_methods.py"),
                             run_name="bench_cifar_methods")
    parse, config = methods["get_args_parser"]().parse_args, methods["method_config"]
    args = parse([])
    for method in ("dividemix", "divide_lccn"):
        asym = config(args, method, 0, 10, None, "asym0.5").divide
        assert (asym.conf_penalty, asym.lambda_u) == (True, 0.0)
        assert config(args, method, 0, 10, None, "sym0.5").divide == DivideConfig()
    assert config(args, "lccn", 0, 10, None, "asym0.5").divide == DivideConfig()
    given = parse(["--lambda-u", "5", "--no-conf-penalty"])
    for setting in ("asym0.5", "sym0.5"):
        d = config(given, "dividemix", 0, 10, None, setting).divide
        assert (d.conf_penalty, d.lambda_u) == (False, 5.0)


def test_memorisation_flags_reach_the_trainer_and_the_regime_is_reported(bench, shared_data,
                                                                         tmp_path, one_thread):
    """``--augment none`` trains on the stored images, ``--weight-decay`` reaches every
    network's optimiser, and each method's summary says whether it memorised: peak test
    accuracy, the drop from it, the final training loss against H(observed | clean)."""
    g = bench["fit_pair"].__globals__
    base, trainers = g["LocalTrainer"], []

    class Recording(base):
        def fit(self, **kw):
            trainers.append(self)
            return super().fit(**kw)

    g["LocalTrainer"] = Recording
    try:
        r = bench["main"](_argv(shared_data, tmp_path / "m", tmp_path / "cache", "--augment",
                                "none", "--weight-decay", "0.0"))[0]
    finally:
        g["LocalTrainer"] = base
    assert len(trainers) == 2
    for t in trainers:
        assert t.train.augment is None
        assert {grp["weight_decay"] for grp in t.optimizer.param_groups} == {0.0}
    # H(observed | clean) of the realised symmetric-0.5 view: near the 1.68 nats of 0.5 I + 0.05
    assert 1.3 < r["noise_floor"] < 2.0
    for entry in r["methods"].values():
        s, tests = entry["summary"], [row["test_top1"] for row in entry["history"]]
        assert s["peak_test"] == max(tests) and s["drop"] == max(tests) - tests[-1]
        assert s["final_loss"] == entry["history"][-1]["loss"]
        assert s["memorises"] == (s["drop"] >= 0.05 and s["final_loss"] < r["noise_floor"])
    assert "Regime per run and method" in bench["markdown_report"]([r])
    # the recorded command line is the one given, its folders written by their role
    assert r["argv"][:6] == ["--data", "DATA", "--cache", "CACHE", "--out", "OUT"]
    assert bench["recorded_argv"](["--data=/x/y", "--seeds", "0", "--out=/o"]) == [
        "--data=DATA", "--seeds", "0", "--out=OUT"]
    assert bench["recorded_argv"](["--pretrain-from", "/tmp/x/mem-random1-0.pt",
                                   "--init-from=/m/clean.pt"]) == [
        "--pretrain-from", "PRE/mem-random1-0.pt", "--init-from=MODELS/clean.pt"]


def test_regime_flags_a_run_that_memorises(bench):
    hist = [{"test_top1": t, "loss": lo} for t, lo in [(0.4, 2.0), (0.52, 1.7), (0.45, 1.2),
                                                      (0.33, 0.34)]]
    got = bench["regime"]({"history": hist}, 1.677)
    assert got["peak_epoch"] == 2 and abs(got["drop"] - 0.19) < 1e-12 and got["memorises"]
    assert not bench["regime"]({"history": hist[:2]}, 1.677)["memorises"]  # no drop
    assert not bench["regime"]({"history": hist}, 0.3)["memorises"]         # loss above floor


def test_methods_bench_honours_the_memorisation_protocols_flags(monkeypatch):
    """``--augment none`` reaches every method of the methods bench (it used to crop and flip
    whatever the flag said), ``--weight-decay`` its optimiser, and ``--normalise image``,
    which only bench_cifar.py applies, is refused rather than ignored."""
    import types

    import numpy as np

    methods = runpy.run_path(str(ROOT / "benchmarks" / "bench_cifar_methods.py"),
                             run_name="bench_cifar_methods")
    rng = np.random.default_rng(0)
    arrays = types.SimpleNamespace(
        train_x=rng.integers(0, 256, (100, 3, 32, 32), dtype=np.uint8),
        train_y=np.arange(100) % 10, test_x=rng.integers(0, 256, (20, 3, 32, 32),
                                                         dtype=np.uint8),
        test_y=np.arange(20) % 10)
    monkeypatch.setitem(methods["load_setting"].__globals__, "load_cifar10",
                        lambda *a, **k: arrays)
    parse = methods["get_args_parser"]().parse_args
    for flags, cropped in (([], True), (["--augment", "none"], False)):
        args = parse(["--train-size", "100", "--weight-decay", "0", *flags])
        view, train_x, *_, aug = methods["load_setting"](args, "sym0.5", 0)
        assert (aug is not None) == cropped and len(view) == 100
        cfg = methods["method_config"](args, "dividemix", 0, 10, view, "sym0.5")
        assert cfg.optim.weight_decay == 0.0
    with pytest.raises(SystemExit):
        methods["main"](["--normalise", "image", "--report"])


def test_methods_report_tabulates_the_regime_of_each_run(tmp_path):
    """The methods report says per run whether it memorised (runs recorded before the regime
    was, without a noise floor, are left out of that table, not failed)."""
    import json

    methods = runpy.run_path(str(ROOT / "benchmarks" / "bench_cifar_methods.py"),
                             run_name="bench_cifar_methods")
    base = {"final_test": 0.33, "selected_test": 0.5, "transition_error": float("nan")}
    regime = {"peak_test": 0.52, "peak_epoch": 13, "drop": 0.19, "final_loss": 0.34,
              "noise_floor": 1.66, "memorises": True}
    for method, summary in (("ce", {**base, **regime}), ("forward", base)):
        (tmp_path / f"sym0.5-seed0-{method}.json").write_text(json.dumps(
            {"setting": "sym0.5", "seed": 0, "method": method, "wall_s": 60.0,
             "summary": summary}))
    text = methods["report"](tmp_path)
    assert "| sym0.5 | 0 | ce | 52.00 (13) | 19.00 | 0.340 / 1.660 | yes |" in text
    assert "| sym0.5 | 0 | forward |" not in text and "| forward | 33.00 / 50.00 |" in text


def test_an_automatic_warm_up_hands_lccn_the_epoch_the_rule_picks(bench, shared_data,
                                                                 tmp_path, one_thread):
    from pipeline.core.monitor import warmup_end_epoch

    argv = _argv(shared_data, tmp_path / "a", tmp_path / "cache")
    at = argv.index("--epochs")
    argv[at + 1], argv[argv.index("--pretrain-epochs") + 1] = "6", "auto"
    argv[argv.index("--milestones") + 1] = "3"
    r = bench["main"](argv)[0]
    ce, lccn = r["methods"]["ce"]["history"], r["methods"]["lccn"]
    p = lccn["pretrain_epochs"]  # the cap: min(half the run, the first milestone - 1) = 2
    n_val = round(200 * 0.05)
    assert p == warmup_end_epoch(ce[:p], n_val=n_val, cap=2)
    assert [row["phase"] for row in lccn["history"]] == [0.0] * p + [1.0] * (6 - p)
    assert lccn["history"][:p] == ce[:p]  # the shared CE epochs
    # LCCN alone: CE runs only up to the cap, and the same epoch is picked
    out = argv.index("--out") + 1
    alone = bench["main"](argv[:out] + [str(tmp_path / "b")] + argv[out + 1:]
                          + ["--methods", "lccn"])[0]
    assert set(alone["methods"]) == {"lccn"}
    assert alone["methods"]["lccn"]["pretrain_epochs"] == p
    assert _tests(alone["methods"]["lccn"]) == _tests(lccn)
