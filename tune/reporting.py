"""From a Train run to Tune: one Tune result per epoch of the trial's Ray Train run.

A sweep trial is a Tune function that builds and fits the job's ``TorchTrainer``; Ray Train
V2 hands every ``ray.train.report`` of the workers to the trainer's callbacks, and
:class:`EpochReport` (a ``TuneReportCallback``) passes rank 0's metrics on to the trial's
Tune session. Only the reports that close an epoch go on (they carry ``val_top1``; the
mid-epoch checkpoint reports carry only the step), each with ``epochs_done`` = epochs
finished, the clock ASHA compares trials on. Without per-epoch results a scheduler cannot
stop a weak trial before its last epoch.
"""

from __future__ import annotations

import math
from typing import Any

from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY, TuneReportCallback

from tune.search_spaces import METRIC, TIME_ATTR


def epoch_result(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The Tune result of one Train report of rank 0: its numeric metrics plus
    ``epochs_done``, or None for a report that does not close an epoch."""
    if METRIC not in metrics or "epoch" not in metrics:
        return None
    out = {k: float(v) for k, v in metrics.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = {k: v for k, v in out.items() if not math.isinf(v)}
    out[TIME_ATTR] = int(metrics["epoch"]) + 1
    return out


class EpochReport(TuneReportCallback):
    """``TuneReportCallback`` that forwards epoch-closing reports only (see module doc)."""

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        result = epoch_result(metrics[0] if metrics else {})
        if result is None:
            return
        if checkpoint is not None:
            result[CHECKPOINT_PATH_KEY] = checkpoint.path
        self._training_actor_item_queue.put(result)
