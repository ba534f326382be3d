"""The mechanisms that keep LCCN from collapsing: the anchor-point warm-up, posterior
targets, the noisy validation split, instance-dependent noise and the collapse monitor."""

from __future__ import annotations

import math
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.config import LCCNConfig, MonitorConfig
from pipeline.core.confusion_store import ConfusionStore
from pipeline.core.labels import holdout_split
from pipeline.core.losses import clipped_cross_entropy, soft_cross_entropy
from pipeline.core.monitor import (
    ChainCollapsed,
    CollapseMonitor,
    CollapseWarning,
    chain_health,
    memorisation_epoch,
)
from pipeline.core.noise import instance_dependent, make_view, symmetric
from pipeline.core.sampler import gibbs_posterior, gibbs_step
from pipeline.core.warmup import (
    anchor_transition,
    deconvolve,
    estimate_phi_init,
    soft_confusion,
    warmup_prior,
)
from pipeline.train.labeler import GibbsLabeler


def _noisy_posteriors(t: np.ndarray, n: int, *, sharp: float, seed: int):
    """Clean posteriors of a classifier that is sure of a ``sharp`` fraction of samples
    (one-hot) and unsure of the rest (Dirichlet draws), and the noisy posteriors a CE
    classifier trained on labels through ``t`` estimates: ``clean @ t``."""
    rng = np.random.default_rng(seed)
    k = t.shape[0]
    cls = rng.integers(0, k, n)
    clean = rng.dirichlet(np.full(k, 0.3), n)
    sure = rng.random(n) < sharp
    clean[sure] = np.eye(k)[cls[sure]]
    noisy = clean @ t
    observed = np.array([rng.choice(k, p=p / p.sum()) for p in noisy])
    return torch.from_numpy(clean), torch.from_numpy(noisy), torch.from_numpy(observed)


def test_anchor_estimate_recovers_the_transition_from_a_noisy_posterior():
    k = 6
    t = 0.5 * np.eye(k) + 0.5 / k                           # symmetric 0.5 (include_true)
    t[1] = 0.0
    t[1, 1], t[1, 4] = 0.6, 0.4                             # plus one pair flip
    _, noisy, observed = _noisy_posteriors(t, 6000, sharp=0.1, seed=0)
    phi = anchor_transition(noisy, k)
    assert phi.shape == (k, k)
    assert torch.allclose(phi.sum(1), torch.ones(k, dtype=torch.float64))
    assert (phi - torch.from_numpy(t)).abs().max() < 0.03
    # Eq. 8 reads the same (noisy-label) classifier as the clean posterior: its diagonal
    # is far too low, which is what drives the chain away from the labels
    eq8 = soft_confusion(noisy, observed, k)
    assert float(torch.diagonal(eq8).mean()) < float(np.diag(t).mean()) - 0.15


def test_anchor_estimate_is_the_same_when_summed_over_workers():
    t = 0.6 * np.eye(4) + 0.1
    _, noisy, _ = _noisy_posteriors(t, 3000, sharp=0.2, seed=1)
    whole = anchor_transition(noisy, 4)
    parts = [noisy[:1000], noisy[1000:]]
    # two "ranks" in threads with an all-reduce that sums what both contribute
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def make_reduce(r):
        def reduce(x):
            slots[r] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return reduce

    threads = [threading.Thread(target=lambda r=r: out.__setitem__(
        r, anchor_transition(parts[r], 4, reduce=make_reduce(r)))) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert torch.allclose(out[0], whole) and torch.allclose(out[1], whole)


def test_anchor_estimate_with_an_outlier_output_has_a_uniform_outlier_row():
    probs = torch.softmax(torch.randn(500, 5, generator=torch.Generator().manual_seed(0)), 1)
    phi = estimate_phi_init(LCCNConfig(warmup="anchor"), probs, torch.zeros(500).long(), 5, 4)
    assert phi.shape == (5, 4)
    assert torch.allclose(phi[4], torch.full((4,), 0.25, dtype=torch.float64))
    assert torch.allclose(phi.sum(1), torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="quantile"):
        anchor_transition(probs[:, :4], 4, quantile=1.0)


def test_deconvolve_recovers_the_clean_posterior_behind_a_noisy_one():
    k = 6
    t = 0.5 * np.eye(k) + 0.5 / k                           # symmetric 0.5 (include_true)
    t[1] = 0.0
    t[1, 1], t[1, 4] = 0.5, 0.5                             # plus a 0.5 pair flip 1 -> 4
    clean, noisy, _ = _noisy_posteriors(t, 400, sharp=0.5, seed=2)
    q = deconvolve(noisy, torch.from_numpy(t), iters=400)
    assert q.shape == noisy.shape and q.dtype == noisy.dtype
    assert torch.allclose(q.sum(1), torch.ones(400, dtype=torch.float64))
    # an invertible t: the EM updates reach clean = noisy @ inv(t); the error left is
    # that of the slow last steps towards the simplex's boundary (the one-hot samples)
    assert (q - clean).abs().max() < 0.02
    assert (noisy - clean).abs().max() > 0.4
    # the case the option is for: a CE classifier at 0.5 / 0.5 on an image of class 1
    # (half its labels flipped to 4) deconvolves to class 1, and Eq. 7 then draws it
    # back to 1 whatever its label; read as the clean posterior it gives under half for
    # label 4 (1/3 where row 4 is clean; here 0.46, row 4 being 0.58 on its own label)
    p = torch.zeros(1, k, dtype=torch.float32)
    p[0, 1] = p[0, 4] = 0.5
    prior = deconvolve(p, torch.from_numpy(t))
    assert prior.dtype == torch.float32 and float(prior[0, 1]) > 0.97
    phi = torch.from_numpy(t)
    post_model = p[0].double() * phi[:, 4] / (p[0].double() * phi[:, 4]).sum()
    post_deconv = prior[0].double() * phi[:, 4] / (prior[0].double() * phi[:, 4]).sum()
    assert float(post_model[1]) < 0.5 and float(post_deconv[1]) > 0.9
    with pytest.raises(ValueError, match="disagree"):
        deconvolve(noisy[:, :5], phi)


def _labeler(cfg: LCCNConfig, observed, z0, k: int, phi) -> GibbsLabeler:
    """A one-worker labeler over a fresh store of ``observed`` / ``z0``, drawing from seed 7."""
    store = ConfusionStore(observed, z0, k, k)
    return GibbsLabeler(cfg, store, store.counts, store.version, phi_init=phi, max_steps=10,
                        generator=torch.Generator().manual_seed(7))


def test_labeler_reads_the_deconvolved_prior_during_the_warm_up_only():
    k, n = 4, 32
    g = torch.Generator().manual_seed(5)
    observed = torch.randint(0, k, (n,), generator=g)
    z0 = torch.randint(0, k, (n,), generator=g)
    phi = torch.full((k, k), 0.1, dtype=torch.float64) + 0.6 * torch.eye(k, dtype=torch.float64)
    lab = _labeler(LCCNConfig(warmup_steps=1, warmup_prior="deconvolved"), observed, z0, k, phi)
    idx = torch.arange(16)
    probs = torch.softmax(torch.randn(16, k, generator=g), 1)
    lab.prefetch(idx)
    counts = lab.counts.clone()
    _, stats = lab.sample(probs, observed[idx], idx)
    prior = deconvolve(probs, phi)
    assert torch.allclose(stats.posterior.double(), gibbs_posterior(
        prior, observed[idx], z0[idx], counts, 1.0, phi=phi).double(), atol=1e-6)
    assert not torch.allclose(stats.posterior.double(), gibbs_posterior(
        probs, observed[idx], z0[idx], counts, 1.0, phi=phi).double(), atol=1e-3)
    # past the warm-up: the classifier itself, with the counts (Eq. 7 as ever)
    past = _labeler(LCCNConfig(warmup_steps=0, warmup_prior="deconvolved"), observed, z0, k,
                    phi)
    past.prefetch(idx)
    _, later = past.sample(probs, observed[idx], idx)
    assert later.warmup is False
    assert torch.allclose(later.posterior.double(), gibbs_posterior(
        probs, observed[idx], z0[idx], counts, 1.0).double(), atol=1e-6)
    with pytest.raises(ValueError, match="warmup_prior"):
        LCCNConfig(warmup_prior="clean")
    # the whole split's prior (the argmax initial assignment), in chunks
    assert warmup_prior("model", probs, phi) is probs
    assert torch.allclose(warmup_prior("deconvolved", probs, phi, chunk=5), prior)
    with pytest.raises(ValueError, match="warmup_prior 'clean'"):
        warmup_prior("clean", probs, phi)


def test_soft_cross_entropy_is_the_expected_clipped_loss():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, generator=g, requires_grad=True)
    target = torch.randint(0, 5, (7,), generator=g)
    onehot = torch.nn.functional.one_hot(target, 5).double()
    assert torch.allclose(soft_cross_entropy(logits, onehot), clipped_cross_entropy(logits, target))
    # for a distribution q: the mean over z ~ q of the one-hot loss, and gradient softmax - q
    q = torch.softmax(torch.randn(7, 5, generator=g), 1)
    loss = soft_cross_entropy(logits, q)
    expected = sum(q[:, c] * -torch.log_softmax(logits, 1)[:, c] for c in range(5)).mean()
    assert torch.allclose(loss, expected)
    loss.backward()
    assert torch.allclose(logits.grad, (torch.softmax(logits, 1) - q).detach() / 7, atol=1e-6)
    # a padding row (weight 0) adds nothing, even with a non-finite target: an
    # all-held-out batch's padding sample is not in C and Eq. 7 can give it NaN
    logits.grad = None
    bad = q.clone()
    bad[2] = float("nan")
    w = torch.ones(7)
    w[2] = 0
    loss = soft_cross_entropy(logits, bad, weight=w)
    loss.backward()
    keep = torch.arange(7) != 2
    assert torch.allclose(loss, soft_cross_entropy(logits[keep], q[keep]))
    assert torch.isfinite(logits.grad).all() and (logits.grad[2] == 0).all()


def test_labeler_posterior_is_the_eq7_conditional_and_draws_are_unchanged():
    k, n = 4, 40
    g = torch.Generator().manual_seed(3)
    observed = torch.randint(0, k, (n,), generator=g)
    z0 = torch.randint(0, k, (n,), generator=g)
    lab = _labeler(LCCNConfig(alpha=0.5), observed, z0, k, torch.eye(k, dtype=torch.float64))
    idx = torch.arange(16)
    probs = torch.softmax(torch.randn(16, k, generator=g), 1)
    lab.prefetch(idx)
    counts = lab.counts.clone()
    z, stats = lab.sample(probs, observed[idx], idx)
    ref = gibbs_posterior(probs, observed[idx], z0[idx], counts, 0.5)
    assert torch.allclose(stats.posterior, ref)
    assert torch.equal(z, gibbs_step(probs, observed[idx], z0[idx], counts, 0.5,
                                     generator=torch.Generator().manual_seed(7)))


def test_holdout_split_is_disjoint_stratified_and_fixed_by_the_seed():
    observed = np.repeat(np.arange(5), [100, 200, 300, 40, 60])
    tr, va = holdout_split(observed, 0.05, seed=0)
    assert np.intersect1d(tr, va).size == 0
    assert np.array_equal(np.sort(np.concatenate([tr, va])), np.arange(observed.size))
    assert np.bincount(observed[va], minlength=5).tolist() == [5, 10, 15, 2, 3]
    tr2, va2 = holdout_split(observed, 0.05, seed=0)
    assert np.array_equal(va, va2) and np.array_equal(tr, tr2)
    _, va3 = holdout_split(observed, 0.05, seed=1)
    assert not np.array_equal(va, va3)
    assert holdout_split(observed, 0.0, seed=0)[1].size == 0


def test_instance_dependent_noise_realises_its_rate_and_depends_on_the_image():
    rng = np.random.default_rng(0)
    n, k, rate = 6000, 10, 0.4
    clean = rng.integers(0, k, n)
    feats = rng.standard_normal((n, 48)).astype(np.float32)
    view = instance_dependent(clean, feats, k, rate, seed=0)
    se = math.sqrt(rate * (1 - rate) / n)
    assert abs(view.noise_rate() - rate) < 4 * se + 0.005
    # the realised transition is the view's transition, rows sum to 1
    assert np.allclose(view.transition.sum(1), 1.0)
    assert np.allclose(view.transition, view.realised_transition())
    # the same seed gives the same labels; the flip target follows the features: two
    # copies of one image with one clean class, flipped, land on the same wrong class
    again = make_view({"kind": "instance", "rate": rate, "seed": 0}, clean, k, features=feats)
    assert np.array_equal(again.observed, view.observed)
    twin = np.repeat(feats[:1], 400, 0)
    tv = instance_dependent(np.full(400, 3), twin, k, 0.5, seed=5)
    flipped = tv.observed[tv.observed != 3]
    assert flipped.size > 100 and np.bincount(flipped).max() / flipped.size > 0.9
    with pytest.raises(ValueError, match="needs features"):
        make_view({"kind": "instance", "rate": rate, "seed": 0}, clean, k)


def test_collapse_monitor_fires_on_a_collapsed_chain_and_not_on_a_healthy_one():
    rng = np.random.default_rng(0)
    k, n = 10, 5000
    observed = torch.from_numpy(rng.integers(0, k, n))
    healthy = chain_health(observed.clone(), observed, k, k)
    assert healthy["latent_entropy"] == pytest.approx(1.0) and healthy["z_agreement"] == 1.0
    mon = CollapseMonitor(MonitorConfig())
    mon.start(0.5)
    assert mon.check(healthy, 0.48) == []
    # latent classes 0-4 absorbed by 5-9: half the classes vanish
    merged = torch.where(observed < 5, observed + 5, observed)
    sick = chain_health(merged, observed, k, k)
    with pytest.warns(CollapseWarning, match="latent classes merging"):
        reasons = mon.check(sick, 0.48, epoch=3)
    assert any("vanishing" in r for r in reasons)
    with pytest.warns(CollapseWarning, match="classifier degrading"):
        mon.check(healthy, 0.30)
    with pytest.raises(ChainCollapsed, match="epoch 4"):
        CollapseMonitor(MonitorConfig(stop=True)).check(sick, epoch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CollapseMonitor(MonitorConfig()).check(healthy)  # no validation split: no val check


def test_noise_floor_is_the_label_noises_entropy_under_the_class_shares():
    """H(observed | clean): 1.68 nats for symmetric 0.5 over 10 classes (0.55 kept, 0.05 to
    each other class); a noiseless class adds nothing; an outlier row is not read."""
    from pipeline.core.monitor import noise_floor

    sym = torch.full((10, 10), 0.05) + 0.5 * torch.eye(10)
    h = -(0.55 * math.log(0.55) + 9 * 0.05 * math.log(0.05))
    assert noise_floor(sym, torch.ones(10)) == pytest.approx(h) and h == pytest.approx(1.677,
                                                                                       abs=1e-3)
    half = sym.clone()
    half[5:] = torch.eye(10)[5:]  # classes 5-9 clean, as many samples as 0-4
    assert noise_floor(half, torch.ones(10)) == pytest.approx(h / 2)
    assert noise_floor(half, torch.tensor([1.0] * 5 + [0.0] * 5)) == pytest.approx(h)
    with_outlier = torch.cat([2 * sym, torch.full((1, 10), 0.1)])  # rows need not sum to 1
    assert noise_floor(with_outlier, torch.ones(10)) == pytest.approx(h)


def test_collapse_monitor_checks_validation_only_at_or_below_the_starts_learning_rate():
    """A restarted schedule (LCCN from a finished run, at a far higher rate than its start
    was trained at) costs any method accuracy at first: the validation check waits until
    the rate is back at the start's; a switch within one schedule checks at once; a state
    saved without the rate (older checkpoints) checks at every rate."""
    rng = np.random.default_rng(0)
    observed = torch.from_numpy(rng.integers(0, 10, 5000))
    healthy = chain_health(observed.clone(), observed, 10, 10)
    restarted = CollapseMonitor(MonitorConfig())
    restarted.start(0.66, lr=0.001)  # a finished run's network, trained last at lr 0.001
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert restarted.check(healthy, 0.30, lr=0.1) == []
        assert restarted.check(healthy, 0.40, lr=0.01) == []
        assert restarted.check(healthy, 0.60, lr=0.001) == []  # within the allowed drop
    with pytest.warns(CollapseWarning, match="classifier degrading: noisy validation "
                                             "accuracy 0.5000, 0.6600 when LCCN started"):
        assert restarted.check(healthy, 0.50, lr=0.001, epoch=23)
    switched = CollapseMonitor(MonitorConfig())
    switched.start(0.60, lr=0.1)  # LCCN after epoch 8 of one schedule, at the same rate
    with pytest.warns(CollapseWarning, match="classifier degrading"):
        switched.check(healthy, 0.45, lr=0.1)
    again = CollapseMonitor(MonitorConfig())
    again.load_state_dict(restarted.state_dict())
    assert (again.val_start, again.lr_start) == (0.66, 0.001)
    assert again.check(healthy, 0.30, lr=0.1) == []
    old = CollapseMonitor(MonitorConfig())
    old.load_state_dict({"monitor_val_start": 0.66})
    with pytest.warns(CollapseWarning, match="classifier degrading"):
        old.check(healthy, 0.30, lr=0.1)


def test_memorisation_epoch_watches_the_decayed_rate_and_needs_patience():
    """The guard's signal: after the first lr decay of the noise phase, ``patience``
    consecutive epochs more than ``drop`` below the best noisy validation accuracy since."""
    def rows(vals, lrs, first=0):
        return [{"epoch": float(first + i), "lr": lr, "val_top1": v}
                for i, (v, lr) in enumerate(zip(vals, lrs))]

    lrs = [0.1] * 4 + [0.01] * 6
    # swings at the phase's first rate are not watched (a 6-point dip at lr 0.1)
    vals = [0.50, 0.44, 0.43, 0.52, 0.60, 0.61, 0.58, 0.585, 0.57, 0.56]
    assert memorisation_epoch(rows(vals, lrs), first_epoch=0, drop=0.02, patience=2) == 7
    assert memorisation_epoch(rows(vals, lrs), first_epoch=0, drop=0.02, patience=3) == 8
    assert memorisation_epoch(rows(vals, lrs), first_epoch=0, drop=0.045, patience=1) == 9
    assert memorisation_epoch(rows(vals, lrs), first_epoch=0, drop=0.06, patience=1) is None
    # a recovery resets the count: 0.58, back at 0.60, then 0.58 (one epoch below each time)
    wobble = [0.5] * 4 + [0.60, 0.58, 0.60, 0.58, 0.60, 0.58]
    assert memorisation_epoch(rows(wobble, lrs), first_epoch=0, drop=0.01, patience=2) is None
    # the CE epochs before first_epoch are not the phase: its first rate is read at epoch 3
    ce_first = rows([0.3, 0.9] + vals, [0.5, 0.5] + lrs)
    assert memorisation_epoch(ce_first, first_epoch=2, drop=0.02, patience=2) == 9
    # a constant rate is never watched; NaN (no validation split) never counts
    assert memorisation_epoch(rows(vals, [0.1] * 10), first_epoch=0, drop=0.02,
                              patience=1) is None
    nan = [0.5] * 4 + [math.nan] * 6
    assert memorisation_epoch(rows(nan, lrs), first_epoch=0, drop=0.0, patience=1) is None
    with pytest.raises(ValueError, match="guard_patience must be an integer >= 1"):
        LCCNConfig(guard_patience=0)
    with pytest.raises(ValueError, match="guard_targets must be one of"):
        LCCNConfig(guard_targets="soft")


def test_overfit_epoch_needs_the_training_fit_to_run_ahead_of_the_held_out_fit():
    """The default trigger (LCCNConfig.guard_rise): at a rate below the noise phase's first,
    a held-out loss of the observed labels above its lowest with the gap to the training
    loss widened by more than ``rise`` x the labels' entropy since that lowest epoch.
    Swings at the first rate are not watched; a new held-out low never fires; both losses
    rising together (the classifier moving away from labels it now calls wrong, on both
    splits) does not widen the gap."""
    from pipeline.core.monitor import overfit_epoch

    def rows(held, fit, lrs, first=0):
        return [{"epoch": float(first + i), "lr": lr, "val_observed_loss": h,
                 "observed_loss": f, "label_entropy": 1.5}
                for i, (h, f, lr) in enumerate(zip(held, fit, lrs))]

    lrs = [0.1] * 4 + [0.01] * 6
    # the stress protocol's shape: a 40% swing at lr 0.1, then the held-out loss flattens
    # while the training loss falls
    held = [1.60, 2.25, 1.55, 1.80, 1.30, 1.29, 1.30, 1.31, 1.36, 1.45]
    fit = [1.40, 1.30, 1.20, 1.10, 0.80, 0.70, 0.68, 0.55, 0.50, 0.45]
    # lowest at epoch 5 (gap 0.59); epoch 6: gap 0.62 (+0.03), epoch 7: 0.76 (+0.17)
    assert overfit_epoch(rows(held, fit, lrs), first_epoch=0, rise=0.01) == 6   # > 0.015
    assert overfit_epoch(rows(held, fit, lrs), first_epoch=0, rise=0.02) == 7   # > 0.03
    assert overfit_epoch(rows(held, fit, lrs), first_epoch=0, rise=0.3) is None   # 0.41
    # the fidelity protocol's shape: the held-out loss creeps down with wobbles while the
    # training loss creeps down as well: the gap stays within 0.01
    flat = [2.0] * 4 + [1.210, 1.200, 1.190, 1.196, 1.185, 1.190]
    flat_fit = [2.0] * 4 + [1.190, 1.180, 1.172, 1.175, 1.168, 1.170]
    assert overfit_epoch(rows(flat, flat_fit, lrs), first_epoch=0, rise=0.01) is None
    # both losses rising together: the gap does not widen
    up = [h - 0.5 for h in held]
    assert overfit_epoch(rows(held, up, lrs), first_epoch=0, rise=0.01) is None
    # a training loss that collapses while the held-out loss keeps setting new lows: not
    down = [2.0] * 4 + [1.30, 1.25, 1.20, 1.15, 1.10, 1.05]
    assert overfit_epoch(rows(down, [0.1] * 10, lrs), first_epoch=0, rise=0.01) is None
    # the CE epochs before first_epoch are not the phase; a constant rate is never watched;
    # NaN (no validation split) never counts
    ce_first = rows([9.0, 9.0] + held, [9.0, 9.0] + fit, [0.5, 0.5] + lrs)
    assert overfit_epoch(ce_first, first_epoch=2, rise=0.02) == 9
    assert overfit_epoch(rows(held, fit, [0.1] * 10), first_epoch=0, rise=0.01) is None
    nan = [math.nan] * 10
    assert overfit_epoch(rows(nan, fit, lrs), first_epoch=0, rise=0.0) is None
    with pytest.raises(ValueError, match=r"guard_rise must lie in \[0, 1\)"):
        LCCNConfig(guard_rise=1.0)
    with pytest.raises(ValueError, match="teacher must be one of"):
        LCCNConfig(teacher="ema")


def test_floor_epoch_is_the_first_noise_phase_epoch_below_the_floor():
    from pipeline.core.monitor import floor_epoch

    rows = [{"epoch": float(e), "observed_loss": fit, "noise_floor": floor}
            for e, (fit, floor) in enumerate([(1.2, math.nan), (1.9, 1.7), (1.75, 1.7),
                                              (1.6, 1.7), (1.2, 1.7)])]
    assert floor_epoch(rows, first_epoch=0) == 3  # NaN (no floor yet) never fires
    assert floor_epoch(rows, first_epoch=4) == 4
    assert floor_epoch(rows[:3], first_epoch=0) is None


def test_the_monitor_replay_gives_back_the_recorded_gpu_restart_warnings():
    """benchmarks/replay_monitor.py on the committed GPU restart runs: the validation check
    compared at every rate fires in exactly the epochs the runs logged (no latent-class
    check fired there), and compared at the start's rate (lr 0.01, the last 40 epochs) in
    none; the figures docs/fidelity.md and gpu.md quote."""
    import runpy

    root = Path(__file__).resolve().parents[1]
    replay = runpy.run_path(str(root / "benchmarks" / "replay_monitor.py"), run_name="replay")
    results = sorted((root / "benchmarks" / "results" / "gpu-paper-120-restart").glob("*.json"))
    rows = {r["setting"]: r for r in replay["main"]([str(f) for f in results])}
    assert set(rows) == {"asym0.5", "sym0.5"}
    for setting, warned in (("asym0.5", 78), ("sym0.5", 63)):
        r = rows[setting]
        assert r["recorded"] == r["every_rate"] == warned, setting
        assert (r["start_rate"], r["armed_epochs"], r["lr_start"]) == (0, 40, 0.01), setting


# -- the regression case: symmetric noise from a weak pre-trained classifier ----------------


def _digits_sym(seed: int):
    from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor
    from pipeline.train.trainer import TensorData

    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=seed)
    x = to_tensor(images)
    view = symmetric(labels[tr], 10, 0.5, include_true=True, seed=seed)
    return TensorData(x[tr], view), TensorData(x[te], clean_view(labels[te]))


def _final_top1(method: str, seed: int, **lccn) -> float:
    from pipeline.core.config import ModelConfig, OptimConfig, RunConfig
    from pipeline.train.trainer import LocalTrainer

    train, test = _digits_sym(seed)
    # one epoch of CE pre-training: a weak classifier (about 55-65% on clean test digits)
    cfg = RunConfig(method=method, seed=seed, model=ModelConfig("small_cnn", 1),
                    optim=OptimConfig(epochs=20, pretrain_epochs=1, batch_size=32, lr=0.1,
                                      milestones=(13,)),
                    lccn=LCCNConfig(**lccn))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollapseWarning)
        return LocalTrainer(cfg, train, test).fit()[-1]["test_top1"]


@pytest.fixture(scope="module")
def weak_start_runs():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the numbers below were measured with one thread
    seeds = (0, 1, 2)
    try:
        yield {"ce": [_final_top1("ce", s) for s in seeds],
               "default": [_final_top1("lccn", s) for s in seeds],
               # the paper's recipe: no ramp, no best-epoch teacher, no memorisation guard
               "paper": [_final_top1("lccn", s, targets="sample", ramp_epochs=0.0,
                                     teacher="live", guard_rise=0.0) for s in seeds]}
    finally:
        torch.set_num_threads(old)


def test_default_lccn_holds_against_ce_from_a_weak_start_under_symmetric_noise(weak_start_runs):
    ce, lccn = np.mean(weak_start_runs["ce"]), np.mean(weak_start_runs["default"])
    # measured: CE 0.764, default LCCN (one-epoch ramp) 0.797 (+3.3 points) over seeds 0-2;
    # without the ramp 0.724, one seed at 0.588
    assert lccn >= ce - 0.01, weak_start_runs


def test_the_papers_recipe_collapses_on_the_same_case(weak_start_runs):
    # what the defaults guard against: sampled one-hot targets from the first LCCN step
    # (measured: 0.475 against CE's 0.764, seed 2 at 0.29)
    assert np.mean(weak_start_runs["paper"]) < np.mean(weak_start_runs["ce"]) - 0.10, \
        weak_start_runs


# -- the automatic warm-up (--pretrain-epochs auto) -------------------------------------------


def test_warmup_ends_once_noisy_validation_stops_rising_by_a_standard_error():
    from pipeline.core.monitor import warmup_end_epoch, warmup_rise

    def rows(vals):
        return [{"epoch": float(i), "val_top1": v} for i, v in enumerate(vals)]

    # n = 2,500 held-out images at a ~0.6: one standard error is ~1 point
    rising = rows([0.30, 0.40, 0.48, 0.55, 0.60])
    assert warmup_end_epoch(rising, n_val=2500, cap=10) is None  # still climbing
    flat = rows([0.30, 0.40, 0.48, 0.55, 0.60, 0.605, 0.600])
    rise, se = warmup_rise(flat, 2500)
    assert rise == pytest.approx(0.005) and se == pytest.approx(math.sqrt(0.605 * 0.395 / 2500))
    assert warmup_end_epoch(flat, n_val=2500, cap=10) == 7
    # a dip and a recovery two epochs later is no plateau: the best of the last two counts
    assert warmup_end_epoch(rows([0.3, 0.4, 0.35, 0.5]), n_val=2500, cap=10) is None
    # the same plateau on 60 held-out images (se ~6 points) ends the warm-up sooner
    assert warmup_end_epoch(rows([0.30, 0.40, 0.42, 0.43]), n_val=60, cap=10) == 4
    assert warmup_end_epoch(rows([0.30, 0.40, 0.42, 0.43]), n_val=2500, cap=10) is None
    # the cap, and the decision is read only from rows before it
    assert warmup_end_epoch(rows([0.1, 0.2, 0.3, 0.4]), n_val=2500, cap=4) == 4
    assert warmup_end_epoch(rows([0.1, 0.2, 0.3]), n_val=2500, cap=4) is None
    # without a validation split: the cap
    nan = rows([math.nan] * 3)
    assert warmup_end_epoch(nan, n_val=0, cap=3) == 3
    assert warmup_end_epoch(nan[:2], n_val=0, cap=3) is None
    # a prefix's decision never changes as rows are added (a resumed run decides alike)
    for e in range(3, len(flat) + 1):
        got = warmup_end_epoch(flat[:e], n_val=2500, cap=10)
        assert got is None or got == 7


def test_pretrain_epochs_auto_parses_and_methods_with_a_fixed_schedule_refuse_it():
    import argparse

    from pipeline.core.config import OptimConfig, RunConfig
    from pipeline.core.options import add_options, apply_options
    from pipeline.train.methods import get_method

    p = argparse.ArgumentParser()
    add_options(p, ["--epochs", "--pretrain-epochs"])
    run = apply_options(RunConfig(), p.parse_args(["--epochs", "30", "--pretrain-epochs",
                                                   "auto"]))
    assert run.optim.pretrain_auto and run.optim.pretrain_epochs == 15  # the cap: half
    fixed = apply_options(RunConfig(), p.parse_args(["--pretrain-epochs", "4"]))
    assert not fixed.optim.pretrain_auto and fixed.optim.pretrain_epochs == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--pretrain-epochs", "soon"])
    auto = OptimConfig(epochs=20, pretrain_epochs="auto")
    for name in ("lccn", "ce"):
        get_method(name).check_run(RunConfig(method=name, optim=auto))
    for name in ("dividemix", "divide_lccn", "trevision", "forward"):
        with pytest.raises(ValueError, match=f"{name}'s schedule is laid out from a fixed"):
            get_method(name).check_run(RunConfig(method=name, optim=auto))


def test_an_automatic_warm_up_starts_lccn_where_the_rows_say(capsys):
    from pipeline.core.config import ModelConfig, OptimConfig, RunConfig
    from pipeline.core.monitor import warmup_end_epoch
    from pipeline.train.trainer import LocalTrainer

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train, test = _digits_sym(0)
        cfg = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", 1),
                        optim=OptimConfig(epochs=8, pretrain_epochs="auto", batch_size=32,
                                          lr=0.1, milestones=(6,)))
        trainer = LocalTrainer(cfg, train, test)
        rows = trainer.fit()
    finally:
        torch.set_num_threads(old)
    start = next(i for i, r in enumerate(rows) if r["phase"] == 1.0)
    assert all(r["phase"] == 1.0 for r in rows[start:])
    n_val = int(trainer.held_out.sum())
    # the epoch the rule picks from the CE rows alone (the cap: half of 8 epochs)
    assert start == warmup_end_epoch(rows[:start], n_val=n_val, cap=4) <= 4
    assert warmup_end_epoch(rows[:start - 1], n_val=n_val, cap=4) is None
    out = capsys.readouterr().out
    assert f"[lccn] cross-entropy warm-up: {start} epochs (--pretrain-epochs auto" in out


def test_a_fixed_warm_up_that_ends_on_a_still_rising_classifier_is_warned_of(capsys):
    from pipeline.core.config import ModelConfig, OptimConfig, RunConfig
    from pipeline.core.monitor import warmup_rise
    from pipeline.train.trainer import LocalTrainer

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train, test = _digits_sym(0)
        cfg = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", 1),
                        optim=OptimConfig(epochs=4, pretrain_epochs=3, batch_size=32, lr=0.1))
        trainer = LocalTrainer(cfg, train, test)
        rows = trainer.fit()
    finally:
        torch.set_num_threads(old)
    rise, se = warmup_rise(rows[:3], int(trainer.held_out.sum()))
    out = capsys.readouterr().out
    assert rise > 2 * se  # measured: +22.5 points, se 6.3 (62 held-out digits)
    assert "[lccn] warning: the cross-entropy warm-up ends after 3 epochs on a classifier " \
           f"still learning (best noisy validation accuracy {max(r['val_top1'] for r in rows[:3]):.3f}" in out
    assert f"{rise * 100:+.1f} points above the best before them" in out


def test_a_warm_up_that_ends_below_its_best_noisy_validation_epoch_is_warned_of():
    from pipeline.core.monitor import warmup_fall
    from pipeline.train.methods.lccn import swing_warning

    def rows(vals):
        return [{"epoch": float(i), "val_top1": v} for i, v in enumerate(vals)]

    # the digits quickstart's warm-up (seed 1, 250 held-out digits, lr 0.1): best at epoch
    # 2, then down 9.6 points; one standard error is 2.6 points
    swing = rows([0.560, 0.780, 0.748, 0.684])
    fall, se, at = warmup_fall(swing, 250)
    assert fall == pytest.approx(0.096) and at == 1
    assert se == pytest.approx(math.sqrt(0.78 * 0.22 / 250))
    msg = swing_warning(swing, 250)
    assert msg is not None and "9.6 points below its best" in msg
    assert "(0.684 at its last epoch, 0.780 at epoch 2;" in msg
    assert "--warmup-weights best starts it from epoch 2" in msg
    # ending at the best, or within two standard errors of it: no warning
    assert swing_warning(rows([0.588, 0.716, 0.756, 0.784]), 250) is None
    assert swing_warning(rows([0.60, 0.78, 0.76]), 250) is None  # 2 points, se 2.6
    # the same 2-point dip over 2,500 held-out images (se 0.8) is warned of
    assert swing_warning(rows([0.60, 0.78, 0.76]), 2500) is not None
    # no validation split, or no warm-up rows (a run continued from another's CE state)
    assert swing_warning(rows([math.nan, math.nan]), 0) is None
    assert swing_warning([], 250) is None


def test_warmup_weights_best_starts_the_noise_phase_from_the_best_warm_up_epoch(capsys):
    """lr 0.2 on the symmetric-0.5 digits: the warm-up's noisy validation accuracy swings and
    peaks before its last epoch (measured at epoch 3 of 5 on two machines: 0.419 then 0.371,
    0.403; 0.387 then 0.371, 0.387). With ``warmup_weights="best"`` the noise phase's φ_init
    is the one a run whose warm-up ended at the first best epoch estimates (the same first
    epochs), the guard's first candidate is that epoch at its own accuracy, and the copy is
    in the method's checkpointed state while the warm-up goes on."""
    from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig
    from pipeline.train.trainer import LocalTrainer

    def fit(epochs: int, pretrain: int, weights: str) -> tuple[LocalTrainer, list[dict]]:
        train, test = _digits_sym(0)
        cfg = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", 1),
                        optim=OptimConfig(epochs=epochs, pretrain_epochs=pretrain,
                                          batch_size=32, lr=0.2),
                        lccn=LCCNConfig(warmup_weights=weights))
        trainer = LocalTrainer(cfg, train, test)
        return trainer, trainer.fit()

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best, rows = fit(6, 5, "best")
        out = capsys.readouterr().out
        vals = [r["val_top1"] for r in rows[:5]]
        at = max(range(5), key=vals.__getitem__)  # the first of equal epochs, as the run keeps
        assert at < 4, f"the warm-up's best noisy validation epoch is its last here: {vals}"
        ref, _ = fit(at + 2, at + 1, "last")
        last, _ = fit(6, 5, "last")
        ce_only, _ = fit(5, 5, "best")  # the noise phase never starts: the copy stays kept
    finally:
        torch.set_num_threads(old)
    assert (f"[lccn] warmup_weights best: the noise phase starts from the warm-up's epoch "
            f"{at + 1} (noisy validation accuracy {vals[at]:.3f}") in out
    assert torch.equal(best.phi_init, ref.phi_init)
    assert not torch.equal(best.phi_init, last.phi_init)
    assert best.method.state_dict()["warmup_best"]["weights"] is None  # dropped once used
    # the guard's candidate from the warm-up's last row is the restored epoch, at its accuracy
    guard_best = best.method.state_dict()["guard_best"]
    assert guard_best["epoch"] == at and guard_best["val"] == pytest.approx(vals[at])
    kept = ce_only.method.state_dict()["warmup_best"]
    assert kept["epoch"] == at and kept["val"] == pytest.approx(vals[at])
    assert set(kept["weights"]["model"]) == set(ce_only.model.state_dict())