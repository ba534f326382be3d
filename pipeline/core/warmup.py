"""Initial state of the Gibbs chain: warm-up transitions (Eq. 8) and initial assignments.

``phi[k, j] = P(observed = j | latent = k)``; rows sum to 1. ``K_latent`` is ``K`` or ``K + 1``
(LCCN*'s outlier row last).
"""

from __future__ import annotations

import torch
from torch import Tensor


def estimate_phi_init(cfg, probs: Tensor, observed: Tensor, k_latent: int, num_classes: int,
                      *, reduce=None) -> Tensor:
    """The warm-up transition ``phi_init (K_latent, K)`` (rows sum to 1) that
    ``cfg.warmup`` (an :class:`~pipeline.core.config.LCCNConfig`) names, from the pretrained
    classifier's ``probs (N, K_latent)`` and the ``observed (N,)`` labels of this worker's
    samples; ``reduce`` sums partial statistics over workers (identity in one process)."""
    if cfg.warmup == "identity":
        return smoothed_identity(k_latent, num_classes, smoothing=cfg.warmup_smoothing)
    if cfg.warmup == "anchor":
        return anchor_transition(probs, num_classes, quantile=cfg.anchor_quantile,
                                 reduce=reduce)
    if cfg.warmup == "eq8":
        return soft_confusion(probs, observed, num_classes, reduce=reduce)
    raise ValueError(f"unknown warm-up {cfg.warmup!r}")


def soft_confusion(probs: Tensor, observed: Tensor, num_classes: int, *,
                   reduce=None) -> Tensor:
    """Eq. 8: ``phi_init[k, j] = Σ_n 1(ỹ_n = j) P(k | x_n) / Σ_n P(k | x_n)``.

    probs: (N, K_latent) predictions of the pretrained classifier over the training set;
    observed: (N,) int64 in [0, K); ``reduce``: an optional sum over workers of the
    (K_latent, K) numerator. Returns (K_latent, K) float64, rows sum to 1 (a row the
    classifier never predicts is uniform).
    """
    if probs.ndim != 2 or observed.shape != (probs.shape[0],):
        raise ValueError(f"probs (N, K_latent) and observed (N,) disagree: "
                         f"{tuple(probs.shape)} vs {tuple(observed.shape)}")
    onehot = torch.nn.functional.one_hot(observed.long(), num_classes).to(torch.float64)
    num = probs.to(torch.float64).T @ onehot                       # (K_latent, K)
    if reduce is not None:
        num = reduce(num)
    den = num.sum(1, keepdim=True)
    uniform = torch.full_like(num, 1.0 / num_classes)
    return torch.where(den > 0, num / den.clamp_min(1e-300), uniform)


def anchored_prior(alpha: Tensor, phi_init: Tensor, total: int, strength: float) -> Tensor:
    """The Dirichlet prior of each latent row of phi when the warm-up estimate anchors it
    (:attr:`LCCNConfig.prior_strength`): ``α_j + m · phi_init[k, j]`` with
    ``m = strength · total / K_latent`` pseudo-counts per row (``total``: the samples counted
    in C, so ``strength`` 1 weighs the estimate as much as an average row's counts).
    ``alpha (K,)`` float64; returns ``(K_latent, K)`` float64, or ``alpha`` itself when
    ``strength`` is 0 (the paper's symmetric prior)."""
    if strength <= 0:
        return alpha
    k_latent = phi_init.shape[0]
    m = float(strength) * float(total) / k_latent
    return alpha.to(phi_init.device).unsqueeze(0) + m * phi_init.to(torch.float64)


def smoothed_identity(k_latent: int, num_classes: int, *, smoothing: float = 0.1) -> Tensor:
    """``(1 - s) I + s / K`` on the first K rows; a uniform outlier row if ``k_latent = K + 1``.

    Returns (k_latent, K) float64 with rows summing to 1.
    """
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must lie in [0, 1), got {smoothing}")
    if k_latent not in (num_classes, num_classes + 1):
        raise ValueError(f"k_latent must be K or K+1 (K={num_classes}), got {k_latent}")
    phi = torch.full((k_latent, num_classes), smoothing / num_classes, dtype=torch.float64)
    phi[:num_classes] += (1 - smoothing) * torch.eye(num_classes, dtype=torch.float64)
    if k_latent > num_classes:
        phi[num_classes] = 1.0 / num_classes
    return phi


def initial_assignment(observed: Tensor, *, probs: Tensor | None = None,
                       mode: str = "argmax") -> Tensor:
    """Initial latent labels ``z (N,) int64``.

    mode ``"argmax"``: the pretrained classifier's argmax over ``probs (N, K_latent)`` (as
    the authors' code does); ``"observed"``: the observed labels.
    """
    if mode == "observed":
        return observed.clone().long()
    if mode == "argmax":
        if probs is None:
            raise ValueError("initial assignment mode 'argmax' needs the classifier's probs")
        if probs.shape[0] != observed.shape[0]:
            raise ValueError(f"probs has {probs.shape[0]} rows for {observed.shape[0]} samples")
        return probs.argmax(1).long()
    raise ValueError(f"unknown initial assignment mode {mode!r}; use 'argmax' or 'observed'")


def deconvolve(probs: Tensor, phi: Tensor, *, iters: int = 50) -> Tensor:
    """The clean posterior behind a noisy one: the ``q (B, K_latent)`` on the simplex whose
    prediction of the observed label through ``phi`` matches ``probs``, i.e. that minimises
    ``KL(probs || q @ phi)``.

    A classifier trained with cross-entropy on the observed labels estimates the noisy
    posterior ``P(ỹ | x) = Σ_k P(k | x) phi[k, ·]``, but Eq. 7 wants the clean ``P(k | x)``
    as its prior. Reading the first as the second counts the noise twice: a cat image
    labelled "dog" under a 0.5 cat→dog flip, whose CE classifier says 0.5 cat / 0.5 dog,
    is drawn back to cat with probability 1/3, not 1, and ``phi[cat, dog]`` is then
    counted near 0.25 instead of 0.5. The solution comes from ``iters`` EM updates
    ``q <- q * (phi @ (probs / (q @ phi)))`` from ``q = probs`` (each keeps q on the
    simplex and does not increase the KL); where ``phi`` is invertible and ``probs`` in
    its range they converge to ``probs @ inv(phi)``.

    probs: (B, K_latent), rows on the simplex (K_latent = K: the observed classes; K + 1:
    LCCN*, whose outlier probability is deconvolved with the rest); phi: (K_latent, K),
    rows sum to 1. Returns (B, K_latent) in the dtype of ``probs``.
    """
    if probs.ndim != 2 or phi.ndim != 2 or probs.shape[1] != phi.shape[0]:
        raise ValueError(f"probs (B, K_latent) and phi (K_latent, K) disagree: "
                         f"{tuple(probs.shape)} vs {tuple(phi.shape)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    t = phi.to(probs.device, torch.float64)
    k = t.shape[1]
    p = probs.to(torch.float64)
    # the noisy posterior over the K observed classes (LCCN*: the outlier output of a
    # classifier trained on K classes is read as its share of every class)
    target = p[:, :k] / p[:, :k].sum(1, keepdim=True).clamp_min(1e-300)
    q = p / p.sum(1, keepdim=True).clamp_min(1e-300)
    for _ in range(iters):
        q = q * ((target / (q @ t).clamp_min(1e-300)) @ t.T)
        q = q / q.sum(1, keepdim=True).clamp_min(1e-300)
    return q.to(probs.dtype)


def warmup_prior(mode: str, probs: Tensor, phi_init: Tensor, *, chunk: int = 65536) -> Tensor:
    """What Eq. 7 reads as the prior during the warm-up for ``LCCNConfig.warmup_prior``
    ``mode``: ``probs (N, K_latent)`` themselves (``"model"``) or deconvolved through
    ``phi_init`` (``"deconvolved"``, :func:`deconvolve`, in chunks of ``chunk`` rows so a
    whole split's N x K float64 copies stay bounded). The ``argmax`` initial assignment
    takes its arg max, so the chain starts where the warm-up's draws point."""
    if mode == "model":
        return probs
    if mode == "deconvolved":
        probs = probs.detach()
        if len(probs) <= chunk:
            return deconvolve(probs, phi_init)
        return torch.cat([deconvolve(p, phi_init) for p in probs.split(chunk)])
    raise ValueError(f"unknown warmup_prior {mode!r}; use 'model' or 'deconvolved'")


def initial_latents(cfg, observed: Tensor, probs: Tensor, phi_init: Tensor) -> Tensor:
    """The chain's first ``z (N,) int64`` for ``cfg`` (an
    :class:`~pipeline.core.config.LCCNConfig`): with ``cfg.init == "argmax"`` the arg max of the
    prior the warm-up's draws read (:func:`warmup_prior`), so the chain starts where they
    point; with ``"observed"`` the observed labels."""
    prior = warmup_prior(cfg.warmup_prior, probs, phi_init) if cfg.init == "argmax" else probs
    return initial_assignment(observed, probs=prior, mode=cfg.init)


def anchor_transition(probs: Tensor, num_classes: int, *, quantile: float = 0.97,
                      bins: int = 1000, reduce=None) -> Tensor:
    """The anchor-point estimate of phi (Patrini et al. 2017, "Making deep neural networks
    robust to label noise: a loss correction approach", Sec. 3.4).

    A classifier trained with cross-entropy on the observed labels estimates the *noisy*
    posterior ``P(ỹ = j | x) = Σ_k P(k | x) phi[k, j]``. At an anchor of class k (a sample
    whose clean posterior is one-hot at k) that is exactly row k of phi. The anchors of k
    are taken as the samples whose ``P(k | x)`` is at or above its ``quantile``-th quantile
    over the split (the robust variant of the paper's arg max); row k is the mean of their
    predicted distributions. Unlike Eq. 8, which reads the same classifier as the *clean*
    posterior, this stays consistent when the classifier is flat.

    probs: (N, K_latent) predictions of the pretrained classifier, K_latent = K or K + 1
        (LCCN*: the outlier output is dropped and renormalised over the K observed classes,
        the outlier row is uniform). ``reduce``: an optional sum over workers (all-reduce)
        applied to the (K, bins) histograms and the (K, K) sums, so every rank of a
        distributed run computes the same estimate from its own shard of ``probs``.
        The quantile is located on a ``bins``-bin histogram of each column.
    Returns (K_latent, K) float64, rows sum to 1.
    """
    if probs.ndim != 2 or probs.shape[1] not in (num_classes, num_classes + 1):
        raise ValueError(f"probs must be (N, K or K+1) with K={num_classes}, got "
                         f"{tuple(probs.shape)}")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must lie in (0, 1), got {quantile}")
    reduce = reduce or (lambda t: t)
    k_latent, k = probs.shape[1], num_classes
    p = probs[:, :k].to(torch.float64)
    p = p / p.sum(1, keepdim=True).clamp_min(1e-300)                     # (N, K)
    b = (p * bins).long().clamp_(0, bins - 1)                             # (N, K) bin of P(k|x)
    hist = torch.zeros(k, bins, dtype=torch.float64)
    hist.scatter_add_(1, b.T.contiguous(), torch.ones(k, p.shape[0], dtype=torch.float64))
    hist = reduce(hist)
    total = hist.sum(1, keepdim=True)                                     # (K, 1) = N
    at_or_above = hist.flip(1).cumsum(1).flip(1)                          # [k, b] = #(bin >= b)
    need = ((1 - quantile) * total).ceil().clamp_min(1)
    # the highest bin whose tail still holds at least `need` samples
    ok = at_or_above >= need
    first_bin = (ok * torch.arange(bins, dtype=torch.float64)).amax(1).long()   # (K,)
    anchor = b >= first_bin.unsqueeze(0)                                  # (N, K) bool
    sums = anchor.to(torch.float64).T @ p                                 # (K, K): rows sum P(.|x)
    sums = reduce(sums)
    cnt = sums.sum(1, keepdim=True)
    phi = torch.where(cnt > 0, sums / cnt.clamp_min(1e-300), torch.full_like(sums, 1.0 / k))
    if k_latent > k:
        phi = torch.cat([phi, torch.full((1, k), 1.0 / k, dtype=torch.float64)])
    return phi
