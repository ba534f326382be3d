"""The classic noisy-label baselines the LCCN paper compares with, as losses and layers.

Conventions: ``logits: (M, K)``; ``target: (M,) int64`` observed (noisy) labels;
``T[i, j] = P(observed = j | clean = i)``, rows sum to 1 (the same orientation as LCCN's
``phi[k, j]``). Every loss returns the batch mean (or a ``weight``-ed mean, like
:mod:`pipeline.core.losses`).

- Bootstrapping (Reed et al., "Training deep neural networks on noisy labels with
  bootstrapping", ICLR workshop 2015): :func:`bootstrap_hard_loss`, :func:`bootstrap_soft_loss`.
- Forward correction (Patrini et al., "Making deep neural networks robust to label noise:
  a loss correction approach", CVPR 2017): :func:`forward_loss`, with ``T`` from
  :func:`forward_transition` (anchor points, Eq. 8, or a file read by :func:`load_transition`).
- S-adaptation (Goldberger & Ben-Reuven, "Training deep neural-networks using a noise
  adaptation layer", ICLR 2017): :class:`SAdaptation`.
- T-Revision (Xia et al., "Are anchor points really indispensable in label-noise
  learning?", NeurIPS 2019): :func:`importance_weights`, :func:`reweight_loss`,
  :class:`TRevisionSlack`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.core.losses import soft_cross_entropy
from pipeline.core.warmup import anchor_transition, soft_confusion

# --------------------------------------------------------------------------------------
# Bootstrapping
# --------------------------------------------------------------------------------------


def bootstrap_hard_loss(logits: Tensor, target: Tensor, *, beta: float = 0.8,
                        xi: float = 1e-20, weight: Tensor | None = None) -> Tensor:
    """Hard bootstrapping (Reed et al. 2015, Eq. 7; the paper's default β = 0.8, the mode
    the LCCN paper compares with):

    ``-Σ_k [β · onehot(target)_k + (1 - β) · onehot(argmax_k' q_k')_k] log q_k``,
    ``q = softmax(logits)``: the observed label is mixed with the network's own hard
    prediction (no gradient flows through the argmax). Same ξ-clipping and ``weight`` as
    :func:`pipeline.core.losses.soft_cross_entropy`.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    _check_logits_target(logits, target)
    k = logits.shape[1]
    y = F.one_hot(target.long(), k).to(torch.float32)
    z = F.one_hot(logits.detach().argmax(1), k).to(torch.float32)
    return soft_cross_entropy(logits, beta * y + (1 - beta) * z, xi=xi, weight=weight)


def bootstrap_soft_loss(logits: Tensor, target: Tensor, *, beta: float = 0.95,
                        xi: float = 1e-20, weight: Tensor | None = None) -> Tensor:
    """Soft bootstrapping (Reed et al. 2015, Eq. 6; their β = 0.95):
    ``-Σ_k [β · onehot(target)_k + (1 - β) · q_k] log q_k`` with ``q = softmax(logits)``
    kept in the graph (the ``(1 - β)`` part is an entropy term, as in the paper)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    _check_logits_target(logits, target)
    y = F.one_hot(target.long(), logits.shape[1]).to(torch.float32)
    q = torch.softmax(logits.float(), dim=1)
    return soft_cross_entropy(logits, beta * y + (1 - beta) * q, xi=xi, weight=weight)


# --------------------------------------------------------------------------------------
# Forward correction
# --------------------------------------------------------------------------------------


def noisy_nll(noisy_probs: Tensor, target: Tensor, *, xi: float = 1e-20,
              weight: Tensor | None = None) -> Tensor:
    """``-log clip(noisy_probs[m, target[m]], ξ)`` averaged (or ``weight``-averaged) over
    the batch: the loss on a predicted *noisy*-label distribution. noisy_probs: (M, K)."""
    if not 0 < xi < 0.5:
        raise ValueError(f"xi must lie in (0, 0.5), got {xi}")
    p = noisy_probs.gather(1, target.long().unsqueeze(1)).squeeze(1)
    loss = -torch.log(p.clamp_min(xi))
    if weight is None:
        return loss.mean()
    w = weight.to(loss.dtype)
    return (loss * w).sum() / w.sum().clamp_min(1.0)


def forward_loss(logits: Tensor, target: Tensor, T: Tensor, *, xi: float = 1e-20,
                 weight: Tensor | None = None) -> Tensor:
    """Forward correction (Patrini et al. 2017, Sec. 3.2): the cross-entropy of the
    *noisy* posterior the network implies through ``T``,
    ``-log (softmax(logits) @ T)[target]``, ξ-clipped.

    T: (K, K), ``T[i, j] = P(observed = j | clean = i)``, rows sum to 1; identity gives
    plain cross-entropy. The authors estimate ``T`` from a network first trained with
    cross-entropy (anchor points at the 97th percentile, :func:`forward_transition`), then
    retrain from scratch with this loss.
    """
    _check_logits_target(logits, target)
    k = logits.shape[1]
    if T.shape != (k, k):
        raise ValueError(f"T must be ({k}, {k}) for {k}-class logits, got {tuple(T.shape)}")
    p = torch.softmax(logits.float(), dim=1)
    return noisy_nll(p @ T.to(p), target, xi=xi, weight=weight)


def check_transition(T, num_classes: int, *, source: str = "T", atol: float = 1e-3,
                     latent_rows: int | None = None) -> Tensor:
    """Validate a transition matrix and return it as float64 with rows renormalised.

    T: array-like (K_latent, K), ``K_latent = latent_rows`` (default K); entries finite and
    in [0, 1]; every row sums to 1 within ``atol``. ``source`` names where it came from
    (a file) in the error.
    """
    rows = num_classes if latent_rows is None else latent_rows
    try:
        t = torch.as_tensor(np.asarray(T, dtype=np.float64))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: not a numeric matrix ({e})") from None
    if t.shape != (rows, num_classes):
        raise ValueError(f"{source}: transition must be ({rows}, {num_classes}), got "
                         f"{tuple(t.shape)}")
    bad = (~torch.isfinite(t) | (t < 0) | (t > 1)).nonzero()
    if bad.numel():
        i, j = (int(v) for v in bad[0])
        raise ValueError(f"{source}: entry [{i}, {j}] = {float(t[i, j])} is not a "
                         "probability in [0, 1]")
    s = t.sum(1)
    off = ((s - 1).abs() > atol).nonzero()
    if off.numel():
        i = int(off[0])
        raise ValueError(f"{source}: row {i} sums to {float(s[i]):.6g}, not 1 (tolerance "
                         f"{atol}); rows are P(observed = . | clean = {i})")
    return t / s.unsqueeze(1)


def load_transition(path: str | Path, num_classes: int, *, atol: float = 1e-3) -> Tensor:
    """Read an oracle or externally estimated transition ``T (K, K)`` from a file and
    validate it with :func:`check_transition` (errors name the file).

    Formats by suffix: ``.npy``; ``.json`` (a list of K rows); ``.csv`` (comma-separated)
    or ``.txt`` / ``.tsv`` (whitespace-separated), one row per line, ``#`` comments.
    ``T[i, j] = P(observed = j | clean = i)``: row i is the noise of clean class i.
    Returns (K, K) float64, rows renormalised to sum to exactly 1.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"transition file {p} does not exist")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
        elif suffix == ".json":
            arr = json.loads(p.read_text())
        elif suffix == ".csv":
            arr = np.loadtxt(p, delimiter=",", ndmin=2)
        elif suffix in (".txt", ".tsv"):
            arr = np.loadtxt(p, ndmin=2)
        else:
            raise ValueError(f"transition file {p}: unknown format {suffix!r}; use .npy, "
                             ".json, .csv, .txt or .tsv")
    except ValueError as e:
        if str(e).startswith(f"transition file {p}"):
            raise
        raise ValueError(f"transition file {p}: cannot parse ({e})") from None
    return check_transition(arr, num_classes, source=f"transition file {p}", atol=atol)


def forward_transition(source: str, num_classes: int, *, probs: Tensor | None = None,
                       observed: Tensor | None = None, path: str | Path | None = None,
                       quantile: float = 0.97, reduce=None) -> Tensor:
    """The ``T (K, K)`` for :func:`forward_loss` (and the initial ``T`` of S-adaptation and
    T-Revision), from

    - ``"anchor"``: anchor points of a cross-entropy-trained network's ``probs (N, K)``
      (:func:`pipeline.core.warmup.anchor_transition`; Patrini et al. and Xia et al. take the
      97th percentile, the default ``quantile``);
    - ``"eq8"``: the soft confusion of ``probs`` against the noisy ``observed (N,)`` labels
      (the LCCN paper's Eq. 8, which Goldberger & Ben-Reuven also use to initialise);
    - ``"file"``: an oracle matrix at ``path`` (:func:`load_transition`).

    ``reduce``: an optional sum over workers (all-reduce) of the estimates' partial
    statistics, so every rank of a distributed run gets the same ``T`` from its own share
    of ``probs`` (every rank must call this alike). Returns (K, K) float64, rows sum to 1.
    """
    if source == "anchor":
        if probs is None:
            raise ValueError("the anchor-point estimate needs the network's probs (N, K)")
        return anchor_transition(probs, num_classes, quantile=quantile, reduce=reduce)
    if source == "eq8":
        if probs is None or observed is None:
            raise ValueError("the Eq. 8 estimate needs probs (N, K) and observed (N,)")
        return soft_confusion(probs, observed, num_classes, reduce=reduce)
    if source == "file":
        if path is None:
            raise ValueError("transition source 'file' needs a path")
        return load_transition(path, num_classes)
    raise ValueError(f"unknown transition source {source!r}; use 'anchor', 'eq8' or 'file'")


# --------------------------------------------------------------------------------------
# S-adaptation
# --------------------------------------------------------------------------------------


class SAdaptation(nn.Module):
    """The noise adaptation layer of Goldberger & Ben-Reuven 2017 (their "simple" model):
    a learned ``K x K`` transition ``softmax(W)`` (row-wise) stacked on the classifier,

    ``P(observed = j | x) = Σ_i softmax(logits)_i · softmax(W)[i, j]``,

    trained by back-propagating the noisy-label cross-entropy through both the network
    and ``W``. ``W`` starts at ``log(T0 + eps)`` so ``softmax(W) ≈ T0`` (the authors
    initialise ``T0`` from the pretrained network's confusion against the noisy labels,
    ``eps = 1e-8``). At test time the classifier's own
    ``softmax(logits)`` is the prediction.

    init_transition: (K, K), rows sum to 1 (:func:`check_transition` is applied).
    """

    def __init__(self, init_transition: Tensor, *, eps: float = 1e-8) -> None:
        super().__init__()
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        t0 = check_transition(init_transition, _square(init_transition, "S-adaptation"),
                              source="S-adaptation initial transition")
        self.weight = nn.Parameter(torch.log(t0 + eps).to(torch.float32))

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0]

    def transition(self) -> Tensor:
        """The current transition ``softmax(W, dim=1)``: (K, K), rows sum to 1."""
        return torch.softmax(self.weight, dim=1)

    def forward(self, logits: Tensor) -> Tensor:
        """logits: (M, K) -> (M, K) predicted noisy-label probabilities."""
        if logits.ndim != 2 or logits.shape[1] != self.num_classes:
            raise ValueError(f"logits must be (M, {self.num_classes}), got "
                             f"{tuple(logits.shape)}")
        p = torch.softmax(logits.float(), dim=1)
        return p @ self.transition()

    def loss(self, logits: Tensor, target: Tensor, *, xi: float = 1e-20,
             weight: Tensor | None = None) -> Tensor:
        """The training loss: ``-log P(observed = target | x)``, ξ-clipped."""
        _check_logits_target(logits, target)
        return noisy_nll(self(logits), target, xi=xi, weight=weight)


# --------------------------------------------------------------------------------------
# T-Revision
# --------------------------------------------------------------------------------------


def importance_weights(logits: Tensor, target: Tensor, T: Tensor, *,
                       max_weight: float | None = None) -> Tensor:
    """T-Revision's importance weights ``β = P(Y = y | x) / P(Ỹ = y | x)``: the clean
    posterior of the observed label over its noisy posterior through ``T``,
    ``softmax(logits)[y] / (softmax(logits) @ T)[y]``.

    T: (K, K) (``T_hat + ΔT`` during revision, not renormalised, as the authors' code).
    max_weight: optional upper clip of β; the authors' code does not clip (None).
    Returns (M,) float32 in the graph of both ``logits`` and ``T`` (the caller detaches
    what should not learn). A zero denominator (a column of ``T`` that rules the observed
    label out) is floored at the smallest normal float instead of dividing by 0.
    """
    _check_logits_target(logits, target)
    k = logits.shape[1]
    if T.shape != (k, k):
        raise ValueError(f"T must be ({k}, {k}) for {k}-class logits, got {tuple(T.shape)}")
    p = torch.softmax(logits.float(), dim=1)
    y = target.long().unsqueeze(1)
    clean = p.gather(1, y).squeeze(1)
    noisy = (p @ T.to(p)).gather(1, y).squeeze(1)
    beta = clean / noisy.clamp_min(torch.finfo(noisy.dtype).tiny)
    if max_weight is not None:
        if not max_weight > 0:
            raise ValueError(f"max_weight must be > 0, got {max_weight}")
        beta = beta.clamp_max(max_weight)
    return beta


def reweight_loss(logits: Tensor, target: Tensor, T: Tensor, *,
                  max_weight: float | None = None, detach_weights: bool = True,
                  weight: Tensor | None = None) -> Tensor:
    """Importance-reweighted cross-entropy ``mean_m β_m · CE(logits_m, target_m)`` (with
    ``weight (M,)``: ``Σ_m weight_m β_m CE_m / Σ_m weight_m``, e.g. 0 at padding).

    T-Revision's second stage trains with a fixed ``T_hat`` and *detached* β (the authors'
    ``reweight_loss`` re-wraps β as a fresh leaf); its revision stage keeps β in the graph
    so the slack ``ΔT`` learns through it (:meth:`TRevisionSlack.loss`,
    ``detach_weights=False``). Authors' defaults (CIFAR-10): stage 2 SGD lr 0.01,
    momentum 0.9, weight decay 1e-4, 200 epochs, lr /10 at epochs 40 and 80, batch 128;
    revision Adam lr 5e-7, weight decay 1e-4, 200 epochs; ``T_hat`` from anchor points at
    the 97th percentile of a 20-epoch cross-entropy run.
    """
    beta = importance_weights(logits, target, T, max_weight=max_weight)
    if detach_weights:
        beta = beta.detach()
    ce = F.cross_entropy(logits.float(), target.long(), reduction="none")
    if weight is None:
        return (beta * ce).mean()
    w = weight.to(ce.dtype)
    return (w * beta * ce).sum() / w.sum().clamp_min(1.0)


class TRevisionSlack(nn.Module):
    """T-Revision's learnable slack: ``T = T_hat + ΔT`` with ``ΔT (K, K)`` starting at 0
    (the authors' ``T_revision`` linear layer, ``nn.init.constant_(weight, 0)``), learned
    with the network through the importance weights. ``T_hat`` is a fixed buffer; the sum
    is neither clipped nor renormalised (as the authors' code).

    T_hat: (K, K), rows sum to 1 (:func:`check_transition` is applied).
    """

    def __init__(self, T_hat: Tensor) -> None:
        super().__init__()
        k = _square(T_hat, "T-Revision T_hat")
        self.register_buffer("T_hat", check_transition(T_hat, k, source="T-Revision T_hat")
                             .to(torch.float32))
        self.delta = nn.Parameter(torch.zeros(k, k))

    def transition(self) -> Tensor:
        """``T_hat + ΔT``: (K, K)."""
        return self.T_hat + self.delta

    def loss(self, logits: Tensor, target: Tensor, *,
             max_weight: float | None = None, weight: Tensor | None = None) -> Tensor:
        """The revision-stage loss ``mean_m β_m(T_hat + ΔT) · CE(logits_m, target_m)``
        (``weight``-ed as :func:`reweight_loss`); gradients reach ``ΔT`` (and the
        network) through β."""
        return reweight_loss(logits, target, self.transition(), max_weight=max_weight,
                             detach_weights=False, weight=weight)


# --------------------------------------------------------------------------------------


def _square(T, name: str) -> int:
    shape = tuple(np.shape(T))
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"{name}: the transition must be a square (K, K) matrix, got {shape}")
    return shape[0]


def _check_logits_target(logits: Tensor, target: Tensor) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be (M, K), got {tuple(logits.shape)}")
    m, k = logits.shape
    if target.shape != (m,):
        raise ValueError(f"target must be ({m},), got {tuple(target.shape)}")
    if m:
        lo, hi = (int(v) for v in torch.aminmax(target))
        if lo < 0 or hi >= k:
            raise ValueError(f"target labels must lie in [0, {k}), got range [{lo}, {hi}]")


__all__ = [
    "SAdaptation", "TRevisionSlack", "bootstrap_hard_loss", "bootstrap_soft_loss",
    "check_transition", "forward_loss", "forward_transition", "importance_weights",
    "load_transition", "noisy_nll", "reweight_loss",
]
