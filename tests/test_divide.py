"""DivideMix / DivideLCCN building blocks against values worked out by hand.

Every expected number below is written out (fractions or closed forms computed with
``math``), never obtained by calling the function under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.core.divide import (
    average_loss_history,
    balanced_subset,
    co_divide,
    co_guess,
    co_refine,
    co_refine_lccn,
    conf_penalty,
    division_losses,
    ensemble_topk,
    lccn_division_losses,
    lccn_posterior,
    linear_rampup,
    mixmatch,
    normalize_losses,
    semi_loss,
    sharpen,
    transition_columns,
    uniform_prior_penalty,
)
from pipeline.core.sampler import conditional_transition

LN3 = math.log(3.0)


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


# ---------------------------------------------------------------------- normalisation


def test_normalize_losses_min_max():
    out = normalize_losses(torch.tensor([1.0, 3.0, 2.0, 5.0]))
    assert out.dtype == torch.float64
    assert torch.allclose(out, t([0.0, 0.5, 0.25, 1.0]))


def test_normalize_losses_refuses_constant_and_non_finite():
    with pytest.raises(ValueError, match="all 3 losses equal 2.0"):
        normalize_losses(torch.full((3,), 2.0))
    with pytest.raises(ValueError, match=r"losses\[2\] = nan"):
        normalize_losses(torch.tensor([0.1, 0.2, float("nan"), 0.3]))
    with pytest.raises(ValueError, match="empty"):
        normalize_losses(torch.tensor([]))


def test_average_loss_history_takes_the_last_window():
    history = [torch.full((2,), float(e)) for e in range(6)]      # epochs 0..5
    assert torch.allclose(average_loss_history(history), t([3.0, 3.0]))          # (1+..+5)/5
    assert torch.allclose(average_loss_history(history, window=2), t([4.5, 4.5]))
    assert torch.allclose(average_loss_history(history[:2]), t([0.5, 0.5]))      # fewer kept
    with pytest.raises(ValueError, match="disagree in length"):
        average_loss_history([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="empty"):
        average_loss_history([])


# ---------------------------------------------------------------------- co-divide


def test_balanced_subset_caps_each_class():
    observed = torch.tensor([0] * 10 + [1] * 3 + [2] * 7)
    idx = balanced_subset(observed, 12, 3, seed=7)            # 12 // 3 = 4 per class
    assert torch.equal(torch.bincount(observed[idx], minlength=3), torch.tensor([4, 3, 4]))
    assert torch.equal(idx, torch.sort(idx).values) and idx.unique().numel() == idx.numel()
    assert torch.equal(idx, balanced_subset(observed, 12, 3, seed=7))
    draws = {tuple(balanced_subset(observed, 12, 3, seed=s).tolist()) for s in range(6)}
    assert len(draws) > 1
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        balanced_subset(torch.tensor([0, 3]), 6, 3, seed=0)
    with pytest.raises(ValueError, match="cannot hold one sample"):
        balanced_subset(observed, 2, 3, seed=0)


@pytest.fixture
def planted():
    """2000 per-sample losses: 1400 clean ones low (N(0.3, 0.15), floored at 0) and 600
    noisy ones high (N(2.5, 0.5)), interleaved at random; and random noisy labels."""
    g = torch.Generator().manual_seed(0)
    is_clean = torch.zeros(2000, dtype=torch.bool)
    is_clean[torch.randperm(2000, generator=g)[:1400]] = True
    low = (0.3 + 0.15 * torch.randn(2000, generator=g, dtype=torch.float64)).clamp_min(0)
    high = 2.5 + 0.5 * torch.randn(2000, generator=g, dtype=torch.float64)
    losses = torch.where(is_clean, low, high)
    observed = torch.randint(0, 4, (2000,), generator=g)
    return losses, is_clean, observed


def _precision_recall(pred, truth):
    tp = (pred & truth).sum().item()
    return tp / max(pred.sum().item(), 1), tp / truth.sum().item()


def test_co_divide_separates_planted_clean_and_noisy(planted):
    losses, is_clean, _ = planted
    d = co_divide(losses, seed=3)
    precision, recall = _precision_recall(d.clean, is_clean)
    assert precision > 0.995 and recall > 0.995, (precision, recall)
    assert d.means[0] < d.means[1]                       # clean = the low-mean component
    assert d.prob_clean.shape == (2000,) and d.prob_clean.dtype == torch.float64
    assert torch.equal(d.clean, d.prob_clean > 0.5)
    assert d.fit_idx is None
    # the low-loss side is the clean side: the lowest loss is surely clean, the highest not
    assert d.prob_clean[losses.argmin()] > 0.99 and d.prob_clean[losses.argmax()] < 0.01


def test_co_divide_is_deterministic_and_thresholds(planted):
    losses, _, _ = planted
    a, b = co_divide(losses, seed=11), co_divide(losses, seed=11)
    assert torch.equal(a.prob_clean, b.prob_clean)
    strict = co_divide(losses, seed=11, p_threshold=0.999)
    assert torch.equal(strict.clean, a.prob_clean > 0.999)
    assert strict.clean.sum() < a.clean.sum()


def test_co_divide_fits_on_a_balanced_subset_and_predicts_all(planted):
    losses, is_clean, observed = planted
    d = co_divide(losses, seed=5, observed=observed, fit_size=400, num_classes=4)
    assert d.fit_idx is not None and d.fit_idx.numel() == 400    # 100 per class, all present
    assert torch.equal(torch.bincount(observed[d.fit_idx], minlength=4),
                       torch.full((4,), 100))
    assert d.prob_clean.shape == (2000,)
    precision, recall = _precision_recall(d.clean, is_clean)
    assert precision > 0.99 and recall > 0.99, (precision, recall)
    with pytest.raises(ValueError, match="class-balanced"):
        co_divide(losses, fit_size=400)


def test_co_divide_on_averaged_history_is_not_renormalised(planted):
    losses, is_clean, _ = planted
    norm = normalize_losses(losses)
    history = [norm * 0.5, norm]                      # averaged: 0.75 * norm, max 0.75
    avg = average_loss_history(history)
    assert math.isclose(float(avg.max()), 0.75)
    d = co_divide(avg, seed=3, normalize=False)
    assert d.means[1] < 0.75                          # on the un-renormalised scale
    precision, recall = _precision_recall(d.clean, is_clean)
    assert precision > 0.99 and recall > 0.99


def test_division_losses():
    logits = torch.tensor([[0.0, LN3], [0.0, LN3]])   # softmax (1/4, 3/4)
    assert torch.allclose(division_losses(logits, torch.tensor([1, 0])),
                          torch.tensor([-math.log(0.75), math.log(4.0)]))
    post = torch.tensor([[0.25, 0.75]])
    expected = math.log(math.exp(0.25) + math.exp(0.75)) - 0.75
    assert torch.allclose(lccn_division_losses(post, torch.tensor([1])),
                          torch.tensor([expected]))


# ---------------------------------------------------------------------- refinement


def test_sharpen():
    assert torch.allclose(sharpen(t([[0.6, 0.4]]), 0.5), t([[9 / 13, 4 / 13]]))
    assert torch.allclose(sharpen(t([[0.6, 0.4]]), 1.0), t([[0.6, 0.4]]))
    # T = 1/3: cubes 0.216, 0.064, 0.008 -> / 0.288
    assert torch.allclose(sharpen(t([0.6, 0.4, 0.2]), 1 / 3), t([0.75, 0.064 / 0.288,
                                                                0.008 / 0.288]))
    with pytest.raises(ValueError, match="> 0"):
        sharpen(t([[0.5, 0.5]]), 0.0)


def test_co_refine():
    y = t([[1, 0], [0, 1], [1, 0]])
    p = t([[0.2, 0.8], [0.5, 0.5], [0.6, 0.4]])
    w = t([0.5, 1.0, 0.0])
    # row 0: 0.5*(1,0) + 0.5*(0.2,0.8) = (0.6, 0.4) -> (9/13, 4/13)
    # row 1: w = 1 keeps the label; row 2: w = 0 keeps the prediction, sharpened
    expected = t([[9 / 13, 4 / 13], [0.0, 1.0], [9 / 13, 4 / 13]])
    assert torch.allclose(co_refine(y, p, w, 0.5), expected)
    assert torch.allclose(co_refine(y, p, w.unsqueeze(1), 0.5), expected)
    with pytest.raises(ValueError, match=r"w_clean must lie in \[0, 1\]"):
        co_refine(y, p, t([0.5, 1.5, 0.0]), 0.5)
    with pytest.raises(ValueError, match="same"):
        co_refine(y, p[:2], w, 0.5)


def test_lccn_posterior_from_phi_columns():
    phi = t([[0.8, 0.2], [0.3, 0.7]])                 # phi[k, j] = P(obs j | latent k)
    cond = transition_columns(phi, torch.tensor([1, 0]))
    assert torch.allclose(cond, t([[0.2, 0.7], [0.8, 0.3]]))
    p = t([[0.5, 0.5], [0.5, 0.5]])
    # observed 1: (0.1, 0.35) / 0.45; observed 0: (0.4, 0.15) / 0.55
    assert torch.allclose(lccn_posterior(p, cond), t([[2 / 9, 7 / 9], [8 / 11, 3 / 11]]))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        transition_columns(phi, torch.tensor([2]))


def test_co_refine_lccn():
    phi = t([[0.8, 0.2], [0.3, 0.7]])
    y = t([[0, 1]])
    cond = transition_columns(phi, torch.tensor([1]))
    # q = (2/9, 7/9); 0.4*(0,1) + 0.6*q = (2/15, 13/15); squared (4, 169)/225 -> /173
    out = co_refine_lccn(y, t([[0.5, 0.5]]), cond, t([0.4]), 0.5)
    assert torch.allclose(out, t([[4 / 173, 169 / 173]]))
    # it differs from DivideMix's co-refinement, which mixes in the raw prediction:
    # 0.4*(0,1) + 0.6*(0.5,0.5) = (0.3, 0.7) -> (9, 49)/58
    assert torch.allclose(co_refine(y, t([[0.5, 0.5]]), t([0.4]), 0.5),
                          t([[9 / 58, 49 / 58]]))


def test_lccn_posterior_with_the_gibbs_conditional():
    """The same posterior with Eq. 7's conditional transition (own count removed)."""
    counts = torch.tensor([[3, 1], [1, 3]])
    cond = conditional_transition(torch.tensor([1]), torch.tensor([1]), counts, 1.0)
    # column j=1 with [1,1] less one: (1+1, 3+1-1) over rows (4+2, 4+2-1) = (1/3, 3/5)
    assert torch.allclose(cond, t([[1 / 3, 3 / 5]]))
    # p = (1/2, 1/2): (1/6, 3/10) / (14/30) = (5/14, 9/14)
    assert torch.allclose(lccn_posterior(t([[0.5, 0.5]]), cond), t([[5 / 14, 9 / 14]]))


def test_co_guess():
    p1 = [t([[0.6, 0.4]]), t([[0.8, 0.2]])]
    p2 = [t([[0.4, 0.6]]), t([[0.6, 0.4]])]
    # mean (0.6, 0.4) -> (9/13, 4/13)
    assert torch.allclose(co_guess(p1, p2, 0.5), t([[9 / 13, 4 / 13]]))
    with pytest.raises(ValueError, match="view 3"):
        co_guess(p1, [p2[0], t([[0.5, 0.5], [0.5, 0.5]])], 0.5)
    with pytest.raises(ValueError, match="each network"):
        co_guess(p1, [], 0.5)


# ---------------------------------------------------------------------- MixMatch


@pytest.fixture
def batch():
    x_l = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    x_u = -torch.arange(6, dtype=torch.float32).reshape(2, 3) - 1
    p_l = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.2, 0.8], [0.0, 1.0]])
    p_u = torch.tensor([[0.5, 0.5], [0.3, 0.7]])
    return x_l, p_l, x_u, p_u


def test_mixmatch_is_a_convex_combination_with_lambda_at_least_half(batch):
    x_l, p_l, x_u, p_u = batch
    x, p = torch.cat([x_l, x_u]), torch.cat([p_l, p_u])
    for seed in range(20):
        m = mixmatch(x_l, p_l, x_u, p_u, 4.0, generator=torch.Generator().manual_seed(seed))
        assert 0.5 <= m.lam <= 1.0
        assert m.n_labelled == 4 and m.inputs.shape == (6, 3) and m.targets.shape == (6, 2)
        assert torch.equal(torch.sort(m.perm).values, torch.arange(6))
        assert torch.allclose(m.inputs, m.lam * x + (1 - m.lam) * x[m.perm])
        assert torch.allclose(m.targets, m.lam * p + (1 - m.lam) * p[m.perm])
        # each mixed entry lies between its two sources, nearer the un-shuffled one
        lo, hi = torch.minimum(x, x[m.perm]), torch.maximum(x, x[m.perm])
        assert bool(((m.inputs >= lo - 1e-5) & (m.inputs <= hi + 1e-5)).all())
        assert bool(((m.inputs - x).abs() <= (m.inputs - x[m.perm]).abs() + 1e-5).all())
        assert torch.allclose(m.targets.sum(1), torch.ones(6))


def test_mixmatch_is_reproducible_with_the_same_generator(batch):
    a = mixmatch(*batch, 4.0, generator=torch.Generator().manual_seed(42))
    b = mixmatch(*batch, 4.0, generator=torch.Generator().manual_seed(42))
    assert a.lam == b.lam and torch.equal(a.perm, b.perm) and torch.equal(a.inputs, b.inputs)
    lams = {mixmatch(*batch, 4.0, generator=torch.Generator().manual_seed(s)).lam
            for s in range(5)}
    assert len(lams) == 5


def test_mixmatch_alpha_limits(batch):
    """Beta(a, a) piles up at 0 and 1 for small a (λ' -> 1: no mixing) and at 1/2 for
    large a (λ' -> 1/2: an even mix)."""
    g = torch.Generator().manual_seed(0)
    small = [mixmatch(*batch, 0.01, generator=g).lam for _ in range(50)]
    large = [mixmatch(*batch, 1e5, generator=g).lam for _ in range(50)]
    assert np.median(small) > 0.999
    assert max(large) < 0.51
    with pytest.raises(ValueError, match="alpha"):
        mixmatch(*batch, 0.0, generator=g)


def test_linear_rampup():
    # lambda_u * clip((current - 10) / 16, 0, 1)
    assert linear_rampup(5, 10, lambda_u=25) == 0.0
    assert linear_rampup(10, 10, lambda_u=25) == 0.0
    assert linear_rampup(14, 10, lambda_u=25) == 6.25
    assert linear_rampup(18.5, 10, lambda_u=25) == 13.28125
    assert linear_rampup(26, 10, lambda_u=25) == 25.0
    assert linear_rampup(300, 10, lambda_u=25) == 25.0
    assert linear_rampup(14, 10, 8, lambda_u=150) == 75.0
    assert linear_rampup(50, 10, lambda_u=0) == 0.0


# ---------------------------------------------------------------------- losses


def test_semi_loss():
    logits_x = torch.tensor([[0.0, LN3]])             # softmax (1/4, 3/4)
    targets_x = torch.tensor([[0.5, 0.5]])
    logits_u = torch.tensor([[0.0, 0.0], [LN3, 0.0]])  # (1/2, 1/2), (3/4, 1/4)
    targets_u = torch.tensor([[1.0, 0.0], [0.75, 0.25]])
    lx, lu = semi_loss(logits_x, targets_x, logits_u, targets_u)
    assert math.isclose(lx.item(), 0.5 * math.log(16 / 3), rel_tol=1e-6)
    # squared errors (1/4, 1/4) and (0, 0), averaged over all 4 entries
    assert math.isclose(lu.item(), 0.125, rel_tol=1e-6)


def test_uniform_prior_penalty():
    logits = torch.tensor([[LN3, 0.0], [0.0, 0.0]])   # mean prediction (5/8, 3/8)
    expected = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    assert math.isclose(uniform_prior_penalty(logits).item(), expected, rel_tol=1e-6)
    assert abs(uniform_prior_penalty(torch.zeros(3, 4)).item()) < 1e-7
    prior = torch.tensor([0.625, 0.375])
    assert abs(uniform_prior_penalty(logits, prior).item()) < 1e-7
    with pytest.raises(ValueError, match=r"prior must be \(2,\)"):
        uniform_prior_penalty(logits, torch.ones(3) / 3)


def test_conf_penalty():
    logits = torch.tensor([[LN3, 0.0], [0.0, 0.0]])
    expected = 0.5 * (0.75 * math.log(0.75) + 0.25 * math.log(0.25)) + 0.5 * math.log(0.5)
    assert math.isclose(conf_penalty(logits).item(), expected, rel_tol=1e-6)
    assert math.isclose(conf_penalty(torch.zeros(2, 5)).item(), -math.log(5), rel_tol=1e-6)
    # weighted: a padding row (weight 0) adds nothing
    padded = torch.cat([logits, torch.tensor([[5.0, -5.0]])])
    assert math.isclose(conf_penalty(padded, weight=torch.tensor([1.0, 1.0, 0.0])).item(),
                        expected, rel_tol=1e-6)


# ---------------------------------------------------------------------- evaluation


def test_ensemble_topk_ranks_the_summed_logits():
    logits1 = torch.tensor([[5.0, 0, 4, 0, 0, 0],
                            [0.0, 1, 2, 3, 4, 5],
                            [0.0, 1, 2, 3, 4, 5]])
    logits2 = torch.tensor([[0.0, 0, 4, 0, 0, 0],     # sum (5,0,8,0,0,0): top-1 = 2
                            [0.0, 1, 2, 3, 4, 5],     # sum ranks 5,4,3,2,1,0
                            [9.0, 0, 0, 0, 0, 0]])    # sum (9,1,2,3,4,5): 0,5,4,3,2,1
    target = torch.tensor([2, 0, 1])
    # row 0: hit at top-1 (net 1 alone would say 0); row 1: class 0 is last (6th);
    # row 2: class 1 is last
    assert ensemble_topk(logits1, logits2, target) == {1: 1, 5: 1}
    assert ensemble_topk(logits1, logits2, torch.tensor([2, 1, 4]), ks=(1, 2, 5)) == {
        1: 1, 2: 1, 5: 3}
    # k above K counts everything
    assert ensemble_topk(logits1[:, :3], logits2[:, :3], torch.tensor([2, 0, 1]),
                         ks=(1, 5)) == {1: 1, 5: 3}


# ---------------------------------------------------------------------- composed


def test_one_dividemix_round_on_real_networks():
    """Two linear networks warmed up on 3 Gaussian blobs with 40% symmetric label noise:
    co-divide on their real losses finds the clean samples, and one DivideMix step of
    network 1 (on network 2's division) runs end to end with finite loss and gradients."""
    g = torch.Generator().manual_seed(0)
    k, n = 3, 600
    centers = torch.tensor([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
    y = torch.randint(0, k, (n,), generator=g)
    x = centers[y] + torch.randn(n, 2, generator=g)
    flip = torch.rand(n, generator=g) < 0.4
    observed = torch.where(flip, torch.randint(0, k, (n,), generator=g), y)
    is_clean = observed == y
    nets = [torch.nn.Linear(2, k) for _ in range(2)]
    for i, net in enumerate(nets):
        torch.nn.init.normal_(net.weight, generator=torch.Generator().manual_seed(i))
        torch.nn.init.zeros_(net.bias)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(100):                                   # warm-up: full-batch CE
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), observed).backward()
            opt.step()
    with torch.no_grad():
        divisions = [co_divide(division_losses(net(x), observed), seed=0) for net in nets]
    for d in divisions:
        precision, recall = _precision_recall(d.clean, is_clean)
        assert precision > 0.99 and recall > 0.99, (precision, recall)

    net, other, d = nets[0], nets[1], divisions[1]                # train net 1 on net 2's
    for nt in nets:
        nt.zero_grad(set_to_none=True)
    lab, unl = d.clean.nonzero().squeeze(1)[:32], (~d.clean).nonzero().squeeze(1)[:32]
    views = [x + 0.05 * torch.randn(n, 2, generator=g) for _ in range(2)]
    with torch.no_grad():
        p_bar = sum(torch.softmax(net(v[lab]), 1) for v in views) / 2
        y_l = torch.nn.functional.one_hot(observed[lab], k).float()
        t_l = co_refine(y_l, p_bar, d.prob_clean[lab].float(), 0.5)
        t_u = co_guess([torch.softmax(net(v[unl]), 1) for v in views],
                       [torch.softmax(other(v[unl]), 1) for v in views], 0.5)
    m = mixmatch(torch.cat([views[0][lab], views[1][lab]]), torch.cat([t_l, t_l]),
                 torch.cat([views[0][unl], views[1][unl]]), torch.cat([t_u, t_u]), 4.0,
                 generator=torch.Generator().manual_seed(0))
    logits = net(m.inputs)
    lx, lu = semi_loss(logits[:m.n_labelled], m.targets[:m.n_labelled],
                       logits[m.n_labelled:], m.targets[m.n_labelled:])
    loss = lx + linear_rampup(10.5, 10, lambda_u=25) * lu + uniform_prior_penalty(logits)
    loss.backward()
    assert torch.isfinite(loss) and net.weight.grad.abs().sum() > 0
    assert other.weight.grad is None                              # net 2 only guesses
