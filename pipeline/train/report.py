"""Feeding the label-issue report during a run: the accumulator of a method (its
posterior windows, :mod:`pipeline.core.posterior`) made for the engine's data, the noisy
validation split's predictions, and the end of each epoch (ranks merged). The report
itself is :mod:`pipeline.track.label_issues`.

Imports: :mod:`pipeline.core`, :mod:`pipeline.train.session`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from pipeline.core.posterior import MAX_ENTRIES, ReportAccumulator
from pipeline.train.session import all_gather_rows


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
    when the run's size makes it keep each sample's top classes only."""
    o = run.optim
    acc = ReportAccumulator(num_samples=engine.data.num_samples, k_latent=k_latent,
                            num_classes=engine.num_classes, epochs=run.lccn.report_epochs,
                            total_epochs=o.epochs, first_noise_epoch=o.pretrain_epochs,
                            alpha=run.lccn.alpha,
                            observed=getattr(engine.data, "observed", None))
    if not acc.exact and acc.enabled and engine.session.rank == 0:
        print(f"label-issue report: N x K_latent = {engine.data.num_samples:,} x {k_latent} "
              f"is above {MAX_ENTRIES:,}: each sample keeps its {acc.k} largest classes "
              f"(the scores stay exact)", flush=True)
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
        got = heldout_predictions(models, engine.data.val_batches(), width=engine.k_latent,
                                  device=engine.device,
                                  gather=lambda t: all_gather_rows(engine.session, t))
        if got is not None:
            acc.record_heldout(*got)


def record_if_selected(acc: ReportAccumulator, engine: Any, models: Sequence[torch.nn.Module],
                       row: dict[str, float]) -> None:
    """Every rank, once an epoch's row is scored: when its noisy validation accuracy beats
    every earlier epoch's that the accumulator has seen (the first of equals, as the
    engine's selected epoch), record the ``models``' held-out predictions as the
    selected classifier's (the same decision on every rank: the row is all-reduced)."""
    if not acc.enabled or getattr(engine.data, "held_out", None) is None:
        return
    val = float(row.get("val_top1", float("nan")))
    best = acc.selected["val_top1"] if acc.selected is not None else float("-inf")
    if not val > best:
        return
    got = heldout_predictions(models, engine.data.val_batches(), width=engine.k_latent,
                              device=engine.device,
                              gather=lambda t: all_gather_rows(engine.session, t))
    if got is not None:
        acc.record_selected(*got, epoch=int(row.get("epoch", -1)), val_top1=val)
