"""Confusion counts C between latent and observed labels, and the transition they define.

Conventions (docs/design.md):

- ``C[k, j]``: number of samples whose current latent label is ``k`` and observed label is
  ``j``. Shape ``(K_latent, K)``; ``K_latent = K`` (LCCN) or ``K + 1`` (LCCN*, last row =
  outlier). int64.
- ``phi[k, j] = P(observed = j | latent = k)``; rows sum to 1.

All functions are pure tensor maps except :func:`apply_delta_` and :func:`apply_moves_host`,
which update ``C`` in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

try:  # compiled host kernels for the CPU path (optional: the torch path serves without)
    import numba
except ImportError:
    numba = None


def as_alpha(alpha: float | Tensor | list, num_classes: int, *, k_latent: int | None = None,
             dtype=torch.float64) -> Tensor:
    """The Dirichlet parameter as a ``(K,)`` vector over observed labels (one prior for
    every latent row), or, given ``k_latent``, a ``(K_latent, K)`` matrix passed through
    as it is (a prior per latent row); every entry > 0."""
    a = torch.as_tensor(alpha, dtype=dtype)
    if a.ndim == 0:
        a = a.expand(num_classes).clone()
    if a.shape != (num_classes,) and (k_latent is None or a.shape != (k_latent, num_classes)):
        shapes = f"({num_classes},)" + ("" if k_latent is None
                                       else f" or ({k_latent}, {num_classes})")
        raise ValueError(f"alpha must be a scalar or have shape {shapes}, got {tuple(a.shape)}")
    if not torch.isfinite(a).all() or (a <= 0).any():
        raise ValueError(f"alpha must be finite and > 0, got {a.tolist()}")
    return a


def _check_labels(name: str, labels: Tensor, upper: int) -> None:
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor, got {labels.dtype}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= upper):
        bad = labels[(labels < 0) | (labels >= upper)][0]
        raise ValueError(f"{name} contains {int(bad)}, outside [0, {upper})")


def count_matrix(latent: Tensor, observed: Tensor, k_latent: int, num_classes: int, *,
                 counted: Tensor | None = None) -> Tensor:
    """Recount ``C`` from an assignment table.

    latent: (N,) int64 in [0, k_latent); observed: (N,) int64 in [0, num_classes);
    counted: (N,) bool or None (all). Returns C: (k_latent, num_classes) int64.
    """
    if latent.shape != observed.shape or latent.ndim != 1:
        raise ValueError(f"latent and observed must both be (N,), got {tuple(latent.shape)}"
                         f" and {tuple(observed.shape)}")
    _check_labels("latent", latent, k_latent)
    _check_labels("observed", observed, num_classes)
    if counted is not None:
        latent, observed = latent[counted], observed[counted]
    flat = latent.long() * num_classes + observed.long()
    return torch.bincount(flat, minlength=k_latent * num_classes).view(k_latent, num_classes)


def apply_delta_(counts: Tensor, observed: Tensor, z_old: Tensor, z_new: Tensor) -> Tensor:
    """Move each sample's count from ``[z_old, j]`` to ``[z_new, j]`` in place (j = observed).

    counts: (K_latent, K) int64; observed, z_old, z_new: (M,) int64. Samples not counted in
    C must be filtered out by the caller. Returns ``counts``.
    """
    k = counts.shape[1]
    flat = counts.view(-1)
    dev = counts.device  # a replica on an accelerator takes host deltas
    observed, z_old, z_new = (t.to(dev, non_blocking=True) for t in (observed, z_old, z_new))
    ones = torch.ones_like(observed, dtype=counts.dtype)
    flat.index_add_(0, z_old.long() * k + observed.long(), -ones)
    flat.index_add_(0, z_new.long() * k + observed.long(), ones)
    return counts


def _moves_kernel(idx, z_new, counted, z, observed, counts, out):
    """Own moves of one batch: ``z[idx] = z_new`` for counted samples, each count moved
    from ``[z_old, j]`` to ``[z_new, j]``, and the moves written to ``out (3, B)`` as
    (observed, z_old, z_new). Returns how many moved, or -1 (idx) / -2 (z_new) on an
    out-of-range value, before anything is written for that sample."""
    n = z.shape[0]
    k_latent = counts.shape[0]
    moved = 0
    for t in range(idx.shape[0]):
        i = idx[t]
        if i < 0 or i >= n:
            return -1
        if not counted[i]:
            continue
        new = z_new[t]
        if new < 0 or new >= k_latent:
            return -2
        old = z[i]
        if old != new:
            j = observed[i]
            counts[old, j] -= 1
            counts[new, j] += 1
            out[0, moved] = j
            out[1, moved] = old
            out[2, moved] = new
            moved += 1
            z[i] = new
    return moved


if numba is not None:
    _moves_kernel = numba.njit(cache=True, nogil=True)(_moves_kernel)


def apply_moves_host(counts: Tensor, z: Tensor, observed: Tensor, counted: Tensor, idx: Tensor,
                     z_new: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """Apply one worker's own moves to CPU tensors in place, in one compiled call: for each
    counted sample ``i = idx[t]``, move its count from ``[z[i], observed[i]]`` to
    ``[z_new[t], observed[i]]`` and set ``z[i] = z_new[t]``.

    counts (K_latent, K) int64; z, observed (N,) int64; counted (N,) bool; idx, z_new (B,)
    int64. Returns the moves ``(observed, z_old, z_new)`` (the form :func:`apply_delta_`
    takes), or None when nothing moved. ``ValueError`` naming the value on an out-of-range
    index or label (samples before it are already applied).
    """
    if numba is None:
        raise RuntimeError("apply_moves_host needs numba (pip install numba)")
    out = np.empty((3, idx.shape[0]), dtype=np.int64)
    moved = _moves_kernel(idx.numpy(), z_new.numpy(), counted.numpy(), z.numpy(),
                          observed.numpy(), counts.numpy(), out)
    if moved == -1:
        bad = idx[(idx < 0) | (idx >= z.shape[0])][0]
        raise ValueError(f"sample index {int(bad)} outside [0, {z.shape[0]})")
    if moved == -2:
        bad = z_new[(z_new < 0) | (z_new >= counts.shape[0])][0]
        raise ValueError(f"latent label {int(bad)} outside [0, {counts.shape[0]})")
    if moved == 0:
        return None
    moves = torch.from_numpy(out[:, :moved])
    return moves[0], moves[1], moves[2]


def transition(counts: Tensor, alpha: float | Tensor = 0.0) -> Tensor:
    """``phi[k, j] = (C[k, j] + alpha_j) / sum_j' (C[k, j'] + alpha_j')``; rows sum to 1.

    counts: (K_latent, K); alpha: scalar, (K,) or (K_latent, K) (``alpha_kj``), may be 0
    here (rows with no count and alpha = 0 come out uniform). Returns float64 (K_latent, K).
    """
    c = counts.to(torch.float64)
    a = torch.as_tensor(alpha, dtype=torch.float64)
    num = c + a
    den = num.sum(1, keepdim=True)
    uniform = torch.full_like(num, 1.0 / num.shape[1])
    return torch.where(den > 0, num / den.clamp_min(1e-300), uniform)


def check_invariants(counts: Tensor, latent: Tensor, observed: Tensor, *,
                     counted: Tensor | None = None) -> None:
    """Raise ``AssertionError`` naming the broken invariant (docs/design.md).

    1. C >= 0 and C.sum() equals the number of counted samples;
    2. column sums of C equal the histogram of observed labels over counted samples;
    3. C equals the recount from the assignment table.
    """
    k_latent, k = counts.shape
    if (counts < 0).any():
        at = (counts < 0).nonzero()[0].tolist()
        raise AssertionError(f"invariant 1: C has a negative entry at {at}")
    n = int(latent.numel() if counted is None else counted.sum())
    if int(counts.sum()) != n:
        raise AssertionError(f"invariant 1: C.sum() = {int(counts.sum())} != {n} counted samples")
    obs = observed if counted is None else observed[counted]
    hist = torch.bincount(obs.long(), minlength=k)
    if not torch.equal(counts.sum(0), hist):
        raise AssertionError("invariant 2: column sums of C differ from the observed histogram")
    recount = count_matrix(latent, observed, k_latent, k, counted=counted)
    if not torch.equal(counts, recount):
        diff = (counts != recount).nonzero()[0].tolist()
        raise AssertionError(f"invariant 3: C differs from the recount of z first at {diff}")


def theorem3_bound(counts_old: Tensor, counts_new: Tensor, alpha: float | Tensor) -> Tensor:
    """Theorem 3's bound on ``|phi_i^new - phi_i^old|_1`` per latent row i.

    With O_i = row sum before, T_i = net change of row i, T^_i = sum of |changes| of row i
    (allocations in plus removals out), r_i = T_i / (O_i + sum alpha), r^_i = T^_i / (...):
    bound_i = (|r_i| + r^_i) / (1 + r_i). Returns (K_latent,) float64.
    """
    k = counts_old.shape[1]
    a = as_alpha(alpha, k)
    o = counts_old.sum(1).to(torch.float64)
    d = (counts_new - counts_old).to(torch.float64)
    t = d.sum(1)
    t_hat = d.abs().sum(1)
    s = o + a.sum()
    r, r_hat = t / s, t_hat / s
    return (r.abs() + r_hat) / (1 + r)



def transition_error(phi: Tensor, truth: Any) -> float:
    """Mean |phi - truth| over the rows both have (the first K when one of them carries an
    outlier row); NaN without a truth."""
    if truth is None:
        return float("nan")
    t = torch.as_tensor(np.asarray(truth), dtype=torch.float64)
    rows = min(phi.shape[0], t.shape[0])
    return float((phi[:rows].to(torch.float64) - t[:rows]).abs().mean())
