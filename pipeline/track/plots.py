"""Pure plotting functions for run tracking: each returns a matplotlib ``Figure`` and never
saves, logs or shows it (the caller does, then closes it).

Figures are built on ``matplotlib.figure.Figure`` with an Agg canvas attached, never through
pyplot: no global figure registry (nothing to leak or close across epochs), no backend
switch, safe in threads and Ray workers.

Conventions: ``phi[k, j] = P(observed = j | latent = k)``; rows (latent, axis 0) sum to 1,
columns (axis 1) are observed labels. ``phi`` is ``(K_latent, K)`` with ``K_latent = K + 1``
for LCCN* (last row = outlier).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

__all__ = ["accuracy_vs", "as_matrix", "curves", "latent_names", "transition_heatmap"]

MAX_TICK_LABELS = 30        # above this many classes, tick labels are left off
LOG_FLOOR = 1e-3            # smallest probability shown on the log colour scale


def as_matrix(phi, *, name: str = "phi") -> np.ndarray:
    """``phi`` (tensor or array-like) as a 2-D float64 numpy array; raises on other ranks
    or non-finite entries."""
    if hasattr(phi, "detach"):
        phi = phi.detach().cpu().numpy()
    m = np.asarray(phi, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"{name} must be a (K_latent, K) matrix, got shape {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError(f"{name} has non-finite entries")
    return m


def latent_names(k_latent: int, class_names: Sequence[str] | None, num_classes: int) -> list[str]:
    """Row (latent) names: the class names, plus ``"outlier"`` for LCCN*'s extra row.
    Without class names, the class numbers ``"0" .. "K-1"`` (and ``"outlier"``)."""
    if class_names is None:
        return [str(i) for i in range(num_classes)] + (
            ["outlier"] if k_latent == num_classes + 1 else
            [str(i) for i in range(num_classes, k_latent)])
    names = [str(c) for c in class_names]
    if len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for a matrix with {num_classes} columns")
    if k_latent == num_classes + 1:
        return names + ["outlier"]
    if k_latent != num_classes:
        raise ValueError(f"phi has {k_latent} rows and {num_classes} columns: expected "
                         f"K_latent = K or K + 1")
    return names


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _panel(fig: Figure, ax, m: np.ndarray, *, title: str, rows: list[str], cols: list[str],
           log_scale: bool, annotate: bool) -> None:
    if log_scale:
        norm = LogNorm(vmin=LOG_FLOOR, vmax=1.0)
        shown = np.clip(m, LOG_FLOOR, 1.0)
    else:
        norm = Normalize(vmin=0.0, vmax=max(1.0, float(m.max())))
        shown = m
    im = ax.imshow(shown, cmap="viridis", norm=norm, interpolation="nearest", aspect="auto")
    ax.set_title(title)
    ax.set_xlabel("observed label j")
    ax.set_ylabel("latent label k")
    if len(cols) <= MAX_TICK_LABELS:
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    if len(rows) <= MAX_TICK_LABELS:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
    if annotate:
        for k in range(m.shape[0]):
            for j in range(m.shape[1]):
                v = m[k, j]
                if v >= 0.005:
                    ax.text(j, k, f"{v:.2f}", ha="center", va="center", fontsize=6,
                            color="black" if v > 0.5 else "white")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)


def transition_heatmap(phi, *, truth=None, class_names: Sequence[str] | None = None,
                       log_scale: bool = False, title: str = "learned phi",
                       annotate: bool | None = None) -> Figure:
    """Heat map of a transition matrix, with the true one beside it when given.

    phi: (K_latent, K) rows sum to 1 (``phi[k, j] = P(observed=j | latent=k)``).
    truth: (K, K) or (K_latent, K) true transition, or None. A (K, K) truth next to an
        LCCN* phi is drawn without the outlier row.
    log_scale: log colour scale clipped at 1e-3, as in the paper's Fig. 6.
    annotate: write the values in the cells (default: when K <= 12).
    """
    m = as_matrix(phi)
    k_latent, k = m.shape
    rows = latent_names(k_latent, class_names, k)
    cols = [str(c) for c in class_names] if class_names is not None else [str(j) for j in range(k)]
    if annotate is None:
        annotate = k <= 12
    panels = [(m, title, rows)]
    if truth is not None:
        t = as_matrix(truth, name="truth")
        if t.shape[1] != k or t.shape[0] not in (k, k_latent):
            raise ValueError(f"truth has shape {t.shape}; phi has {m.shape}: expected "
                             f"({k}, {k}) or ({k_latent}, {k})")
        panels.append((t, "true transition", rows[:t.shape[0]]))
    side = 2.0 + 0.35 * min(k, 24)
    fig = _figure(side * len(panels) + 1.0, side)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (mat, name, names) in zip(axes, panels):
        _panel(fig, ax, mat, title=name, rows=names, cols=cols, log_scale=log_scale,
               annotate=annotate)
    return fig


def curves(history: Sequence[dict], *, keys: Sequence[str] = ("test_top1", "label_recovery",
                                                               "transition_error"),
           x_key: str = "epoch") -> Figure:
    """One panel per key, value against ``x_key`` (the row index when a row lacks it).

    history: one dict of floats per epoch. Keys absent from every row or NaN everywhere get
    an empty panel saying so, so the figure's layout does not depend on the run.
    """
    if not keys:
        raise ValueError("curves needs at least one key")
    fig = _figure(4.0 * len(keys), 3.2)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys):
        xs, ys = [], []
        for i, row in enumerate(history):
            v = row.get(key)
            if v is None:
                continue
            v = float(v)
            if math.isfinite(v):
                xs.append(float(row.get(x_key, i)))
                ys.append(v)
        ax.set_title(key)
        ax.set_xlabel(x_key)
        if ys:
            ax.plot(xs, ys, marker="o", markersize=3)
            ax.grid(True, alpha=0.3)
        else:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center",
                    transform=ax.transAxes)
    return fig


def accuracy_vs(rows: Sequence[dict], *, x_key: str = "lccn.alpha",
                keys: Sequence[str] = ("val_top1", "test_top1"), log_x: bool = True,
                title: str = "") -> Figure:
    """One point per row (a sweep trial) and key: ``row[key]`` against ``row[x_key]``, one
    marker per key, on a log x axis unless ``log_x`` is False. Rows without a finite
    ``x_key`` (or key) are left out; with no point left the figure says so."""
    fig = _figure(5.5, 3.6)
    ax = fig.subplots()
    drawn = 0
    for key, marker in zip(keys, "osD^v"):
        pts = []
        for row in rows:
            try:
                x, y = float(row.get(x_key)), float(row.get(key))
            except (TypeError, ValueError):
                continue
            if math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x):
                pts.append((x, y))
        if pts:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle="none",
                    label=key)
            drawn += len(pts)
    ax.set_xlabel(x_key)
    ax.set_ylabel("accuracy")
    if title:
        ax.set_title(title)
    if drawn:
        if log_x:
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    return fig
