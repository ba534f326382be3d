"""Progress inside an epoch (rank 0): on a 1M-image epoch one line per epoch leaves an hour
of silence.

:class:`EpochProgress` is told of every training step. On a terminal it draws a tqdm bar;
otherwise (job logs, ``ray job logs``) it prints a plain line every ``every_s`` seconds:
the step, the epoch's fraction, images/s since the epoch (or the resumed part of it)
started, and the time left in the epoch at that rate. The same figures go to MLflow as the
metrics ``progress_images_per_s`` and ``progress_epoch_fraction`` at the global step (the
epoch rows use the epoch as their step: separate names keep the two apart).

Imports: the standard library and tqdm.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm


def format_seconds(s: float) -> str:
    """``1h02m``, ``12m05s`` or ``42s``."""
    if s != s or s in (float("inf"), float("-inf")):
        return "?"
    s = max(0, int(round(s)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class EpochProgress:
    """Rank 0's progress through one epoch's training pass.

    label: the line's prefix (the run name); epoch: 0-based; steps: the pass's steps;
    start: steps already done (a resumed epoch); images_per_step: the global batch;
    every_s: seconds between plain lines (0: none); bar: a tqdm bar instead of lines
    (default: when ``stream`` is a terminal); log: ``log(metrics, step)`` (MLflow) called
    with each line's figures; clock: seconds (tests pass their own).
    """

    def __init__(self, *, label: str, epoch: int, epochs: int, steps: int, start: int = 0,
                 images_per_step: int, every_s: float, stream: TextIO | None = None,
                 bar: bool | None = None, log: Callable[[dict[str, float], int], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.epoch, self.epochs = label, epoch, epochs
        self.steps, self.start, self.done = steps, start, start
        self.images_per_step, self.every_s = images_per_step, every_s
        self.stream = stream if stream is not None else sys.stdout
        self.log, self.clock = log, clock
        self.t0 = self.last = clock()
        if bar is None:
            bar = bool(every_s) and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = (tqdm(total=steps, initial=start, unit="step", file=self.stream,
                         desc=f"[{label}] epoch {epoch + 1}/{epochs}", leave=False,
                         dynamic_ncols=True) if bar else None)
        self.lines = 0

    def figures(self) -> dict[str, float]:
        """images/s since the start, the epoch's fraction done and the seconds left."""
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = (self.done - self.start) / elapsed
        left = (self.steps - self.done) / rate if rate > 0 else float("inf")
        return {"images_per_s": rate * self.images_per_step,
                "epoch_fraction": self.done / max(self.steps, 1), "eta_s": left}

    def step(self, global_step: int) -> None:
        """One more step done (``global_step``: the run's count after it)."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        if not self.every_s or self.clock() - self.last < self.every_s \
                or self.done >= self.steps:
            return
        self.last = self.clock()
        f = self.figures()
        print(f"[{self.label}] epoch {self.epoch + 1}/{self.epochs}  step "
              f"{self.done}/{self.steps} ({100 * f['epoch_fraction']:.0f}%)  "
              f"{f['images_per_s']:.1f} img/s  epoch ETA {format_seconds(f['eta_s'])}",
              file=self.stream, flush=True)
        self.lines += 1
        if self.log is not None:
            self.log({"progress_images_per_s": f["images_per_s"],
                      "progress_epoch_fraction": f["epoch_fraction"]}, global_step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
