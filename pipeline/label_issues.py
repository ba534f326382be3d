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
scored there on equal footing, from the final model's probabilities ``P(k | x)``: cleanlab
with ``find_label_issues`` (flags) and its self-confidence ranking, LCCN with the Eq. 7
posterior of a held-out sample, ``p(k) ∝ P(k | x) · phi[k, ỹ]`` with ``phi`` the chain's
final transition ``(C + α) / rowsum`` (the sample is not in C, so nothing is removed).
The training-split ranking (the chain's own averaged posterior, the report's main output)
is scored beside them; cleanlab has no out-of-sample probabilities there.

Files (:meth:`LabelIssueReport.write`)::

    mislabelled.csv   rank, idx, key, observed, suggested, confidence   (flagged samples,
                      most confident first; class names as in the manifest)
    outliers.csv      rank, idx, key, observed, confidence              (LCCN* only)
    summary.json      counts, precision/recall at k of every ranking, cleanlab's beside LCCN
    summary.md        the same as tables

Conventions: ``phi[k, j] = P(observed = j | latent = k)``, rows sum to 1, ``(K_latent, K)``;
posteriors are ``(N, K_latent)`` with rows summing to 1; ``clean`` is ``-1`` where unknown
and ``K`` for an out-of-distribution sample.

    python -m pipeline.label_issues CHECKPOINT_DIR --shards TRAIN_SPLIT [--label-view V.npz]
    (or lccn-label-issues ...)
        [--out DIR] [--k 20 50] [--tracking-uri URI --mlflow-run-id ID]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.config import json_safe

__all__ = ["PosteriorWindow", "ReportAccumulator", "Ranking", "LabelIssueReport",
           "rank_mislabelled", "rank_outliers", "heldout_posterior", "cleanlab_ranking", "at_k",
           "build_report", "main"]

STATE_KEY = "label_report"
# the accumulator is dense (N, K_latent) float32 on every rank: above this many entries
# (400 MB) it stays off and the run says so (e.g. full WebVision: 2.4M x 1001)
MAX_ENTRIES = 100_000_000


# -- accumulating the chain's posterior during training ----------------------------------------


class PosteriorWindow:
    """Running per-sample sum of the Eq. 7 posterior (or some of its ``columns``) over the
    epochs ``[first, total_epochs)`` of a run whose samples are spread over ranks: the one
    accumulator behind the label-issue report and LCCN*'s exported p(outlier).

    Protocol (every call marked *collective* happens on every rank at the same moment):

    - :meth:`sink` at the start of an epoch's training pass: a callable taking ``idx (B,)
      int64`` and ``post (B, K_latent)`` (valid rows only), or None outside the window. It
      adds into a dense per-rank part on ``post``'s device: no host read in the step.
    - :meth:`merge` (collective) sums the parts of all ranks into ``sum``/``count`` (the
      same on every rank afterwards); the engine calls it at every checkpoint moment
      (``Method.flush``), so what a checkpoint carries includes the epoch's draws up to it
      and a run resumed mid-epoch ends with exactly the uninterrupted run's sums.
    - :meth:`end_epoch` (collective) merges and records the epoch.

    ``sum (N, width)`` in ``dtype``, ``count (N,)`` int64 (draws per sample).
    """

    def __init__(self, *, num_samples: int, width: int, first: int, total_epochs: int,
                 columns: slice | None = None, dtype: torch.dtype = torch.float32,
                 enabled: bool = True) -> None:
        self.num_samples, self.width = num_samples, width
        self.first, self.total_epochs = first, total_epochs
        self.columns, self.dtype = columns, dtype
        self.enabled = enabled
        self.sum: Tensor | None = None
        self.count: Tensor | None = None
        self.epochs: list[int] = []
        self._part: Tensor | None = None
        self._part_n: Tensor | None = None
        self._open = False  # between sink and end_epoch: the same on every rank

    def covers(self, epoch: int) -> bool:
        return self.enabled and self.first <= epoch < self.total_epochs

    def sink(self, epoch: int) -> Callable[[Tensor, Tensor], None] | None:
        if not self.covers(epoch):
            return None
        self._part = self._part_n = None
        self._open = True
        return self.add

    def add(self, idx: Tensor, post: Tensor) -> None:
        """Add a batch's posteriors ``post (B, K_latent)`` of samples ``idx (B,)``."""
        cols = post.detach() if self.columns is None else post.detach()[:, self.columns]
        if self._part is None:
            self._part = torch.zeros(self.num_samples, self.width, dtype=self.dtype,
                                     device=post.device)
            self._part_n = torch.zeros(self.num_samples, dtype=torch.int64, device=post.device)
        i = idx.to(post.device, non_blocking=True).long()
        self._part.index_add_(0, i, cols.to(self.dtype))
        self._part_n.index_add_(0, i, torch.ones_like(i))

    def merge(self, reduce: Callable[[Tensor], Tensor]) -> None:
        """Sum every rank's part since the last merge into ``sum``/``count`` (collective;
        nothing to do, on every rank alike, outside an open epoch)."""
        if not self._open:
            return
        # sums of at most a few probabilities per sample; counts exact in dtype up to 2^24
        part = (torch.zeros(self.num_samples, self.width + 1, dtype=self.dtype)
                if self._part is None else
                torch.cat([self._part, self._part_n.to(self.dtype).unsqueeze(1)], 1).cpu())
        tot = reduce(part)
        if self.sum is None:
            self.sum = torch.zeros(self.num_samples, self.width, dtype=self.dtype)
            self.count = torch.zeros(self.num_samples, dtype=torch.int64)
        self.sum += tot[:, :-1]
        self.count += tot[:, -1].round().long()
        self._part = self._part_n = None

    def end_epoch(self, epoch: int, reduce: Callable[[Tensor], Tensor]) -> None:
        """Merge the epoch's last part (collective) and record the epoch."""
        if not self.covers(epoch):
            return
        self.merge(reduce)
        self._open = False
        self.epochs.append(int(epoch))

    def mean(self) -> Tensor:
        """``(N, width)`` float64: the mean over each sample's draws (NaN without any)."""
        if self.sum is None:
            return torch.full((self.num_samples, self.width), math.nan, dtype=torch.float64)
        return self.sum.to(torch.float64) / self.count.unsqueeze(1).to(torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self.sum, "count": self.count, "epochs": list(self.epochs),
                "window": [self.first, self.total_epochs]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        total = state.get("sum")
        if total is not None and tuple(total.shape) != (self.num_samples, self.width):
            raise ValueError(f"averaged posterior state of shape {tuple(total.shape)}; this "
                             f"run has {(self.num_samples, self.width)}")
        self.sum = None if total is None else total.to(self.dtype).clone()
        self.count = None if total is None else state["count"].clone()
        self.epochs = list(state.get("epochs", []))
        self._part = self._part_n = None


class ReportAccumulator(PosteriorWindow):
    """The label-issue report's window: the whole posterior ``(N, K_latent)`` float32 over
    the last ``epochs`` epochs (off, and saying so, above ``MAX_ENTRIES``), and the final
    model's predictions on the noisy validation split."""

    def __init__(self, *, num_samples: int, k_latent: int, num_classes: int, epochs: int,
                 total_epochs: int, first_noise_epoch: int, alpha: Any) -> None:
        enabled = epochs > 0 and num_samples * k_latent <= MAX_ENTRIES
        super().__init__(num_samples=num_samples, width=k_latent,
                         first=max(first_noise_epoch, total_epochs - max(0, epochs)),
                         total_epochs=total_epochs, enabled=enabled)
        self.k_latent, self.num_classes = k_latent, num_classes
        self.alpha = alpha
        self.too_large = epochs > 0 and not enabled
        self.heldout: dict[str, Tensor] | None = None

    def record_heldout(self, probs: Tensor, idx: Tensor) -> None:
        """The latest model's probabilities ``(n, K_out)`` on the noisy validation split
        (gathered from every rank) and their ``idx (n,)``."""
        self.heldout = {"probs": probs.float().cpu(), "idx": idx.long().cpu()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "alpha": self.alpha, "k_latent": self.k_latent,
                "num_classes": self.num_classes, "heldout": self.heldout}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        super().load_state_dict(state)
        self.heldout = state.get("heldout")


def heldout_predictions(models: Sequence[torch.nn.Module], batches: Iterable[Any] | None, *,
                        width: int, device: torch.device, gather: Callable[[Tensor], Tensor]
                        ) -> tuple[Tensor, Tensor] | None:
    """Softmax probabilities ``(n, width)`` (the mean over ``models``, ``width`` logits
    each) and ``idx (n,)`` of the valid samples of ``batches``, gathered over ranks with
    ``gather`` (every rank calls it; a rank with no batch contributes no row). None
    without batches (no noisy validation split)."""
    if batches is None:
        return None
    probs, idxs = [torch.zeros(0, width)], [torch.zeros(0, dtype=torch.int64)]
    with torch.no_grad():
        for m in models:
            m.eval()
        for b in batches:
            x = b.images.to(device, non_blocking=True)
            p = torch.stack([torch.softmax(m(x).float(), 1) for m in models]).mean(0)
            probs.append(p[b.valid.to(device)].cpu())
            idxs.append(b.idx[b.valid])
    return gather(torch.cat(probs)), gather(torch.cat(idxs))


def accumulator_for(run: Any, engine: Any, *, k_latent: int) -> ReportAccumulator:
    """The accumulator of an LCCN method's run (``run.lccn.report_epochs``); says on rank 0
    when the run's size keeps it off."""
    o = run.optim
    acc = ReportAccumulator(num_samples=engine.data.num_samples, k_latent=k_latent,
                            num_classes=engine.num_classes, epochs=run.lccn.report_epochs,
                            total_epochs=o.epochs, first_noise_epoch=o.pretrain_epochs,
                            alpha=run.lccn.alpha)
    if acc.too_large and engine.session.rank == 0:
        print(f"label-issue report off: N x K_latent = {engine.data.num_samples} x "
              f"{k_latent} posteriors exceed {MAX_ENTRIES:,} entries", flush=True)
    return acc


def finish_epoch(acc: ReportAccumulator, engine: Any, epoch: int,
                 models: Sequence[torch.nn.Module]) -> None:
    """Every rank, after an epoch's training pass: sum the epoch's posteriors over ranks and
    record the ``models``' predictions on the noisy validation split (the out-of-sample
    predictions cleanlab is compared on), replacing the last epoch's: a run that stops
    early (the collapse monitor) still reports on the model it ended with."""
    if not acc.covers(epoch):
        return
    acc.end_epoch(epoch, engine.reduce_cpu)
    if getattr(engine.data, "held_out", None) is not None:
        from pipeline.engine import all_gather_rows

        got = heldout_predictions(models, engine.data.val_batches(), width=engine.k_latent,
                                  device=engine.device,
                                  gather=lambda t: all_gather_rows(engine.session, t))
        if got is not None:
            acc.record_heldout(*got)


# -- rankings ----------------------------------------------------------------------------------


@dataclass
class Ranking:
    """One method's verdict over a set of samples: ``idx (n,)``, ``score (n,)`` (higher =
    more likely an issue), ``flagged (n,) bool`` (the method's own decision), and
    ``suggested (n,)`` (the label it proposes; -1 where it proposes none)."""

    name: str
    idx: np.ndarray
    score: np.ndarray
    flagged: np.ndarray
    suggested: np.ndarray

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
        summary = self.summary()
        paths.append(out / "summary.json")
        paths[-1].write_text(json.dumps(json_safe(summary), indent=1))
        paths.append(out / "summary.md")
        paths[-1].write_text(self.markdown())
        return paths

    def summary(self) -> dict[str, Any]:
        return {"samples": int(len(self.mislabelled.idx)),
                "flagged_mislabelled": int(self.mislabelled.flagged.sum()),
                "flagged_outliers": (None if self.outliers is None
                                     else int(self.outliers.flagged.sum())),
                "posterior_epochs": self.epochs, "evaluation": self.evaluation,
                "notes": self.notes}

    def markdown(self) -> str:
        s = self.summary()
        lines = ["# Label-issue report", "",
                 f"{s['samples']} training samples ranked by their Eq. 7 posterior averaged "
                 f"over epoch{'s' if len(self.epochs) > 1 else ''} "
                 f"{', '.join(str(e + 1) for e in self.epochs)}; "
                 f"{s['flagged_mislabelled']} flagged as mislabelled"
                 + ("" if s["flagged_outliers"] is None else
                    f", {s['flagged_outliers']} as out of distribution") + ".", ""]
        if self.evaluation:
            lines += ["| split | issues | method | k | precision | recall |",
                      "|---|---|---|---|---|---|"]
            for ev in self.evaluation:
                for r in ev["at"]:
                    lines.append(f"| {ev['split']} | {ev['kind']} ({ev['issues']} of "
                                 f"{ev['evaluated']}) | {ev['method']} | {r['k']} | "
                                 f"{_fmt(r['precision'])} | {_fmt(r['recall'])} |")
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
    if not acc or acc.get("sum") is None:
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
    total = np.asarray(acc["sum"], dtype=np.float64)
    count = np.asarray(acc["count"], dtype=np.int64)
    if total.shape[0] != n:
        raise ValueError(f"the averaged posterior has {total.shape[0]} rows, the chain {n}")
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
    post = total[rows] / count[rows, None]
    mis = rank_mislabelled(post, observed[rows], rows, num_classes=k)
    out = rank_outliers(post, rows, num_classes=k) if total.shape[1] == k + 1 else None
    report = LabelIssueReport(mis, out, observed, keys, list(class_names),
                              list(acc.get("epochs", [])))
    lo, hi = (int(count[rows].min()), int(count[rows].max())) if len(rows) else (0, 0)
    report.notes.append(f"training split: {len(rows)} samples counted in the chain, each "
                        f"with {lo if lo == hi else f'{lo} to {hi}'} averaged "
                        f"posterior{'' if hi == 1 else 's'}")
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
            report.evaluation.append(ev)

    evaluate("train", mis, "mislabelled", observed[rows])
    if out is not None:
        evaluate("train", out, "outlier", observed[rows])
    held = acc.get("heldout")
    if held is None or len(held["idx"]) == 0:
        report.notes.append("no noisy validation split: cleanlab (which needs out-of-sample "
                            "predictions) not compared")
        return report
    hidx = np.asarray(held["idx"], dtype=np.int64)
    hprobs = np.asarray(held["probs"], dtype=np.float64)
    from pipeline.confusion import transition

    phi = transition(torch.as_tensor(chain["counts"]),
                     torch.as_tensor(acc["alpha"], dtype=torch.float64)).numpy()
    hobs = observed[hidx]
    lpost = heldout_posterior(hprobs[:, :phi.shape[0]], hobs, phi)
    evaluate("validation", rank_mislabelled(lpost, hobs, hidx, num_classes=k),
             "mislabelled", hobs)
    evaluate("validation", cleanlab_ranking(hprobs, hobs, hidx, num_classes=k),
             "mislabelled", hobs)
    report.notes.append(
        f"validation split: {len(hidx)} held-out samples (never trained on, never counted "
        f"in C); cleanlab's find_label_issues and LCCN's Eq. 7 posterior "
        f"P(k|x) phi[k, observed] both from the final model's out-of-sample probabilities")
    return report


def split_keys(train_source: str) -> list[str] | None:
    """The dataset keys of a local training split (None for a remote one)."""
    if "://" in str(train_source):
        return None
    from shards.labelview import read_split_labels

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
    if not acc or acc.get("sum") is None:
        return None
    report = build_report(state, clean=clean, keys=split_keys(train_source),
                          class_names=class_names)
    paths = report.write(out_dir)
    if tracking_uri and run_id:
        log_report(tracking_uri, run_id, paths, report)
    return {**report.summary(), "files": [str(p) for p in paths]}


# -- the command line ----------------------------------------------------------------------------


def get_args_parser() -> argparse.ArgumentParser:
    from shards.cli import prog_name

    p = argparse.ArgumentParser(
        prog=prog_name("pipeline.label_issues"),
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
    """The command line (``python -m pipeline.label_issues``, ``lccn-label-issues``);
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
        from pipeline.manifest import Manifest
        from shards.labelview import read_split_labels

        try:
            labels = read_split_labels(args.shards)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --shards {args.shards}: {e}") from None
        keys, clean = [str(k) for k in labels["key"]], labels["clean"]
        names = list(Manifest.load(args.shards).classes)
    if args.label_view is not None:
        from pipeline.labels import LabelView

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
