"""Collapse monitor: is the Gibbs chain still telling the classes apart?

A chain *collapses* when it drifts into a degenerate state the noise model cannot leave by
itself: latent classes merge or vanish (z no longer separates the classes), or the
classifier trained on its own samples degrades while phi absorbs the damage. The
statistics here are cheap (one pass over z) and pure; the trainers compute them once per
epoch from the store, log them, and hand them to :class:`CollapseMonitor`.

Conventions: ``z (N,) int64`` in ``[0, K_latent)``, ``observed (N,) int64`` in ``[0, K)``,
``phi[k, j] = P(observed = j | latent = k)`` (rows sum to 1).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from pipeline.core.config import MonitorConfig


class ChainCollapsed(RuntimeError):
    """Raised by :meth:`CollapseMonitor.check` when ``MonitorConfig.stop`` is set."""


class CollapseWarning(UserWarning):
    """Emitted by :meth:`CollapseMonitor.check` for a degenerate chain."""


def _entropy(hist: Tensor) -> float:
    p = hist.to(torch.float64)
    p = p / p.sum().clamp_min(1.0)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def chain_health(z: Tensor, observed: Tensor, k_latent: int, num_classes: int, *,
                 counted: Tensor | None = None, phi: Tensor | None = None,
                 phi_init: Tensor | None = None) -> dict[str, float]:
    """Statistics of the chain state over the counted samples.

    Returns ``latent_entropy`` (entropy of the latent-class histogram over the first K
    latent classes, in nats, divided by that of the observed-label histogram: 1 when z is
    spread like the labels, lower when classes merge), ``latent_min_share`` (the smallest
    of the first K latent classes relative to the smallest observed class; 0 = a class
    vanished), ``z_agreement`` (fraction with z = observed), ``outlier_share`` (fraction in
    the outlier row, 0 without one) and, when both are given, ``phi_drift`` (mean absolute
    difference between phi and phi_init).
    """
    if counted is not None:
        z, observed = z[counted], observed[counted]
    zh = torch.bincount(z.long(), minlength=k_latent)
    oh = torch.bincount(observed.long(), minlength=num_classes)
    h_obs = _entropy(oh)
    out = {
        "latent_entropy": _entropy(zh[:num_classes]) / h_obs if h_obs > 0 else float("nan"),
        "latent_min_share": float(zh[:num_classes].min()) / max(float(oh[oh > 0].min()), 1.0)
        if oh.any() else float("nan"),
        "z_agreement": float((z == observed).double().mean()) if z.numel() else float("nan"),
        "outlier_share": float(zh[num_classes:].sum()) / max(z.numel(), 1),
    }
    if phi is not None and phi_init is not None:
        out["phi_drift"] = float((phi.to(torch.float64) - phi_init.to(torch.float64))
                                 .abs().mean())
    return out


def noise_floor(phi: Tensor, latent_hist: Tensor) -> float:
    """H(observed | clean) in nats of a transition ``phi`` (rows: latent classes; only the
    first ``len(latent_hist)`` are read) under the class shares ``latent_hist``: the lowest
    mean loss on the observed labels of a classifier that knows each image's clean class
    and nothing of its label's noise. A classifier whose loss on the observed labels (the
    epoch rows' ``observed_loss``) falls below it fits labels it cannot know without
    memorising them."""
    k = latent_hist.numel()
    t = phi[:k].to(torch.float64)
    t = t / t.sum(1, keepdim=True).clamp_min(1e-300)
    pi = latent_hist.to(torch.float64)
    pi = pi / pi.sum().clamp_min(1.0)
    rows = -(t * torch.where(t > 0, t, torch.ones_like(t)).log()).sum(1)
    return float((pi * rows).sum())


def _watched(history: Sequence[Mapping[str, float]], first_epoch: int
             ) -> Iterator[Mapping[str, float]]:
    """The rows a memorisation trigger watches: from ``first_epoch`` on, those whose
    learning rate is below that of the first such row (at the phase's first rate the
    held-out figures swing from one epoch to the next with no trend)."""
    lr0: float | None = None
    for r in history:
        if int(r.get("epoch", -1)) < first_epoch:
            continue
        lr = float(r.get("lr", math.nan))
        if lr0 is None:
            lr0 = lr
        if lr < lr0 * (1 - 1e-6):
            yield r


def memorisation_epoch(history: Sequence[Mapping[str, float]], *, first_epoch: int,
                       drop: float, patience: int) -> int | None:
    """The epoch at whose end the noisy validation accuracy says the classifier is
    memorising its labels (:attr:`LCCNConfig.guard_drop`), or None.

    ``history``: the epoch rows in order (``epoch``, ``lr``, ``val_top1``). Watched: the
    rows from ``first_epoch`` on whose learning rate is below that of the row of
    ``first_epoch`` (at the phase's first rate the accuracy swings by several points from
    one epoch to the next). The answer is the first watched epoch that ends the
    ``patience``-th consecutive watched epoch more than ``drop`` below the best
    ``val_top1`` of the watched epochs before it. NaN accuracies (no validation split)
    never count."""
    best, below = -math.inf, 0
    for r in _watched(history, first_epoch):
        val = float(r.get("val_top1", math.nan))
        if math.isnan(val):
            below = 0
            continue
        if val < best - drop:
            below += 1
            if below >= patience:
                return int(r["epoch"])
        else:
            below = 0
        best = max(best, val)
    return None


def overfit_epoch(history: Sequence[Mapping[str, float]], *, first_epoch: int,
                  rise: float) -> int | None:
    """The first epoch at whose end the classifier fits its training labels beyond what holds
    on held-out images (:attr:`LCCNConfig.guard_rise`), or None.

    ``history``: the epoch rows in order (``epoch``, ``lr``, ``val_observed_loss``: the
    held-out loss of the observed labels, ``observed_loss``: the training pass's,
    ``label_entropy``: the entropy of the observed labels' class shares, in nats, the loss
    of a classifier that knows nothing of the image). Watched: the rows from
    ``first_epoch`` on whose learning rate is below that of the row of ``first_epoch`` (at
    the phase's first rate the held-out loss swings by tens of percent from one epoch to
    the next, with no trend). The answer is the first watched epoch whose held-out loss
    is above the lowest of the watched epochs before it while the gap between its held-out
    and its training loss has widened by more than ``rise x label_entropy`` since that
    lowest epoch: the fit of the training labels improves and the fit of labels from the
    same distribution on images never trained on does not, so what is learned is the
    training images' own labels. No estimate of the noise enters. NaN losses (no
    validation split) never count."""
    low: tuple[float, float] | None = None  # (held-out, training) loss at the lowest held-out
    for r in _watched(history, first_epoch):
        held, fit = float(r.get("val_observed_loss", math.nan)), float(r.get("observed_loss",
                                                                           math.nan))
        scale = float(r.get("label_entropy", math.nan))
        if math.isnan(held):
            continue
        if low is not None and held > low[0] and \
                (held - fit) - (low[0] - low[1]) > rise * scale:  # NaN: False
            return int(r["epoch"])
        if low is None or held < low[0]:
            low = (held, fit)
    return None


def warmup_rise(history: Sequence[Mapping[str, float]], n_val: int, *,
                window: int = 2) -> tuple[float, float]:
    """``(rise, se)`` of the epoch rows so far: how far the best noisy validation accuracy
    (``val_top1``) of the last ``window`` rows lies above the best of the rows before them,
    and one standard error of that accuracy, sqrt(a(1 - a) / n_val) at the best accuracy
    a. NaN for both with fewer than ``window + 1`` rows or without a validation split."""
    vals = [float(r.get("val_top1", math.nan)) for r in history]
    if len(vals) <= window or n_val <= 0 or any(math.isnan(v) for v in vals):
        return math.nan, math.nan
    best = max(vals)
    return (max(vals[-window:]) - max(vals[:-window]),
            math.sqrt(max(best * (1 - best), 1e-12) / n_val))


def warmup_fall(history: Sequence[Mapping[str, float]], n_val: int) -> tuple[float, float, int]:
    """``(fall, se, best)`` of the warm-up's epoch rows: how far the last row's noisy
    validation accuracy (``val_top1``) lies below the best row's, one standard error of
    that accuracy (as :func:`warmup_rise`) and the best row's index. NaN, NaN, -1 without
    rows or a validation split. A warm-up that ends well below its best hands the noise
    phase a classifier on a swing down (a high learning rate's oscillation), from which
    the transition and the latent labels start."""
    vals = [float(r.get("val_top1", math.nan)) for r in history]
    if not vals or n_val <= 0 or any(math.isnan(v) for v in vals):
        return math.nan, math.nan, -1
    best = max(range(len(vals)), key=vals.__getitem__)
    return (vals[best] - vals[-1],
            math.sqrt(max(vals[best] * (1 - vals[best]), 1e-12) / n_val), best)


def warmup_end_epoch(history: Sequence[Mapping[str, float]], *, n_val: int, cap: int,
                     window: int = 2) -> int | None:
    """The epoch at which an automatic cross-entropy warm-up
    (:attr:`~pipeline.core.config.OptimConfig.pretrain_auto`) ends: the first ``e`` from
    ``window + 1`` on before which the noisy validation accuracy stopped rising (the best of
    rows ``e - window .. e - 1`` above the best of rows ``0 .. e - window - 1`` by less than
    one standard error, :func:`warmup_rise`), at the latest ``cap``; None while neither has
    happened in ``history`` (the rows of epochs 0, 1, ... in order). Without a validation
    split it is ``cap``. A pure function of the rows: a resumed run and every rank find the
    same epoch."""
    rows = [r for r in history if int(r.get("epoch", -1)) < cap]
    for e in range(window + 1, len(rows) + 1):
        rise, se = warmup_rise(rows[:e], n_val, window=window)
        if rise < se:  # False for NaN
            return e
    return cap if len(history) >= cap else None


def label_entropy(shares: Tensor) -> float:
    """The entropy in nats of the class shares ``shares (K,)`` (counts or probabilities):
    the loss of a classifier that predicts those shares for every image."""
    return _entropy(shares)


def floor_epoch(history: Sequence[Mapping[str, float]], *, first_epoch: int) -> int | None:
    """The first epoch from ``first_epoch`` on whose row has the classifier's loss on the
    observed labels below the label noise's entropy (``observed_loss < noise_floor``,
    :attr:`LCCNConfig.guard_floor`), or None: it fits labels it cannot know without
    memorising them."""
    for r in history:
        if int(r.get("epoch", -1)) < first_epoch:
            continue
        fit, floor = float(r.get("observed_loss", math.nan)), float(r.get("noise_floor",
                                                                          math.nan))
        if fit < floor:  # False for NaN
            return int(r["epoch"])
    return None


class CollapseMonitor:
    """Checks the per-epoch health of an LCCN run against :class:`MonitorConfig`.

    ``start(val_top1, lr=)`` records the noisy validation accuracy when LCCN starts (NaN
    without a validation split) and the learning rate the starting network was last
    trained at (None: unknown); ``check(health, val_top1, lr=)`` returns the list of
    reasons the chain looks collapsed (empty when healthy), warns with
    :class:`CollapseWarning` and, with ``stop``, raises :class:`ChainCollapsed`.

    The validation check compares like with like: it runs only in epochs whose learning
    rate is at most the starting network's. A run that restarts the schedule from a
    finished one (the paper's CIFAR protocol, ``--init-from``) begins at a far higher rate
    than the one its start was trained at, and any method, CE included, loses accuracy
    there for a while; the check waits until the schedule is back at the start's rate. A
    run that switches to LCCN part way through one schedule goes on at the same rate, so
    there it checks from the first LCCN epoch on.
    """

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.val_start = float("nan")
        self.lr_start: float | None = None
        self.fired = 0

    def start(self, val_top1: float, *, lr: float | None = None) -> None:
        self.val_start = float(val_top1)
        self.lr_start = None if lr is None else float(lr)

    def compares(self, lr: float | None) -> bool:
        """Whether the validation check runs in an epoch at learning rate ``lr``."""
        return self.lr_start is None or lr is None or lr <= self.lr_start * (1 + 1e-6)

    def state_dict(self) -> dict[str, float | None]:
        return {"monitor_val_start": self.val_start, "monitor_lr_start": self.lr_start}

    def load_state_dict(self, state: dict) -> None:
        """From a method's checkpoint state (older ones hold only the accuracy)."""
        self.val_start = float(state.get("monitor_val_start", math.nan))
        lr = state.get("monitor_lr_start")
        self.lr_start = None if lr is None else float(lr)

    def reasons(self, health: dict[str, float], val_top1: float = float("nan"), *,
                lr: float | None = None) -> list[str]:
        c, out = self.cfg, []
        ent = health.get("latent_entropy", float("nan"))
        if ent < c.entropy_floor:
            out.append(f"latent classes merging: latent-histogram entropy {ent:.3f} of the "
                       f"observed labels' (floor {c.entropy_floor})")
        share = health.get("latent_min_share", float("nan"))
        if share < c.vanish_floor:
            out.append(f"a latent class vanishing: the smallest holds {share:.3f} of the "
                       f"smallest observed class (floor {c.vanish_floor})")
        if not math.isnan(self.val_start) and not math.isnan(val_top1) \
                and self.compares(lr) and val_top1 < self.val_start - c.val_drop:
            out.append(f"classifier degrading: noisy validation accuracy {val_top1:.4f}, "
                       f"{self.val_start:.4f} when LCCN started (allowed drop {c.val_drop})")
        return out

    def check(self, health: dict[str, float], val_top1: float = float("nan"), *,
              epoch: int | None = None, lr: float | None = None,
              stop: bool | None = None) -> list[str]:
        """``lr``: the learning rate of the epoch checked (see :meth:`compares`); ``stop``
        overrides ``MonitorConfig.stop`` (a distributed run warns here and stops every
        rank together itself)."""
        found = self.reasons(health, val_top1, lr=lr)
        if found:
            self.fired += 1
            where = f" at epoch {epoch}" if epoch is not None else ""
            msg = f"LCCN chain collapse suspected{where}: " + "; ".join(found)
            if self.cfg.stop if stop is None else stop:
                raise ChainCollapsed(msg)
            warnings.warn(msg, CollapseWarning, stacklevel=2)
        return found
