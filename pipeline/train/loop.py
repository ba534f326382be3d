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

from pipeline.core.losses import clipped_cross_entropy, soft_cross_entropy
from pipeline.train.fastpath import HostStage, to_device
from pipeline.train.labeler import GibbsLabeler


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
                    after_step: Callable[[], None] | None = None,
                    loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                    before_step: Callable[[], None] | None = None,
                    observe: Callable[[Tensor, Tensor, Tensor], None] | None = None
                    ) -> dict[str, float]:
    """One pass over ``batches``.

    labeler None: cross-entropy on the observed labels (CE; trusted samples, if a
    ``trusted (N,) bool`` lookup is given, train on their clean label), or
    ``loss_fn(logits, labels, weight)`` on them (a baseline's loss; ``weight (B,)`` float
    is 0 at padding). ``before_step()`` runs between backward and the optimiser step (a
    method's own parameters outside DDP: all-reduce their gradients). Otherwise LCCN:
    forward -> Gibbs-sample z (Eq. 7) -> ξ-clipped CE on z (or, with
    ``targets="posterior"``, on the Eq. 7 conditional z was drawn from) -> backward ->
    optimiser step -> commit z (async; the store's reply is awaited by the next sample);
    ``observe(idx (B,), posterior (B, K_latent), valid (B,) bool)`` sees the Eq. 7
    conditional of every batch (LCCN*'s p(outlier) average).
    Returns loss, label_recovery (sampled z == clean where the clean label is known),
    changed (fraction of z that moved), staleness, gamma, step_time, sampler_time,
    sampler_share, sync_time, images_per_s, steps.

    On an accelerator the step never waits for the device except where the store needs the
    sampled labels: z goes to the host through a pinned buffer whose copy is enqueued right
    after sampling and awaited only after backward and the optimiser step are enqueued, so
    the device stays busy; the per-step figures accumulate on the device and are read once,
    at the end of the epoch.
    """
    model.train()
    dev = torch.device(device)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    acc = {"loss": zero.clone(), "recovered": zero.clone(), "changed": zero.clone()}
    tot = {"n": 0, "known": 0, "staleness": 0.0, "sampler": 0.0, "sync": 0.0, "steps": 0,
           "gamma": 1.0}
    stage = HostStage()
    t_start = time.perf_counter()
    for batch, nxt in _lookahead(batches):
        images = batch.images.to(dev, non_blocking=True)
        observed, idx, clean, valid = batch.observed, batch.idx, batch.clean, batch.valid
        labels = observed if trusted is None else torch.where(trusted[idx], clean, observed)
        known = valid & (clean >= 0)
        if num_classes is not None:
            known &= clean <= num_classes
        labels_d, clean_d, valid_d, known_d = to_device((labels, clean, valid, known), dev)
        if labeler is not None and tot["steps"] == 0:
            labeler.prefetch(idx)
        logits = model(images)
        if labeler is not None:
            t0 = time.perf_counter()
            probs = torch.softmax(logits.detach().float(), dim=1)
            z, stats = labeler.sample(probs, observed, idx)
            tot["sampler"] += time.perf_counter() - t0 - stats.wait
            tot["sync"] += stats.wait
            if observe is not None:
                observe(idx, stats.posterior, valid)
            target = z if labeler.cfg.targets != "map" else stats.posterior.argmax(1)
            target = target.to(dev, non_blocking=True)
            stage.put(z)  # to the host for the commit, without waiting for it here
            acc["changed"] += stats.changed
            tot["staleness"] += stats.staleness
            tot["gamma"] = stats.gamma
        else:
            target = labels_d
        w = valid_d.to(torch.float32)
        if labeler is not None and labeler.cfg.targets == "posterior":
            loss = soft_cross_entropy(logits, stats.posterior.to(dev), xi=xi, weight=w)
        elif labeler is None and loss_fn is not None:
            loss = loss_fn(logits, target, w)
        else:
            loss = clipped_cross_entropy(logits, target, xi=xi, weight=w)
        if labeler is not None and stats.ramp < 1.0:
            # the LCCN target's weight ramps up from 0: a weak pretrained classifier keeps
            # learning from the observed labels while its own posterior is still poor
            loss = stats.ramp * loss + (1.0 - stats.ramp) * clipped_cross_entropy(
                logits, labels_d, xi=xi, weight=w)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        if labeler is not None:
            # send the labels now: the round trip overlaps the next forward; the reply is
            # awaited by the next sample()
            t0 = time.perf_counter()
            z_host = stage.get()
            labeler.commit(idx[valid], z_host[valid], nxt.idx if nxt is not None else None)
            tot["sync"] += time.perf_counter() - t0
        if after_step is not None:
            after_step()
        nvalid = int(valid.sum())
        acc["loss"] += loss.detach() * nvalid
        tot["n"] += nvalid
        tot["known"] += int(known.sum())
        acc["recovered"] += ((target == clean_d) & known_d).sum()
        tot["steps"] += 1
    if labeler is not None:
        tot["sync"] += labeler.flush()
    host = {k: float(v) for k, v in acc.items()}  # the epoch's one read of device figures
    elapsed = time.perf_counter() - t_start
    steps = max(tot["steps"], 1)
    return {
        "loss": host["loss"] / max(tot["n"], 1),
        "label_recovery": host["recovered"] / tot["known"] if tot["known"] else float("nan"),
        "changed": host["changed"] / steps,
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
    probs, idxs, cleans, valids = [], [], [], []
    for b in batches:
        # kept on the device until the end: one copy to the host, not one sync per batch
        probs.append(torch.softmax(model(b.images.to(device, non_blocking=True)).float(), dim=1))
        idxs.append(b.idx)
        cleans.append(b.clean)
        valids.append(b.valid)
    if not probs:
        raise ValueError("predict() got no batches")
    valid = torch.cat(valids)
    return torch.cat(probs).cpu()[valid], torch.cat(idxs)[valid], torch.cat(cleans)[valid]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Any], *, num_classes: int,
             device: torch.device | str = "cpu", noise: Tensor | None = None
             ) -> dict[str, float]:
    """Top-1 / top-5 accuracy over samples with a label (the batches' ``clean``) in
    ``[0, K)``, and ``nll``: the mean of ``-log P(label | x)`` where ``P(label | x) =
    sum_k P(k | x) noise[k, label]``, the model's prediction of an *observed* label through
    ``noise (K_latent, K)`` (rows P(observed | latent): a method's noise model; None: the
    identity, ``P(label | x)`` itself). On the noisy validation split (labels = the observed
    ones) ``nll`` is the held-out likelihood of the noisy labels under the whole model.

    For a K+1-way model (LCCN*) the outlier logit is left out of the ranking.
    """
    probs, _, clean = predict(model, batches, device=device)
    keep = (clean >= 0) & (clean < num_classes)
    full, clean = probs[keep], clean[keep]
    probs = full[:, :num_classes]
    if clean.numel() == 0:
        return {"top1": float("nan"), "top5": float("nan"), "nll": float("nan"), "n": 0.0}
    topk = probs.topk(min(5, num_classes), dim=1).indices
    top1 = (topk[:, 0] == clean).float().mean()
    top5 = (topk == clean.unsqueeze(1)).any(1).float().mean()
    return {"top1": float(top1), "top5": float(top5), "nll": noisy_nll_of(full, clean, noise),
            "n": float(clean.numel())}


def noisy_nll_sum(probs: Tensor, labels: Tensor, noise: Tensor | None) -> Tensor:
    """``sum_i -log sum_k probs[i, k] noise[k, labels[i]]`` as a float64 scalar tensor on
    ``probs``' device (``noise`` None: the identity, ``-log probs[i, labels[i]]``);
    probabilities floored at 1e-12."""
    p = probs.to(torch.float64)
    labels = labels.to(p.device).long()
    if noise is None:
        q = p.gather(1, labels.unsqueeze(1))[:, 0]
    else:
        t = noise.to(p.device, torch.float64)
        if t.shape[0] != p.shape[1]:
            raise ValueError(f"noise model has {t.shape[0]} latent rows, the model "
                             f"{p.shape[1]} outputs")
        q = (p * t[:, labels].T).sum(1)
    return -q.clamp_min(1e-12).log().sum()


def noisy_nll_of(probs: Tensor, labels: Tensor, noise: Tensor | None) -> float:
    """The mean of :func:`noisy_nll_sum` over the samples."""
    return float(noisy_nll_sum(probs, labels, noise)) / labels.numel()
