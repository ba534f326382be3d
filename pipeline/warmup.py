"""Initial state of the Gibbs chain: warm-up transitions (Eq. 8) and initial assignments.

``phi[k, j] = P(observed = j | latent = k)``; rows sum to 1. ``K_latent`` is ``K`` or ``K + 1``
(LCCN*'s outlier row last).
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_confusion(probs: Tensor, observed: Tensor, num_classes: int) -> Tensor:
    """Eq. 8: ``phi_init[k, j] = Σ_n 1(ỹ_n = j) P(k | x_n) / Σ_n P(k | x_n)``.

    probs: (N, K_latent) predictions of the pretrained classifier over the training set;
    observed: (N,) int64 in [0, K). Returns (K_latent, K) float64, rows sum to 1 (a row
    the classifier never predicts is uniform).
    """
    if probs.ndim != 2 or observed.shape != (probs.shape[0],):
        raise ValueError(f"probs (N, K_latent) and observed (N,) disagree: "
                         f"{tuple(probs.shape)} vs {tuple(observed.shape)}")
    onehot = torch.nn.functional.one_hot(observed.long(), num_classes).to(torch.float64)
    num = probs.to(torch.float64).T @ onehot                       # (K_latent, K)
    den = num.sum(1, keepdim=True)
    uniform = torch.full_like(num, 1.0 / num_classes)
    return torch.where(den > 0, num / den.clamp_min(1e-300), uniform)


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
