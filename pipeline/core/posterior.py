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
