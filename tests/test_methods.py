"""The classic baselines as methods of the engine (bootstrap, forward, sadapt, trevision):
each learns on noisy digits in one process; Forward with an oracle transition trains on
exactly the analytic loss; the learned transitions of S-adaptation and T-Revision are
checkpointed and a resumed run ends with the same parameters; and each runs through the
real distributed job (2 Ray Train workers on generated shards)."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.baselines import SAdaptation
from pipeline.core.config import (
    BaselineConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    from_dict,
)
from pipeline.core.labels import LabelView
from pipeline.core.noise import CIFAR10_ASYM_MAP, pair_flip
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor
from pipeline.train.methods import registered
from pipeline.train.trainer import LocalTrainer, TensorData

from lccn_jobs import digits as quickstart_ray
from lccn_jobs.datasets import CIFAR as cifar_lccn
from lccn_jobs.sources import write_synthetic_shards

REPO = Path(__file__).resolve().parents[1]

BASELINES = ("bootstrap", "forward", "sadapt", "trevision")


def _run(method: str, *, epochs: int = 6, pretrain: int = 2, **baseline) -> RunConfig:
    return RunConfig(method=method, seed=0, model=ModelConfig("small_cnn", 1),
                     optim=OptimConfig(epochs=epochs, pretrain_epochs=pretrain, batch_size=64,
                                       lr=0.05),
                     baseline=BaselineConfig(**baseline))


def test_baseline_config_round_trips_and_names_bad_values():
    assert set(BASELINES) <= set(registered())
    run = _run("forward", transition="file", transition_file="/t.npy", bootstrap_beta=0.6)
    assert from_dict(RunConfig, asdict(run)) == run
    assert RunConfig().baseline == BaselineConfig()  # the authors' defaults
    assert (BaselineConfig().bootstrap_beta, BaselineConfig().transition) == (0.8, "anchor")
    for kwargs, match in [(dict(bootstrap_beta=1.5), "bootstrap_beta must lie in"),
                          (dict(transition="oracle"), "transition must be one of"),
                          (dict(transition="file"), "needs transition_file"),
                          (dict(revision_fraction=1.0), "revision_fraction must lie in"),
                          (dict(anchor_quantile=1.0), "anchor_quantile must lie in")]:
        with pytest.raises(ValueError, match=match):
            BaselineConfig(**kwargs)


# -- one process: the digits ----------------------------------------------------------------


@pytest.fixture(scope="module")
def noisy_digits():
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=0)
    x = to_tensor(images)
    view = pair_flip(labels[tr], 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    return TensorData(x[tr], view), TensorData(x[te], clean_view(labels[te]))


@pytest.mark.parametrize("method", BASELINES)
def test_each_baseline_beats_chance_on_noisy_digits(method, noisy_digits, one_thread):
    """2 CE epochs then 4 of the method (40% pair-flip noise on 4 of 10 classes): the
    clean test accuracy stays far above chance (0.1); the rows carry the metric names of
    CE and LCCN; a method that estimates a transition reports how far it is from the
    true one (NaN during the CE epochs)."""
    train, test = noisy_digits
    trainer = LocalTrainer(_run(method), train, test)
    hist = trainer.fit()
    assert [r["phase"] for r in hist] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    for r in hist:
        assert {"loss", "val_top1", "test_top1", "transition_error", "label_recovery"} <= set(r)
        assert np.isfinite(r["loss"]) and np.isfinite(r["val_top1"])
        assert 0 < r["val_nll"] < 10  # through the method's T where it has one
    assert hist[-1]["test_top1"] > 0.6, [r["test_top1"] for r in hist]
    assert hist[-1]["val_top1"] > 0.5
    errors = [r["transition_error"] for r in hist]
    assert np.isnan(errors[:2]).all()
    if method == "bootstrap":
        assert np.isnan(errors).all() and trainer.transition() is None
        return
    T = trainer.transition()
    assert T.shape == (10, 10)
    assert torch.allclose(T.sum(1).double(), torch.ones(10, dtype=torch.float64), atol=1e-3)
    # closer to the true noise than "no noise" is (the identity: 0.032 away; measured
    # 0.019 for the anchor points, 0.024 for the learned layer)
    identity_error = np.abs(np.eye(10) - view_transition(train)).mean()
    assert 0 < errors[-1] < identity_error, errors
    assert hist[2]["init_transition_error"] == pytest.approx(errors[2], abs=0.02)
    if method == "sadapt":  # the layer learns: its transition moves from the Eq. 8 start
        assert errors[-1] != errors[2]
    if method == "trevision":
        assert [r["trevision_stage"] for r in hist] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        assert trainer.method.slack.delta.abs().sum() > 0  # revised in stage 3 only
    for r in hist[2:]:
        assert r.get("transition_rank_gap", 0.0) == 0.0  # one rank


def test_trevision_stages_each_run_a_complete_schedule(noisy_digits, one_thread):
    """6 epochs, 2 CE, lr 0.05 decayed x0.1 at epoch 4: the reweighting stage (epochs 2-3)
    runs the noise phase's schedule compressed into its own 2 epochs (0.05 then 0.005)
    instead of sitting at 0.05 while the decay falls into the revision; the revision
    (epochs 4-5) runs Adam at its constant 5e-7, and the rows log the rate applied."""
    train, test = noisy_digits
    run = _run("trevision")
    run = replace(run, optim=replace(run.optim, milestones=(4,)))
    trainer = LocalTrainer(run, train, test)
    hist = trainer.fit()
    assert [r["trevision_stage"] for r in hist] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert [r["lr"] for r in hist] == pytest.approx([0.05, 0.05, 0.05, 0.005, 5e-7, 5e-7])
    assert trainer.method.revision_optimizer.param_groups[0]["lr"] == 5e-7
    assert trainer.method.stage2_lr(3) == pytest.approx(0.005)
    assert hist[-1]["test_top1"] > 0.6


def view_transition(data: TensorData) -> np.ndarray:
    return np.asarray(data.labels.transition)


def test_forward_with_an_oracle_file_trains_on_the_analytic_loss(tmp_path, one_thread):
    """A hand-made batch of 8 samples, 3 classes, an oracle T from a file, one Forward
    step through the engine (no pre-training): the reported loss is
    ``-mean log (softmax(f(x)) @ T)[y]`` computed by hand in float64, and the network's
    parameters after the step are those of one SGD step on that loss."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1, 8, 8, generator=g)
    y = np.array([0, 1, 2, 0, 1, 2, 2, 1])
    T = np.array([[0.7, 0.2, 0.1], [0.0, 0.9, 0.1], [0.25, 0.25, 0.5]])
    path = tmp_path / "T.json"
    path.write_text(json.dumps(T.tolist()))
    view = LabelView(observed=y, clean=y, num_classes=3, transition=np.eye(3))
    run = RunConfig(method="forward", seed=0, model=ModelConfig("small_cnn", 1),
                    optim=OptimConfig(epochs=1, pretrain_epochs=0, batch_size=8, lr=0.1),
                    baseline=BaselineConfig(transition="file", transition_file=str(path)),
                    val_fraction=0.0)
    trainer = LocalTrainer(run, TensorData(x, view), TensorData(x, view))
    ref = copy.deepcopy(trainer.model)
    ref.train()
    logits = ref(x)
    noisy = torch.softmax(logits.double(), 1) @ torch.from_numpy(T)
    analytic = -torch.log(noisy[torch.arange(8), torch.from_numpy(y)]).mean()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt.zero_grad()
    analytic.backward()
    opt.step()

    hist = trainer.fit()
    assert hist[0]["loss"] == pytest.approx(float(analytic.detach()), rel=1e-5)
    assert torch.allclose(trainer.transition(), torch.from_numpy(T))
    assert hist[0]["transition_error"] == pytest.approx(np.abs(T - np.eye(3)).mean())
    for (name, a), b in zip(ref.named_parameters(), trainer.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    # a file of the wrong class count is refused, naming it
    np.save(tmp_path / "T4.npy", np.eye(4))
    bad = replace(run, baseline=BaselineConfig(transition="file",
                                               transition_file=str(tmp_path / "T4.npy")))
    with pytest.raises(ValueError, match=r"T4.npy: transition must be \(3, 3\)"):
        LocalTrainer(bad, TensorData(x, view), TensorData(x, view)).fit()


# -- checkpoints: the worker loop in one process ----------------------------------------------


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    train, test = quickstart_ray.write_digits_shards(root, seed=0)
    return train, test, quickstart_ray.digits_view(train, rate=0.4, seed=0)


@pytest.mark.parametrize("method, epochs, fail_at, resume_batch",
                         [("sadapt", 2, 30, 9), ("trevision", 3, 50, 11)])
def test_learned_transition_is_checkpointed_and_resumed_exactly(method, epochs, fail_at,
                                                                resume_batch, digits_shards,
                                                                tmp_path, one_thread):
    """One worker, 19 steps per epoch (1,195 training digits: the validation split is
    dropped before the plan), a checkpoint every 7 steps: a run that fails in its last
    epoch (S-adaptation: step 30 of 38, resumed from step 28; T-Revision: step 50 of 57, in
    the revision stage, resumed from step 49) and resumes ends with the same network,
    transition layer (slack) and optimiser state as the uninterrupted run."""
    from pipeline.cluster.worker import DistConfig, LocalSession, run_worker
    from pipeline.train.checkpoints import load_state

    train, test, view = digits_shards
    run = replace(_run(method, epochs=epochs, pretrain=1), val_fraction=0.05)
    dist = DistConfig(run_name="r", run_dir=str(tmp_path / "a"), train_source=str(train),
                      test_source=str(test), num_workers=1, loader_workers=0,
                      shuffle_buffer=100, preset="digits", checkpoint_every=7)
    (tmp_path / "a").mkdir()
    ref = LocalSession(tmp_path / "a" / "ckpt")
    run_worker(run, dist, view, None, ref)
    (tmp_path / "b").mkdir()
    dist_b = replace(dist, run_dir=str(tmp_path / "b"), inject_failure=f"0:{fail_at}:raise")
    session = LocalSession(tmp_path / "b" / "ckpt")
    with pytest.raises(RuntimeError, match=f"injected failure at step {fail_at}"):
        run_worker(run, dist_b, view, None, session)
    rows = run_worker(run, dist_b, view, None, session)
    assert rows[0]["resumed_epoch"] == epochs - 1 and rows[0]["resumed_batch"] == resume_batch

    a, b = ref.load_checkpoint(), session.load_checkpoint()
    assert a["global_step"] == b["global_step"] == 19 * epochs
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    first = load_state(ref.checkpoints()[0])  # step 7, a CE epoch: not started yet
    if method == "sadapt":
        assert not first["sadapt_started"] and a["sadapt_started"]
        w_a, w_b = a["sadapt_layer"]["weight"], b["sadapt_layer"]["weight"]
        assert torch.equal(w_a, w_b)
        # learned: no longer the Eq. 8 start of the noise phase (checkpoint at epoch 1's end)
        start = next(load_state(c) for c in ref.checkpoints()
                     if load_state(c)["epoch"] == 1 and load_state(c)["batch"] == 0)
        eq8 = start["sadapt_layer"]["weight"]
        assert not torch.equal(eq8, w_a)
        assert torch.allclose(_layer(w_a).transition().sum(1), torch.ones(10))
        # the layer is the optimiser's second parameter group, with its momentum
        opt_a, opt_b = a["optimizers"][0], b["optimizers"][0]
        assert len(opt_a["param_groups"]) == 2 and opt_a["param_groups"][1]["weight_decay"] == 0
        (layer_id,) = opt_a["param_groups"][1]["params"]
        assert torch.equal(opt_a["state"][layer_id]["momentum_buffer"],
                           opt_b["state"][layer_id]["momentum_buffer"])
    else:
        assert not first["trevision_started"] and first["trevision_optimizer"] is None
        for key in ("T_hat", "delta"):
            assert torch.equal(a["trevision_slack"][key], b["trevision_slack"][key]), key
        assert a["trevision_slack"]["delta"].abs().sum() > 0
        assert a["trevision_optimizer"]["param_groups"][0]["lr"] == 5e-7
        sa, sb = a["trevision_optimizer"]["state"], b["trevision_optimizer"]["state"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"])
                                              for i in sa)
        assert [r["trevision_stage"] for r in a["history"]] == [1.0, 2.0, 3.0]


def _layer(weight: torch.Tensor) -> SAdaptation:
    layer = SAdaptation(torch.eye(weight.shape[0]))
    layer.weight.data.copy_(weight)
    return layer


# -- the distributed job: 2 Ray Train workers ---------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from pipeline.cluster.ray_train import init_ray

    started = init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("method, variant", [("bootstrap", ""), ("forward", "oracle"),
                                             ("sadapt", "tracking"), ("trevision", "")])
def test_each_baseline_runs_in_the_distributed_job(method, variant, ray_cluster, tmp_path):
    """``jobs/cifar_lccn.py --smoke-test --method M``: 2 workers on generated CIFAR-like
    shards, 1 CE epoch and 2 of the method. The run completes with the metric names of CE
    and LCCN (in MLflow too); both ranks train with the same transition (S-adaptation's
    layer and T-Revision's slack are averaged over ranks; the anchor points of T-Revision
    and the Eq. 8 start of S-adaptation are all-reduced); an oracle file reaches every
    worker."""
    argv = ["--smoke-test", "--method", method, "--run-dir", str(tmp_path),
            "--run-name", f"{method}-smoke"]
    oracle = None
    if variant == "oracle":
        oracle = np.full((10, 10), 0.02)
        np.fill_diagonal(oracle, 0.82)
        np.savetxt(tmp_path / "T.csv", oracle, delimiter=",")
        argv += ["--transition-file", str(tmp_path / "T.csv")]
    if variant != "tracking":
        argv.append("--no-tracking")
    s = cifar_lccn.main(argv)
    assert s["epoch"] == 3 and len(s["history"]) == 3
    m = s["metrics"]
    assert {"loss", "val_top1", "test_top1"} <= set(m) and np.isfinite(m["loss"])
    assert [r["phase"] for r in s["history"]] == [0.0, 1.0, 1.0]
    assert s["transition"] is None  # no chain: nothing for the driver to re-check
    true = np.asarray(s["true_transition"])
    if method == "bootstrap":
        assert "transition_error" not in m  # not measured: left out of the summary
    else:
        assert 0 < m["transition_error"] < 1
    if oracle is not None:
        assert m["transition_error"] == pytest.approx(np.abs(oracle - true).mean())
    if method in ("sadapt", "trevision"):
        assert [r["transition_rank_gap"] for r in s["history"][1:]] == [0.0, 0.0]
    if method == "trevision":
        assert [r["trevision_stage"] for r in s["history"]] == [1.0, 2.0, 3.0]
    if variant == "tracking":
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=s["tracking_uri"])
        run = client.get_run(s["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert {"loss", "val_top1", "test_top1", "transition_error"} <= set(run.data.metrics)
        assert run.data.params["run.method"] == method
        steps = client.get_metric_history(run.info.run_id, "transition_error")
        assert sorted(x.step for x in steps) == [1, 2]  # NaN in the CE epoch: not logged
        # the learned layer is logged as a chain's phi: heat maps, CSV; the checkpoint stays
        # in the run dir (not copied into MLflow)
        files = {f.path for f in client.list_artifacts(run.info.run_id)}
        assert {"transitions", "transition.csv", "curves.png"} <= files
        assert "checkpoint" not in files
        figs = {f.path for f in client.list_artifacts(run.info.run_id, "transitions")}
        assert figs == {"transitions/phi_epoch_001.png", "transitions/phi_epoch_002.png"}


def test_jobs_refuse_a_bad_transition_file_before_ray(tmp_path):
    """A transition file that is missing or has a row that does not sum to 1 ends the job
    with one line naming the file, before any shard is read by Ray."""
    tr, _ = write_synthetic_shards(tmp_path / "c10", dataset="cifar10", num_classes=10,
                                          size=(8, 8), n_train=40, n_test=10, seed=0,
                                          shard_size=10, noisy_web_labels=False,
                                          classes=cifar_lccn.smoke.classes)
    bad = np.eye(10)
    bad[3, 4] = 0.5
    np.save(tmp_path / "bad.npy", bad)
    base = ["--data", str(tmp_path / "c10"), "--no-tracking", "--run-dir", str(tmp_path / "r"),
            "--method", "forward", "--num-workers", "1"]  # (one test shard)
    for path, message in [(tmp_path / "missing.npy", "does not exist"),
                          (tmp_path / "bad.npy", "row 3 sums to 1.5")]:
        with pytest.raises(SystemExit) as e:
            cifar_lccn.main([*base, "--transition-file", str(path)])
        assert e.value.code.startswith("error: ") and str(path) in e.value.code
        assert message in e.value.code and "\n" not in e.value.code
    args = cifar_lccn.get_args_parser().parse_args(
        ["--data", "/x", "--method", "trevision", "--transition", "eq8",
         "--revision-fraction", "0.25", "--bootstrap-beta", "0.7"])
    run = cifar_lccn.config(args).run
    assert run.method == "trevision" and run.baseline == BaselineConfig(
        bootstrap_beta=0.7, transition="eq8", revision_fraction=0.25)


def test_noisy_nll_goes_through_the_noise_model():
    """``val_nll``'s maths: -log sum_k P(k|x) T[k, y] (the identity: -log P(y|x)); a model
    that predicts the clean class scores the flipped labels well only through T."""
    import math

    from pipeline.train.loop import noisy_nll_of

    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)
    labels = torch.tensor([0, 0])
    assert noisy_nll_of(probs, labels, None) == pytest.approx(-(math.log(0.9) + math.log(0.2)) / 2)
    t = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)  # class 1 -> 0 half the time
    q = (0.9 * 1.0 + 0.1 * 0.5, 0.2 * 1.0 + 0.8 * 0.5)
    assert noisy_nll_of(probs, labels, t) == pytest.approx(-(math.log(q[0]) + math.log(q[1])) / 2)
    assert noisy_nll_of(probs, labels, t) < noisy_nll_of(probs, labels, None)
    assert math.isfinite(noisy_nll_of(torch.tensor([[1.0, 0.0]]), torch.tensor([1]), None))
    with pytest.raises(ValueError, match="noise model has 3 latent rows, the model 2 outputs"):
        noisy_nll_of(probs, labels, torch.ones(3, 2) / 2)


def test_lccn_val_nll_is_the_noisy_labels_likelihood_through_its_phi(noisy_digits, one_thread):
    """The engine's ``val_nll`` of an LCCN run: the held-out observed labels' mean
    -log sum_k P(k|x) phi[k, y] with the chain's phi (with alpha), recomputed here from the
    final model and the labeler's counts; before the noise phase, the identity."""
    from pipeline.core.confusion import transition
    from pipeline.train.loop import noisy_nll_of, predict

    train, test = noisy_digits
    trainer = LocalTrainer(_run("lccn", epochs=4), train, test)
    hist = trainer.fit()
    assert all(np.isfinite(r["val_nll"]) for r in hist)
    eng = trainer.engine
    probs, idx, labels = predict(eng.members[0].eval_model, eng.data.val_batches())
    lab = trainer.labeler
    phi = transition(lab.counts, lab.alpha)
    assert hist[-1]["val_nll"] == pytest.approx(noisy_nll_of(probs, labels, phi), rel=1e-6)
    assert torch.equal(trainer.method.noise_model(), phi)
    assert hist[-1]["val_nll"] != pytest.approx(noisy_nll_of(probs, labels, None), rel=1e-3)


# -- what a method may use of the engine, and what others may know of a method ---------------


def _engine_uses(path: Path) -> dict[str, int]:
    """Attribute name -> first line, of every read of a method's engine in ``path``
    (``self.engine.X``, ``engine.X``, ``eng.X``, ``method.engine.X``)."""
    import ast

    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if owner in ("engine", "eng", "self.engine", "method.engine"):
                out.setdefault(node.attr, node.lineno)
    return out


def test_methods_use_only_what_the_engine_view_declares(noisy_digits):
    """Every attribute the methods (and the report helpers they call with their engine) read
    of the engine is declared by ``EngineView``, and the real engine has every one."""
    import typing

    from pipeline.train.methods.base import EngineView

    declared = set(typing.get_type_hints(EngineView)) | {
        n for n in vars(EngineView) if not n.startswith("_")}
    files = [*sorted((REPO / "pipeline" / "train" / "methods").glob("*.py")),
             REPO / "pipeline" / "train" / "report.py"]
    used = {(f.name, name, line) for f in files for name, line in _engine_uses(f).items()}
    assert {"data", "session", "reduce_cpu", "frozen_copy"} <= {u[1] for u in used}
    undeclared = sorted(u for u in used if u[1] not in declared)
    assert not undeclared, f"methods read engine attributes EngineView lacks: {undeclared}"
    train, test = noisy_digits
    engine = LocalTrainer(_run("lccn"), train, test).engine
    assert all(hasattr(engine, name) for name in declared), \
        sorted(n for n in declared if not hasattr(engine, n))


def test_no_module_outside_the_methods_checks_a_method_by_its_name():
    """What the driver, the jobs and Tune need to know of a method is a method attribute
    (``needs_chain``, ``latent_classes``, ``reads``...): no comparison of a method's name
    with a registered one outside ``pipeline/train/methods``, but the two programs whose
    protocol is LCCN beside CE."""
    import ast

    names = set(registered())
    protocol = {"jobs/quickstart.py", "lccn_jobs/digits.py"}  # LCCN, then CE beside it
    bad = []
    for folder in ("pipeline", "lccn_jobs", "tune", "jobs", "shards"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("pipeline/train/methods/") or rel in protocol:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                consts = {c.value for s in sides for c in ast.walk(s)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                if consts & names and any("method" in ast.unparse(s) for s in sides):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
