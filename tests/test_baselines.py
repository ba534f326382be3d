"""Bootstrapping, Forward, S-adaptation and T-Revision against values worked out by hand
(closed forms with ``math`` or an explicit NumPy loop, never the function under test)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.core.baselines import (
    SAdaptation,
    TRevisionSlack,
    bootstrap_hard_loss,
    bootstrap_soft_loss,
    check_transition,
    forward_loss,
    forward_transition,
    importance_weights,
    load_transition,
    reweight_loss,
)

LN3 = math.log(3.0)
# softmax of (ln 3, 0) is (3/4, 1/4)
Q = torch.tensor([[LN3, 0.0]])


# ---------------------------------------------------------------------- Bootstrapping


def test_bootstrap_hard():
    # argmax is class 0, label 1: target 0.8*(0,1) + 0.2*(1,0) = (0.2, 0.8)
    expected = -(0.2 * math.log(0.75) + 0.8 * math.log(0.25))
    assert math.isclose(bootstrap_hard_loss(Q, torch.tensor([1])).item(), expected,
                        rel_tol=1e-6)
    # the prediction agrees with the label: plain cross-entropy
    assert math.isclose(bootstrap_hard_loss(Q, torch.tensor([0])).item(), -math.log(0.75),
                        rel_tol=1e-6)
    # beta = 1 is cross-entropy on the observed label
    assert math.isclose(bootstrap_hard_loss(Q, torch.tensor([1]), beta=1.0).item(),
                        math.log(4.0), rel_tol=1e-6)
    with pytest.raises(ValueError, match="beta"):
        bootstrap_hard_loss(Q, torch.tensor([1]), beta=1.5)


def test_bootstrap_hard_gradient_is_that_of_the_fixed_target():
    logits = Q.clone().requires_grad_(True)
    bootstrap_hard_loss(logits, torch.tensor([1])).backward()
    # d/dlogits of -Σ t log softmax = softmax - t, t = (0.2, 0.8)
    assert torch.allclose(logits.grad, torch.tensor([[0.75 - 0.2, 0.25 - 0.8]]))


def test_bootstrap_soft():
    # target 0.95*(0,1) + 0.05*(3/4, 1/4) = (0.0375, 0.9625)
    expected = -(0.0375 * math.log(0.75) + 0.9625 * math.log(0.25))
    assert math.isclose(bootstrap_soft_loss(Q, torch.tensor([1])).item(), expected,
                        rel_tol=1e-6)


# ---------------------------------------------------------------------- Forward


def test_forward_with_identity_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, generator=g)
    target = torch.randint(0, 5, (16,), generator=g)
    assert torch.allclose(forward_loss(logits, target, torch.eye(5)),
                          F.cross_entropy(logits, target), atol=1e-6)


def test_forward_hand_value():
    T = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    # noisy posterior of label 1: 3/4 * 0.1 + 1/4 * 0.7 = 0.25
    assert math.isclose(forward_loss(Q, torch.tensor([1]), T).item(), math.log(4.0),
                        rel_tol=1e-6)
    # label 0: 3/4 * 0.9 + 1/4 * 0.3 = 0.75
    assert math.isclose(forward_loss(Q, torch.tensor([0]), T).item(), -math.log(0.75),
                        rel_tol=1e-6)


def test_forward_with_an_oracle_transition_matches_the_analytic_loss():
    rng = np.random.default_rng(1)
    k, m = 4, 8
    T = rng.dirichlet(np.ones(k), size=k)               # rows sum to 1
    logits = rng.normal(size=(m, k))
    target = rng.integers(0, k, size=m)
    expected = 0.0
    for i in range(m):                                  # -log Σ_k p_k T[k, y]
        p = np.exp(logits[i]) / np.exp(logits[i]).sum()
        expected -= math.log(sum(p[c] * T[c, target[i]] for c in range(k)))
    expected /= m
    got = forward_loss(torch.tensor(logits, dtype=torch.float32), torch.tensor(target),
                       torch.tensor(T))
    assert math.isclose(got.item(), expected, rel_tol=1e-5)


def test_forward_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"T must be \(2, 2\)"):
        forward_loss(Q, torch.tensor([1]), torch.eye(3))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        forward_loss(Q, torch.tensor([2]), torch.eye(2))


# ---------------------------------------------------------------------- transition files


@pytest.fixture
def T3():
    return np.array([[0.8, 0.1, 0.1], [0.0, 0.6, 0.4], [0.25, 0.25, 0.5]])


@pytest.mark.parametrize("suffix", [".npy", ".json", ".csv", ".txt"])
def test_load_transition_formats(tmp_path, T3, suffix):
    path = tmp_path / f"T{suffix}"
    if suffix == ".npy":
        np.save(path, T3)
    elif suffix == ".json":
        path.write_text(json.dumps(T3.tolist()))
    elif suffix == ".csv":
        path.write_text("\n".join(",".join(str(v) for v in r) for r in T3) + "\n")
    else:
        path.write_text("# oracle\n" + "\n".join(" ".join(str(v) for v in r) for r in T3))
    got = load_transition(path, 3)
    assert got.dtype == torch.float64 and torch.allclose(got, torch.tensor(T3))


def test_load_transition_renormalises_rounded_rows(tmp_path):
    path = tmp_path / "T.csv"
    path.write_text("0.333,0.333,0.333\n0,1,0\n0,0,1\n")       # row 0 sums to 0.999
    got = load_transition(path, 3)
    assert torch.allclose(got[0], torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(got.sum(1), torch.ones(3, dtype=torch.float64))


def test_load_transition_errors_name_the_file(tmp_path, T3):
    bad_row = T3.copy()
    bad_row[1] = [0.0, 0.6, 0.3]
    np.save(tmp_path / "rows.npy", bad_row)
    with pytest.raises(ValueError, match=r"rows\.npy: row 1 sums to 0\.9"):
        load_transition(tmp_path / "rows.npy", 3)
    np.save(tmp_path / "shape.npy", T3[:2])
    with pytest.raises(ValueError, match=r"shape\.npy: transition must be \(3, 3\), got \(2, 3\)"):
        load_transition(tmp_path / "shape.npy", 3)
    neg = T3.copy()
    neg[2] = [-0.1, 0.6, 0.5]
    np.save(tmp_path / "neg.npy", neg)
    with pytest.raises(ValueError, match=r"neg\.npy: entry \[2, 0\] = -0\.1"):
        load_transition(tmp_path / "neg.npy", 3)
    (tmp_path / "text.csv").write_text("0.5,0.5\nx,1\n")
    with pytest.raises(ValueError, match=r"text\.csv: cannot parse"):
        load_transition(tmp_path / "text.csv", 2)
    (tmp_path / "T.mat").write_text("")
    with pytest.raises(ValueError, match=r"T\.mat: unknown format"):
        load_transition(tmp_path / "T.mat", 3)
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        load_transition(tmp_path / "missing.npy", 3)


def test_forward_transition_sources(tmp_path, T3):
    np.save(tmp_path / "T.npy", T3)
    assert torch.allclose(forward_transition("file", 3, path=tmp_path / "T.npy"),
                          torch.tensor(T3))
    # Eq. 8 on hard predictions: latent 0 <- samples 0, 2 (observed 0, 1); latent 1 <- 1
    probs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    observed = torch.tensor([0, 1, 1])
    assert torch.allclose(forward_transition("eq8", 2, probs=probs, observed=observed),
                          torch.tensor([[0.5, 0.5], [0.0, 1.0]], dtype=torch.float64))
    anchor = forward_transition("anchor", 2, probs=torch.softmax(torch.randn(50, 2), 1))
    assert anchor.shape == (2, 2) and torch.allclose(anchor.sum(1), torch.ones(2).double())
    with pytest.raises(ValueError, match="unknown transition source"):
        forward_transition("oracle", 3)
    with pytest.raises(ValueError, match="needs a path"):
        forward_transition("file", 3)


def test_check_transition_names_its_source():
    with pytest.raises(ValueError, match="my T: row 0 sums to 2"):
        check_transition([[1.0, 1.0], [0.0, 1.0]], 2, source="my T")


# ---------------------------------------------------------------------- S-adaptation


def test_s_adaptation_starts_at_the_initial_transition():
    T0 = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1], [0.0, 0.5, 0.5]])
    layer = SAdaptation(T0)
    # softmax(log(T0 + eps)) = (T0 + eps) / (1 + K eps)
    assert torch.allclose(layer.transition(), (T0 + 1e-8) / (1 + 3e-8), atol=1e-7)
    logits = torch.tensor([[LN3, 0.0, 0.0]])            # softmax (3/5, 1/5, 1/5)
    # P(obs = j) = 0.6 T0[0, j] + 0.2 T0[1, j] + 0.2 T0[2, j]
    expected = torch.tensor([[0.58, 0.30, 0.12]])
    assert torch.allclose(layer(logits), expected, atol=1e-6)
    assert math.isclose(layer.loss(logits, torch.tensor([2])).item(), -math.log(0.12),
                        rel_tol=1e-5)


def test_s_adaptation_is_row_stochastic_and_learns():
    g = torch.Generator().manual_seed(0)
    layer = SAdaptation(torch.full((4, 4), 0.25))
    logits = torch.randn(32, 4, generator=g, requires_grad=True)
    target = torch.randint(0, 4, (32,), generator=g)
    opt = torch.optim.SGD([layer.weight, logits], lr=1.0)
    before = layer.transition().detach().clone()
    layer.loss(logits, target).backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    opt.step()
    after = layer.transition().detach()
    assert not torch.allclose(before, after)
    assert torch.allclose(after.sum(1), torch.ones(4), atol=1e-6) and bool((after > 0).all())


def test_s_adaptation_refuses_bad_input():
    with pytest.raises(ValueError, match="row 1 sums to"):
        SAdaptation(torch.tensor([[1.0, 0.0], [0.5, 0.4]]))
    with pytest.raises(ValueError, match=r"square \(K, K\) matrix, got \(2, 3\)"):
        SAdaptation(torch.ones(2, 3) / 3)
    with pytest.raises(ValueError, match="T_hat: the transition must be a square"):
        TRevisionSlack(torch.ones(3) / 3)
    with pytest.raises(ValueError, match=r"logits must be \(M, 2\)"):
        SAdaptation(torch.eye(2))(torch.zeros(1, 3))


# ---------------------------------------------------------------------- T-Revision


T_HAT = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
LOGITS2 = torch.tensor([[LN3, 0.0], [LN3, 0.0]])          # both (3/4, 1/4)
TARGET2 = torch.tensor([0, 1])


def test_importance_weights_hand_values():
    # label 0: 0.75 / (0.75*0.8 + 0.25*0.4) = 0.75 / 0.7; label 1: 0.25 / (0.15 + 0.15)
    beta = importance_weights(LOGITS2, TARGET2, T_HAT)
    assert torch.allclose(beta, torch.tensor([0.75 / 0.7, 0.25 / 0.3]))
    clipped = importance_weights(LOGITS2, TARGET2, T_HAT, max_weight=1.0)
    assert torch.allclose(clipped, torch.tensor([1.0, 0.25 / 0.3]))
    assert torch.allclose(importance_weights(LOGITS2, TARGET2, torch.eye(2)), torch.ones(2))


def test_reweight_loss_hand_value_and_detached_weights():
    expected = 0.5 * (0.75 / 0.7 * -math.log(0.75) + 0.25 / 0.3 * math.log(4.0))
    logits = LOGITS2.clone().requires_grad_(True)
    loss = reweight_loss(logits, TARGET2, T_HAT)
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    # detached β: the gradient is β_m (softmax - onehot) / M
    beta = torch.tensor([0.75 / 0.7, 0.25 / 0.3]).unsqueeze(1)
    resid = torch.tensor([[0.75 - 1, 0.25], [0.75, 0.25 - 1]])
    assert torch.allclose(logits.grad, beta * resid / 2, atol=1e-6)
    # identity transition: plain cross-entropy
    assert math.isclose(reweight_loss(LOGITS2, TARGET2, torch.eye(2)).item(),
                        F.cross_entropy(LOGITS2, TARGET2).item(), rel_tol=1e-6)


def test_t_revision_slack_starts_at_zero_and_learns_through_the_weights():
    slack = TRevisionSlack(T_HAT)
    assert torch.equal(slack.delta, torch.zeros(2, 2))
    assert torch.allclose(slack.transition(), T_HAT)
    loss = slack.loss(LOGITS2, TARGET2)
    assert math.isclose(loss.item(), reweight_loss(LOGITS2, TARGET2, T_HAT).item(),
                        rel_tol=1e-6)
    loss.backward()
    # d/dΔT[i, j] of mean_m β_m CE_m, β_m = p_my / Σ_i p_mi T[i, y_m]:
    #   (1/M) Σ_m 1(y_m = j) CE_m · (-p_my p_mi / noisy_m²)
    p = np.array([0.75, 0.25])
    T = T_HAT.double().numpy()
    expected = np.zeros((2, 2))
    for y in (0, 1):
        noisy = p @ T[:, y]
        ce = -math.log(p[y])
        for i in (0, 1):
            expected[i, y] += ce * (-p[y] * p[i] / noisy**2) / 2
    assert torch.allclose(slack.delta.grad.double(), torch.tensor(expected), atol=1e-6)
    # and one Adam step moves ΔT
    opt = torch.optim.Adam(slack.parameters(), lr=1e-3)
    opt.step()
    assert slack.delta.abs().sum() > 0
