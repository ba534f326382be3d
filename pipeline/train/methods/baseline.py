"""What the classic baselines share (``bootstrap``, ``forward``, ``sadapt``, ``trevision``):
cross-entropy on the observed labels for the ``pretrain_epochs`` (as every method), then
the method's own loss (:meth:`BaselineMethod.loss`) on the observed labels, on the same
learning-rate schedule. The maths is :mod:`pipeline.core.baselines`; the options are
:class:`pipeline.core.config.BaselineConfig`.

Helpers: :func:`estimate_transition` (``T`` from the pretrained network over every rank's
share of the training split) and :func:`average_gradients` (a method's own parameters live
outside the DDP-wrapped network, so their gradients are averaged over ranks by hand before
each optimiser step: every rank keeps the same transition).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from pipeline.core.baselines import forward_transition
from pipeline.core.confusion import transition_error
from pipeline.train.loop import LabelTask, Task, predict
from pipeline.train.methods.base import Method


def estimate_transition(method: Method, source: str) -> Tensor:
    """``T (K, K)`` float64 (rows sum to 1) at the start of the noise phase: anchor points
    or Eq. 8 of the network trained so far, its predictions over this rank's share of the
    training split with the statistics all-reduced (every rank gets the same ``T``), or
    the file ``BaselineConfig.transition_file``. Every rank must call it."""
    eng, cfg = method.engine, method.run.baseline
    k = method.num_classes
    if source == "file":
        return forward_transition("file", k, path=cfg.transition_file)
    probs, idx, _ = predict(method.members[0].scorer, eng.data.train_eval_batches(),
                            device=eng.device)
    observed = eng.data.observed[idx]
    return forward_transition(source, k, probs=probs, observed=observed,
                              quantile=cfg.anchor_quantile, reduce=eng.reduce_cpu)


def average_gradients(method: Method, params: Iterable[nn.Parameter]) -> None:
    """Replace the gradient of each of ``params`` by its mean over ranks (what DDP does
    for the network's). Every rank must call it, with the same parameters."""
    session = method.engine.session
    ws = session.world_size
    if ws == 1:
        return
    for p in params:
        if p.grad is None:  # the same on every rank: the loss is the same function
            continue
        g = session.all_reduce_sum(p.grad)
        if g is not p.grad:
            p.grad.copy_(g)
        p.grad.div_(ws)


class BaselineMethod(Method):
    """One network; cross-entropy on the observed labels for the first ``pretrain_epochs``,
    then :meth:`loss`. Subclasses define :meth:`loss` and, where they estimate a transition,
    :meth:`current_transition` (reported as ``transition_error`` against the view's true
    transition at every checkpoint, NaN before the noise phase or without a truth)."""

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        self.cfg = run.baseline

    def in_noise_phase(self, epoch: int) -> bool:
        return epoch >= self.run.optim.pretrain_epochs

    # -- what a baseline defines ----------------------------------------------------------------

    def loss(self, logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
        """The noise-phase loss of a batch: ``logits (B, K)``, observed ``target (B,)``,
        ``weight (B,)`` float (0 at padding)."""
        raise NotImplementedError

    def optimizer(self, epoch: int) -> torch.optim.Optimizer:
        """The optimiser that steps in ``epoch`` (the member's by default)."""
        return self.members[0].optimizer

    def before_step(self) -> None:
        """Between backward and the optimiser step of a noise-phase batch."""

    # -- the engine's hooks ---------------------------------------------------------------------

    def train_task(self, epoch: int) -> Task:
        noise = self.in_noise_phase(epoch)
        return LabelTask(self.members[0].train_model, self.optimizer(epoch),
                         xi=self.run.lccn.xi, known_below=self.num_classes + 1,
                         loss_fn=self.loss if noise else None,
                         before_step=self.before_step if noise else None)

    def transition_rank_gap(self) -> float:
        """Largest ``|T_rank - T_rank0|`` over ranks (0: every rank trains with the same
        transition; a collective, every rank must call it). NaN without a transition."""
        t = self.current_transition()
        if t is None:
            return float("nan")
        session = self.engine.session
        mine = t.detach().to(session.device, torch.float64)
        parts = session.all_gather(mine)
        return float(max((p - parts[0]).abs().max() for p in parts))

    def transition_error(self) -> float:
        t = self.current_transition()
        if t is None:
            return float("nan")
        return transition_error(t, self.engine.data.transition)

    def observe_chain(self, state: dict | None, *, epoch: int,
                      row: dict[str, float] | None) -> dict[str, float]:
        return {"transition_error": self.transition_error()}
