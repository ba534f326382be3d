"""The local trainer end to end on real data (scikit-learn digits) with injected noise."""

from __future__ import annotations

import runpy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig, from_dict
from pipeline.core.confusion import count_matrix, transition
from pipeline.core.labels import LabelView
from pipeline.core.noise import CIFAR10_ASYM_MAP, open_set, pair_flip, trusted_subset
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor
from pipeline.train.trainer import LocalTrainer, TensorData

# jobs/quickstart.py, the in-process comparison: a script, not a job of lccn_jobs
quickstart_main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "jobs"
                                     / "quickstart.py"))["main"]


@pytest.fixture(scope="module")
def quickstart_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    return quickstart_main(["--seeds", "0", "1", "2", "--out", str(out)])


def test_lccn_beats_ce_on_noisy_digits_over_three_seeds(quickstart_results):
    runs = quickstart_results["runs"]
    assert len(runs) == 3
    margins = [r["lccn"]["test_top1"] - r["ce"]["test_top1"] for r in runs]
    # LCCN wins on every seed and by >= 3 points on average (measured: +4.7 to +11.6)
    assert all(m > 0 for m in margins), margins
    assert np.mean(margins) >= 0.03, margins
    for r in runs:
        assert r["lccn"]["transition_error"] < 0.05
        assert r["lccn"]["label_recovery"] > r["ce"]["label_recovery"]


def _digits(seed=0):
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=seed)
    x = to_tensor(images)
    return x[tr], labels[tr], x[te], labels[te]


def _short_cfg(**lccn):
    return RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", 1),
                     optim=OptimConfig(epochs=3, pretrain_epochs=1, batch_size=64, lr=0.05),
                     lccn=LCCNConfig(**lccn))


def test_epoch_metrics_and_chain_invariants_after_training():
    """After 1 CE + 2 LCCN epochs: C is the recount of z, the store applied one commit per
    LCCN step, the reported transition error is mean |phi - T|
    of the final C, gamma follows the annealing schedule, and the model learned."""
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    trainer = LocalTrainer(_short_cfg(warmup_steps=5, anneal=True, guard_floor=False),
                           TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    hist = trainer.fit()
    store = trainer.store
    z, obs = store.z.numpy(), store.observed.numpy()
    # one index space: the store holds every sample of the split, the noisy validation
    # split uncounted (its z stays the observed label)
    counted = store.counted.numpy()
    assert len(z) == len(view) and not counted[trainer.held_out].any()
    assert counted.sum() == len(trainer.train_rows)
    assert np.array_equal(z[trainer.held_out], obs[trainer.held_out])
    recount = np.zeros((10, 10), np.int64)
    np.add.at(recount, (z[counted], obs[counted]), 1)
    np.testing.assert_array_equal(store.counts.numpy(), recount)
    lccn_steps = int(sum(r["steps"] for r in hist[1:]))
    assert [r["phase"] for r in hist] == [0.0, 1.0, 1.0]
    # every step's labels applied once (z0 is the start state); commit_every steps per call
    assert store.steps == lccn_steps == trainer.labeler.step_count
    assert store.version < lccn_steps
    phi = recount / recount.sum(1, keepdims=True)
    assert hist[-1]["transition_error"] == pytest.approx(np.abs(phi - view.transition).mean())
    # gamma of the last step: max(exp(-0.8 step / max_step), 0.5) at step = lccn_steps - 1
    expected = max(np.exp(-0.8 * (lccn_steps - 1) / lccn_steps), 0.5)
    assert hist[-1]["gamma"] == pytest.approx(expected)
    assert hist[-1]["staleness"] == 0.0  # one worker sees every commit
    assert hist[-1]["test_top1"] > 0.5 and hist[-1]["loss"] < hist[0]["loss"]
    # the memorisation signal: the classifier's loss on the observed labels (CE's own loss in
    # the CE epoch, another quantity than LCCN's loss after it) and the noise floor the
    # warm-up's phi implies under the training labels' class shares
    from pipeline.core.monitor import noise_floor

    assert hist[0]["observed_loss"] == pytest.approx(hist[0]["loss"], rel=1e-5)
    assert all(np.isfinite(r["observed_loss"]) for r in hist)
    assert hist[-1]["observed_loss"] != pytest.approx(hist[-1]["loss"], rel=1e-3)
    shares = torch.bincount(store.observed[store.counted], minlength=10)
    floor = noise_floor(trainer.phi_init, shares)
    assert np.isnan(hist[0]["noise_floor"]) and 0.5 < floor < 2.0
    assert [r["noise_floor"] for r in hist[1:]] == pytest.approx([floor, floor])
    # the target ramp is counted in the trainer's epochs: one (the default) is over after
    # the first LCCN epoch's steps, whatever the length of the phase
    lab = trainer.labeler
    assert lab.steps_per_epoch == int(hist[1]["steps"]) and lab.max_steps == lccn_steps
    lab.step_count = lab.steps_per_epoch - 1
    assert lab.ramp() == 1.0
    lab.step_count = lab.steps_per_epoch // 2 - 1
    assert lab.ramp() == pytest.approx(0.5, abs=1 / lab.steps_per_epoch)


def test_lccn_star_outlier_row_and_lccn_plus_trusted_targets(monkeypatch):
    """LCCN*: pixel-shuffled (open-set) samples end in the outlier latent class far more
    often than real ones. LCCN+: trusted samples are trained on their clean label (the
    targets the labeler returns), even where their observed label is wrong."""
    from pipeline.train import labeler as lccn

    xtr, ytr, xte, yte = _digits()
    view = open_set(ytr, 10, 0.2, seed=0)
    view = trusted_subset(view, 0.1, seed=0)
    trusted = torch.from_numpy(view.trusted)
    clean = torch.from_numpy(view.clean)
    seen = {"trusted": 0, "wrong_observed": 0}
    real_sample = lccn.GibbsLabeler.sample

    def recording_sample(self, probs, observed, idx):
        z, stats = real_sample(self, probs, observed, idx)
        t = trusted[idx]
        assert torch.equal(z[t], clean[idx][t]), "a trusted sample got a sampled target"
        # the posterior target (the default) of a trusted sample is one-hot at its label
        assert torch.equal(stats.posterior[t].argmax(1), clean[idx][t])
        assert torch.all(stats.posterior[t].max(1).values == 1.0)
        seen["trusted"] += int(t.sum())
        seen["wrong_observed"] += int((t & (observed != clean[idx])).sum())
        return z, stats

    monkeypatch.setattr(lccn.GibbsLabeler, "sample", recording_sample)
    cfg = _short_cfg(outlier=True, use_trusted=True, warmup="identity", init="observed")
    # no validation split: the trainer's idx are the view's
    cfg = replace(cfg, val_fraction=0.0)
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    assert trainer.k_latent == 11
    trainer.fit()
    store = trainer.store
    assert seen["trusted"] == 2 * int(trusted.sum())  # every trusted sample, both LCCN epochs
    assert seen["wrong_observed"] > 0  # the check above saw trusted samples with wrong labels
    assert int(store.counts.sum()) == int((~trusted).sum())
    store.check()
    # the outlier row is live in the chain: samples the classifier calls outliers move to
    # latent class 10, their counts move into row 10 and phi's row 10 follows
    lab = trainer.labeler
    idx = torch.nonzero(~trusted)[:32, 0]
    observed = torch.from_numpy(view.observed)[idx]
    probs = torch.zeros(32, 11)
    probs[:, 10] = 1.0
    lab.flush()
    lab.prefetch(idx)
    before, z_before = store.counts[10].clone(), store.z[idx].clone()
    z, _ = lab.sample(probs, observed, idx)
    assert (z == 10).all()
    lab.commit(idx, z, None)
    lab.flush()
    assert (store.z[idx] == 10).all()
    entered = torch.bincount(observed[z_before != 10], minlength=10)
    assert int(entered.sum()) > 0 and torch.equal(store.counts[10] - before, entered)
    phi = trainer.transition()
    assert phi.shape == (11, 10) and torch.allclose(phi.sum(1), torch.ones(11, dtype=phi.dtype))
    row = store.counts[10].to(torch.float64)
    assert torch.allclose(phi[10], row / row.sum())
    store.check()


def test_config_round_trips_through_a_dict():
    from dataclasses import asdict

    cfg = _short_cfg(alpha=0.5, anneal=True)
    assert from_dict(RunConfig, asdict(cfg)) == cfg
    with pytest.raises(ValueError, match="unknown RunConfig fields"):
        from_dict(RunConfig, {"methd": "ce"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=0.0), "alpha must be > 0"),
    (dict(alpha=-2.0), "alpha must be > 0"),
    (dict(warmup="eq9"), "warmup must be one of"),
    (dict(init="random"), "init must be one of"),
    (dict(ramp_epochs=-1.0), "ramp_epochs must be a finite number >= 0"),
    (dict(ramp_epochs=float("inf")), "ramp_epochs must be a finite number >= 0"),
])
def test_bad_config_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LCCNConfig(**kwargs)


def test_class_count_mismatch_is_an_error():
    xtr, ytr, xte, yte = _digits()
    other = LabelView(observed=yte % 5, clean=yte % 5, num_classes=5)
    with pytest.raises(ValueError, match="train has 10 classes but test has 5"):
        LocalTrainer(_short_cfg(), TensorData(xtr, clean_view(ytr)), TensorData(xte, other))
    with pytest.raises(ValueError, match="images but a label view"):
        TensorData(xtr[:10], clean_view(ytr))


# -- LCCN*: the outlier warm-up and the exported p(outlier) ------------------------------------


def _open_set_digits(seed=0, fraction=0.2):
    """Digits with ``fraction`` of the training samples made out-of-distribution
    (pixel-shuffled, their label kept), as the shard loader shows an open-set view."""
    from pipeline.train.trainer import open_set_images

    xtr, ytr, xte, yte = _digits(seed)
    view = open_set(ytr, 10, fraction, seed=seed)
    return TensorData(open_set_images(xtr, view), view), TensorData(xte, clean_view(yte))


def _star_cfg(**lccn):
    lccn = {"outlier_prior": 0.5, **lccn}  # the outlier row's warm-up on: flags that fire
    return RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", 1),
                     optim=OptimConfig(epochs=6, pretrain_epochs=2, batch_size=64, lr=0.05),
                     lccn=LCCNConfig(outlier=True, **lccn))


def _read_outliers(path):
    import csv

    with open(path) as f:
        rows = list(csv.DictReader(f))
    return rows


def test_lccn_star_exports_p_outlier_that_ranks_planted_outliers_first(tmp_path):
    """20% of the digits pixel-shuffled: the exported p(outlier) (last 2 epochs' Eq. 7
    posteriors) ranks them above the rest and every flagged sample is one of them; the file
    has one row per training sample (split idx, validation split left out, keys), and the
    same file is an artifact of the run's MLflow run.

    Measured: 144 flagged, all planted; precision of the |planted| highest p(outlier) 0.86
    (other seeds: benchmarks/results/outliers.md)."""
    from mlflow import MlflowClient

    from pipeline.train.engine import Tracking

    train, test = _open_set_digits()
    view = train.labels
    keys = [f"digit-{i:04d}" for i in range(len(view))]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = Tracking(uri=uri, experiment="lccn-star", run_name="local", params={})
    trainer = LocalTrainer(_star_cfg(), train, test, out_dir=str(tmp_path / "out"), keys=keys,
                           tracking=tracking)
    trainer.fit()
    rows = _read_outliers(tmp_path / "out" / "outliers.csv")
    assert list(rows[0]) == ["idx", "key", "observed", "p_outlier", "flag"]
    idx = np.array([int(r["idx"]) for r in rows])
    assert sorted(idx.tolist()) == sorted(trainer.train_rows.tolist())  # each once, no val
    assert len(idx) < len(view)
    assert [r["key"] for r in rows] == [keys[i] for i in idx]
    assert [int(r["observed"]) for r in rows] == view.observed[idx].tolist()
    p = np.array([float(r["p_outlier"]) for r in rows])
    flag = np.array([int(r["flag"]) for r in rows])
    assert np.array_equal(flag, (p > 0.5).astype(int))
    ood = view.ood[idx]
    assert flag.sum() >= 60 and ood[flag == 1].all()  # measured: 144 flagged, all planted
    top = np.argsort(-p)[:int(ood.sum())]
    assert ood[top].mean() >= 0.75  # measured 0.86 (base rate 0.2)
    assert p[ood].mean() > 20 * p[~ood].mean()

    client = MlflowClient(tracking_uri=uri)
    run_id = trainer.engine.run_id
    files = {f.path for f in client.list_artifacts(run_id)}
    assert {"outliers.csv", "transition.csv", "curves.png", "transitions"} <= files
    # the local trainer's run carries every epoch's metrics, as a distributed one does
    assert sorted(m.step for m in client.get_metric_history(run_id, "val_top1")) == \
        list(range(_star_cfg().optim.epochs))
    got = Path(client.download_artifacts(run_id, "outliers.csv", str(tmp_path / "dl")))
    assert got.read_text() == (tmp_path / "out" / "outliers.csv").read_text()

    # the classifier a user takes away: an MLflow pytorch model in the run, a signature,
    # loadable, and the same probabilities over the K classes (the outlier logit left out)
    import os

    import mlflow
    import mlflow.pytorch

    assert trainer.engine.model_uri == f"runs:/{run_id}/model"
    assert "MLFLOW_TRACKING_URI" not in os.environ   # no global MLflow state left behind
    from pipeline.track.tracking import _use_tracking_uri

    with _use_tracking_uri(uri):  # a LoggedModel is looked up through the global URI
        local = mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{run_id}/model",
                                                    tracking_uri=uri,
                                                    dst_path=str(tmp_path / "m"))
        info = mlflow.models.get_model_info(local)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    spec = info.signature.inputs.to_dict()[0]["tensor-spec"]
    assert tuple(spec["shape"]) == (-1, 1, 8, 8)
    assert tuple(info.signature.outputs.to_dict()[0]["tensor-spec"]["shape"]) == (-1, 10)
    loaded = mlflow.pytorch.load_model(local)
    x = test.images[:16]
    probs = loaded(x)
    assert probs.shape == (16, 10)
    assert torch.allclose(probs.sum(1), torch.ones(16), atol=1e-5)
    assert torch.equal(probs, trainer.engine.predictor()(x))
    assert (probs.argmax(1) == test.labels.clean[:16]).float().mean() > 0.5


def test_without_its_warm_up_the_outlier_class_stays_empty(tmp_path):
    """The outlier row's own warm-up is what populates it: CE pre-training only lowers the
    outlier logit, and with ``outlier_prior=0`` Eq. 7 leaves (almost) every planted outlier
    out of the outlier class and nothing is flagged (measured: 1 of 241 in the class;
    with the default prior 107)."""
    train, test = _open_set_digits()
    cfg = _star_cfg(outlier_prior=0.0)
    trainer = LocalTrainer(cfg, train, test, out_dir=str(tmp_path))
    trainer.fit()
    ood = train.labels.ood & ~trainer.held_out
    in_outlier_class = trainer.store.z.numpy() == 10
    assert in_outlier_class[ood].mean() < 0.02
    assert not any(r["flag"] == "1" for r in _read_outliers(tmp_path / "outliers.csv"))


def test_posterior_window_sums_columns_over_its_epochs_and_resumes_mid_epoch():
    """The one posterior accumulator (label-issue report, LCCN*'s p(outlier)): only the
    window's epochs count, ``columns`` selects, a merge at a checkpoint moment makes a run
    resumed from it end with the uninterrupted run's sums, and a wrong shape is named."""
    from pipeline.core.posterior import PosteriorWindow

    def window():
        return PosteriorWindow(num_samples=5, width=1, columns=slice(2, 3), first=1,
                               total_epochs=3, dtype=torch.float64)

    post = torch.tensor([[0.1, 0.1, 0.8], [0.5, 0.4, 0.1], [0.3, 0.3, 0.4]])
    same = lambda t: t  # noqa: E731 -- one rank: the all-reduce is the identity
    acc = window()
    assert acc.sink(0) is None and not acc.covers(3)
    for epoch in (1, 2):
        sink = acc.sink(epoch)
        sink(torch.tensor([0, 3]), post[:2])
        sink(torch.tensor([3]), post[2:])
        acc.end_epoch(epoch, same)
    mean = acc.mean()[:, 0]
    assert mean[0] == pytest.approx(0.8) and mean[3] == pytest.approx(0.25)
    assert torch.isnan(mean[[1, 2, 4]]).all() and acc.count.tolist() == [2, 0, 0, 4, 0]
    assert acc.epochs == [1, 2]
    acc.merge(same)  # outside an open epoch: nothing (the engine's epoch-end moment)
    assert acc.count.tolist() == [2, 0, 0, 4, 0]
    # interrupted in epoch 2 after its first batch: a checkpoint moment merges it
    a = window()
    sink = a.sink(1)
    sink(torch.tensor([0, 3]), post[:2])
    sink(torch.tensor([3]), post[2:])
    a.end_epoch(1, same)
    a.sink(2)(torch.tensor([0, 3]), post[:2])
    a.merge(same)
    b = window()
    b.load_state_dict(a.state_dict())
    b.sink(2)(torch.tensor([3]), post[2:])  # the resumed pass does the rest of epoch 2
    b.end_epoch(2, same)
    assert torch.equal(b.sum, acc.sum) and torch.equal(b.count, acc.count)
    with pytest.raises(ValueError, match="shape"):
        PosteriorWindow(num_samples=4, width=1, first=0, total_epochs=1).load_state_dict(
            acc.state_dict())


def test_outlier_prior_applies_only_during_the_outlier_warm_up():
    from pipeline.core.confusion_store import ConfusionStore
    from pipeline.core.warmup import smoothed_identity
    from pipeline.train.labeler import GibbsLabeler

    obs = torch.tensor([0, 1, 2, 0])
    store = ConfusionStore(obs, obs.clone(), 4, 3)
    cfg = LCCNConfig(outlier=True, outlier_prior=0.25, outlier_warmup=0.5)
    lab = GibbsLabeler(cfg, store, store.counts, 0, phi_init=smoothed_identity(4, 3),
                       max_steps=10, generator=torch.Generator().manual_seed(0))
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert torch.allclose(lab.outlier_proposal(probs), torch.tensor([[0.375, 0.375, 0.0, 0.25]]))
    lab.step_count = 5  # half of the 10 LCCN steps: the warm-up is over
    assert torch.equal(lab.outlier_proposal(probs), probs)
    plain = GibbsLabeler(replace(cfg, outlier=False), ConfusionStore(obs, obs.clone(), 3, 3),
                         store.counts[:3], 0, phi_init=smoothed_identity(3, 3), max_steps=10,
                         generator=torch.Generator())
    assert torch.equal(plain.outlier_proposal(probs[:, :3]), probs[:, :3])  # K latent: no-op


def test_target_ramp_rises_linearly_over_ramp_epochs_of_steps():
    from pipeline.core.confusion_store import ConfusionStore
    from pipeline.core.warmup import smoothed_identity
    from pipeline.train.labeler import GibbsLabeler

    obs = torch.tensor([0, 1, 2, 0])

    def labeler(ramp_epochs: float, **kw) -> GibbsLabeler:
        store = ConfusionStore(obs, obs.clone(), 3, 3)
        return GibbsLabeler(LCCNConfig(ramp_epochs=ramp_epochs), store, store.counts, 0,
                            phi_init=smoothed_identity(3, 3), max_steps=100,
                            generator=torch.Generator(), **kw)

    lab = labeler(2.0, steps_per_epoch=10)  # 20 steps of ramp in a 100-step phase
    weights = []
    for step in (0, 9, 18, 19, 50):
        lab.step_count = step
        weights.append(lab.ramp())
    assert weights == pytest.approx([1 / 20, 10 / 20, 19 / 20, 1.0, 1.0])
    lab0 = labeler(0.0, steps_per_epoch=10)
    assert lab0.ramp() == 1.0  # the paper: the LCCN target alone from the first step
    whole = labeler(1.0)  # no epoch length given: the phase counts as one epoch
    whole.step_count = 49
    assert whole.ramp() == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(outlier_prior=1.0), "outlier_prior must lie in"),
    (dict(outlier_warmup=1.5), "outlier_warmup must lie in"),
    (dict(outlier_epochs=0), "outlier_epochs must be an integer"),
    (dict(outlier_threshold=1.0), "outlier_threshold must lie in"),
])
def test_bad_outlier_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LCCNConfig(**kwargs)


def test_lccn_plus_refuses_trusted_outliers_without_lccn_star():
    train, test = _open_set_digits()
    view = trusted_subset(train.labels, count=20, seed=0, outliers=5)
    cfg = replace(_short_cfg(use_trusted=True), val_fraction=0.0)
    with pytest.raises(ValueError, match="5 trusted samples are labelled outliers"):
        LocalTrainer(cfg, TensorData(train.images, view), test)


class _KeepCheckpoints:
    """A one-process session that checkpoints: keeps every state the engine writes and
    hands ``resume`` back as the checkpoint to load."""

    checkpointing = True

    def __init__(self, resume=None):
        from pipeline.train.session import ProcessSession
        self._inner = ProcessSession("cpu")
        self.rank, self.world_size, self.device = 0, 1, self._inner.device
        self.resume, self.states = resume, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load_checkpoint(self):
        return self.resume

    def report(self, metrics, checkpoint_dir):
        if checkpoint_dir is not None:
            self.states.append(torch.load(Path(checkpoint_dir) / "state.pt", weights_only=False))


def test_weight_average_follows_its_recurrence_scores_the_run_and_is_checkpointed():
    """OptimConfig.ema_decay: after global step t the average moves toward the weights by
    1 - min(decay, (1 + t) / (10 + t)) and takes the live batch-norm statistics; validation
    and test score the average, not the live weights; the checkpoint carries it and a run
    resumed from that checkpoint starts from it (from the weights for a checkpoint written
    without one)."""
    from pipeline.train.loop import evaluate
    from pipeline.train.members import ema_decay_at

    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(warmup_steps=5),
                  optim=OptimConfig(epochs=2, pretrain_epochs=1, batch_size=64, lr=0.05,
                                    ema_decay=0.9))
    session = _KeepCheckpoints()
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                           session=session)
    member = trainer.engine.members[0]
    expected = [p.detach().clone() for p in member.ema.parameters()]  # the initial weights
    assert all(torch.equal(e, p) for e, p in zip(expected, member.model.parameters()))
    steps = []

    def record(step):
        steps.append(step)
        d = ema_decay_at(0.9, step)
        for e, p in zip(expected, member.model.parameters()):
            e.mul_(d).add_(p.detach(), alpha=1 - d)

    trainer.engine.options = replace(trainer.engine.options, after_step=record)
    hist = trainer.fit()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == sum(r["steps"] for r in hist)
    assert ema_decay_at(0.9, 1) == pytest.approx(2 / 11) and ema_decay_at(0.9, 1000) == 0.9
    for e, a, p in zip(expected, member.ema.parameters(), member.model.parameters()):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, p)
    for a, b in zip(member.ema.buffers(), member.model.buffers()):
        assert torch.equal(a, b)
    # the reported test accuracy is the average's
    test = trainer.engine.data.test_batches()
    ev = evaluate(member.ema_eval, test, num_classes=10)
    assert hist[-1]["test_top1"] == pytest.approx(ev["top1"])
    assert member.scorer is member.ema_eval
    # checkpointed at each epoch end; a resumed run starts from the saved average
    first = session.states[0]
    assert first["epoch"] == 1 and len(first["emas"]) == 1
    resumed = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                           session=_KeepCheckpoints(resume=first))
    resumed.engine.prepare()
    r = resumed.engine.members[0]
    assert resumed.engine.start_epoch == 1
    for name, t in r.ema.state_dict().items():
        assert torch.equal(t, first["emas"][0][name]), name
    assert not all(torch.equal(a, b) for a, b in zip(r.ema.parameters(), r.model.parameters()))
    old = {k: v for k, v in first.items() if k != "emas"}
    legacy = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                          session=_KeepCheckpoints(resume=old))
    legacy.engine.prepare()
    lm = legacy.engine.members[0]
    assert all(torch.equal(a, b) for a, b in zip(lm.ema.parameters(), lm.model.parameters()))
    with pytest.raises(ValueError, match="ema_decay must be in"):
        OptimConfig(ema_decay=1.0)


def _write_checkpoint(folder, state):
    import json
    folder.mkdir(parents=True)
    torch.save(state, folder / "state.pt")
    (folder / "meta.json").write_text(json.dumps({"global_step": state["global_step"]}))


def test_init_from_starts_a_fresh_run_from_another_runs_final_weights(tmp_path):
    """EngineOptions.init_from (the jobs' --init-from): a finished CE run's newest complete
    checkpoint is found from its run folder; LCCN with no pre-training starts from those
    weights (and average) with a fresh optimiser at epoch 0 in its noise phase; a wrong
    path, two runs, a network count or shape that does not fit are errors naming the file."""
    from pipeline.train.checkpoints import init_state_file

    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    optim = OptimConfig(epochs=2, pretrain_epochs=2, batch_size=64, lr=0.05, ema_decay=0.9)
    ce_session = _KeepCheckpoints()
    ce = LocalTrainer(replace(_short_cfg(), method="ce", optim=optim), TensorData(xtr, view),
                      TensorData(xte, clean_view(yte)), session=ce_session)
    ce.fit()
    first, final = ce_session.states
    run = tmp_path / "runs" / "train" / "ce-run"
    _write_checkpoint(run / "checkpoint_000000", first)
    _write_checkpoint(run / "checkpoint_000001", final)
    (run / "checkpoint_000002").mkdir()  # incomplete: no state
    _write_checkpoint(run / "checkpoint_000003", final)
    (run / "checkpoint_000003" / "meta.json").write_text('{"global_st')  # half written
    for where in (tmp_path / "runs", run, run / "checkpoint_000001",
                  run / "checkpoint_000001" / "state.pt"):
        assert init_state_file(where) == run / "checkpoint_000001" / "state.pt", where
    cfg = replace(_short_cfg(warmup_steps=5), optim=replace(optim, epochs=1, pretrain_epochs=0))

    def lccn(init_from):
        t = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
        t.engine.options = replace(t.engine.options, init_from=str(init_from))
        return t

    t = lccn(tmp_path / "runs")
    t.engine.prepare()
    m = t.engine.members[0]
    for name, v in m.model.state_dict().items():
        assert torch.equal(v, final["models"][0][name]), name
    for name, v in m.ema.state_dict().items():
        assert torch.equal(v, final["emas"][0][name]), name
    assert t.engine.start_epoch == 0 and not m.optimizer.state  # fresh momentum
    # the rate CE's weights were last trained at: the collapse monitor's reference
    assert t.engine.trained_lr() == pytest.approx(final["history"][-1]["lr"])
    hist = t.fit()
    assert [r["phase"] for r in hist] == [1.0] and hist[0]["test_top1"] > 0.5
    assert t.method.monitor.lr_start == pytest.approx(0.05)
    assert hist[0]["val_compared"] == 1.0  # the same rate: the validation check runs
    assert t.engine.trained_lr() == pytest.approx(hist[-1]["lr"])  # now its own history
    # errors
    _write_checkpoint(tmp_path / "runs" / "train" / "other" / "checkpoint_000000", first)
    with pytest.raises(ValueError, match="checkpoints of 2 runs"):
        init_state_file(tmp_path / "runs")
    with pytest.raises(FileNotFoundError, match="no state.pt"):
        init_state_file(tmp_path / "empty")
    two = dict(final, models=[final["models"][0]] * 2)
    torch.save(two, tmp_path / "two.pt")
    with pytest.raises(ValueError, match=r"two\.pt: it holds 2 networks"):
        lccn(tmp_path / "two.pt").engine.prepare()
    bad = dict(final, models=[{k: v for k, v in final["models"][0].items() if "weight" not in k}],
               emas=None)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"bad\.pt: network 0 does not fit"):
        lccn(tmp_path / "bad.pt").engine.prepare()


def test_every_member_of_a_run_takes_norm_weight_decay():
    """OptimConfig.norm_weight_decay reaches the optimiser of each network a method trains
    (DivideMix's two included); the default keeps the single parameter group."""
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    for method, nwd, want in (("lccn", None, [5e-4]), ("lccn", 0.0, [5e-4, 0.0]),
                              ("dividemix", 0.0, [5e-4, 0.0])):
        cfg = replace(_short_cfg(), method=method,
                      optim=replace(_short_cfg().optim, weight_decay=5e-4,
                                    norm_weight_decay=nwd))
        trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
        members = trainer.engine.members
        assert len(members) == (2 if method == "dividemix" else 1)
        for m in members:
            assert [g["weight_decay"] for g in m.optimizer.param_groups] == want, method


def test_a_resume_keeps_the_runs_weight_decay_and_names_a_changed_norm_weight_decay():
    """A checkpoint written with one parameter group does not load into a run with
    norm_weight_decay set (two groups): a clear error naming the option, not torch's; with
    the same groups the run's own decay values win over the checkpoint's."""
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    base = _short_cfg()
    cfg = replace(base, optim=replace(base.optim, epochs=1, pretrain_epochs=1))
    session = _KeepCheckpoints()
    LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                 session=session).fit()
    first = session.states[0]
    changed = replace(cfg, optim=replace(cfg.optim, epochs=2, norm_weight_decay=0.0))
    resumed = LocalTrainer(changed, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                           session=_KeepCheckpoints(resume=first))
    with pytest.raises(ValueError, match="norm_weight_decay"):
        resumed.engine.prepare()
    other = replace(cfg, optim=replace(cfg.optim, epochs=2, weight_decay=1e-3))
    resumed = LocalTrainer(other, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                           session=_KeepCheckpoints(resume=first))
    resumed.engine.prepare()
    assert resumed.engine.start_epoch == 1
    assert [g["weight_decay"] for g in resumed.engine.members[0].optimizer.param_groups] == [1e-3]


def test_progress_lines_inside_an_epoch():
    """EpochProgress: a line every ``every_s`` seconds with the step, the fraction, images/s
    and the epoch's ETA at that rate, the same figures to the log; none at the pass's end
    (the epoch line follows); a resumed epoch's rate counts only its own steps."""
    import io

    from pipeline.train.progress import EpochProgress, format_seconds

    now = [0.0]
    out, logged = io.StringIO(), []
    p = EpochProgress(label="run", epoch=1, epochs=3, steps=10, start=2, images_per_step=64,
                      every_s=5.0, stream=out, log=lambda m, step: logged.append((step, m)),
                      clock=lambda: now[0])
    for i in range(8):          # 2 s a step: lines after steps 3 and 6 (6 s, 12 s)
        now[0] += 2.0
        p.step(100 + i)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == ["[run] epoch 2/3  step 5/10 (50%)  32.0 img/s  epoch ETA 10s",
                     "[run] epoch 2/3  step 8/10 (80%)  32.0 img/s  epoch ETA 4s"]
    assert [s for s, _ in logged] == [102, 105]
    assert logged[0][1] == {"progress_images_per_s": 32.0, "progress_epoch_fraction": 0.5}
    assert (format_seconds(3725), format_seconds(65), format_seconds(float("inf"))) == \
        ("1h02m", "1m05s", "?")


def test_the_trainer_reports_progress_inside_its_epochs(capsys):
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(), method="ce", optim=replace(_short_cfg().optim, epochs=1))
    LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)),
                 progress_seconds=1e-9).fit()
    lines = [x for x in capsys.readouterr().out.splitlines() if " step " in x]
    steps = -(-len(LocalTrainer(cfg, TensorData(xtr, view),
                                TensorData(xte, clean_view(yte))).train_rows) // 64)
    assert len(lines) == steps - 1 and lines[0].startswith("[local] epoch 1/1  step 1/")
    assert all("img/s" in x and "epoch ETA" in x for x in lines)


def test_prior_strength_anchors_every_row_of_phi_at_the_warm_up_estimate():
    """``prior_strength`` s: row k of phi's Dirichlet prior is ``alpha + m phi_init[k]``
    with ``m = s N / K_latent``; a chain whose counts turned diagonal (a classifier that
    memorised its labels) still samples with a transition that keeps the estimated noise,
    and a labeler made again over the same C (a resume) gets the same prior."""
    from pipeline.core.confusion_store import ConfusionStore
    from pipeline.core.sampler import gibbs_posterior
    from pipeline.train.labeler import GibbsLabeler

    k, n = 3, 300
    obs = torch.arange(n) % k
    store = ConfusionStore(obs, obs.clone(), k, k)       # z = observed: C diagonal
    phi_init = torch.full((k, k), 0.25, dtype=torch.float64).fill_diagonal_(0.5)

    def labeler(strength: float) -> GibbsLabeler:
        return GibbsLabeler(LCCNConfig(alpha=1.0, prior_strength=strength), store,
                            store.counts, 0, phi_init=phi_init, max_steps=10,
                            generator=torch.Generator().manual_seed(0))

    plain, anchored = labeler(0.0), labeler(2.0)
    assert plain.alpha.shape == (k,) and torch.equal(plain.alpha, torch.ones(k, dtype=torch.float64))
    m = 2.0 * n / k
    torch.testing.assert_close(anchored.alpha, 1.0 + m * phi_init)
    phi = transition(store.counts, anchored.alpha)
    # counts 100 on the diagonal, 200 pseudo-counts per row spread as phi_init: the
    # diagonal is (100 + 1 + 100) / (100 + 3 + 200), not the (100 + 1) / 103 of alpha alone
    torch.testing.assert_close(phi.diagonal(), torch.full((k,), 201 / 303, dtype=torch.float64))
    assert float(transition(store.counts, plain.alpha).diagonal().min()) > 0.98
    # Eq. 7: a sample the classifier calls 50/50 between its label 0 and class 1 keeps a
    # fifth of its posterior on class 1 with the anchored prior, a hundredth without
    args = (torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([0]), torch.tensor([0]),
            store.counts)
    assert 0.15 < float(gibbs_posterior(*args, anchored.alpha)[0, 1]) < 0.25
    assert float(gibbs_posterior(*args, plain.alpha)[0, 1]) < 0.015
    torch.testing.assert_close(labeler(2.0).alpha, anchored.alpha)  # a resumed labeler
    with pytest.raises(ValueError, match="prior_strength must be a finite number >= 0"):
        LCCNConfig(prior_strength=-1.0)


def test_the_memorisation_guard_switches_to_hard_targets_and_the_anchored_prior(monkeypatch,
                                                                                 capsys):
    """LCCNConfig.guard_drop: the run trains on posterior targets with the paper's prior
    until the noisy validation accuracy falls (scripted here: 0.60, then 0.40 after the
    lr decay), then on sampled targets with phi anchored at the warm-up estimate; the
    chain stays consistent through the switch."""
    from pipeline.train.engine import Engine

    script = [0.50, 0.50, 0.60, 0.40, 0.40, 0.40]  # by epoch (the row being scored)
    monkeypatch.setattr(Engine, "val_scores", lambda self: {
        "top1": script[min(len(self.history), len(script) - 1)], "nll": 1.0})
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(guard_drop=0.05, guard_patience=1, guard_rise=0, teacher="live"),
                  val_fraction=0.1,
                  optim=OptimConfig(epochs=5, pretrain_epochs=1, batch_size=64, lr=0.05,
                                    milestones=(2,)))
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    rows = trainer.fit()
    assert [r["lr"] for r in rows] == pytest.approx([0.05, 0.05, 0.005, 0.005, 0.005])
    assert [r["guarded"] for r in rows[1:]] == [0.0, 0.0, 0.0, 1.0]
    out = capsys.readouterr().out
    assert ("memorisation guard: the noisy validation accuracy has been more than 0.05 "
            "below its best for 1 epochs (to epoch 4); from epoch 5 on LCCN trains on "
            "sample targets with prior_strength 1") in out
    method = trainer.method
    lab = method.labeler
    assert method.guarded_at == 3 and lab.cfg.targets == "sample"
    n_counted = int(lab.counts.sum())
    torch.testing.assert_close(lab.alpha, 1.0 + n_counted / 10 * method.phi_init)
    state = trainer.engine.chain.read()
    assert torch.equal(state["counts"], count_matrix(state["z"], state["observed"], 10, 10,
                                                     counted=state["counted"]))


def test_the_floor_guard_switches_once_the_classifier_fits_below_the_noise_floor(capsys):
    """LCCNConfig.guard_floor: the epoch whose observed_loss falls below the warm-up's noise
    floor switches the rest of the run to sampled targets with the anchored prior (digits
    memorise within a few epochs at lr 0.05 and 40% pair flips: the floor is ~0.5 nats)."""
    from pipeline.core.monitor import floor_epoch

    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(guard_floor=True, guard_rise=0, teacher="live",
                             guard_sampler="live"), val_fraction=0.1,
                  optim=OptimConfig(epochs=6, pretrain_epochs=1, batch_size=32, lr=0.05))
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    rows = trainer.fit()
    assert trainer.method.sampler_model is None  # "live": Eq. 7 reads the trained network
    assert trainer.method.state_dict()["guard_sampler"] is None
    at = floor_epoch(rows[:-1], first_epoch=1)
    assert at is not None, [(r["observed_loss"], r["noise_floor"]) for r in rows]
    assert rows[at]["observed_loss"] < rows[at]["noise_floor"]
    assert all(r["observed_loss"] >= r["noise_floor"] for r in rows[1:at])
    assert [r["guarded"] for r in rows[1:]] == [float(e > at) for e in range(1, 6)]
    assert trainer.method.guarded_at == at and trainer.method.labeler.cfg.targets == "sample"
    # messages count epochs from 1, as the epoch lines do
    assert (f"fell below the noise floor {rows[1]['noise_floor']:.3f} (epoch {at + 1}); "
            f"from epoch {at + 2} on") in capsys.readouterr().out


def test_after_the_floor_guard_eq7_reads_a_frozen_copy_of_the_classifier(monkeypatch):
    """LCCNConfig.guard_sampler "frozen" (default): once the floor guard fires, z is drawn
    from a frozen copy of the classifier as it was after the noise phase's epoch with the
    best noisy validation accuracy up to the switch (its eval-mode probabilities on every
    later batch), while the trained network moves on ("live", the trained network
    throughout: the floor guard test above). The copy is checkpointed, and a resumed run
    that fires the guard again from its epoch rows gets the saved copy back, not the
    weights it resumed with."""
    from pipeline.train.labeler import GibbsLabeler
    from pipeline.train.loop import predict

    seen: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    sample = GibbsLabeler.sample
    holder: dict = {}

    def recording_sample(self, probs, observed, idx):
        m = holder.get("method")
        seen.append((idx.clone(), probs.clone(), m is not None and m.guarded_at is not None))
        return sample(self, probs, observed, idx)

    monkeypatch.setattr(GibbsLabeler, "sample", recording_sample)
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(guard_floor=True, guard_rise=0, teacher="live"), val_fraction=0.1,
                  optim=OptimConfig(epochs=6, pretrain_epochs=1, batch_size=32, lr=0.05))
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    holder["method"] = method = trainer.method
    after_epoch: dict[int, tuple[float, dict]] = {}  # epoch -> (noisy val, weights after it)
    trainer.fit(on_epoch=lambda e, row: after_epoch.__setitem__(e, (row["val_top1"], {
        k: v.clone() for k, v in method.members[0].model.state_dict().items()})))
    at = method.guarded_at
    assert at is not None and at < 5
    best = max(range(0, at + 1), key=lambda e: after_epoch[e][0])  # the CE epoch 0 included
    expected = after_epoch[best][1]
    frozen, live = method.sampler_bare.state_dict(), method.members[0].model.state_dict()
    for k, v in expected.items():  # the copy is the best epoch's weights ...
        torch.testing.assert_close(frozen[k], v)
    assert any(not torch.equal(frozen[k], live[k]) for k in frozen)  # ... not the trained
    assert not any(p.requires_grad for p in method.sampler_bare.parameters())
    # every draw after the switch read the frozen copy's eval-mode probabilities
    after = [(i, p) for i, p, g in seen if g]
    assert after, "no batch was sampled after the switch"
    idx, probs = torch.cat([i for i, _ in after]), torch.cat([p for _, p in after])
    ref, ref_idx, _ = predict(method.sampler_model, trainer.engine.data.train_eval_batches())
    by_idx = torch.full((int(ref_idx.max()) + 1, ref.shape[1]), float("nan"))
    by_idx[ref_idx] = ref
    torch.testing.assert_close(probs, by_idx[idx], atol=1e-5, rtol=1e-4)
    # the checkpoint keeps the copy; resumed, the guard fires again and restores it
    state = method.state_dict()
    torch.testing.assert_close(state["guard_sampler"], expected)
    method.guarded_at, method.sampler_bare, method.sampler_model = None, None, None
    method.cfg = cfg.lccn
    method.load_state_dict(state)
    method._guard(6)
    restored = method.sampler_bare.state_dict()
    for k, v in expected.items():
        torch.testing.assert_close(restored[k], v)


def test_the_teacher_is_the_network_of_the_best_noisy_validation_epoch_so_far(monkeypatch):
    """LCCNConfig.teacher "best" (the default is "live"): Eq. 7 reads the network being
    trained while the epoch just ended holds the best noisy validation accuracy so far, else
    a copy of the weights after that best epoch (its eval-mode probabilities), re-made when a
    later epoch beats it; the later of two equal epochs wins. Scripted accuracies (the epoch being
    scored): 0.50 (CE), 0.60, 0.55, 0.58, 0.60, 0.62, 0.61."""
    from pipeline.train.engine import Engine
    from pipeline.train.labeler import GibbsLabeler
    from pipeline.train.loop import predict

    script = [0.50, 0.60, 0.55, 0.58, 0.60, 0.62, 0.61]
    monkeypatch.setattr(Engine, "val_scores", lambda self: {
        "top1": script[min(len(self.history), len(script) - 1)], "nll": 1.0,
        "nll_plain": 1.0})
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    sample = GibbsLabeler.sample
    holder: dict = {}

    def recording_sample(self, probs, observed, idx):
        seen.append((len(holder["trainer"].engine.history), idx.clone(), probs.clone()))
        return sample(self, probs, observed, idx)

    monkeypatch.setattr(GibbsLabeler, "sample", recording_sample)
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    assert LCCNConfig().teacher == "live"
    cfg = replace(_short_cfg(teacher="best"), val_fraction=0.1,
                  optim=OptimConfig(epochs=7, pretrain_epochs=1, batch_size=64, lr=0.05))
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    holder["trainer"] = trainer
    method = trainer.method
    weights: dict[int, dict] = {}
    copies: dict[int, dict] = {}

    def on_epoch(e, row):
        weights[e] = {k: v.clone() for k, v in method.members[0].model.state_dict().items()}
        if method.sampler_bare is not None:
            copies[e] = {k: v.clone() for k, v in method.sampler_bare.state_dict().items()}

    rows = trainer.fit(on_epoch=on_epoch)
    # epoch e reads: 1, 2 live (0 and 1 set the best); 3, 4 epoch 1's copy; 5 live (4 ties
    # 1: the later); 6 live (5 is the best)
    assert [r["teacher_epoch"] for r in rows] == [-1, -1, -1, 1, 1, -1, -1]
    for e in (3, 4):
        for k, v in weights[1].items():
            torch.testing.assert_close(copies[e][k], v)
    # the draws of epochs 3 and 4 read the copy's eval-mode probabilities, not the trained
    # network's (whose weights moved on)
    frozen = trainer.engine.frozen_copy(method.members[0], weights[1])[1]
    ref, ref_idx, _ = predict(frozen, trainer.engine.data.train_eval_batches())
    by_idx = torch.full((int(ref_idx.max()) + 1, ref.shape[1]), float("nan"))
    by_idx[ref_idx] = ref
    during = [(i, p) for e, i, p in seen if e in (3, 4)]
    assert during
    idx = torch.cat([i for i, _ in during])
    torch.testing.assert_close(torch.cat([p for _, p in during]), by_idx[idx], atol=1e-5,
                               rtol=1e-4)
    live = [(i, p) for e, i, p in seen if e == 5]
    assert not torch.allclose(torch.cat([p for _, p in live]),
                              by_idx[torch.cat([i for i, _ in live])], atol=1e-3)
    # the guard never fired (a constant rate is not watched), and said so at the start
    assert all(r["guarded"] == 0.0 and r["guard_ranks"] == 0.0 for r in rows[1:])


def test_the_guard_stays_off_on_a_run_that_does_not_memorise(capsys):
    """A real run (digits, 40% pair flips, weight decay, lr 0.05 -> 0.005 after epoch 4):
    the classifier keeps fitting held-out labels as well as it fits its own, the guard
    watches epochs 5-8 and never switches."""
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(), val_fraction=0.1,
                  optim=OptimConfig(epochs=8, pretrain_epochs=2, batch_size=64, lr=0.05,
                                    milestones=(4,)))
    rows = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte))).fit()
    watched = [r for r in rows[2:] if r["lr"] < rows[2]["lr"]]
    assert len(watched) == 4
    assert all(r["guarded"] == 0.0 for r in rows), [r["val_observed_loss"] for r in rows]
    gaps = [r["val_observed_loss"] - r["observed_loss"] for r in watched]
    assert max(gaps) - min(gaps) < 0.05 * watched[0]["label_entropy"], gaps
    shares = np.bincount(view.observed, minlength=10) / len(view)
    assert rows[-1]["label_entropy"] == pytest.approx(-(shares * np.log(shares)).sum(), abs=0.01)
    assert "memorisation guard" not in capsys.readouterr().out


@pytest.mark.parametrize("teacher", ["live", "best"])
def test_the_rise_trigger_switches_targets_and_prior_and_keeps_the_teacher(monkeypatch,
                                                                            capsys, teacher):
    """LCCNConfig.guard_rise (default 0.05): the first epoch after the lr decay whose held-out
    loss of the observed labels is above its lowest with the gap to the training loss
    widened by more than 0.05 x H(observed) since switches the rest of the run to sampled
    targets and the anchored prior. The best-epoch teacher goes on choosing by noisy
    validation accuracy; the live one (default) is replaced by a frozen copy of the best
    noisy-validation epoch before the switch, and the epoch rows name that epoch. Scripted
    held-out losses; the training pass is real (its loss falls)."""
    from pipeline.train.engine import Engine

    held = [2.0, 1.5, 1.6, 1.2, 1.19, 1.35, 1.4, 1.4]     # by epoch scored; lr decays at 3
    top1 = [0.5, 0.55, 0.5, 0.6, 0.62, 0.58, 0.56, 0.55]
    monkeypatch.setattr(Engine, "val_scores", lambda self: {
        "top1": top1[len(self.history)], "nll": 1.0, "nll_plain": held[len(self.history)]})
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(teacher=teacher), val_fraction=0.1,
                  optim=OptimConfig(epochs=8, pretrain_epochs=1, batch_size=64, lr=0.05,
                                    milestones=(3,)))
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    rows = trainer.fit()
    assert rows[5]["observed_loss"] < rows[4]["observed_loss"], [r["observed_loss"] for r in rows]
    # watched from epoch 3 (lr 0.005): lowest 1.19 at 4; at 5 the held-out loss is up 0.16
    # and the training loss down, a gap wider by more than 0.05 x 2.25
    assert [r["guarded"] for r in rows] == [0.0] * 6 + [1.0] * 2
    method = trainer.method
    assert method.guarded_at == 5 and method.labeler.cfg.targets == "sample"
    n_counted = int(method.labeler.counts.sum())
    torch.testing.assert_close(method.labeler.alpha, 1.0 + n_counted / 10 * method.phi_init)
    assert [r["teacher_epoch"] for r in rows] == (
        [-1, -1, -1, 1, -1, -1, 4, 4] if teacher == "best" else [-1] * 6 + [4, 4])
    out = capsys.readouterr().out
    assert ("memorisation guard: the held-out loss of the observed labels stopped falling "
            "while its gap to the training loss widened by more than 0.05 x their entropy "
            "(epoch 6); from epoch 7 on LCCN trains on sample targets with prior_strength 1"
            ) in out


def test_the_run_exports_its_selected_epochs_classifier_and_its_final_one_beside_it(
        tmp_path, monkeypatch):
    """The exported program (and the MLflow model, through Engine.predictor) holds the
    weights after the epoch with the best noisy validation accuracy, the epoch the run
    reports as selected (the first of equals); ``<name>-final.pt2`` the weights the run
    ended with; each sidecar says which. Scripted accuracies: the best is epoch 2 of 4."""
    import json

    from pipeline.track.predict import ExportedClassifier
    from pipeline.train.engine import Engine, select_epoch

    script = [0.5, 0.7, 0.6, 0.7]
    monkeypatch.setattr(Engine, "val_scores", lambda self: {
        "top1": script[len(self.history)], "nll": 1.0, "nll_plain": 1.0})
    xtr, ytr, xte, yte = _digits()
    view = pair_flip(ytr, 10, CIFAR10_ASYM_MAP, 0.4, seed=0)
    cfg = replace(_short_cfg(), method="ce", val_fraction=0.1,
                  optim=OptimConfig(epochs=4, pretrain_epochs=1, batch_size=64, lr=0.05))
    trainer = LocalTrainer(cfg, TensorData(xtr, view), TensorData(xte, clean_view(yte)))
    trainer.engine.options.export_path = str(tmp_path / "models" / "run.pt2")
    after: dict[int, dict] = {}
    rows = trainer.fit(on_epoch=lambda e, r: after.__setitem__(e, {
        k: v.clone() for k, v in trainer.model.state_dict().items()}))
    assert select_epoch(rows) == 1
    x = xte[:32]
    best = build_small(after[1])
    final = build_small(after[3])
    sel = ExportedClassifier(tmp_path / "models" / "run.pt2")
    fin = ExportedClassifier(tmp_path / "models" / "run-final.pt2")
    with torch.no_grad():
        torch.testing.assert_close(sel(x), torch.softmax(best(x), 1))
        torch.testing.assert_close(fin(x), torch.softmax(final(x), 1))
    assert not torch.allclose(sel(x), fin(x))
    meta = json.loads((tmp_path / "models" / "run.json").read_text())
    assert meta["weights"] == "selected epoch 2 of 4 (best noisy validation accuracy 0.7000)"
    meta = json.loads((tmp_path / "models" / "run-final.json").read_text())
    assert meta["weights"] == "final epoch 4"
    torch.testing.assert_close(trainer.engine.predictor()(x), sel(x))


def build_small(state: dict) -> torch.nn.Module:
    from pipeline.train.models import build_model

    net = build_model("small_cnn", 10, in_channels=1)
    net.load_state_dict(state)
    return net.eval()
