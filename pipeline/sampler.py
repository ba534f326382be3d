"""One Gibbs step of LCCN (Eq. 7 of the paper), vectorised over a batch.

For sample m with observed label j = ỹ_m and current latent label z_old_m::

    C¬ = C with one count removed at [z_old_m, j]              (its own count only)
    p(k) ∝ [ P(k | x_m) · (α_j + C¬[k, j]) / Σ_j' (α_j' + C¬[k, j']) ] ^ γ

Shapes: ``probs (M, K_latent)``, ``observed (M,) int64 in [0, K)``, ``z_old (M,) int64``,
``counts (K_latent, K)``, ``alpha`` scalar or ``(K,)``. ``phi[k, j] = P(observed=j | latent=k)``.
The own-count removal applies only to samples currently counted in C (``counted``);
LCCN+'s trusted samples are never counted and never sampled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.confusion import as_alpha


def anneal_gamma(step: int, max_step: int, *, floor: float = 0.5, rate: float = 0.8) -> float:
    """The paper's power annealing ``max(exp(-rate * step / max_step), floor)``."""
    if max_step <= 0:
        raise ValueError(f"max_step must be > 0, got {max_step}")
    return max(math.exp(-rate * step / max_step), floor)


def conditional_transition(observed: Tensor, z_old: Tensor, counts: Tensor,
                           alpha: float | Tensor, *, counted: Tensor | None = None) -> Tensor:
    """The conditional transition term of Eq. 7, own count removed.

    Returns ``(M, K_latent)`` float64: ``[m, k] = (α_j + C¬[k, j]) / Σ_j' (α_j' + C¬[k, j'])``
    with ``j = observed[m]`` and ``C¬`` = ``counts`` less sample m's own count at
    ``[z_old[m], j]`` when ``counted[m]`` (default: all counted).
    """
    k_latent, k = counts.shape
    if (isinstance(alpha, Tensor) and alpha.device == counts.device and alpha.shape == (k,)
            and alpha.dtype == torch.float64 and alpha.device.type != "cpu"):
        a = alpha  # a device copy the labeler validated once (as_alpha's checks would sync)
    else:
        a = as_alpha(alpha, k).to(counts.device)
    obs = observed.long()
    # Gather the M needed columns before converting (rows of C^T: a contiguous (M, K_latent)
    # result), and sum integer counts as integers: O(K_latent * M) float64 work instead of
    # converting all of C (O(K^2), 8 MB at K=1000). The values are identical: integer sums
    # below 2**53 are exact in float64 in any order.
    num = counts.T[obs].to(torch.float64) + a[obs].unsqueeze(1)       # (M, K_latent)
    rows = (counts.to(torch.float64).sum(1) if counts.is_floating_point()
            else counts.sum(1).to(torch.float64))                      # (K_latent,)
    den = (rows + a.sum()).expand(obs.shape[0], k_latent).clone()     # (M, K_latent)
    # own-count removal at [m, z_old[m]]: adding -1 (or -0 when not counted) is the same
    # IEEE operation as subtracting 1 (or 0); one scatter per matrix, no gather/put pair
    if counted is None:
        neg_own = torch.full((obs.shape[0], 1), -1.0, dtype=torch.float64, device=counts.device)
    else:
        neg_own = counted.to(torch.float64).neg_().unsqueeze(1)
    zo = z_old.long().unsqueeze(1)                                     # (M, 1)
    num.scatter_add_(1, zo, neg_own)
    den.scatter_add_(1, zo, neg_own)
    return num.div_(den)


def check_range(name: str, t: Tensor, upper: int) -> None:
    """``ValueError`` naming ``name`` and the range found unless every value of a non-empty
    integer tensor ``t`` lies in ``[0, upper)`` (two reads: pass host tensors on a hot path)."""
    lo, hi = (int(v) for v in torch.aminmax(t))
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} must lie in [0, {upper}), got range [{lo}, {hi}]")


def gibbs_posterior(probs: Tensor, observed: Tensor, z_old: Tensor, counts: Tensor,
                    alpha: float | Tensor, *, gamma: float = 1.0, phi: Tensor | None = None,
                    counted: Tensor | None = None) -> Tensor:
    """The normalised Eq. 7 conditional ``(M, K_latent)`` float64; rows sum to 1.

    probs: (M, K_latent) classifier probabilities P(k | x_m) (clipped at 1e-30 before the
        log, so a class the classifier rules out stays reachable only through the prior).
    phi: optional (K_latent, K) warm-up transition replacing the conditional term (Eq. 8
        or a smoothed identity) while ``step < δ``; rows sum to 1.
    gamma: annealing power (1 = off).
    counted: (M,) bool, which samples hold a count in C (default all).
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be (M, K_latent), got {tuple(probs.shape)}")
    m, k_latent = probs.shape
    if counts.ndim != 2 or counts.shape[0] != k_latent:
        raise ValueError(f"probs has {k_latent} latent classes but counts is "
                         f"{tuple(counts.shape)}; they must agree")
    if observed.shape != (m,) or z_old.shape != (m,):
        raise ValueError(f"observed and z_old must be ({m},), got {tuple(observed.shape)}"
                         f" and {tuple(z_old.shape)}")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = counts.shape[1]
    if m:
        # range checks read two values: cheap on host tensors; on an accelerator they would
        # stall the stream, so the labeler passes observed and z_old from the host and they
        # move to the device only after the check
        check_range("observed labels", observed, k)
        check_range("z_old", z_old, k_latent)
    dev = probs.device
    if counts.device != dev:
        raise ValueError(f"probs are on {dev} but counts on {counts.device}; keep the "
                         "replica of C on the device the classifier runs on")
    observed = observed.to(dev, non_blocking=True)
    z_old = z_old.to(dev, non_blocking=True)
    if counted is not None:
        counted = counted.to(dev, non_blocking=True)
    if phi is not None:
        if phi.shape != counts.shape:
            raise ValueError(f"phi must have shape {tuple(counts.shape)}, got {tuple(phi.shape)}")
        cond = phi.to(dev).T[observed.long()].to(torch.float64)       # (M, K_latent), fresh
    else:
        cond = conditional_transition(observed, z_old, counts, alpha, counted=counted)
    # in place on fresh tensors (copy=True: never write into the caller's probs)
    logp = probs.to(torch.float64, copy=True).clamp_min_(1e-30).log_().add_(cond.log_())
    if gamma != 1.0:
        logp = logp * gamma
    return torch.softmax(logp, dim=1)


def gibbs_draw(probs: Tensor, observed: Tensor, z_old: Tensor, counts: Tensor, alpha: Tensor,
               gamma: Tensor, u: Tensor, phi: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The device core of one Gibbs step, with no host read and no data-dependent branch
    (what ``torch.compile`` captures whole, e.g. into one CUDA graph).

    The same arithmetic as :func:`gibbs_posterior` followed by :func:`sample_categorical`
    with the uniforms ``u (M, 1)`` float64 drawn by the caller, every sample counted in C;
    ``gamma`` is a 0-d float64 tensor (multiplying by 1.0 is exact, so no branch is
    needed); ``alpha`` a ``(K,)`` float64 tensor on the device. Inputs must already be
    range-checked (the labeler checks them on the host). Returns the posterior
    ``(M, K_latent)``, ``z_new (M,)`` and the fraction of ``z`` that moved (0-d float32).
    """
    if phi is not None:
        cond = phi.T[observed].to(torch.float64)
    else:
        cond = conditional_transition(observed, z_old, counts, alpha)
    logp = (probs.to(torch.float64).clamp_min(1e-30).log() + cond.log()) * gamma
    post = torch.softmax(logp, dim=1)
    cdf = post.cumsum(1)
    z_new = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp_max(post.shape[1] - 1)
    changed = (z_new != z_old).to(torch.float32).mean()
    return post, z_new, changed


def sample_categorical(p: Tensor, *, generator: torch.Generator) -> Tensor:
    """One draw per row of ``p (M, K)`` (rows sum to 1) by inverse CDF; returns (M,) int64."""
    u = torch.rand(p.shape[0], 1, generator=generator, dtype=p.dtype, device=p.device)
    cdf = p.cumsum(1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp_max(p.shape[1] - 1)


def gibbs_step(probs: Tensor, observed: Tensor, z_old: Tensor, counts: Tensor,
               alpha: float | Tensor, *, generator: torch.Generator, gamma: float = 1.0,
               phi: Tensor | None = None, counted: Tensor | None = None) -> Tensor:
    """Sample new latent labels ``z_new (M,) int64`` for a batch (Eq. 7).

    Arguments as :func:`gibbs_posterior`; ``generator`` is the explicit source of
    randomness (one uniform per sample).
    """
    p = gibbs_posterior(probs, observed, z_old, counts, alpha, gamma=gamma, phi=phi,
                        counted=counted)
    return sample_categorical(p, generator=generator)
