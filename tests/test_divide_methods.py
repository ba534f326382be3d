"""DivideMix and DivideLCCN as methods of the engine, trained in one process on real data
(scikit-learn digits, 40% symmetric label noise planted by pipeline.core.noise)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.core import divide as divide_maths
from pipeline.core import warmup
from pipeline.core.config import DivideConfig, LCCNConfig, ModelConfig, OptimConfig, RunConfig
from pipeline.core.confusion import count_matrix
from pipeline.core.noise import symmetric
from pipeline.core.sampler import conditional_transition
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor
from pipeline.cluster.worker import LocalSession
from pipeline.train.chains import ChainSet
from pipeline.train.checkpoints import load_state
from pipeline.train.methods import divide as divide_methods
from pipeline.train.trainer import LocalTrainer, TensorData


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=0)
    x = to_tensor(images)
    view = symmetric(labels[tr], 10, 0.4, seed=0)
    return TensorData(x[tr], view), TensorData(x[te], clean_view(labels[te]))


def _cfg(method: str, *, epochs: int = 6, pretrain: int = 2, **divide) -> RunConfig:
    return RunConfig(method=method, seed=0, model=ModelConfig("small_cnn", 1),
                     optim=OptimConfig(epochs=epochs, pretrain_epochs=pretrain, batch_size=64,
                                       lr=0.05),
                     divide=DivideConfig(**divide))


@pytest.fixture(scope="module")
def runs(digits):
    """2 epochs of CE warm-up then 4 of each method (and CE on the same schedule)."""
    train, test = digits
    out = {}
    for method in ("ce", "dividemix", "divide_lccn"):
        trainer = LocalTrainer(_cfg(method), train, test)
        out[method] = (trainer, trainer.fit())
    return out


@pytest.mark.parametrize("method", ["dividemix", "divide_lccn"])
def test_both_networks_train_and_beat_chance_and_ce(runs, method):
    trainer, hist = runs[method]
    ce = runs["ce"][1][-1]["test_top1"]
    assert len(trainer.engine.members) == 2
    w0, w1 = (list(m.model.parameters())[0] for m in trainer.engine.members)
    assert not torch.equal(w0, w1)                        # two networks, started apart
    assert [r["phase"] for r in hist] == [0, 0, 1, 1, 1, 1]
    # 10 classes: chance is 0.1. Measured on this split: CE 0.80, DivideMix 0.96,
    # DivideLCCN 0.97 (the ensemble of both networks)
    assert hist[-1]["test_top1"] > 0.9
    assert hist[-1]["test_top1"] > ce + 0.08
    assert all(np.isfinite(r["loss"]) for r in hist)
    # label_recovery in the noise phase is the training targets' agreement with the clean
    # labels; in the warm-up it is the observed labels' (the noise level, ~0.65)
    assert hist[1]["label_recovery"] < 0.7 < 0.9 < hist[-1]["label_recovery"]


@pytest.mark.parametrize("method", ["dividemix", "divide_lccn"])
def test_test_top1_is_the_ensemble_of_both_networks(runs, digits, method):
    trainer, hist = runs[method]
    _, test = digits
    nets = [m.model.eval() for m in trainer.engine.members]
    with torch.no_grad():
        l0, l1 = (net(test.images) for net in nets)
    clean = torch.from_numpy(test.labels.clean)
    hits = divide_maths.ensemble_topk(l0, l1, clean, ks=(1, 5))
    assert hist[-1]["test_top1"] == pytest.approx(hits[1] / len(clean))
    assert hist[-1]["test_top5"] == pytest.approx(hits[5] / len(clean))


def test_with_a_weight_average_the_ensemble_of_the_averages_is_scored(digits):
    """OptimConfig.ema_decay on the two-network methods: the reported accuracy is the
    ensemble of both networks' weight averages, not of the live weights."""
    train, test = digits
    cfg = _cfg("divide_lccn", epochs=3, pretrain=2)
    cfg = replace(cfg, optim=replace(cfg.optim, ema_decay=0.9))
    trainer = LocalTrainer(cfg, train, test)
    hist = trainer.fit()
    clean = torch.from_numpy(test.labels.clean)

    def top1(nets):
        with torch.no_grad():
            l0, l1 = (net.eval()(test.images) for net in nets)
        return divide_maths.ensemble_topk(l0, l1, clean, ks=(1,))[1] / len(clean)

    members = trainer.engine.members
    assert all(m.ema is not None for m in members)
    assert hist[-1]["test_top1"] == pytest.approx(top1([m.ema for m in members]))
    assert not all(torch.equal(a, b) for a, b in zip(members[0].ema.parameters(),
                                                     members[0].model.parameters()))


def test_warm_up_negative_entropy_penalty(digits):
    """conf_penalty adds mean Σ p log p (<= 0) to the warm-up cross-entropy: a lower
    reported loss and less confident networks than the same warm-up without it."""
    train, test = digits
    out = {}
    for flag in (False, True):
        trainer = LocalTrainer(_cfg("dividemix", epochs=2, pretrain=2, conf_penalty=flag),
                               train, test)
        hist = trainer.fit()
        with torch.no_grad():
            p = torch.softmax(trainer.engine.members[0].model.eval()(train.images), 1)
        out[flag] = (hist[-1]["loss"], float(-(p * p.clamp_min(1e-12).log()).sum(1).mean()))
    assert out[True][0] < out[False][0]
    assert out[True][1] > out[False][1] + 0.05          # higher prediction entropy


@pytest.mark.parametrize("lambda_u, labelled_only", [(0.0, True), (25.0, False)])
def test_without_an_unlabelled_loss_only_the_mixed_labelled_rows_are_trained_on(
        digits, monkeypatch, lambda_u, labelled_only):
    """lambda_u 0 (the Clothing1M / WebVision presets): as DivideMix's code for them, the
    network forwards and trains on the mixed labelled rows alone (their partners drawn from
    the whole batch), the prior penalty over them; otherwise on every mixed row."""
    import pipeline.train.methods.divide as divide_method

    seen = []
    real_mix, real_pen = divide_method.mixmatch, divide_method.uniform_prior_penalty

    def mix(*args, **kwargs):
        out = real_mix(*args, **kwargs)
        seen.append([out.n_labelled, out.inputs.shape[0]])
        return out

    def pen(logits, *args, **kwargs):
        seen[-1].append(logits.shape[0])
        return real_pen(logits, *args, **kwargs)

    monkeypatch.setattr(divide_method, "mixmatch", mix)
    monkeypatch.setattr(divide_method, "uniform_prior_penalty", pen)
    train, test = digits
    LocalTrainer(_cfg("dividemix", epochs=3, pretrain=2, lambda_u=lambda_u), train, test).fit()
    steps = [s for s in seen if 0 < s[0] < s[1]]  # batches with both parts
    assert len(steps) > 10
    assert all(trained == (nl if labelled_only else total) for nl, total, trained in steps)


@pytest.mark.parametrize("method", ["dividemix", "divide_lccn"])
def test_the_division_separates_the_planted_noisy_samples(runs, method):
    trainer, hist = runs[method]
    view = trainer.train.labels
    truly_clean = torch.from_numpy(view.observed == view.clean)
    base = float(truly_clean.double().mean())               # ~0.65 clean
    assert 0.6 < base < 0.7
    assert all("division_precision" not in r for r in hist[:2])  # no division in warm-up
    first = hist[2]
    # right after the 2 warm-up epochs each network's division is already ~0.9 precise
    # (measured 0.90 / 0.91); it sharpens as the networks train on it (measured >= 0.97)
    for sfx in ("", "_net2"):
        assert first[f"division_precision{sfx}"] > 0.85
        assert hist[-1][f"division_precision{sfx}"] > 0.95
        assert hist[-1][f"division_recall{sfx}"] > 0.9
    # the method's current division, recomputed from its clean probabilities
    for prob in trainer.method.prob_clean:
        clean = prob > 0.5
        precision = float(truly_clean[clean].double().mean())
        assert precision > 0.95 and precision > base + 0.25
    # the two networks divide differently (each trains on the other's division)
    p0, p1 = trainer.method.prob_clean
    assert not torch.equal(p0, p1)


def test_divide_lccn_keeps_one_valid_chain_per_network(runs, digits):
    trainer, hist = runs["divide_lccn"]
    assert isinstance(trainer.engine.chain, ChainSet)
    stores = trainer.stores
    assert len(stores) == 2 and stores[0] is not stores[1]
    n = len(trainer.train_rows)   # the noisy validation split is in z, never counted
    steps = int(sum(r["steps"] for r in hist[2:]))
    for s in stores:
        s.check()
        assert int(s.counts.sum()) == n == int(s.counted.sum())
        assert not s.counted[torch.from_numpy(trainer.held_out)].any()
        assert torch.equal(s.counts, count_matrix(s.z, s.observed, 10, 10, counted=s.counted))
        assert s.steps == steps      # every batch's labels applied once per chain (pushes of commit_every)
    assert not torch.equal(stores[0].z, stores[1].z)         # two chains, not one
    last = hist[-1]
    for key in ("transition_error", "transition_error_net2", "chain_gap", "latent_entropy",
                "latent_entropy_net2", "z_agreement", "z_agreement_net2"):
        assert np.isfinite(last[key]), key
    # both chains estimate the planted 40% symmetric transition (mean |phi - T| ~0.035)
    assert last["transition_error"] < 0.06 and last["transition_error_net2"] < 0.06
    assert last["chain_gap"] < 0.05 and last["collapse"] == 0.0
    assert 0 < last["changed"] < 1


def test_divide_lccn_starts_each_chain_at_its_warm_up_prior(digits, monkeypatch):
    """With ``warmup_prior="deconvolved"`` each network's initial assignment is the arg max
    of its deconvolved prediction, the prior its warm-up draws read (as in LCCN)."""
    seen = []
    real_prior, real_init = warmup.warmup_prior, warmup.initial_assignment

    def prior(mode, probs, phi):
        out = real_prior(mode, probs, phi)
        seen.append(("prior", mode, probs, out))
        return out

    def init(observed, *, probs, mode):
        z0 = real_init(observed, probs=probs, mode=mode)
        seen.append(("init", probs, z0))
        return z0

    monkeypatch.setattr(warmup, "warmup_prior", prior)
    monkeypatch.setattr(warmup, "initial_assignment", init)
    cfg = replace(_cfg("divide_lccn", epochs=3, pretrain=2),
                  lccn=LCCNConfig(warmup_prior="deconvolved"))
    LocalTrainer(cfg, *digits).fit()
    assert [s[0] for s in seen] == ["prior", "init", "prior", "init"]   # one per network
    for (_, mode, probs, out), (_, got, z0) in zip(seen[0::2], seen[1::2]):
        assert mode == "deconvolved" and got is out
        assert not torch.allclose(out, probs)               # the prior was deconvolved
        assert torch.equal(z0, out.argmax(1))


def test_divide_lccn_co_refinement_is_co_refine_lccn_of_its_chain(digits, monkeypatch):
    """Inside the method, the labelled rows' targets equal co_refine_lccn on the same
    prediction, with the conditional transition recomputed from the network's own store
    (own count removed) and w from the OTHER network's division; those targets are what
    MixMatch mixes, and the chain steps once per batch."""
    train, test = digits
    cls = divide_methods.DivideLCCN
    checked = {"refine": 0, "mix": 0}
    expected_targets: list[torch.Tensor] = []
    real_refine, real_mixmatch = cls.refine, divide_methods.mixmatch

    def spy_refine(self, k, b, nxt, p_bar, labelled, w):
        store = self.engine.chain[k].store
        counts, z, version = store.counts.clone(), store.z.clone(), store.version
        out = real_refine(self, k, b, nxt, p_bar, labelled, w)
        w_other = self.prob_clean[1 - k][b.idx].to(torch.float32)
        assert torch.equal(w, w_other)
        lab = (w_other > self.cfg.p_threshold) & b.valid
        assert torch.equal(labelled, lab)
        cond = conditional_transition(b.observed, z[b.idx], counts, self.lc.alpha)
        want = divide_maths.co_refine_lccn(F.one_hot(b.observed[lab], 10), p_bar[lab],
                                           cond[lab], w_other[lab], self.cfg.temperature)
        assert torch.equal(out, want)
        assert store.version == version + 1                 # the chain stepped on this batch
        checked["refine"] += 1
        expected_targets.append(want)
        return out

    def spy_mixmatch(x_l, p_l, x_u, p_u, alpha, *, generator):
        want = expected_targets.pop()
        assert torch.equal(p_l, torch.cat([want, want]))
        checked["mix"] += 1
        return real_mixmatch(x_l, p_l, x_u, p_u, alpha, generator=generator)

    monkeypatch.setattr(cls, "refine", spy_refine)
    monkeypatch.setattr(divide_methods, "mixmatch", spy_mixmatch)
    # one commit per step, so the store itself holds the state each batch sampled against
    cfg = _cfg("divide_lccn", epochs=2, pretrain=1)
    cfg = replace(cfg, lccn=replace(cfg.lccn, commit_every=1))
    trainer = LocalTrainer(cfg, train, test)
    trainer.fit()
    batches = -(-len(trainer.train_rows) // 64)
    assert checked == {"refine": 2 * batches, "mix": 2 * batches}


class _Stop(Exception):
    pass


@pytest.mark.parametrize("method", ["dividemix", "divide_lccn"])
def test_resume_after_an_epoch_ends_as_the_uninterrupted_run(digits, tmp_path, method):
    """Stopped after epoch 2 (the first with a division) and resumed from its checkpoint
    by a new trainer: the same networks, optimizers, chains, division and history as a
    run that never stopped."""
    train, test = digits
    cfg = _cfg(method, epochs=4, pretrain=1)
    whole = LocalTrainer(cfg, train, test, session=LocalSession(tmp_path / "whole"))
    rows_whole = whole.fit()

    session = LocalSession(tmp_path / "cut")

    def stop(epoch, row):
        if epoch == 2:
            raise _Stop

    first = LocalTrainer(cfg, train, test, session=session)
    with pytest.raises(_Stop):
        first.fit(on_epoch=stop)
    state = load_state(session.checkpoints()[-1])
    assert state["epoch"] == 3 and len(state["models"]) == len(state["optimizers"]) == 2
    assert state["division_epoch"] == 2 and len(state["division_prob"]) == 2
    if method == "divide_lccn":
        assert len(state["store"]["chains"]) == 2
    resumed = LocalTrainer(cfg, train, test, session=session)
    rows = resumed.fit()
    assert [r["epoch"] for r in rows] == [3.0] and rows[0]["resumed_epoch"] == 3.0

    timing = {"epoch_time", "step_time", "images_per_s", "steps_per_s", "sampler_time",
              "sync_time", "sampler_share", "resumed_epoch", "resumed_batch"}

    def same(a, b):  # equal rows, NaN equal to NaN (e.g. transition_error of dividemix)
        keys = set(a) - timing
        return keys == set(b) - timing and all(
            a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in keys)

    hist_whole, hist = whole.engine.history, resumed.engine.history
    assert len(hist) == len(hist_whole) == 4
    assert all(same(a, b) for a, b in zip(hist, hist_whole)), (hist[-1], hist_whole[-1])
    for m, mw in zip(resumed.engine.members, whole.engine.members):
        for (name, t), (_, tw) in zip(m.model.state_dict().items(),
                                      mw.model.state_dict().items()):
            assert torch.equal(t, tw), name
        mom = [s["momentum_buffer"] for s in m.optimizer.state_dict()["state"].values()]
        mom_w = [s["momentum_buffer"] for s in mw.optimizer.state_dict()["state"].values()]
        assert all(torch.equal(a, b) for a, b in zip(mom, mom_w))
    for p, pw in zip(resumed.method.prob_clean, whole.method.prob_clean):
        assert torch.equal(p, pw)
    for s, sw in zip(resumed.stores, whole.stores):
        assert torch.equal(s.z, sw.z) and torch.equal(s.counts, sw.counts)
        assert s.version == sw.version


def test_divide_configs_are_checked():
    with pytest.raises(ValueError, match="division_loss must be one of"):
        DivideConfig(division_loss="gmm")
    with pytest.raises(ValueError, match="p_threshold"):
        DivideConfig(p_threshold=1.5)
    with pytest.raises(ValueError, match="mixmatch_alpha"):
        DivideConfig(mixmatch_alpha=0)


def test_divide_lccn_refuses_lccn_star_and_plus(digits):
    train, test = digits
    cfg = replace(_cfg("divide_lccn"), lccn=LCCNConfig(outlier=True))
    with pytest.raises(ValueError, match="plain LCCN chains"):
        LocalTrainer(cfg, train, test)


@pytest.mark.parametrize("lccn", [LCCNConfig(targets="sample"), LCCNConfig(ramp_epochs=0.0),
                                  LCCNConfig(targets="map", ramp_epochs=4.0)])
def test_divide_lccn_refuses_the_lccn_target_options_it_never_reads(digits, lccn):
    """DivideLCCN trains on co-refined targets: a non-default LCCN target or ramp is an
    error naming it, not a silently ignored setting (annealing, which tempers its draws, is
    accepted)."""
    train, test = digits
    with pytest.raises(ValueError, match="does not read lccn.(targets|ramp_epochs)"):
        LocalTrainer(replace(_cfg("divide_lccn"), lccn=lccn), train, test)
    LocalTrainer(replace(_cfg("divide_lccn"), lccn=LCCNConfig(anneal=True)), train, test)


def test_two_views_are_two_augmentations_from_the_generator(digits):
    train, _ = digits
    calls = []

    def augment(x, g):
        calls.append(1)
        return x + torch.rand(x.shape, generator=g)

    data = TensorData(train.images[:10], train.labels.take(np.arange(10)), augment=augment)
    g = torch.Generator().manual_seed(0)
    (b,) = list(data.batches(16, generator=g, views=2))
    assert b.images.shape == b.images2.shape == (10, 1, 8, 8)
    assert not torch.equal(b.images, b.images2) and len(calls) == 2
    # the same draws, in that order, as one view then a second augmentation
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(10, generator=g)
    x = train.images[:10][order]
    assert torch.equal(b.images, x + torch.rand(x.shape, generator=g))
    assert torch.equal(b.images2, x + torch.rand(x.shape, generator=g))
    (one,) = list(data.batches(16, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(one.images, b.images)       # views=1 is unchanged


# -- the distributed worker loop (one worker in this process, shards on disk) ----------------


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory):
    from lccn_jobs import digits as quickstart_ray

    root = tmp_path_factory.mktemp("digit-shards")
    train, test = quickstart_ray.write_digits_shards(root, seed=0)
    return train, test, quickstart_ray.digits_view(train, rate=0.4, seed=0)


def test_divide_lccn_worker_loop_resumes_mid_epoch_exactly(digit_shards, tmp_path):
    """run_worker with one store per network: failing mid-epoch of the noise phase (after a
    mid-epoch checkpoint that carries the epoch's division) and resuming ends with the same
    networks, chains and division as the uninterrupted run; the division pass scored every
    training idx (the held-out split excluded) exactly once."""
    from pipeline.cluster.ray_train import initial_assignment_placeholder
    from pipeline.cluster.store_actor import LocalStoreClient, StoreActor
    from pipeline.cluster.worker import DistConfig, run_worker
    from pipeline.train.sources import held_out_mask

    train, test, view = digit_shards
    run = _cfg("divide_lccn", epochs=2, pretrain=1)
    dist = DistConfig(run_name="local", run_dir=str(tmp_path / "a"), train_source=str(train),
                      test_source=str(test), num_workers=1, loader_workers=0,
                      shuffle_buffer=100, preset="digits", checkpoint_every=7,
                      tracking_uri=None)
    z0, counted = initial_assignment_placeholder(view, run)
    obs = torch.from_numpy(view.observed)

    def stores():
        return [StoreActor(obs, z0, 10, 10, counted=counted) for _ in range(2)]

    (tmp_path / "a").mkdir()
    ref = stores()
    ref_rows = run_worker(run, dist, view, [LocalStoreClient(s) for s in ref],
                          LocalSession(tmp_path / "a" / "ckpt"))
    assert len(ref_rows) == 2 and ref_rows[-1]["test_top1"] > 0.5
    held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
    for s in ref:
        s.check()
        assert int(s.counts.sum()) == int((~held_out).sum())

    # 19 steps per epoch (1,195 training digits, the validation split dropped): fail at step
    # 25 (epoch 1, the first noise epoch); the last checkpoint is the one at step 21, batch 2
    # of epoch 1, with epoch 1's division
    dist_b = replace(dist, run_dir=str(tmp_path / "b"), inject_failure="0:25:raise")
    (tmp_path / "b").mkdir()
    cut = stores()
    session = LocalSession(tmp_path / "b" / "ckpt")
    with pytest.raises(RuntimeError, match="injected failure at step 25"):
        run_worker(run, dist_b, view, [LocalStoreClient(s) for s in cut], session)
    st = session.load_checkpoint()
    assert (st["epoch"], st["batch"], st["division_epoch"]) == (1, 2, 1)
    rows = run_worker(run, dist_b, view, [LocalStoreClient(s) for s in cut], session)
    assert rows[0]["resumed_epoch"] == 1 and rows[0]["resumed_batch"] == 2
    a, b = LocalSession(tmp_path / "a" / "ckpt").load_checkpoint(), session.load_checkpoint()
    for ma, mb in zip(a["models"], b["models"]):
        assert all(torch.equal(ma[key], mb[key]) for key in ma)
    for pa, pb in zip(a["division_prob"], b["division_prob"]):
        assert torch.equal(pa, pb)
        assert (pa[torch.from_numpy(held_out)] == 0).all()      # never divided
    for s, r in zip(cut, ref):
        assert torch.equal(s.z, r.z) and torch.equal(s.counts, r.counts)
