"""The building blocks of DivideMix and DivideLCCN: pure tensor maths, no training loop.

DivideMix (Li, Socher & Hoi, "DivideMix: Learning with Noisy Labels as Semi-supervised
Learning", ICLR 2020) trains two networks. Each epoch, each network's per-sample losses
are fitted by a 2-component Gaussian mixture; the posterior of the low-mean component is
the sample's probability of being clean, and the *other* network trains on that division
(co-divide): the clean part as labelled data with co-refined labels, the rest as
unlabelled data with co-guessed labels, both through MixMatch. DivideLCCN (the LCCN
paper's cross-model variant) keeps all of that and changes one thing: the prediction that
co-refinement mixes with the observed label is LCCN's posterior for the observed label
(:func:`lccn_posterior`), i.e. the network's prediction re-weighted by the conditional
transition of Eq. 7.

Defaults are those of the authors' code (``Train_CIFAR.py`` / ``Train_clothing1M.py`` of
the DivideMix repository; ``divide_train_varC.py`` of the LCCN repository):
GMM ``max_iter=10, tol=1e-2, reg_covar=5e-4``, ``p_threshold=0.5``, sharpening ``T=0.5``,
MixMatch ``alpha=4`` (CIFAR) / ``0.5`` (Clothing1M, WebVision), ``lambda_u=25`` with a
16-epoch linear ramp after warm-up (0 on Clothing1M and WebVision).

Shapes: ``K`` classes; probabilities are rows summing to 1 over the last axis; labels are
``(M,) int64``. ``phi[k, j] = P(observed = j | latent = k)``; rows sum to 1.
Randomness comes only from the explicit ``seed`` / ``torch.Generator`` arguments.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# --------------------------------------------------------------------------------------
# co-divide
# --------------------------------------------------------------------------------------


def normalize_losses(losses: Tensor) -> Tensor:
    """Min-max normalisation of per-sample losses to ``[0, 1]``, as DivideMix does before
    fitting the mixture: ``(l - min l) / (max l - min l)``.

    losses: (N,) float. Returns (N,) float64. Refuses an empty, non-finite or constant
    vector (a constant one has no two populations to separate).
    """
    x = _as_loss_vector(losses, "losses")
    lo, hi = float(x.min()), float(x.max())
    if hi == lo:
        raise ValueError(f"all {x.numel()} losses equal {lo}; min-max normalisation and the "
                         "two-component division need at least two distinct values")
    return (x - lo) / (hi - lo)


def average_loss_history(history: Sequence[Tensor], *, window: int = 5) -> Tensor:
    """Mean of the last ``window`` normalised loss vectors (DivideMix's stabiliser).

    The authors' code keeps every epoch's normalised losses and, in its 90%-symmetric-noise
    runs (``r == 0.9``), divides on ``history[-5:].mean(0)`` instead of the current epoch's
    vector. The caller owns the history (keep at most ``window`` entries: older ones are
    never read) and passes the result to :func:`co_divide` with ``normalize=False``, as
    the authors do (the average is not renormalised).

    history: sequence of (N,) tensors, oldest first. Returns (N,) float64.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if len(history) == 0:
        raise ValueError("the loss history is empty")
    recent = [_as_loss_vector(h, f"history[{i}]")
              for i, h in enumerate(history[-window:], start=max(0, len(history) - window))]
    n = recent[0].numel()
    bad = [h.numel() for h in recent if h.numel() != n]
    if bad:
        raise ValueError(f"history vectors disagree in length: {n} vs {bad[0]}")
    return torch.stack(recent).mean(0)


def balanced_subset(observed: Tensor, size: int, num_classes: int, *, seed: int) -> Tensor:
    """A class-balanced random subset of sample positions, at most ``size // K`` per class.

    DivideMix on Clothing1M fits its mixture on ``num_batches * batch_size`` samples drawn
    with at most ``1/K`` of them per (noisy) class; a class with fewer samples contributes
    all of them, so the subset can be smaller than ``size``.

    observed: (N,) int64 noisy labels in [0, K). Returns sorted (n,) int64 positions;
    deterministic given ``seed``.
    """
    obs = observed.long().reshape(-1)
    if obs.numel() and (int(obs.min()) < 0 or int(obs.max()) >= num_classes):
        raise ValueError(f"observed labels must lie in [0, {num_classes}), got range "
                         f"[{int(obs.min())}, {int(obs.max())}]")
    per_class = size // num_classes
    if per_class < 1:
        raise ValueError(f"a subset of {size} cannot hold one sample of each of "
                         f"{num_classes} classes")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(obs.numel(), generator=g)
    # rank of each sample within its class in the random order; keep the first per_class
    cls = obs[order]
    sorted_cls, by_cls = torch.sort(cls, stable=True)
    counts = torch.bincount(sorted_cls, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(obs.numel()) - starts[sorted_cls]
    keep = order[by_cls[rank < per_class]]
    return torch.sort(keep).values


@dataclass(frozen=True)
class Division:
    """The result of :func:`co_divide`.

    prob_clean: (N,) float64, the posterior of the low-mean mixture component.
    clean: (N,) bool, ``prob_clean > p_threshold`` (the labelled set of the other network).
    means: (clean, noisy) component means on the normalised loss scale.
    fit_idx: (n,) int64 positions the mixture was fitted on, or None (all samples).
    """

    prob_clean: Tensor
    clean: Tensor
    means: tuple[float, float]
    fit_idx: Tensor | None


def co_divide(losses: Tensor, *, p_threshold: float = 0.5, seed: int = 0,
              normalize: bool = True, observed: Tensor | None = None,
              fit_size: int | None = None, num_classes: int | None = None,
              max_iter: int = 10, tol: float = 1e-2, reg_covar: float = 5e-4) -> Division:
    """Divide the training set into a clean and a noisy part by a 2-component GMM on the
    per-sample losses (DivideMix, Sec. 3.1; the authors' ``eval_train``).

    losses: (N,) per-sample cross-entropy of one network (gathered over all workers).
    normalize: min-max normalise first (:func:`normalize_losses`); pass False for an
        already normalised vector such as :func:`average_loss_history`'s.
    observed, fit_size, num_classes: fit the mixture on a class-balanced subset of
        ``fit_size`` samples (:func:`balanced_subset` over the noisy labels ``observed``)
        and predict on all N (normalised over all N): the Clothing1M-scale route, where
        fitting on a million losses buys nothing over 32k.
    seed: the mixture's ``random_state`` and the subset's draw; equal inputs and seed give
        equal outputs on every worker.
    max_iter, tol, reg_covar: ``sklearn.mixture.GaussianMixture`` settings (DivideMix's).
    """
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.mixture import GaussianMixture

    if not 0.0 <= p_threshold <= 1.0:
        raise ValueError(f"p_threshold must lie in [0, 1], got {p_threshold}")
    x = normalize_losses(losses) if normalize else _as_loss_vector(losses, "losses")
    fit_idx = None
    if fit_size is not None:
        if observed is None or num_classes is None:
            raise ValueError("fit_size needs the noisy labels (observed) and num_classes "
                             "to draw a class-balanced subset")
        if observed.shape != x.shape:
            raise ValueError(f"observed must be {tuple(x.shape)}, got {tuple(observed.shape)}")
        fit_idx = balanced_subset(observed, fit_size, num_classes, seed=seed)
    fit_on = x if fit_idx is None else x[fit_idx]
    if fit_on.numel() < 2 or float(fit_on.max()) == float(fit_on.min()):
        raise ValueError(f"cannot fit two components on {fit_on.numel()} losses with "
                         f"{'one value' if fit_on.numel() else 'no values'}")
    gmm = GaussianMixture(n_components=2, max_iter=max_iter, tol=tol, reg_covar=reg_covar,
                          random_state=seed)
    with warnings.catch_warnings():
        # 10 EM iterations is the authors' setting, not a failure to converge
        warnings.simplefilter("ignore", ConvergenceWarning)
        gmm.fit(fit_on.numpy().reshape(-1, 1))
    post = gmm.predict_proba(x.numpy().reshape(-1, 1))
    means = gmm.means_.reshape(-1)
    lo = int(means.argmin())
    prob = torch.from_numpy(np.ascontiguousarray(post[:, lo])).to(torch.float64)
    return Division(prob_clean=prob, clean=prob > p_threshold,
                    means=(float(means[lo]), float(means[1 - lo])), fit_idx=fit_idx)


def _as_loss_vector(losses: Tensor, name: str) -> Tensor:
    x = torch.as_tensor(losses).detach().to("cpu", torch.float64).reshape(-1)
    if x.numel() == 0:
        raise ValueError(f"{name} is empty")
    bad = (~torch.isfinite(x)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {float(x[i])} is not finite "
                         f"({bad.numel()} non-finite values)")
    return x


def division_losses(logits: Tensor, observed: Tensor) -> Tensor:
    """Per-sample cross-entropy ``-log softmax(logits)[observed]``, the quantity DivideMix
    divides on. logits: (M, K); observed: (M,) int64. Returns (M,) float32."""
    return F.cross_entropy(logits.float(), observed.long(), reduction="none")


def lccn_division_losses(posterior: Tensor, observed: Tensor) -> Tensor:
    """The per-sample loss the LCCN authors' DivideLCCN code divides on once its
    transition is live: ``nn.CrossEntropyLoss`` applied to the LCCN posterior
    :func:`lccn_posterior` *as if it were logits*, i.e.
    ``-log softmax(posterior)[observed] = logsumexp_k posterior[k] - posterior[observed]``.

    It decreases as the posterior mass on the observed label grows, over a compressed range
    (``posterior`` lies in ``[0, 1]``); before the transition exists the code divides on
    :func:`division_losses`. posterior: (M, K) rows sum to 1; observed: (M,) int64.
    Returns (M,) float32.
    """
    return F.cross_entropy(posterior.float(), observed.long(), reduction="none")


# --------------------------------------------------------------------------------------
# label co-refinement and co-guessing
# --------------------------------------------------------------------------------------


def sharpen(p: Tensor, T: float) -> Tensor:
    """Temperature sharpening ``p_k^(1/T) / Σ_k' p_k'^(1/T)`` over the last axis.

    p: (..., K) non-negative rows; T > 0 (DivideMix: 0.5). Returns the same shape.
    """
    if not T > 0:
        raise ValueError(f"the sharpening temperature must be > 0, got {T}")
    pt = p ** (1.0 / T)
    return pt / pt.sum(-1, keepdim=True)


def co_refine(label_onehot: Tensor, p_model: Tensor, w_clean: Tensor, T: float) -> Tensor:
    """DivideMix's label co-refinement of the labelled (clean) set, Eq. 3-4:
    ``sharpen(w · y + (1 - w) · p, T)``.

    label_onehot: (M, K) one-hot observed labels; p_model: (M, K) the trained network's
    prediction averaged over the augmented views; w_clean: (M,) or (M, 1) the clean
    probability from the *other* network's division. Returns (M, K), rows sum to 1.
    """
    _check_pair(label_onehot, p_model, "label_onehot", "p_model")
    w = _column(w_clean, label_onehot.shape[0], "w_clean").to(p_model.dtype)
    return sharpen(w * label_onehot.to(p_model.dtype) + (1 - w) * p_model, T)


def transition_columns(phi: Tensor, observed: Tensor) -> Tensor:
    """The column of ``phi`` for each observed label: ``out[m, k] = phi[k, observed[m]]
    = P(observed_m | latent = k)``. phi: (K_latent, K), rows sum to 1; observed: (M,).
    Returns (M, K_latent)."""
    if phi.ndim != 2:
        raise ValueError(f"phi must be (K_latent, K), got {tuple(phi.shape)}")
    obs = observed.long()
    if obs.numel() and (int(obs.min()) < 0 or int(obs.max()) >= phi.shape[1]):
        raise ValueError(f"observed labels must lie in [0, {phi.shape[1]}), got range "
                         f"[{int(obs.min())}, {int(obs.max())}]")
    return phi.T[obs]


def lccn_posterior(p_model: Tensor, cond: Tensor) -> Tensor:
    """LCCN's posterior of the latent label given the observed one (Eq. 7 at γ = 1):
    ``q[m, k] ∝ p_model[m, k] · cond[m, k]``, normalised over k.

    cond: (M, K) the conditional transition for each sample's observed label, either
    :func:`transition_columns` of a transition ``phi`` (the authors' DivideLCCN code uses
    ``(C + 1) / rowsum`` of each network's own counts) or
    :func:`pipeline.core.sampler.conditional_transition` (own count removed).
    p_model: (M, K). Returns (M, K) in ``p_model``'s dtype, rows sum to 1.
    """
    _check_pair(p_model, cond, "p_model", "cond")
    q = p_model * cond.to(p_model.dtype)
    return q / q.sum(-1, keepdim=True)


def co_refine_lccn(label_onehot: Tensor, p_model: Tensor, cond: Tensor, w_clean: Tensor,
                   T: float) -> Tensor:
    """DivideLCCN's co-refinement: :func:`co_refine` with the network's prediction replaced
    by LCCN's posterior for the observed label, ``sharpen(w · y + (1 - w) · q, T)`` with
    ``q = lccn_posterior(p_model, cond)`` (``train`` in the authors' ``divide_train_varC.py``).

    label_onehot, p_model, cond: (M, K); w_clean: (M,) or (M, 1). Returns (M, K).
    """
    return co_refine(label_onehot, lccn_posterior(p_model, cond), w_clean, T)


def co_guess(p1_views: Sequence[Tensor], p2_views: Sequence[Tensor], T: float) -> Tensor:
    """DivideMix's label co-guessing for the unlabelled set: the mean of both networks'
    predictions over the augmented views, sharpened.

    p1_views, p2_views: each a sequence of (M, K) probabilities of one network over the
    views (DivideMix: 2 views each). Returns (M, K), rows sum to 1.
    """
    views = [*p1_views, *p2_views]
    if not p1_views or not p2_views:
        raise ValueError("co-guessing needs at least one view from each network")
    shape = views[0].shape
    for i, v in enumerate(views):
        if v.shape != shape:
            raise ValueError(f"view {i} is {tuple(v.shape)}, expected {tuple(shape)}")
    return sharpen(torch.stack(views).mean(0), T)


# --------------------------------------------------------------------------------------
# MixMatch and the semi-supervised loss
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mixed:
    """The result of :func:`mixmatch`. ``inputs`` (B_l + B_u, ...) and ``targets``
    (B_l + B_u, K) are mixed in the order labelled then unlabelled (split at
    ``n_labelled``); ``lam`` is the mixing weight λ' >= 0.5 of the un-shuffled side and
    ``perm`` (B_l + B_u,) the partner of each row."""

    inputs: Tensor
    targets: Tensor
    lam: float
    perm: Tensor
    n_labelled: int


def mixmatch(x_l: Tensor, p_l: Tensor, x_u: Tensor, p_u: Tensor, alpha: float, *,
             generator: torch.Generator) -> Mixed:
    """MixUp across the labelled and unlabelled batches, as DivideMix's MixMatch step:
    ``λ ~ Beta(α, α)``, ``λ' = max(λ, 1 - λ)``, one random permutation of the
    concatenated batch, ``x' = λ' x + (1 - λ') x[perm]`` and the same for the targets.

    x_l: (B_l, ...) labelled inputs (DivideMix passes both augmented views, with their
    refined targets repeated); p_l: (B_l, K); x_u: (B_u, ...); p_u: (B_u, K).
    alpha > 0 (DivideMix: 4 on CIFAR, 0.5 on Clothing1M and WebVision).
    generator: a CPU ``torch.Generator``, the only source of randomness (λ, then perm).
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if x_l.shape[0] != p_l.shape[0] or x_u.shape[0] != p_u.shape[0]:
        raise ValueError(f"inputs and targets disagree in batch size: {x_l.shape[0]} vs "
                         f"{p_l.shape[0]} (labelled), {x_u.shape[0]} vs {p_u.shape[0]} "
                         "(unlabelled)")
    if x_l.shape[1:] != x_u.shape[1:] or p_l.shape[1:] != p_u.shape[1:]:
        raise ValueError(f"labelled and unlabelled batches disagree in shape: "
                         f"{tuple(x_l.shape)}/{tuple(x_u.shape)}, "
                         f"{tuple(p_l.shape)}/{tuple(p_u.shape)}")
    # λ from the generator: seed a NumPy generator with 63 bits drawn from it (torch has
    # no Beta sampler that takes a Generator)
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    lam = float(np.random.default_rng(seed).beta(alpha, alpha))
    lam = max(lam, 1.0 - lam)
    x = torch.cat([x_l, x_u])
    p = torch.cat([p_l, p_u])
    perm = torch.randperm(x.shape[0], generator=generator)
    idx = perm.to(x.device)
    mixed_x = lam * x + (1 - lam) * x[idx]
    idx = perm.to(p.device)
    mixed_p = lam * p + (1 - lam) * p[idx]
    return Mixed(inputs=mixed_x, targets=mixed_p, lam=lam, perm=perm,
                 n_labelled=x_l.shape[0])


def linear_rampup(current: float, warm_up: float, rampup_length: float = 16, *,
                  lambda_u: float = 25.0) -> float:
    """The weight of the unlabelled loss: ``lambda_u · clip((current - warm_up) /
    rampup_length, 0, 1)``. ``current`` is the fractional epoch (epoch + batch / batches);
    DivideMix: ``lambda_u = 25`` on CIFAR-10 at 50% symmetric noise (0 / 25 / 50 / 150 by
    noise level in the paper), 0 on Clothing1M and WebVision."""
    if not rampup_length > 0:
        raise ValueError(f"rampup_length must be > 0, got {rampup_length}")
    t = (current - warm_up) / rampup_length
    return lambda_u * float(min(max(t, 0.0), 1.0))


def semi_loss(logits_x: Tensor, targets_x: Tensor, logits_u: Tensor,
              targets_u: Tensor) -> tuple[Tensor, Tensor]:
    """DivideMix's semi-supervised losses on the mixed batch (Eq. 9-10):

    ``Lx = -mean_m Σ_k targets_x[m, k] log softmax(logits_x)[m, k]`` (soft cross-entropy
    on the mixed labelled part) and ``Lu = mean_{m, k} (softmax(logits_u)[m, k] -
    targets_u[m, k])²`` (mean squared error over all M·K entries on the mixed unlabelled
    part). The total is ``Lx + linear_rampup(...) · Lu + uniform_prior_penalty(...)``.
    Returns (Lx, Lu) scalars.
    """
    _check_pair(logits_x, targets_x, "logits_x", "targets_x")
    _check_pair(logits_u, targets_u, "logits_u", "targets_u")
    lx = -(F.log_softmax(logits_x, dim=1) * targets_x).sum(1).mean()
    lu = ((torch.softmax(logits_u, dim=1) - targets_u) ** 2).mean()
    return lx, lu


def uniform_prior_penalty(logits: Tensor, prior: Tensor | None = None) -> Tensor:
    """DivideMix's regulariser against collapsing onto few classes:
    ``Σ_k π_k log(π_k / p̄_k)`` with ``p̄ = mean_m softmax(logits)[m]`` over the batch
    (the whole mixed batch) and ``π`` uniform ``1/K`` unless given.

    logits: (M, K); prior: optional (K,) summing to 1. Returns a scalar (0 when the mean
    prediction equals the prior, positive otherwise).
    """
    k = logits.shape[1]
    pi = (torch.full((k,), 1.0 / k, dtype=logits.dtype, device=logits.device)
          if prior is None else prior.to(logits.dtype))
    if pi.shape != (k,):
        raise ValueError(f"prior must be ({k},), got {tuple(pi.shape)}")
    mean = torch.softmax(logits, dim=1).mean(0)
    return (pi * torch.log(pi / mean)).sum()


def conf_penalty(logits: Tensor, *, weight: Tensor | None = None) -> Tensor:
    """The negative-entropy penalty DivideMix adds to the warm-up cross-entropy under
    asymmetric noise (and always on Clothing1M): ``mean_m Σ_k p_mk log p_mk`` with
    ``p = softmax(logits)``; minimising it discourages over-confident predictions.
    logits: (M, K); weight (M,): a weighted mean instead (0 for padding rows). Returns a
    scalar in ``[-log K, 0]``."""
    logp = F.log_softmax(logits, dim=1)
    neg_entropy = (logp.exp() * logp).sum(1)
    if weight is None:
        return neg_entropy.mean()
    w = weight.to(neg_entropy.dtype)
    return (neg_entropy * w).sum() / w.sum().clamp_min(1.0)


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------


def ensemble_topk(logits1: Tensor, logits2: Tensor, target: Tensor, *,
                  ks: Sequence[int] = (1, 5)) -> dict[int, int]:
    """Correct counts of the two-network ensemble DivideMix evaluates: the classes ranked
    by the *sum of the two networks' logits*.

    logits1, logits2: (M, K); target: (M,) int64 clean labels. Returns ``{k: number of
    samples whose target is among the top-k}`` (k above K counts every sample); counts,
    not rates, so workers can sum them.
    """
    _check_pair(logits1, logits2, "logits1", "logits2")
    if target.shape != (logits1.shape[0],):
        raise ValueError(f"target must be ({logits1.shape[0]},), got {tuple(target.shape)}")
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"top-k needs one or more k >= 1, got {list(ks)}")
    s = logits1.float() + logits2.float()
    kmax = min(max(ks), s.shape[1])
    top = s.topk(kmax, dim=1).indices                                    # (M, kmax)
    hit = top == target.long().to(s.device).unsqueeze(1)                 # (M, kmax)
    return {k: int(hit[:, :min(k, kmax)].any(1).sum()) for k in ks}


# --------------------------------------------------------------------------------------


def _check_pair(a: Tensor, b: Tensor, na: str, nb: str) -> None:
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"{na} and {nb} must be the same (M, K) shape, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")


def _column(w: Tensor, m: int, name: str) -> Tensor:
    w = torch.as_tensor(w)
    if w.shape not in ((m,), (m, 1)):
        raise ValueError(f"{name} must be ({m},) or ({m}, 1), got {tuple(w.shape)}")
    if w.numel() and (bool(torch.isnan(w).any()) or float(w.min()) < 0 or float(w.max()) > 1):
        raise ValueError(f"{name} must lie in [0, 1], got range [{float(w.min())}, "
                         f"{float(w.max())}]")
    return w.reshape(m, 1)
