"""The cross-entropy baseline: the observed labels for every epoch, on the same schedule
(the base class's training pass, :meth:`Method.train_task`)."""

from __future__ import annotations

from pipeline.train.methods.base import Method, register


@register
class CrossEntropy(Method):
    name = "ce"
    auto_warmup = True  # no noise phase: the same run either way
