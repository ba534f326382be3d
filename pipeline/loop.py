"""``train_one_epoch`` and ``evaluate``: they return dicts of plain floats and never log or
save; the caller does. A batch is anything with fields ``images (B,C,H,W)``,
``observed (B,)``, ``idx (B,)``, ``clean (B,)`` (-1 unknown, K outlier) and ``valid (B,) bool``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.lccn import GibbsLabeler
from pipeline.losses import clipped_cross_entropy, soft_cross_entropy


def _lookahead(batches: Iterable[Any]) -> Iterator[tuple[Any, Any | None]]:
    """Yield (batch, next_batch or None) so the labeler can prefetch the next batch's z."""
    it = iter(batches)
    try:
        cur = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield cur, nxt
        cur = nxt
    yield cur, None


def train_one_epoch(model: nn.Module, batches: Iterable[Any], optimizer: torch.optim.Optimizer, *,
                    labeler: GibbsLabeler | None = None, trusted: Tensor | None = None,
                    xi: float = 1e-20, device: torch.device | str = "cpu",
                    num_classes: int | None = None,
                    after_step: Callable[[], None] | None = None) -> dict[str, float]:
    """One pass over ``batches``.

    labeler None: cross-entropy on the observed labels (CE; trusted samples, if a
    ``trusted (N,) bool`` lookup is given, train on their clean label). Otherwise LCCN:
    forward -> Gibbs-sample z (Eq. 7) -> commit z (async) -> ξ-clipped CE on z (or, with
    ``targets="posterior"``, on the Eq. 7 conditional z was drawn from) -> backward.
    Returns loss, label_recovery (sampled z == clean where the clean label is known),
    changed (fraction of z that moved), staleness, gamma, step_time, sampler_time,
    sampler_share, sync_time, images_per_s, steps.
    """
    model.train()
    tot = {"loss": 0.0, "n": 0, "recovered": 0, "known": 0, "changed": 0.0,
           "staleness": 0.0, "sampler": 0.0, "sync": 0.0, "steps": 0, "gamma": 1.0}
    t_start = time.perf_counter()
    for batch, nxt in _lookahead(batches):
        images = batch.images.to(device, non_blocking=True)
        observed, idx, clean, valid = batch.observed, batch.idx, batch.clean, batch.valid
        if labeler is not None and tot["steps"] == 0:
            labeler.prefetch(idx)
        logits = model(images)
        if labeler is not None:
            t0 = time.perf_counter()
            probs = torch.softmax(logits.detach().float(), dim=1)
            z, stats = labeler.sample(probs, observed, idx)
            tot["sampler"] += time.perf_counter() - t0 - stats.wait
            tot["sync"] += stats.wait
            target = z if labeler.cfg.targets != "map" else stats.posterior.argmax(1)
            # send the labels now: the round trip overlaps backward, the optimiser step and
            # the next forward; the reply is awaited by the next sample()
            t0 = time.perf_counter()
            labeler.commit(idx[valid], z[valid], nxt.idx if nxt is not None else None)
            tot["sync"] += time.perf_counter() - t0
            tot["changed"] += stats.changed
            tot["staleness"] += stats.staleness
            tot["gamma"] = stats.gamma
        labels = observed if trusted is None else torch.where(trusted[idx], clean, observed)
        if labeler is None:
            target = labels
        w = valid.to(device)
        if labeler is not None and labeler.cfg.targets == "posterior":
            loss = soft_cross_entropy(logits, stats.posterior.to(device), xi=xi, weight=w)
        else:
            loss = clipped_cross_entropy(logits, target.to(device), xi=xi, weight=w)
        if labeler is not None and stats.ramp < 1.0:
            # the LCCN target's weight ramps up from 0: a weak pretrained classifier keeps
            # learning from the observed labels while its own posterior is still poor
            loss = stats.ramp * loss + (1.0 - stats.ramp) * clipped_cross_entropy(
                logits, labels.to(device), xi=xi, weight=w)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        nvalid = int(valid.sum())
        tot["loss"] += float(loss.detach()) * nvalid
        tot["n"] += nvalid
        known = valid & (clean >= 0)
        if num_classes is not None:
            known &= clean <= num_classes
        tot["known"] += int(known.sum())
        tot["recovered"] += int((target.cpu()[known] == clean[known]).sum())
        tot["steps"] += 1
    if labeler is not None:
        tot["sync"] += labeler.flush()
    elapsed = time.perf_counter() - t_start
    steps = max(tot["steps"], 1)
    return {
        "loss": tot["loss"] / max(tot["n"], 1),
        "label_recovery": tot["recovered"] / tot["known"] if tot["known"] else float("nan"),
        "changed": tot["changed"] / steps,
        "staleness": tot["staleness"] / steps,
        "gamma": float(tot["gamma"]),
        "step_time": elapsed / steps,
        "sampler_time": tot["sampler"] / steps,
        "sync_time": tot["sync"] / steps,
        "sampler_share": (tot["sampler"] + tot["sync"]) / elapsed if elapsed > 0 else 0.0,
        "images_per_s": tot["n"] / elapsed if elapsed > 0 else 0.0,
        "steps": float(tot["steps"]),
    }


@torch.no_grad()
def predict(model: nn.Module, batches: Iterable[Any], *, device: torch.device | str = "cpu"
            ) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax probabilities ``(N, K_out)``, idx ``(N,)`` and clean ``(N,)`` over ``batches``
    (valid samples only)."""
    model.eval()
    probs, idxs, cleans = [], [], []
    for b in batches:
        p = torch.softmax(model(b.images.to(device)).float(), dim=1).cpu()
        probs.append(p[b.valid])
        idxs.append(b.idx[b.valid])
        cleans.append(b.clean[b.valid])
    return torch.cat(probs), torch.cat(idxs), torch.cat(cleans)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Any], *, num_classes: int,
             device: torch.device | str = "cpu") -> dict[str, float]:
    """Clean top-1 / top-5 accuracy over samples with a clean label in ``[0, K)``.

    For a K+1-way model (LCCN*) the outlier logit is left out of the ranking.
    """
    probs, _, clean = predict(model, batches, device=device)
    keep = (clean >= 0) & (clean < num_classes)
    probs, clean = probs[keep, :num_classes], clean[keep]
    if clean.numel() == 0:
        return {"top1": float("nan"), "top5": float("nan"), "n": 0.0}
    topk = probs.topk(min(5, num_classes), dim=1).indices
    top1 = (topk[:, 0] == clean).float().mean()
    top5 = (topk == clean.unsqueeze(1)).any(1).float().mean()
    return {"top1": float(top1), "top5": float(top5), "n": float(clean.numel())}
