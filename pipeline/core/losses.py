"""Losses. ``logits: (M, K)``; ``target: (M,) int64``."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def clipped_cross_entropy(logits: Tensor, target: Tensor, *, xi: float = 1e-20,
                          weight: Tensor | None = None) -> Tensor:
    """The ξ-clipped cross-entropy ℓ1 of Eq. 9: ``-log clip(softmax(logits)[target], ξ, 1-ξ)``.

    Computed in log space: the log-probability is clamped to ``[log ξ, log(1-ξ)]`` so the
    loss is bounded by ``-log ξ`` (the ρ of Theorem 2). ``weight (M,)`` averages with
    per-sample weights (e.g. to drop padded samples); mean over the batch otherwise.
    """
    if not 0 < xi < 0.5:
        raise ValueError(f"xi must lie in (0, 0.5), got {xi}")
    logp = torch.log_softmax(logits.float(), dim=1).gather(1, target.long().unsqueeze(1)).squeeze(1)
    upper = math.log1p(-xi) if xi > 1e-15 else 0.0
    loss = -logp.clamp(math.log(xi), upper)
    if weight is None:
        return loss.mean()
    w = weight.to(loss.dtype)
    return (loss * w).sum() / w.sum().clamp_min(1.0)


def soft_cross_entropy(logits: Tensor, target: Tensor, *, xi: float = 1e-20,
                       weight: Tensor | None = None) -> Tensor:
    """Cross-entropy against a distribution: ``-Σ_k target[m, k] log clip(softmax[m, k])``,
    the expectation of :func:`clipped_cross_entropy` over ``z_m ~ target[m]``.

    logits: (M, K); target: (M, K) rows sum to 1 (e.g. the Eq. 7 conditional). The same
    ξ-clipping and weighting as :func:`clipped_cross_entropy`; for a one-hot ``target`` the
    two are equal.
    """
    if not 0 < xi < 0.5:
        raise ValueError(f"xi must lie in (0, 0.5), got {xi}")
    if target.shape != logits.shape:
        raise ValueError(f"target must be {tuple(logits.shape)}, got {tuple(target.shape)}")
    upper = math.log1p(-xi) if xi > 1e-15 else 0.0
    logp = torch.log_softmax(logits.float(), dim=1).clamp(math.log(xi), upper)
    target = target.to(logp.dtype)
    if weight is None:
        return -(target * logp).sum(1).mean()
    w = weight.to(logp.dtype)
    # a row of weight 0 (padding) adds nothing, whatever its target holds: a padding row
    # that is not in C can get a non-finite Eq. 7 posterior, and NaN x 0 is NaN
    target = torch.where((w > 0).unsqueeze(1), target, torch.zeros_like(target))
    loss = -(target * logp).sum(1)
    return (loss * w).sum() / w.sum().clamp_min(1.0)
