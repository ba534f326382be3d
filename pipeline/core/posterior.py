"""Posterior windows: per-sample running sums of the Eq. 7 posterior over the last epochs
of a run, summed over ranks through a reduce callable it is given (no collectives of its
own). They back the label-issue report (:class:`ReportAccumulator`) and LCCN*'s exported
p(outlier).

Conventions: ``post (B, K_latent)``, rows sum to 1; ``idx (B,)`` int64 in ``[0, N)``.
Imports: torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

STATE_KEY = "label_report"
# the report's accumulator keeps every class of every sample up to this many entries (400 MB
# of float32: exact), and the REPORT_TOPK largest classes of each sample above it (e.g. full
# WebVision, 2.4M x 1001)
MAX_ENTRIES = 100_000_000
REPORT_TOPK = 10
MERGE_ROWS = 16_384  # rows merged at a time (a dense (rows, K_latent) float32 scratch)


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


class ReportAccumulator:
    """The label-issue report's window: every training sample's Eq. 7 posterior summed over
    the last ``epochs`` epochs, kept in ``O(N x k)`` memory, and the final model's
    predictions on the noisy validation split. The :class:`PosteriorWindow` protocol
    (``covers``, ``sink``, ``merge``, ``end_epoch``; the collectives on every rank alike).

    Per sample: ``top_cls (N, k)`` int32 and ``top_sum (N, k)`` float32, the ``k`` classes
    with the largest summed posterior and their sums; ``obs_sum (N,)`` the exact summed
    posterior of the sample's observed label (``observed``), ``out_sum (N,)`` that of the
    outlier class ``K`` (LCCN*; zeros otherwise), ``count (N,)`` the draws summed.
    While ``N x K_latent <= MAX_ENTRIES`` every class is kept instead, as dense sums
    (``sum (N, K_latent)``, a :class:`PosteriorWindow`: exact, and an index_add per batch).
    Above it ``k = min(K_latent, topk)``: at each addition a sample keeps the ``k`` largest of its
    running sums plus the new posterior, so a class's sum is lost only when it stays below
    the k-th largest (under 1/k of the mass); the mislabelled and outlier scores read the
    exact sums. Full WebVision (2.4M x 1000) takes 0.21 GiB instead of 8.9 GiB
    (benchmarks/results/label_issues_scale.md).

    Between two merges every sample is visited by one rank at most (each sample once per
    epoch; merges at every epoch end and checkpoint), so the merge is one all-reduce sum of
    the ranks' parts, each row non-zero on one rank; a row two ranks touched is an error.
    """

    def __init__(self, *, num_samples: int, k_latent: int, num_classes: int, epochs: int,
                 total_epochs: int, first_noise_epoch: int, alpha: Any,
                 observed: Tensor | None = None, topk: int = REPORT_TOPK) -> None:
        self.num_samples, self.k_latent, self.num_classes = num_samples, k_latent, num_classes
        self.first = max(first_noise_epoch, total_epochs - max(0, epochs))
        self.total_epochs = total_epochs
        self.enabled = epochs > 0
        self.exact = num_samples * k_latent <= MAX_ENTRIES
        self.k = k_latent if self.exact else min(k_latent, max(1, int(topk)))
        self.alpha = alpha
        if observed is not None and tuple(observed.shape) != (num_samples,):
            raise ValueError(f"observed must be ({num_samples},), got {tuple(observed.shape)}")
        self.observed = None if observed is None else observed.long().cpu()
        self.heldout: dict[str, Tensor] | None = None
        # the selected epoch's held-out predictions (record_selected)
        self.selected: dict[str, Any] | None = None
        self.top_cls: Tensor | None = None
        self.top_sum: Tensor | None = None
        self.obs_sum: Tensor | None = None
        self.out_sum: Tensor | None = None
        self.count: Tensor | None = None
        self.epochs: list[int] = []
        self._part: dict[str, Tensor] | None = None
        self._observed_dev: Tensor | None = None
        self._open = False
        # every class kept: the dense sums (an index_add per batch, the old state format)
        self.dense = PosteriorWindow(num_samples=num_samples, width=k_latent, first=self.first,
                                     total_epochs=total_epochs, enabled=self.enabled) \
            if self.exact else None

    @property
    def sum(self) -> Tensor | None:
        """The dense sums ``(N, K_latent)`` (while every class is kept), else None."""
        return None if self.dense is None else self.dense.sum

    def covers(self, epoch: int) -> bool:
        return self.enabled and self.first <= epoch < self.total_epochs

    def sink(self, epoch: int) -> Callable[[Tensor, Tensor], None] | None:
        if self.dense is not None:
            return self.dense.sink(epoch)
        if not self.covers(epoch):
            return None
        self._part = None
        self._open = True
        return self.add

    def add(self, idx: Tensor, post: Tensor) -> None:
        """Add a batch's posteriors ``post (B, K_latent)`` of samples ``idx (B,)`` (each
        sample once in a batch)."""
        post = post.detach().float()
        dev, n, k = post.device, self.num_samples, self.k
        if self._part is None:
            self._part = {"cls": torch.zeros(n, k, dtype=torch.int32, device=dev),
                          "sum": torch.zeros(n, k, dtype=torch.float32, device=dev),
                          "obs": torch.zeros(n, dtype=torch.float32, device=dev),
                          "out": torch.zeros(n, dtype=torch.float32, device=dev),
                          "n": torch.zeros(n, dtype=torch.int64, device=dev)}
            self._observed_dev = None if self.observed is None else self.observed.to(dev)
        part = self._part
        i = idx.to(dev, non_blocking=True).long()
        cls, val = _top_of(post, part["cls"][i], part["sum"][i], k)
        part["cls"][i], part["sum"][i] = cls, val
        if self._observed_dev is not None:
            part["obs"].index_add_(0, i, post.gather(1, self._observed_dev[i, None])[:, 0])
        if self.k_latent > self.num_classes:
            part["out"].index_add_(0, i, post[:, self.num_classes])
        part["n"].index_add_(0, i, torch.ones_like(i))

    def merge(self, reduce: Callable[[Tensor], Tensor]) -> None:
        """Add every rank's part since the last merge into the sums (collective; nothing to
        do, on every rank alike, outside an open epoch)."""
        if self.dense is not None:
            self.dense.merge(reduce)
            self.count = self.dense.count
            return
        if not self._open:
            return
        n, k = self.num_samples, self.k
        # one float32 all-reduce: [cls + 1 (k), sums (k), obs, out, draws, ranks]; class ids
        # and draw counts are exact in float32 (< 2^24)
        packed = torch.zeros(n, 2 * k + 4, dtype=torch.float32)
        if self._part is not None:
            part = {key: t.cpu() for key, t in self._part.items()}
            seen = part["n"] > 0
            packed[:, :k] = torch.where(seen[:, None], part["cls"].float() + 1, 0.0)
            packed[:, k:2 * k] = part["sum"]
            packed[:, 2 * k] = part["obs"]
            packed[:, 2 * k + 1] = part["out"]
            packed[:, 2 * k + 2] = part["n"].float()
            packed[:, 2 * k + 3] = seen.float()
        tot = reduce(packed)
        self._part = None
        twice = torch.nonzero(tot[:, 2 * k + 3] > 1.5)
        if twice.numel():
            raise RuntimeError(f"the label-issue report's posteriors of sample "
                               f"{int(twice[0, 0])} came from two ranks between two merges "
                               f"(each sample is visited once an epoch by one rank)")
        if self.count is None:
            self.top_cls = torch.zeros(n, k, dtype=torch.int32)
            self.top_sum = torch.zeros(n, k, dtype=torch.float32)
            self.obs_sum = torch.zeros(n, dtype=torch.float32)
            self.out_sum = torch.zeros(n, dtype=torch.float32)
            self.count = torch.zeros(n, dtype=torch.int64)
        rows = torch.nonzero(tot[:, 2 * k + 2] > 0)[:, 0]
        for chunk in rows.split(MERGE_ROWS):
            t = tot[chunk]
            cls, val = _top_of(self._dense(t[:, :k].long() - 1, t[:, k:2 * k]),
                               self.top_cls[chunk], self.top_sum[chunk], k)
            self.top_cls[chunk], self.top_sum[chunk] = cls, val
        self.obs_sum += tot[:, 2 * k]
        self.out_sum += tot[:, 2 * k + 1]
        self.count += tot[:, 2 * k + 2].round().long()

    def _dense(self, cls: Tensor, val: Tensor) -> Tensor:
        """``(R, K_latent)`` from sparse rows (``cls`` -1: no entry)."""
        out = torch.zeros(cls.shape[0], self.k_latent, dtype=torch.float32)
        return out.scatter_add_(1, cls.clamp_min(0), torch.where(cls >= 0, val, 0.0))

    def end_epoch(self, epoch: int, reduce: Callable[[Tensor], Tensor]) -> None:
        """Merge the epoch's last part (collective) and record the epoch."""
        if not self.covers(epoch):
            return
        if self.dense is not None:
            self.dense.end_epoch(epoch, reduce)
            self.count, self.epochs = self.dense.count, self.dense.epochs
            return
        self.merge(reduce)
        self._open = False
        self.epochs.append(int(epoch))

    def record_heldout(self, probs: Tensor, idx: Tensor) -> None:
        """The latest model's probabilities ``(n, K_out)`` on the noisy validation split
        (gathered from every rank) and their ``idx (n,)``."""
        self.heldout = {"probs": probs.float().cpu(), "idx": idx.long().cpu()}

    def record_selected(self, probs: Tensor, idx: Tensor, *, epoch: int,
                        val_top1: float) -> None:
        """The same from the classifier of the run's selected epoch so far (the best noisy
        validation accuracy; what the run exports): the report's out-of-sample
        predictions."""
        self.selected = {"probs": probs.float().cpu(), "idx": idx.long().cpu(),
                         "epoch": int(epoch), "val_top1": float(val_top1)}

    def state_dict(self) -> dict[str, Any]:
        common = {"alpha": self.alpha, "k_latent": self.k_latent,
                  "num_classes": self.num_classes, "heldout": self.heldout,
                  "heldout_selected": self.selected}
        if self.dense is not None:  # {"sum", "count", "epochs", "window"}
            return {**self.dense.state_dict(), **common}
        return {"top_cls": self.top_cls, "top_sum": self.top_sum, "obs_sum": self.obs_sum,
                "out_sum": self.out_sum, "count": self.count, "topk": self.k,
                "exact_observed": self.observed is not None, "epochs": list(self.epochs),
                "window": [self.first, self.total_epochs], **common}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.heldout = state.get("heldout")
        self.selected = state.get("heldout_selected")
        if self.dense is not None:
            if state.get("sum") is None and state.get("top_cls") is not None:
                raise ValueError("a top-k report state cannot resume a run that keeps every "
                                 "class (the same run's size decides it)")
            self.dense.load_state_dict(state)
            self.count, self.epochs = self.dense.count, self.dense.epochs
            return
        self.epochs = list(state.get("epochs", []))
        self._part = None
        if state.get("count") is None:
            return
        cls, val, obs, out = sparse_sums(state, self.observed)
        if cls.shape[0] != self.num_samples:
            raise ValueError(f"averaged posterior state of {cls.shape[0]} samples; this run "
                             f"has {self.num_samples}")
        if cls.shape[1] != self.k:  # another k: re-cut the kept classes
            cls, val = _top_of(self._dense(cls.long(), val), None, None, self.k)
        self.top_cls, self.top_sum = cls.int().clone(), val.float().clone()
        self.obs_sum, self.out_sum = obs.float().clone(), out.float().clone()
        self.count = state["count"].clone()


def _top_of(post: Tensor, cls: Tensor | None, val: Tensor | None, k: int
            ) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of ``post (R, K_latent)`` plus the sparse rows ``cls,
    val (R, k)`` (``cls`` -1 or a 0 value: no entry): ``(cls int32, val float32)``,
    largest first."""
    dense = post.float().clone()
    if cls is not None:
        c = cls.long()
        dense.scatter_add_(1, c.clamp_min(0), torch.where(c >= 0, val.float(), 0.0))
    top, at = dense.topk(k, dim=1)
    return at.int(), top


def sparse_sums(state: dict[str, Any], observed: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A report state's sums as ``(top_cls (N, k), top_sum (N, k), obs_sum (N,), out_sum
    (N,))``; a dense state of an older run (``sum (N, K_latent)``) as all its classes. The
    observed label's sum is read from the kept classes where the state has no exact one
    (``observed`` given: from the dense sums)."""
    if state.get("top_cls") is not None:
        cls, val = state["top_cls"], state["top_sum"]
        obs, out = state["obs_sum"], state["out_sum"]
        if not state.get("exact_observed", True) and observed is not None:
            hit = cls.long() == observed.long()[:, None]
            obs = (val * hit).sum(1)
        return cls, val, obs, out
    dense = state["sum"].float()
    n, width = dense.shape
    k_cls = int(state.get("num_classes", width))
    cls = torch.arange(width, dtype=torch.int32).expand(n, width).clone()
    obs = (dense.gather(1, observed.long()[:, None])[:, 0] if observed is not None
           else torch.zeros(n))
    out = dense[:, k_cls] if width > k_cls else torch.zeros(n)
    return cls, dense, obs, out
