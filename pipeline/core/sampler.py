"""One Gibbs step of LCCN (Eq. 7 of the paper), vectorised over a batch.

For sample m with observed label j = ỹ_m and current latent label z_old_m::

    C¬ = C with one count removed at [z_old_m, j]              (its own count only)
    p(k) ∝ [ P(k | x_m) · (α_j + C¬[k, j]) / Σ_j' (α_j' + C¬[k, j']) ] ^ γ

Shapes: ``probs (M, K_latent)``, ``observed (M,) int64 in [0, K)``, ``z_old (M,) int64``,
``counts (K_latent, K)``, ``alpha`` scalar, ``(K,)`` or ``(K_latent, K)`` (a prior per latent
row, ``α_kj`` in place of ``α_j``). ``phi[k, j] = P(observed=j | latent=k)``.
The own-count removal applies only to samples currently counted in C (``counted``);
LCCN+'s trusted samples are never counted and never sampled.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from pipeline.core.confusion import as_alpha


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
    ``[z_old[m], j]`` when ``counted[m]`` (default: all counted). ``alpha``: scalar, ``(K,)``
    (one Dirichlet prior for every latent row, the paper's) or ``(K_latent, K)`` (a prior
    per row: ``α_kj`` in place of ``α_j``).
    """
    k_latent, k = counts.shape
    if (isinstance(alpha, Tensor) and alpha.device == counts.device
            and alpha.shape in ((k,), (k_latent, k))
            and alpha.dtype == torch.float64 and alpha.device.type != "cpu"):
        a = alpha  # a device copy the labeler validated once (as_alpha's checks would sync)
    else:
        a = as_alpha(alpha, k, k_latent=k_latent).to(counts.device)
    obs = observed.long()
    # Gather the M needed columns before converting (rows of C^T: a contiguous (M, K_latent)
    # result), and sum integer counts as integers: O(K_latent * M) float64 work instead of
    # converting all of C (O(K^2), 8 MB at K=1000). The values are identical: integer sums
    # below 2**53 are exact in float64 in any order.
    num = counts.T[obs].to(torch.float64)                             # (M, K_latent)
    rows = (counts.to(torch.float64).sum(1) if counts.is_floating_point()
            else counts.sum(1).to(torch.float64))                      # (K_latent,)
    if a.ndim == 2:  # a Dirichlet parameter per latent row (LCCNConfig.prior_strength)
        num = num + a.T[obs]
        den = (rows + a.sum(1)).expand(obs.shape[0], k_latent).clone()
    else:
        num = num + a[obs].unsqueeze(1)
        den = (rows + a.sum()).expand(obs.shape[0], k_latent).clone()  # (M, K_latent)
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
        phi = phi.to(dev)
    return _eq7(probs, observed.long(), z_old.long(), counts, alpha, gamma, phi, counted)


def _eq7(probs: Tensor, observed: Tensor, z_old: Tensor, counts: Tensor,
         alpha: float | Tensor, gamma: float | Tensor, phi: Tensor | None,
         counted: Tensor | None) -> Tensor:
    """The arithmetic of Eq. 7 shared by :func:`gibbs_posterior` (checked inputs) and
    :func:`gibbs_draw` (compiled whole): no host read, no data-dependent branch. The
    numba kernel :func:`_draw_kernel` is the same arithmetic in scalar code."""
    if phi is not None:
        cond = phi.T[observed].to(torch.float64)    # (M, K_latent), fresh (a gather)
    else:
        cond = conditional_transition(observed, z_old, counts, alpha, counted=counted)
    # in place on fresh tensors (copy=True: never write into the caller's probs); a tensor
    # gamma (the compiled path) multiplies unconditionally, by 1.0 exactly when off; the
    # float 1.0 of an unannealed host step skips the pass
    logp = probs.to(torch.float64, copy=True).clamp_min_(1e-30).log_().add_(cond.log_())
    if isinstance(gamma, Tensor) or gamma != 1.0:
        logp.mul_(gamma)
    return torch.softmax(logp, dim=1)


def gibbs_draw(probs: Tensor, observed: Tensor, z_old: Tensor, counts: Tensor, alpha: Tensor,
               gamma: Tensor, u: Tensor, phi: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The device core of one Gibbs step, with no host read and no data-dependent branch
    (what ``torch.compile`` captures whole, e.g. into one CUDA graph).

    The same arithmetic as :func:`gibbs_posterior` followed by :func:`sample_categorical`
    with the uniforms ``u (M, 1)`` float64 drawn by the caller, every sample counted in C;
    ``gamma`` is a 0-d float64 tensor (multiplying by 1.0 is exact, so no branch is
    needed); ``alpha`` a ``(K,)`` or ``(K_latent, K)`` float64 tensor on the device. Inputs must already be
    range-checked (the labeler checks them on the host). Returns the posterior
    ``(M, K_latent)``, ``z_new (M,)`` and the fraction of ``z`` that moved (0-d float32).
    """
    post = _eq7(probs, observed, z_old, counts, alpha, gamma, phi, None)
    cdf = post.cumsum(1)
    z_new = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp_max(post.shape[1] - 1)
    changed = (z_new != z_old).to(torch.float32).mean()
    return post, z_new, changed


HOST_MAX_LATENT = 64
"""Largest ``K_latent`` the host kernel takes: it computes one ``log`` and one ``exp`` per
entry in scalar code, which beats torch's vectorised ones only while the batch is small
(the fixed cost of each torch call dominates up to about this size on one core)."""

try:  # the CPU fast path of the labeler: one compiled call per batch
    import numba
except ImportError:  # an accelerator image without it: the torch path serves
    numba = None


def _draw_kernel(probs, observed, z_old, counts, alpha, u, gamma, phi, counted, post, z_new):
    """Eq. 7 and the inverse-CDF draw for each row, in the order of :func:`gibbs_posterior`
    and :func:`sample_categorical`. ``phi`` (0, 0) = no warm-up transition; ``counted``
    of length 0 = every sample counted. Writes ``post`` and ``z_new``; returns how many
    labels moved, or -1 (observed) / -2 (z_old) on an out-of-range label."""
    m, k_latent = probs.shape
    k = counts.shape[1]
    use_phi = phi.shape[0] > 0
    den_row = np.empty(k_latent)
    for r in range(k_latent):
        c = 0
        a_sum = 0.0
        for j in range(k):
            c += counts[r, j]
            a_sum += alpha[r, j]
        den_row[r] = c + a_sum
    moved = 0
    for i in range(m):
        j = observed[i]
        zo = z_old[i]
        if j < 0 or j >= k:
            return -1
        if zo < 0 or zo >= k_latent:
            return -2
        own = 1.0 if counted.shape[0] == 0 or counted[i] else 0.0
        top = -np.inf
        for r in range(k_latent):
            if use_phi:
                cond = phi[r, j]
            else:
                num = counts[r, j] + alpha[r, j]
                den = den_row[r]
                if r == zo:
                    num -= own
                    den -= own
                cond = num / den
            lp = (math.log(max(probs[i, r], 1e-30)) + math.log(cond)) * gamma
            post[i, r] = lp
            top = max(top, lp)
        total = 0.0
        for r in range(k_latent):
            e = math.exp(post[i, r] - top)
            post[i, r] = e
            total += e
        last = 0.0
        for r in range(k_latent):
            post[i, r] /= total
            last += post[i, r]
        v = u[i] * last
        cdf = 0.0
        z = k_latent - 1
        for r in range(k_latent):
            cdf += post[i, r]
            if cdf >= v:
                z = r
                break
        z_new[i] = z
        moved += z != zo
    return moved


if numba is not None:
    _draw_kernel = numba.njit(cache=True, nogil=True)(_draw_kernel)

_NO_PHI = np.zeros((0, 0))
_ALL_COUNTED = np.zeros(0, dtype=np.bool_)


def gibbs_draw_host(probs: np.ndarray, observed: np.ndarray, z_old: np.ndarray,
                    counts: np.ndarray, alpha: np.ndarray, u: np.ndarray, *, gamma: float = 1.0,
                    phi: np.ndarray | None = None, counted: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, int]:
    """One Gibbs step on host arrays in one compiled call (numba): the labeler's CPU path.

    A step on a small CPU model pays a fixed cost per array call (cold caches right after
    the backward pass, 15-40 µs each), not for arithmetic, so the ~30 calls of
    :func:`gibbs_posterior` + :func:`sample_categorical` become one. The same arithmetic,
    with the uniforms ``u (M,)`` float64 drawn by the caller from the same generator stream;
    the posterior agrees with :func:`gibbs_posterior` to rounding (libm's ``exp``/``log``
    against torch's), so a draw can differ only when a uniform lands within an ulp of a
    CDF boundary. Labels are range-checked.

    probs (M, K_latent) float; observed, z_old (M,) int64; counts (K_latent, K) int64; alpha
    (K,) or (K_latent, K) float64 validated by the caller (> 0, finite); phi (K_latent, K) float64 warm-up
    transition; counted (M,) bool. Returns the posterior ``(M, K_latent)`` float64,
    ``z_new (M,)`` int64 and the number of labels that moved.
    """
    if numba is None:
        raise RuntimeError("gibbs_draw_host needs numba (pip install numba)")
    m, k_latent = probs.shape
    post = np.empty((m, k_latent))
    z_new = np.empty(m, dtype=np.int64)
    if alpha.ndim == 1:  # the kernel reads a prior per latent row
        alpha = np.ascontiguousarray(np.broadcast_to(alpha, (k_latent, alpha.shape[0])))
    moved = _draw_kernel(probs, observed, z_old, counts, alpha, u, float(gamma),
                         _NO_PHI if phi is None else phi,
                         _ALL_COUNTED if counted is None else counted, post, z_new)
    if moved == -1:
        check_range("observed labels", torch.from_numpy(observed), counts.shape[1])
    if moved == -2:
        check_range("z_old", torch.from_numpy(z_old), k_latent)
    return post, z_new, int(moved)


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
