"""The cross-entropy baseline: the observed labels for every epoch, on the same schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pipeline.train.loop import train_one_epoch
from pipeline.train.methods.base import Method, register


@register
class CrossEntropy(Method):
    name = "ce"

    def train_epoch(self, epoch: int, batches: Iterable[Any],
                    after_step: Callable[[], None]) -> dict[str, float]:
        m = self.members[0]
        return train_one_epoch(m.train_model, batches, m.optimizer, labeler=None, trusted=None,
                               xi=self.run.lccn.xi, device=self.engine.device,
                               num_classes=self.num_classes, after_step=after_step)
