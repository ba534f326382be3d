"""The label-issue report of an LCCN run: which training samples are probably mislabelled
(and, for LCCN*, probably out of distribution), ranked, with precision and recall at k
against clean labels where the label view has them, beside cleanlab's
``find_label_issues`` on the same model's out-of-sample predictions.

What the report ranks. The Gibbs chain keeps, for every training sample m, the Eq. 7
posterior over its latent label ``p_m(k) = p(z_m = k | x_m, ỹ_m, C¬)``. A single draw of
``z`` is noisy; the report uses the posterior *averaged over the last E epochs* of the run
(``LCCNConfig.report_epochs``; every sample is visited once per epoch, so E sweeps of the
chain), accumulated by :class:`ReportAccumulator` during training and summed over ranks at
each epoch end and each checkpoint. From the mean ``p̄_m (K_latent,)`` and the observed
label ``j``:

- mislabelled score ``1 - p̄_m[j] - p̄_m[K]`` (the probability that the true label is
  another in-distribution class), suggested label ``argmax_{k < K} p̄_m[k]``; a sample is
  *flagged* when the arg max over all latent classes is neither ``j`` nor the outlier;
- LCCN* only: outlier score ``p̄_m[K]``, flagged when the arg max is ``K``.

Why cleanlab is compared on the noisy validation split. Confident learning needs
*out-of-sample* predicted probabilities (cleanlab's docs: cross-validated ones); a network
that has fitted its training labels predicts them back, and cleanlab then finds almost
nothing. One run has out-of-sample predictions for exactly one set of samples: the noisy
validation split it holds out (never trained on, never counted in C). Cross-validation
would mean K more training runs, which the report does not start. So both methods are
scored there on equal footing, from the probabilities ``P(k | x)`` of the selected epoch's
classifier (the best noisy validation accuracy; the last epoch's in an older state): cleanlab
with ``find_label_issues`` (flags) and its self-confidence ranking, LCCN with the Eq. 7
posterior of a held-out sample, ``p(k) ∝ P(k | x) · phi[k, ỹ]`` with ``phi`` the chain's
final transition ``(C + α) / rowsum`` (the sample is not in C, so nothing is removed).
The training-split ranking (the chain's own averaged posterior, the report's main output)
is scored beside them; cleanlab has no out-of-sample probabilities there.

Files (:meth:`LabelIssueReport.write`)::

    mislabelled.csv   rank, idx, key, observed, suggested, confidence   (flagged samples,
                      most confident first; class names as in the manifest)
    labels.csv        idx, key, observed, suggested, p_suggested, p_observed[, p_outlier],
                      flagged: the cleaned labels of every training sample in the chain
    outliers.csv      rank, idx, key, observed, confidence              (LCCN* only)
    summary.json      counts, precision/recall at k of every ranking, cleanlab's beside LCCN
    summary.md        the same as tables

Conventions: ``phi[k, j] = P(observed = j | latent = k)``, rows sum to 1, ``(K_latent, K)``;
posteriors are ``(N, K_latent)`` with rows summing to 1; ``clean`` is ``-1`` where unknown
and ``K`` for an out-of-distribution sample.

    python -m pipeline.track.label_issues CHECKPOINT_DIR --shards TRAIN_SPLIT [--label-view V.npz]
    (or lccn-label-issues ...)
        [--out DIR] [--k 20 50] [--tracking-uri URI --mlflow-run-id ID]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.cli import prog_name
from pipeline.core.config import MonitorConfig, json_safe
from pipeline.core.confusion import transition
from pipeline.core.labels import LabelView
from pipeline.core.posterior import MAX_ENTRIES, STATE_KEY, sparse_sums
from pipeline.data.manifest import Manifest
from pipeline.data.split_labels import read_split_labels

__all__ = ["Ranking", "LabelIssueReport", "rank_mislabelled", "rank_mislabelled_sparse",
           "rank_outliers", "heldout_posterior", "cleanlab_ranking", "at_k", "build_report",
           "main"]


# -- rankings ----------------------------------------------------------------------------------


@dataclass
class Ranking:
    """One method's verdict over a set of samples: ``idx (n,)``, ``score (n,)`` (higher =
    more likely an issue), ``flagged (n,) bool`` (the method's own decision: the label is
    probably wrong), ``suggested (n,)`` (the label it proposes; -1 where it proposes none)
    and ``relabel (n,) bool`` (where changing the label to ``suggested`` is expected to
    make it right more often than keeping it)."""

    name: str
    idx: np.ndarray
    score: np.ndarray
    flagged: np.ndarray
    suggested: np.ndarray
    # where the method would change the label to ``suggested`` (None: it does not say)
    relabel: np.ndarray | None = None

    def order(self) -> np.ndarray:
        """Positions into ``idx`` from the most to the least likely issue (stable: ties
        keep idx order)."""
        return np.argsort(-self.score, kind="stable")


def _mean_posterior(post: np.ndarray) -> np.ndarray:
    post = np.asarray(post, dtype=np.float64)
    if post.ndim != 2:
        raise ValueError(f"posteriors must be (n, K_latent), got shape {post.shape}")
    s = post.sum(1, keepdims=True)
    bad = np.flatnonzero(~np.isfinite(s[:, 0]) | (s[:, 0] <= 0))
    if bad.size:
        raise ValueError(f"posterior row {int(bad[0])} does not sum to a positive number")
    return post / s


def rank_mislabelled(post: np.ndarray, observed: np.ndarray, idx: np.ndarray, *,
                     num_classes: int, name: str = "lccn") -> Ranking:
    """post: ``(n, K_latent)`` mean posterior over the latent label (rows normalised here);
    observed, idx: ``(n,)``. Score ``1 - p[j] - p[K]`` (another in-distribution class),
    suggested ``argmax_{k < K} p[k]``, flagged where the arg max over all latent classes is
    neither the observed label nor the outlier class."""
    p = _mean_posterior(post)
    obs = np.asarray(observed, dtype=np.int64)
    rows = np.arange(len(obs))
    k = num_classes
    outlier = p[:, k] if p.shape[1] > k else np.zeros(len(obs))
    score = 1.0 - p[rows, obs] - outlier
    top = p.argmax(1)
    return Ranking(name, np.asarray(idx, dtype=np.int64), np.clip(score, 0.0, 1.0),
                   (top != obs) & (top < k), p[:, :k].argmax(1))


def rank_mislabelled_sparse(cls: np.ndarray, mean: np.ndarray, p_observed: np.ndarray,
                            p_outlier: np.ndarray, observed: np.ndarray, idx: np.ndarray, *,
                            num_classes: int, name: str = "lccn") -> Ranking:
    """:func:`rank_mislabelled` from each sample's kept classes ``cls (n, k)`` with their
    mean posterior ``mean (n, k)`` (the report accumulator's top k; all classes below its
    size limit) and the exact means of the observed label and the outlier class: score
    ``1 - p[j] - p[K]``, suggested the kept in-distribution class of largest mean, flagged
    where the largest kept class is neither the observed label nor the outlier."""
    cls, mean = np.asarray(cls, dtype=np.int64), np.asarray(mean, dtype=np.float64)
    obs = np.asarray(observed, dtype=np.int64)
    rows = np.arange(len(obs))
    score = 1.0 - np.asarray(p_observed, np.float64) - np.asarray(p_outlier, np.float64)
    indist = np.where(cls < num_classes, mean, -np.inf)
    best = indist.argmax(1) if len(obs) else np.zeros(0, dtype=np.int64)
    suggested = np.where(np.isfinite(indist[rows, best]), cls[rows, best], -1)
    top = cls[rows, mean.argmax(1)] if len(obs) else np.zeros(0, dtype=np.int64)
    return Ranking(name, np.asarray(idx, dtype=np.int64), np.clip(score, 0.0, 1.0),
                   (top != obs) & (top < num_classes), suggested)


def rank_outliers(post: np.ndarray, idx: np.ndarray, *, num_classes: int,
                  name: str = "lccn") -> Ranking:
    """LCCN*: score ``p[K]``, flagged where the outlier class is the arg max."""
    p = _mean_posterior(post)
    if p.shape[1] != num_classes + 1:
        raise ValueError(f"an outlier ranking needs K + 1 = {num_classes + 1} latent classes, "
                         f"got {p.shape[1]}")
    return Ranking(name, np.asarray(idx, dtype=np.int64), p[:, num_classes],
                   p.argmax(1) == num_classes, np.full(len(p), -1, dtype=np.int64))


def heldout_posterior(probs: np.ndarray, observed: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """Eq. 7 for a sample outside the chain: ``p(k) ∝ P(k | x) · phi[k, ỹ]``.

    probs: ``(n, K_latent)`` classifier probabilities; observed: ``(n,)``;
    phi: ``(K_latent, K)``, rows sum to 1. Returns ``(n, K_latent)``, rows sum to 1."""
    probs = np.asarray(probs, dtype=np.float64)
    phi = np.asarray(phi, dtype=np.float64)
    if probs.shape[1] != phi.shape[0]:
        raise ValueError(f"probs have {probs.shape[1]} classes, phi {phi.shape[0]} latent rows")
    u = probs * phi[:, np.asarray(observed, dtype=np.int64)].T
    s = u.sum(1, keepdims=True)
    return np.where(s > 0, u / np.where(s > 0, s, 1.0), 1.0 / probs.shape[1])


# -- cleaning: the held-out calibration and the decision ---------------------------------------

CHI2_2_95 = 5.991  # the 95% quantile of chi-squared with 2 degrees of freedom


@dataclass
class Calibration:
    """How the report reads the model's posteriors, fitted on the noisy validation split.

    ``temperature``: the classifier's probabilities are ``softmax(log P(k | x) / T)``;
    ``shrink``: the transition is ``(1 - s) phi + s I`` with ``s <= 0``, further from the
    identity (more noise; LCCN*'s outlier row is left as it is). Both maximise the held-out
    likelihood of the observed labels, ``mean log sum_k P_T(k | x) phi_s[k, ỹ]``, the one
    thing noisy labels can check: a classifier trained to its labels is overconfident on
    images it was not trained on, and a transition estimated from such a classifier
    misplaces the noise. ``nll``: that likelihood before and after (mean nats).

    The transition may only move away from the identity. The chain counted φ on rows the
    classifier was fitting, so its own bias is toward too little noise; and the held-out
    likelihood cannot tell noise in φ from noise the classifier has learnt to predict: a
    classifier that has fitted noisy labels predicts them on new images as well, and the
    likelihood then rises as φ nears the identity. Allowed to, the fit moved φ toward the
    identity on memorising CIFAR-10 runs and put the estimated accuracy of the observed
    labels up to 39.5 points above the truth (symmetric 0.5: 94.8% against 55.3%)."""

    temperature: float = 1.0
    shrink: float = 0.0
    nll_before: float = float("nan")
    nll_after: float = float("nan")

    def probs(self, probs: np.ndarray) -> np.ndarray:
        return _tempered(probs, self.temperature)

    def phi(self, phi: np.ndarray) -> np.ndarray:
        return _shrunk(phi, self.shrink)


def _tempered(probs: np.ndarray, t: float) -> np.ndarray:
    z = np.log(np.clip(np.asarray(probs, dtype=np.float64), 1e-300, None)) / t
    z -= z.max(1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(1, keepdims=True)


def _shrunk(phi: np.ndarray, s: float) -> np.ndarray:
    phi = np.asarray(phi, dtype=np.float64)
    k = phi.shape[1]
    target = phi.copy()
    target[:k] = np.eye(k)
    out = np.clip((1.0 - s) * phi + s * target, 0.0, None)
    return out / np.where(out.sum(1, keepdims=True) > 0, out.sum(1, keepdims=True), 1.0)


def _heldout_nll(probs: np.ndarray, observed: np.ndarray, phi: np.ndarray) -> float:
    q = (probs * phi[:, observed].T).sum(1)
    return float(-np.log(np.clip(q, 1e-300, None)).mean())


def calibrate(probs: np.ndarray, observed: np.ndarray, phi: np.ndarray) -> Calibration:
    """:class:`Calibration` of a model (out-of-sample ``probs (n, K_latent)``) and its
    transition ``phi (K_latent, K)`` on held-out samples with observed labels ``(n,)``:
    a grid over the temperature (0.25-4, log-spaced) and the shrink (the most negative
    that keeps every entry >= 0, to 0), then a bounded refinement from the best point.
    Deterministic; no samples: the identity calibration."""
    from scipy.optimize import minimize

    probs = np.asarray(probs, dtype=np.float64)
    obs = np.asarray(observed, dtype=np.int64)
    phi = np.asarray(phi, dtype=np.float64)
    if len(obs) == 0:
        return Calibration()
    k = phi.shape[1]
    diag = np.diag(phi[:k])
    off = phi[:k] - np.diag(diag)
    # phi_s = phi + s (I - phi) on the first K rows: off-diagonals scale by (1 - s) and
    # stay >= 0 for s <= 1; the diagonal phi_kk + s (1 - phi_kk) stays >= 0 for
    # s >= -phi_kk / (1 - phi_kk)
    lows = [-d / (1 - d) for d in diag if d < 1]
    s_min = max(-4.0, max(lows) if lows else 0.0) if off.any() else 0.0
    s_grid = np.linspace(s_min, 0.0, 11) if s_min < 0 else np.zeros(1)
    t_grid = np.exp(np.linspace(np.log(0.25), np.log(4.0), 17))

    def f(x: np.ndarray) -> float:
        return _heldout_nll(_tempered(probs, float(x[0])), obs, _shrunk(phi, float(x[1])))

    start = min(((f(np.array([t, sv])), t, sv) for t in t_grid for sv in s_grid),
                key=lambda v: v[0])
    res = minimize(f, x0=np.array([start[1], start[2]]), method="L-BFGS-B",
                   bounds=[(0.25, 4.0), (s_min, 0.0)])
    best = (float(res.x[0]), float(res.x[1])) if res.fun <= start[0] else (start[1], start[2])
    before, after = f(np.array([1.0, 0.0])), f(np.array(best))
    # two parameters fitted on n samples: kept only when the held-out data support them
    # (likelihood-ratio test at 5%: 2 n (before - after) above chi2(2)'s 5.99), so that a
    # small validation split does not move the posteriors on its own noise
    if 2 * len(obs) * (before - after) <= CHI2_2_95:
        return Calibration(nll_before=before, nll_after=before)
    return Calibration(best[0], best[1], nll_before=before, nll_after=after)


def observed_odds_shift(p_observed: np.ndarray, low: float, high: float) -> float:
    """The log-odds ``d`` that, added to every sample's posterior of its observed label
    (``p -> e^d p / (1 - p + e^d p)``), brings their mean into ``[low, high]`` (the
    held-out estimate's 95% interval): the smallest common correction under which the
    training posteriors imply a label accuracy the held-out split allows; 0 when their mean
    lies in it already."""
    p = np.clip(np.asarray(p_observed, dtype=np.float64), 1e-12, 1 - 1e-12)
    if p.size == 0:
        return 0.0
    now = float(p.mean())
    if low <= now <= high:
        return 0.0
    target = min(max(now, low), high)
    if not 0 < target < 1:
        return 0.0

    def mean_at(d: float) -> float:
        e = np.exp(d)
        return float((e * p / (1 - p + e * p)).mean())

    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if mean_at(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def confident_joint_accuracy(probs: np.ndarray, observed: np.ndarray) -> float:
    """The share of right labels by confident learning (cleanlab's ``estimate_joint``, the
    trace of the estimated joint of observed and true labels) from out-of-sample
    probabilities ``(n, K)`` and the observed labels; NaN where it cannot be estimated (a
    class without a held-out label). It reads every disagreement of a confident classifier
    with a label as noise, so a classifier that errs often makes it low; the noise model's
    estimate errs the other way once the classifier has fitted its training labels."""
    probs = np.asarray(probs, dtype=np.float64)
    obs = np.asarray(observed, dtype=np.int64)
    k = probs.shape[1]
    if len(obs) == 0 or np.bincount(obs, minlength=k).min() == 0:
        return float("nan")
    from cleanlab.count import estimate_joint

    probs = probs / np.clip(probs.sum(1, keepdims=True), 1e-300, None)
    try:
        return float(np.trace(estimate_joint(labels=obs, pred_probs=probs)))
    except (ValueError, ZeroDivisionError):
        return float("nan")


def vanished_classes(counts: np.ndarray, observed: np.ndarray, num_classes: int, *,
                     floor: float = MonitorConfig.vanish_floor) -> np.ndarray:
    """The in-distribution latent classes the chain has all but emptied: class ``j`` holds
    fewer than ``floor`` (the collapse monitor's vanish floor) times as many samples as are
    labelled ``j``. ``counts``: the chain's ``(K_latent, K)`` count matrix (latent by
    observed); ``observed``: the counted samples' labels. A chain that emptied class ``j``
    (under pair flips it can merge a class into the one its labels flip to) explains the
    images labelled ``j`` by other classes whatever they show, so its posterior of them is
    no ground for relabelling."""
    held = np.asarray(counts, dtype=np.float64)[:num_classes].sum(1)
    labelled = np.bincount(np.asarray(observed, dtype=np.int64), minlength=num_classes)
    return np.flatnonzero((labelled > 0) & (held < floor * labelled))


def decide(p_observed: np.ndarray, p_best: np.ndarray, p_outlier: np.ndarray, *,
           shift: float, noise_rate: float) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                     np.ndarray]:
    """The report's two decisions from a posterior (``(n,)`` the observed label's, the most
    probable other in-distribution class's, the outlier class's), read with the observed
    label's log-odds moved by ``shift``. Returns ``(p_observed', p_best', flagged,
    relabel)``: ``flagged`` where the probability that the label is wrong exceeds
    ``noise_rate``, the estimated share of wrong labels (the image and its label make this
    one more suspect than a label drawn at random: the likelihood ratio of "wrong" is
    above 1); ``relabel`` where the other class is more probable than the observed label
    both as the chain reads it and with the shift (changing it is expected to make it
    right more often than keeping it, a positive expected gain ``p_best' - p_observed'``,
    under either reading).

    The shift corrects the posteriors' mean, the share of right labels they imply, and
    not where that correction belongs: a log-odds move common to every sample lowers the
    observed label most where the chain was unsure, while the excess confidence it
    removes sits on the samples the classifier has fitted. So the shift may veto a
    relabel the chain's own posterior supports (``shift > 0``: the training posteriors
    imply more noise than the held-out split allows, as after a collapse of the chain)
    but never makes one: the threshold on ``p_best / p_observed`` (chain) is
    ``max(1, e^shift)``. On the posteriors of memorising runs, relabelling where only the
    shifted posterior favoured the other class made the labels worse."""
    p = np.asarray(p_observed, dtype=np.float64)
    e = np.exp(shift)
    z = 1 - p + e * p
    p_best = np.asarray(p_best, np.float64)
    po, pb, pk = e * p / z, p_best / z, np.asarray(p_outlier, np.float64) / z
    wrong = 1 - po - pk
    return po, pb, wrong > noise_rate, p_best > max(1.0, e) * p


def cleanlab_ranking(probs: np.ndarray, observed: np.ndarray, idx: np.ndarray, *,
                     num_classes: int) -> Ranking:
    """cleanlab on out-of-sample ``probs (n, >= K)`` (the first K columns, renormalised):
    ``find_label_issues`` (prune by noise rate) flags, ``1 - self-confidence`` ranks,
    suggested = arg max of the predicted probabilities."""
    from cleanlab.filter import find_label_issues
    from cleanlab.rank import get_label_quality_scores

    p = np.asarray(probs, dtype=np.float64)[:, :num_classes]
    p = p / np.clip(p.sum(1, keepdims=True), 1e-12, None)
    obs = np.asarray(observed, dtype=np.int64)
    flagged = np.zeros(len(obs), dtype=bool)
    if len(obs):
        # n_jobs=1: cleanlab's default forks a process pool, which deadlocks in a process
        # with threads (a Ray worker, a sweep trial)
        flagged = np.asarray(find_label_issues(obs, p, filter_by="prune_by_noise_rate",
                                               n_jobs=1), dtype=bool)
        quality = get_label_quality_scores(obs, p, method="self_confidence")
    else:
        quality = np.zeros(0)
    return Ranking("cleanlab", np.asarray(idx, dtype=np.int64), 1.0 - quality, flagged,
                   p.argmax(1) if len(obs) else np.zeros(0, dtype=np.int64))


def at_k(ranking: Ranking, truth: np.ndarray, known: np.ndarray,
         ks: Sequence[int] = ()) -> dict[str, Any]:
    """Precision and recall of ``ranking`` against ``truth`` over the samples with a known
    clean label.

    truth, known: ``(n,) bool`` aligned with ``ranking.idx`` (truth: the sample is an issue;
    known: its clean label is known). Reports, for each k: the requested ``ks``, ``k = n_true``
    (R-precision: precision = recall there) and the method's own flagged set."""
    keep = np.asarray(known, dtype=bool)
    truth = np.asarray(truth, dtype=bool)[keep]
    score, flagged = ranking.score[keep], ranking.flagged[keep]
    order = np.argsort(-score, kind="stable")
    hits = np.cumsum(truth[order])
    n, n_true = int(keep.sum()), int(truth.sum())
    out: dict[str, Any] = {"method": ranking.name, "evaluated": n, "issues": n_true,
                           "flagged": int(flagged.sum()), "at": []}

    def row(label: str, k: int, found: int, count: int) -> dict[str, Any]:
        return {"k": label, "n": count, "precision": found / count if count else math.nan,
                "recall": found / n_true if n_true else math.nan}

    req = sorted({int(k) for k in ks if 0 < int(k) <= n})
    for k in req:
        out["at"].append(row(str(k), k, int(hits[k - 1]), k))
    out["r_precision"] = int(hits[n_true - 1]) / n_true if 0 < n_true <= n else math.nan
    if 0 < n_true <= n and n_true not in req:
        out["at"].append(row(f"{n_true} (= issues)", n_true, int(hits[n_true - 1]), n_true))
    nf = int(flagged.sum())
    out["at"].append(row("flagged", nf, int((truth & flagged).sum()), nf))
    return out


# -- the report ----------------------------------------------------------------------------------


@dataclass
class LabelIssueReport:
    """What :func:`build_report` makes: the training split's rankings (``mislabelled``,
    ``outliers`` for LCCN*), the key and label of every training idx, and the evaluation
    tables (``evaluation``: a list of :func:`at_k` dicts with the split they were scored
    on)."""

    mislabelled: Ranking
    outliers: Ranking | None
    observed: np.ndarray
    keys: list[str]
    class_names: list[str]
    epochs: list[int]
    evaluation: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # per row of ``mislabelled`` (every training sample the chain counted): the mean
    # posterior of the suggested label and of the observed one (labels.csv)
    p_suggested: np.ndarray | None = None
    p_observed: np.ndarray | None = None
    # what cleaning is expected to do (build_report): the estimates and their source
    cleaning: dict[str, Any] = field(default_factory=dict)

    def _name(self, c: int) -> str:
        return self.class_names[c] if 0 <= c < len(self.class_names) else str(c)

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write the report's files into ``out_dir``; returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "mislabelled.csv"]
        r = self.mislabelled
        with open(paths[0], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["rank", "idx", "key", "observed", "suggested", "confidence"])
            for rank, pos in enumerate([p for p in r.order() if r.flagged[p]], 1):
                i = int(r.idx[pos])
                w.writerow([rank, i, self.keys[i], self._name(int(self.observed[i])),
                            self._name(int(r.suggested[pos])), f"{r.score[pos]:.4f}"])
        if self.outliers is not None:
            paths.append(out / "outliers.csv")
            o = self.outliers
            with open(paths[-1], "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["rank", "idx", "key", "observed", "confidence"])
                for rank, pos in enumerate([p for p in o.order() if o.flagged[p]], 1):
                    i = int(o.idx[pos])
                    w.writerow([rank, i, self.keys[i], self._name(int(self.observed[i])),
                                f"{o.score[pos]:.4f}"])
        if self.p_suggested is not None:
            paths.append(self.write_labels(out / "labels.csv"))
        summary = self.summary()
        paths.append(out / "summary.json")
        paths[-1].write_text(json.dumps(json_safe(summary), indent=1))
        paths.append(out / "summary.md")
        paths[-1].write_text(self.markdown())
        return paths

    def write_labels(self, path: Path) -> Path:
        """The cleaned labels of every training sample the chain counted, in idx order:
        ``idx, key, observed, suggested`` (the most probable other class; class names),
        ``p_suggested``, ``p_observed`` (their calibrated mean Eq. 7 posteriors),
        ``p_outlier`` (LCCN*), ``flagged`` (1: the label is probably wrong; the sample is
        in mislabelled.csv), ``relabel`` (1: ``suggested`` is more probable than the
        observed label, as the chain reads it and after the held-out correction) and
        ``cleaned`` (``suggested`` where ``relabel``, else ``observed``). Written row by
        row (2.4M rows: about 10 s)."""
        r, o = self.mislabelled, self.outliers
        head = ["idx", "key", "observed", "suggested", "p_suggested", "p_observed"]
        head += ["p_outlier"] if o is not None else []
        head += ["flagged", "relabel", "cleaned"]
        order = np.argsort(r.idx, kind="stable")
        relabel = r.relabel if r.relabel is not None else np.zeros(len(r.idx), dtype=bool)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(head)
            for pos in order.tolist():
                i = int(r.idx[pos])
                ob, sg = int(self.observed[i]), int(r.suggested[pos])
                row = [i, self.keys[i], self._name(ob), self._name(sg) if sg >= 0 else "",
                       f"{self.p_suggested[pos]:.4f}", f"{self.p_observed[pos]:.4f}"]
                if o is not None:
                    row.append(f"{o.score[pos]:.4f}")
                re = bool(relabel[pos])
                row += [int(r.flagged[pos]), int(re), self._name(sg if re else ob)]
                w.writerow(row)
        return path

    def summary(self) -> dict[str, Any]:
        return {"samples": int(len(self.mislabelled.idx)),
                "flagged_mislabelled": int(self.mislabelled.flagged.sum()),
                "flagged_outliers": (None if self.outliers is None
                                     else int(self.outliers.flagged.sum())),
                "posterior_epochs": self.epochs, "cleaning": self.cleaning,
                "evaluation": self.evaluation, "notes": self.notes}

    def cleaning_lines(self) -> list[str]:
        """What cleaning is expected to do, in words, with the estimate's uncertainty."""
        c = self.cleaning
        if not c:
            return []
        a, se, g, n = (c["accuracy_observed"], c["accuracy_observed_se"], c["expected_gain"],
                       c["samples"])
        ci = f" ± {196 * se:.1f}" if se == se else ""
        lines = [f"Estimated accuracy of the observed labels: {100 * a:.1f}%{ci} (95%; from "
                 f"{c['estimated_from']}); {c['flagged']} of {n} labels flagged as probably "
                 f"wrong (more suspect than the estimated {100 * c['flag_threshold']:.1f}% "
                 f"of wrong labels)."]
        low = c.get("confident_joint_accuracy", float("nan"))
        if se == se:
            lines.append("The interval covers the held-out split's sampling error only. The "
                         "estimate reads the noise from the learned transition, which holds "
                         "too little of it where the classifier has learnt to predict the "
                         "annotators' confusions without memorising (fine-tuning, or a "
                         "schedule CE does not memorise on): on CIFAR-10 with human and "
                         "synthetic noise it "
                         "ranged from 5.8 points below the truth to 14.7 above it, within 3 "
                         "points in 14 of 32 measured runs."
                         + ("" if low != low else
                            f" Confident learning on the same held-out predictions "
                            f"estimates {100 * low:.1f}%; it counts the classifier's own "
                            f"errors as label noise and ran up to 29 points low there."))
        if c["relabel"] == 0 or g <= 0:
            lines.append("Cleaning is not expected to help: no label has another class more "
                         "probable than itself; keep the observed labels.")
        else:
            small = " (within the estimate's uncertainty)" if se == se and g < 1.96 * se else ""
            lines.append(f"Relabelling the {c['relabel']} labels whose suggested class is "
                         f"more probable than the observed one is expected to raise it to "
                         f"{100 * (a + g):.1f}% (+{100 * g:.2f} points{small}); labels.csv "
                         f"column 'cleaned'.")
        return lines

    def markdown(self) -> str:
        s = self.summary()
        lines = ["# Label-issue report", "",
                 f"{s['samples']} training samples ranked by their Eq. 7 posterior averaged "
                 f"over epoch{'s' if len(self.epochs) > 1 else ''} "
                 f"{', '.join(str(e + 1) for e in self.epochs)}; "
                 f"{s['flagged_mislabelled']} flagged as mislabelled"
                 + ("" if s["flagged_outliers"] is None else
                    f", {s['flagged_outliers']} as out of distribution") + ".", ""]
        if self.cleaning:
            lines += self.cleaning_lines() + [""]
        if self.evaluation:
            lines += ["| split | issues | method | k | precision | recall |",
                      "|---|---|---|---|---|---|"]
            for ev in self.evaluation:
                for r in ev["at"]:
                    lines.append(f"| {ev['split']} | {ev['kind']} ({ev['issues']} of "
                                 f"{ev['evaluated']}) | {ev['method']} | {r['k']} | "
                                 f"{_fmt(r['precision'])} | {_fmt(r['recall'])} |")
            lines.append("")
            for ev in self.evaluation:
                if "accuracy_cleaned" in ev:
                    lines.append(f"- {ev['split']}: against the clean labels, the observed "
                                 f"labels are {100 * ev['accuracy_observed']:.2f}% right, "
                                 f"the cleaned ones ({ev['relabel']} relabelled) "
                                 f"{100 * ev['accuracy_cleaned']:.2f}%")
            lines.append("")
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(v: float) -> str:
    return "n/a" if v != v else f"{v:.3f}"


def _chain0(store: dict) -> dict:
    return store["chains"][0] if "chains" in store else store


def build_report(state: dict, *, clean: np.ndarray | None = None,
                 keys: Sequence[str] | None = None, class_names: Sequence[str] = (),
                 ks: Sequence[int] = ()) -> LabelIssueReport:
    """The report of a run's checkpoint ``state`` (``state["label_report"]``, the chain's
    ``store``); ``clean (N,)`` (-1 unknown, K out of distribution) scores it, ``keys``
    name the samples (default: their idx)."""
    acc = state.get(STATE_KEY)
    if not has_posterior(acc):
        raise ValueError("the checkpoint holds no averaged posterior: the run's last "
                         "report_epochs epochs were not LCCN epochs (or report_epochs was 0, "
                         "or the run ended before them)")
    store = state.get("store")
    if store is None:
        raise ValueError("the checkpoint holds no chain state (store)")
    chain = _chain0(store)
    observed = np.asarray(chain["observed"], dtype=np.int64)
    counted = np.asarray(chain["counted"], dtype=bool)
    k, n = int(acc["num_classes"]), len(observed)
    cls_t, val_t, obs_t, out_t = sparse_sums(acc, torch.as_tensor(observed))
    k_latent = int(acc.get("k_latent", k))
    count = np.asarray(acc["count"], dtype=np.int64)
    if cls_t.shape[0] != n:
        raise ValueError(f"the averaged posterior has {cls_t.shape[0]} rows, the chain {n}")
    if clean is not None:
        clean = np.asarray(clean, dtype=np.int64)
        if clean.shape != (n,):
            raise ValueError(f"the clean labels given cover {clean.shape[0] if clean.ndim else 0} "
                             f"samples, the run's training chain {n}: give the training "
                             f"split (or label view) the run was trained on")
    keys = [str(i) for i in range(n)] if keys is None else [str(s) for s in keys]
    if len(keys) != n:
        raise ValueError(f"{len(keys)} keys for {n} samples")
    rows = np.flatnonzero(counted & (count > 0))
    c = count[rows].astype(np.float64)
    rsel = torch.as_tensor(rows)
    cls = cls_t[rsel].numpy().astype(np.int64)
    mean = val_t[rsel].numpy().astype(np.float64) / c[:, None]
    p_obs = obs_t[rsel].numpy().astype(np.float64) / c
    p_out = out_t[rsel].numpy().astype(np.float64) / c
    obs_rows = observed[rows]
    n_rows = len(rows)
    # the most probable in-distribution class other than the observed label (kept classes)
    other = np.where((cls < k) & (cls != obs_rows[:, None]), mean, -np.inf)
    best = other.argmax(1) if n_rows else np.zeros(0, dtype=np.int64)
    p_best = np.where(np.isfinite(other[np.arange(n_rows), best]),
                      mean[np.arange(n_rows), best], 0.0) if n_rows else np.zeros(0)
    suggested = np.where(p_best > 0, cls[np.arange(n_rows), best], -1) if n_rows else \
        np.zeros(0, dtype=np.int64)

    # the held-out split: the calibration, the estimated accuracy of the observed labels
    phi = transition(torch.as_tensor(chain["counts"]),
                     torch.as_tensor(acc["alpha"], dtype=torch.float64)).numpy()
    held, held_from = heldout_of(acc)
    has_held = held is not None and len(held["idx"]) > 0
    cal, hpost = Calibration(), None
    if has_held:
        hidx = np.asarray(held["idx"], dtype=np.int64)
        hprobs = np.asarray(held["probs"], dtype=np.float64)[:, :phi.shape[0]]
        hobs = observed[hidx]
        cal = calibrate(hprobs, hobs, phi)
        hpost = heldout_posterior(cal.probs(hprobs), hobs, cal.phi(phi))
        h_obs = hpost[np.arange(len(hidx)), hobs]
        h_out = hpost[:, k] if hpost.shape[1] > k else np.zeros(len(hidx))
        held_acc = float(h_obs.mean())
        held_noise = float((1 - h_obs - h_out).mean())
        se = math.sqrt(max(held_acc * (1 - held_acc), 0.0) / len(hidx))
        shift = observed_odds_shift(p_obs, held_acc - 1.96 * se, held_acc + 1.96 * se)
        source = (f"the noisy validation split, {len(hidx)} images never trained on, as "
                  f"{held_from} predicts them; the "
                  f"training posteriors, which read labels the classifier has fitted as "
                  f"right, are moved into its interval for the decisions")
        cl_acc = confident_joint_accuracy(cal.probs(hprobs)[:, :k], hobs)
    else:
        held_acc, se, shift, cl_acc = float("nan"), float("nan"), 0.0, float("nan")
        source = "the training chain's own posteriors (no noisy validation split)"
    e = math.exp(shift)
    z = 1 - p_obs + e * p_obs
    if has_held:  # the out-of-sample estimate; the shifted training mean sits at its edge
        acc_observed, noise_rate = held_acc, held_noise
    else:
        acc_observed = float((e * p_obs / z).mean()) if n_rows else float("nan")
        noise_rate = float((1 - (e * p_obs + p_out) / z).mean()) if n_rows else float("nan")
    po, pb, flagged, relabel = decide(p_obs, p_best, p_out, shift=shift, noise_rate=noise_rate)
    relabel &= suggested >= 0
    vanished = vanished_classes(chain["counts"], observed[counted], k)
    kept_back = relabel & np.isin(obs_rows, vanished)
    relabel &= ~kept_back
    if k_latent == k + 1:  # LCCN*: a sample the outlier class explains best is not relabelled
        top = cls[np.arange(n_rows), mean.argmax(1)] if n_rows else cls[:, 0]
        relabel &= top != k
    gain = float((pb - po)[relabel].sum() / n_rows) if n_rows else 0.0
    score = np.clip(1.0 - po - (p_out / (1 - p_obs + np.exp(shift) * p_obs)), 0.0, 1.0)
    mis = Ranking("lccn", rows.astype(np.int64), score, flagged, suggested, relabel)
    out = None
    if k_latent == k + 1:
        out = Ranking("lccn", rows.astype(np.int64), p_out, top == k,
                      np.full(n_rows, -1, dtype=np.int64))
    report = LabelIssueReport(mis, out, observed, keys, list(class_names),
                              list(acc.get("epochs", [])))
    report.p_suggested, report.p_observed = pb, po
    report.cleaning = {
        "estimated_from": source, "calibration": asdict(cal), "observed_shift": shift,
        "accuracy_observed": acc_observed, "accuracy_observed_se": se,
        "heldout_accuracy_observed": held_acc, "confident_joint_accuracy": cl_acc,
        "accuracy_cleaned": acc_observed + gain, "expected_gain": gain,
        "relabel": int(relabel.sum()), "flagged": int(flagged.sum()),
        "vanished_classes": vanished.tolist(), "kept_back": int(kept_back.sum()),
        "flag_threshold": noise_rate, "samples": n_rows}
    kept = cls.shape[1]
    if kept < k_latent:
        report.notes.append(f"the accumulator kept each sample's {kept} largest of "
                            f"{k_latent} classes (N x K_latent above {MAX_ENTRIES:,}): the "
                            f"scores are exact, a suggested label's probability a lower "
                            f"bound")
    if vanished.size:
        names = ", ".join(str(class_names[j]) if j < len(class_names) else str(j)
                          for j in vanished)
        plural = "es" if vanished.size > 1 else ""
        report.notes.append(f"the chain all but emptied latent class{plural} {names} (a "
                            f"collapse): {int(kept_back.sum())} samples with "
                            f"{'those labels' if plural else 'that label'} that the posterior "
                            f"would relabel are kept, since the chain explains every image "
                            f"so labelled by another class")
    lo, hi = (int(count[rows].min()), int(count[rows].max())) if n_rows else (0, 0)
    report.notes.append(f"training split: {n_rows} samples counted in the chain, each "
                        f"with {lo if lo == hi else f'{lo} to {hi}'} averaged "
                        f"posterior{'' if hi == 1 else 's'}")
    if has_held:
        report.notes.append(
            f"calibrated on the noisy validation split: temperature {cal.temperature:.3f}, "
            f"transition moved {abs(cal.shrink):.3f} away from the identity (held-out loss of the "
            f"observed labels {cal.nll_before:.4f} -> {cal.nll_after:.4f} nats); the "
            f"training posteriors' log-odds of their observed label moved by {shift:+.3f} "
            f"so that the accuracy they imply lies in the held-out estimate's 95% interval")
    if clean is None:
        report.notes.append("no clean labels given: precision and recall not computed")
        return report

    def evaluate(split: str, ranking: Ranking, kind: str, obs: np.ndarray) -> None:
        c = clean[ranking.idx]
        if kind == "mislabelled":
            known = (c >= 0) & (c < k) if out is None else c >= 0
            truth = (c >= 0) & (c < k) & (c != obs)
        else:
            known, truth = c >= 0, c == k
        if known.any():
            ev = at_k(ranking, truth, known, ks)
            ev.update(split=split, kind=kind)
            if kind == "mislabelled" and ranking.relabel is not None:
                kk = (c >= 0) & (c < k)
                cleaned = np.where(ranking.relabel, ranking.suggested, obs)
                ev.update(accuracy_observed=float((obs[kk] == c[kk]).mean()),
                          accuracy_cleaned=float((cleaned[kk] == c[kk]).mean()),
                          relabel=int(ranking.relabel.sum()))
            report.evaluation.append(ev)

    evaluate("train", mis, "mislabelled", obs_rows)
    if out is not None:
        evaluate("train", out, "outlier", obs_rows)
    if not has_held:
        report.notes.append("no noisy validation split: cleanlab (which needs out-of-sample "
                            "predictions) not compared")
        return report
    v_other = np.where(np.arange(hpost.shape[1])[None, :] == hobs[:, None], -np.inf,
                       hpost)[:, :k]
    v_best = v_other.argmax(1)
    v_pb = hpost[np.arange(len(hidx)), v_best]
    v_out = hpost[:, k] if hpost.shape[1] > k else np.zeros(len(hidx))
    vpo, vpb, vflag, vrel = decide(hpost[np.arange(len(hidx)), hobs], v_pb, v_out,
                                   shift=0.0, noise_rate=held_noise)
    evaluate("validation", Ranking("lccn", hidx, np.clip(1 - vpo - v_out, 0, 1), vflag,
                                   v_best, vrel), "mislabelled", hobs)
    evaluate("validation", cleanlab_ranking(hprobs, hobs, hidx, num_classes=k),
             "mislabelled", hobs)
    report.notes.append(
        f"validation split: {len(hidx)} held-out samples (never trained on, never counted "
        f"in C); cleanlab's find_label_issues and LCCN's calibrated Eq. 7 posterior "
        f"P_T(k|x) phi_s[k, observed] both from the out-of-sample "
        f"probabilities of {held_from}")
    return report


def heldout_of(acc: dict) -> tuple[dict | None, str]:
    """The out-of-sample predictions on the noisy validation split that the report reads
    (``{"idx", "probs"}``) and whose they are: the selected epoch's classifier's (the best
    noisy validation accuracy among the epochs the chain ran: the classifier the run
    exports unless its selected epoch fell in the CE warm-up) where the run recorded them,
    else the last epoch's (an older state).

    The last epoch's classifier is the worse reader wherever a run drifts or memorises
    after its selected epoch: its probabilities on new images rank the wrong labels below
    its own self-confidence (cleanlab's score), and the estimate follows. Re-scored on
    fifteen CIFAR-10 runs (CIFAR-10N ``random1`` and ``aggre``, symmetric and asymmetric
    0.2, fine-tuning), the selected classifier's predictions put the flags' precision and
    recall both at or above cleanlab's, given the same predictions, in 11 runs instead of 7,
    and the estimate within 3 points of the truth in 10 instead of 9
    (``benchmarks/results/cifar_real.md``)."""
    sel = acc.get("heldout_selected")
    if sel is not None and len(sel["idx"]) > 0:
        return sel, (f"the selected epoch's classifier (noisy validation accuracy "
                     f"{float(sel['val_top1']):.4f})")
    return acc.get("heldout"), "the last epoch's classifier"


def has_posterior(acc: dict | None) -> bool:
    """Whether a report state holds averaged posteriors (the top-k sums, or an older run's
    dense ones)."""
    return bool(acc) and (acc.get("top_cls") is not None or acc.get("sum") is not None)


def split_keys(train_source: str) -> list[str] | None:
    """The dataset keys of a local training split (None for a remote one)."""
    if "://" in str(train_source):
        return None
    return [str(k) for k in read_split_labels(train_source)["key"]]


def log_report(tracking_uri: str, run_id: str, paths: Sequence[Path],
               report: LabelIssueReport) -> None:
    """The report's files as artifacts ``label_issues/...`` of MLflow run ``run_id`` and
    its headline numbers as metrics (``label_issues_*``)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for p in paths:
        client.log_artifact(run_id, str(p), artifact_path="label_issues")
    s = report.summary()
    metrics = {"label_issues_flagged": float(s["flagged_mislabelled"])}
    for ev in report.evaluation:
        if ev["r_precision"] == ev["r_precision"]:
            metrics[f"label_issues_rprec_{ev['split']}_{ev['kind']}_{ev['method']}"] = \
                float(ev["r_precision"])
    for key, v in metrics.items():
        client.log_metric(run_id, key, v)


def job_report(state: dict, *, clean: np.ndarray | None, train_source: str,
               class_names: Sequence[str], out_dir: Path, tracking_uri: str | None,
               run_id: str | None) -> dict[str, Any] | None:
    """A job's report at the end of its run (driver side): written to ``out_dir``, logged to
    MLflow; returns the summary (None when the run has no averaged posterior)."""
    acc = state.get(STATE_KEY)
    if not has_posterior(acc):
        return None
    report = build_report(state, clean=clean, keys=split_keys(train_source),
                          class_names=class_names)
    paths = report.write(out_dir)
    if tracking_uri and run_id:
        log_report(tracking_uri, run_id, paths, report)
    return {**report.summary(), "files": [str(p) for p in paths]}


# -- the command line ----------------------------------------------------------------------------


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog_name("pipeline.track.label_issues"),
        description="The label-issue report of a finished LCCN run, from its checkpoint: "
                    "suspected mislabelled (and, for LCCN*, out-of-distribution) training "
                    "samples, ranked, with precision/recall at k beside cleanlab's.")
    p.add_argument("checkpoint", type=Path,
                   help="a checkpoint folder of the run (holds state.pt; the final one: "
                        "'checkpoint' in <run-dir>/results/<run>.json)")
    p.add_argument("--shards", type=Path, default=None,
                   help="the run's training split folder: sample keys and clean labels")
    p.add_argument("--label-view", type=Path, default=None,
                   help="the run's label view (.npz): its clean labels (and out-of-"
                        "distribution marks) score the report")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: <checkpoint>/label_issues)")
    p.add_argument("--k", type=int, nargs="*", default=[],
                   help="also report precision/recall at these k")
    p.add_argument("--tracking-uri", default=None, help="log the files to this MLflow store")
    p.add_argument("--mlflow-run-id", default=None,
                   help="the MLflow run to log to (default: the checkpoint's run)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m pipeline.track.label_issues``, ``lccn-label-issues``);
    0 on success."""
    run_cli(argv)
    return 0


def run_cli(argv: list[str] | None = None) -> LabelIssueReport:
    """:func:`main`, returning the report."""
    args = get_args_parser().parse_args(argv)
    state_file = args.checkpoint / "state.pt"
    if not state_file.is_file():
        raise SystemExit(f"error: {state_file}: no such file (give a checkpoint folder)")
    state = torch.load(state_file, map_location="cpu", weights_only=False)
    clean, keys, names = None, None, []
    if args.shards is not None:
        try:
            labels = read_split_labels(args.shards)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --shards {args.shards}: {e}") from None
        keys, clean = [str(k) for k in labels["key"]], labels["clean"]
        names = list(Manifest.load(args.shards).classes)
    if args.label_view is not None:
        try:
            clean = LabelView.load(args.label_view).clean
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --label-view {args.label_view}: {e}") from None
    try:
        report = build_report(state, clean=clean, keys=keys, class_names=names, ks=args.k)
    except ValueError as e:
        raise SystemExit(f"error: {args.checkpoint}: {e}") from None
    paths = report.write(args.out or args.checkpoint / "label_issues")
    run_id = args.mlflow_run_id or state.get("mlflow_run_id")
    if args.tracking_uri and run_id:
        log_report(args.tracking_uri, run_id, paths, report)
    sys.stdout.write(report.markdown())
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return report


if __name__ == "__main__":
    main()
