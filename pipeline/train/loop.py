"""The one batch loop of every method (:func:`run_pass`), its single-network task
(:class:`LabelTask`: CE and the classic baselines' losses on the observed labels; LCCN's
Gibbs-sampled labels are its subclass :class:`pipeline.train.methods.lccn.GibbsTask`), and
``predict`` / ``evaluate``. They return dicts of plain floats and never log or save; the
caller does. A batch is anything with fields ``images (B,C,H,W)``, ``observed (B,)``,
``idx (B,)``, ``clean (B,)`` (-1 unknown, K outlier) and ``valid (B,) bool``.

A method says what one training pass does to a batch with a :class:`Task`; the loop owns
the rest, identically for every method::

    task.begin()
    for every batch (and the next one, for prefetching):
        images, the loop's rows (clean, valid) and the task's (Task.rows) to the device,
        in one copy
        for each network k (Task.optimizers, in order; DivideMix and DivideLCCN: two):
            loss, target = task.forward(k, StepInput)     forward and loss: the method's
            zero_grad; loss.backward(); task.before_step(k); optimizer.step()
                                                          (fp16: through its GradScaler)
            task.after_step(k, ...)                       LCCN: commit the sampled labels
        after_step()                                      the engine's global step
        statistics: the loss, label recovery of network 0's target, images/s
    task.end()                                            flush; the task's own statistics

AMP, channels-last and compile live in the networks the task calls (the members' wrapped
modules, :mod:`pipeline.train.fastpath`); evaluation is :func:`evaluate` (a method with two
networks overrides it to rank by both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.core.losses import clipped_cross_entropy
from pipeline.train.fastpath import to_device


def _lookahead(batches: Iterable[Any]) -> Iterator[tuple[Any, Any | None]]:
    """Yield (batch, next_batch or None) so a labeler can prefetch the next batch's z."""
    it = iter(batches)
    try:
        cur = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield cur, nxt
        cur = nxt
    yield cur, None


@dataclass
class StepInput:
    """What :meth:`Task.forward` gets for one batch: the host ``batch``, its ``images``,
    ``valid (B,) bool`` and the task's :meth:`Task.rows` (``rows``) on the device, the next
    batch ``nxt`` (None at the last) and ``index``, the batch's position in its epoch (a
    pass resumed mid-epoch starts at its ``start_batch``)."""

    batch: Any
    images: Tensor
    valid: Tensor
    rows: list[Tensor]
    nxt: Any | None
    index: int


class Task:
    """One training pass of a method, as the loop (:func:`run_pass`) sees it.

    optimizers: one per network, stepped in this order on every batch.
    known_below: label recovery counts the rows whose clean label is in
        ``[0, known_below)`` (None: every known clean label).
    """

    optimizers: Sequence[torch.optim.Optimizer] = ()
    known_below: int | None = None

    def begin(self) -> None:
        """The pass starts."""

    def rows(self, batch: Any) -> tuple[Tensor, ...]:
        """Host ``(B,)`` integer or bool tensors the task wants on the device with the
        loop's own, in the same copy (:func:`pipeline.train.fastpath.to_device`)."""
        return ()

    def forward(self, k: int, step: StepInput) -> tuple[Tensor, Tensor | None]:
        """Network k's loss on the batch (0-d, to backpropagate) and its training target's
        class per row ``(B,)`` on the device (label recovery; None: not counted)."""
        raise NotImplementedError

    def before_step(self, k: int) -> None:
        """Between network k's backward and its optimiser step (a method's own parameters
        outside DDP: all-reduce their gradients)."""

    def after_step(self, k: int, step: StepInput) -> None:
        """After network k's optimiser step."""

    def end(self) -> dict[str, float]:
        """Finish the pass's asynchronous work; the task's statistics among ``changed``,
        ``staleness`` (per-step means), ``gamma`` (the last), ``sampler_time`` and
        ``sync_time`` (seconds, totals over the pass)."""
        return {}


def run_pass(task: Task, batches: Iterable[Any], *, device: torch.device | str = "cpu",
             after_step: Callable[[], None] | None = None,
             scalers: Mapping[int, Any] | None = None) -> dict[str, float]:
    """One pass of ``task`` over ``batches`` (see the module doc). Returns loss (the mean
    over valid samples, averaged over the networks), observed_loss (a one-network task's
    mean cross-entropy of the classifier against the labels CE trains on, whatever its own
    loss: below the noise's entropy it is memorising them; NaN where not measured),
    label_recovery (network 0's target == clean where the clean label is known), changed,
    staleness, gamma, step_time,
    sampler_time, sync_time (per step), sampler_share (of the pass's time), images_per_s
    and steps.

    On an accelerator the loop never waits for the device: the per-step figures accumulate
    on the device and are read once, at the end of the pass.

    ``scalers``: a ``torch.amp.GradScaler`` by ``id(optimizer)`` for the networks whose
    forward autocasts to float16 (:func:`pipeline.train.fastpath.grad_scaler`): their loss
    is scaled before the backward pass, the gradients unscaled before ``before_step`` (which
    sees true gradients), and a step with a non-finite gradient skipped.
    """
    dev = torch.device(device)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    loss_sum, recovered = zero.clone(), zero.clone()
    n = known_n = steps = 0
    nets = len(task.optimizers)
    t_start = time.perf_counter()
    task.begin()
    first = getattr(batches, "start_batch", 0)  # a pass resumed mid-epoch
    for index, (batch, nxt) in enumerate(_lookahead(batches), start=first):
        images = batch.images.to(dev, non_blocking=True)
        clean, valid = batch.clean, batch.valid
        known = valid & (clean >= 0)
        if task.known_below is not None:
            known &= clean < task.known_below
        clean_d, valid_d, known_d, *rows = to_device((clean, valid, known,
                                                      *task.rows(batch)), dev)
        step = StepInput(batch, images, valid_d, rows, nxt, index)
        nvalid = int(valid.sum())
        for k, optimizer in enumerate(task.optimizers):
            loss, target = task.forward(k, step)
            optimizer.zero_grad(set_to_none=True)
            scaler = scalers.get(id(optimizer)) if scalers else None
            if scaler is None:
                loss.backward()
                task.before_step(k)
                optimizer.step()
            else:  # float16 autocast
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                task.before_step(k)
                scaler.step(optimizer)
                scaler.update()
            task.after_step(k, step)
            loss_sum += loss.detach() * (nvalid / nets)
            if k == 0 and target is not None:
                recovered += ((target == clean_d) & known_d).sum()
        if after_step is not None:
            after_step()
        n += nvalid
        known_n += int(known.sum())
        steps += 1
    own = task.end()
    host = {"loss": float(loss_sum), "recovered": float(recovered)}  # the one device read
    elapsed = time.perf_counter() - t_start
    per = max(steps, 1)
    sampler, sync = own.get("sampler_time", 0.0), own.get("sync_time", 0.0)
    return {
        "loss": host["loss"] / max(n, 1),
        "label_recovery": host["recovered"] / known_n if known_n else float("nan"),
        "changed": float(own.get("changed", 0.0)),
        "observed_loss": float(own.get("observed_loss", float("nan"))),
        "staleness": float(own.get("staleness", 0.0)),
        "gamma": float(own.get("gamma", 1.0)),
        "step_time": elapsed / per,
        "sampler_time": sampler / per,
        "sync_time": sync / per,
        "sampler_share": (sampler + sync) / elapsed if elapsed > 0 else 0.0,
        "images_per_s": n / elapsed if elapsed > 0 else 0.0,
        "steps": float(steps),
    }


class LabelTask(Task):
    """One network trained toward one label per sample: cross-entropy on the observed labels
    (CE; trusted samples, if a ``trusted (N,) bool`` lookup is given, train on their clean
    label), or ``loss_fn(logits, labels, weight)`` on them (a baseline's loss; ``weight
    (B,)`` float is 0 at padding); ``before_step()`` runs between backward and the
    optimiser step. LCCN's pass, which trains on Gibbs-sampled labels instead, is
    :class:`pipeline.train.methods.lccn.GibbsTask`, a subclass.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 trusted: Tensor | None = None, xi: float = 1e-20,
                 known_below: int | None = None,
                 loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                 before_step: Callable[[], None] | None = None) -> None:
        self.model, self.optimizers = model, (optimizer,)
        self.trusted, self.xi = trusted, xi
        self.known_below = known_below
        self.loss_fn, self._before_step = loss_fn, before_step

    def begin(self) -> None:
        self.model.train()
        self.fit_sum: Tensor | None = None  # (loss, count) summed on the observed labels

    def rows(self, batch: Any) -> tuple[Tensor, ...]:
        observed = batch.observed
        if self.trusted is None:
            return (observed,)
        return (torch.where(self.trusted[batch.idx], batch.clean, observed),)

    def logits(self, step: StepInput) -> tuple[Tensor, Tensor, Tensor]:
        """The network's ``logits (B, K_out)`` on the batch, the rows' weights ``(B,)`` (0 at
        padding) and the labels CE trains on ``(B,)``; the classifier's own fit of those
        labels (the memorisation signal, against LCCN's noise_floor) is summed for
        ``observed_loss``, whatever the task's loss: no gradient, no device read."""
        (labels_d,) = step.rows
        logits = self.model(step.images)
        w = step.valid.to(torch.float32)
        nll = -torch.log_softmax(logits.detach().float(), 1).gather(1, labels_d[:, None])[:, 0]
        fit = torch.stack(((nll * w).sum(), w.sum())).to(torch.float64)
        self.fit_sum = fit if self.fit_sum is None else self.fit_sum + fit
        return logits, w, labels_d

    def forward(self, k: int, step: StepInput) -> tuple[Tensor, Tensor]:
        logits, w, labels_d = self.logits(step)
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels_d, w), labels_d
        return clipped_cross_entropy(logits, labels_d, xi=self.xi, weight=w), labels_d

    def before_step(self, k: int) -> None:
        if self._before_step is not None:
            self._before_step()

    def end(self) -> dict[str, float]:
        obs = [float("nan"), 0.0] if self.fit_sum is None else self.fit_sum.tolist()
        return {"observed_loss": obs[0] / obs[1] if obs[1] > 0 else float("nan")}


def train_one_epoch(model: nn.Module, batches: Iterable[Any], optimizer: torch.optim.Optimizer, *,
                    trusted: Tensor | None = None, xi: float = 1e-20,
                    device: torch.device | str = "cpu", num_classes: int | None = None,
                    after_step: Callable[[], None] | None = None,
                    loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                    before_step: Callable[[], None] | None = None) -> dict[str, float]:
    """One pass of a :class:`LabelTask` over ``batches`` (:func:`run_pass`): a single
    network outside a method (the step benchmarks). ``num_classes``: label recovery counts
    clean labels in ``[0, K]`` (the outlier class K included)."""
    task = LabelTask(model, optimizer, trusted=trusted, xi=xi,
                     known_below=None if num_classes is None else num_classes + 1,
                     loss_fn=loss_fn, before_step=before_step)
    return run_pass(task, batches, device=device, after_step=after_step)


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
    ones) ``nll`` is the held-out likelihood of the noisy labels under the whole model;
    ``nll_plain`` is ``-log P(label | x)`` without the noise model (the classifier's own fit
    of the labels, as CE measures it).

    For a K+1-way model (LCCN*) the outlier logit is left out of the ranking.
    """
    probs, _, clean = predict(model, batches, device=device)
    keep = (clean >= 0) & (clean < num_classes)
    full, clean = probs[keep], clean[keep]
    probs = full[:, :num_classes]
    if clean.numel() == 0:
        return {"top1": float("nan"), "top5": float("nan"), "nll": float("nan"),
                "nll_plain": float("nan"), "n": 0.0}
    topk = probs.topk(min(5, num_classes), dim=1).indices
    top1 = (topk[:, 0] == clean).float().mean()
    top5 = (topk == clean.unsqueeze(1)).any(1).float().mean()
    plain = noisy_nll_of(full, clean, None)
    return {"top1": float(top1), "top5": float(top5),
            "nll": plain if noise is None else noisy_nll_of(full, clean, noise),
            "nll_plain": plain, "n": float(clean.numel())}


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
