"""T-Revision (Xia et al., "Are anchor points really indispensable in label-noise
learning?", NeurIPS 2019): three stages.

1. Cross-entropy on the observed labels (the run's ``pretrain_epochs``; the authors: 20
   epochs), then ``T_hat`` from the network (``BaselineConfig.transition``: anchor points
   at the 97th percentile as the authors, by default).
2. Importance reweighting with ``T_hat`` fixed: ``mean β · CE(f(x), ỹ)`` with
   ``β = q(ỹ) / (q @ T_hat)(ỹ)`` detached, on the member's SGD, with a complete schedule
   of its own: the run's schedule over the noise phase, compressed into this stage's
   epochs (the authors decay stage 2's lr within its own 200 epochs).
3. Revision: a slack ``ΔT`` (from 0; ``T = T_hat + ΔT``, neither clipped nor renormalised)
   learned with the network through β, by Adam at a constant ``revision_lr`` 5e-7 and
   weight decay 1e-4 (the authors' values).

The authors run 200 epochs of stage 2 and 200 of stage 3: here the noise phase is split in
the same proportion, the last ``revision_fraction`` (0.5) of it being the revision. So
neither stage runs over the other's learning-rate decay (running stage 2 on the run's own
schedule would leave it at the first rate and put the decayed epochs under the revision's
Adam, where the network barely moves). The epoch rows' ``lr`` is the applied one (Adam's
in stage 3). The
authors take ``T_hat`` from the epoch with the best noisy-validation accuracy and start
stage 2 from scratch; here from the end of the pre-training, continuing its network.

State: ``trevision_slack`` (``T_hat`` and ``delta``), ``trevision_started`` and
``trevision_optimizer`` (the revision stage's Adam, None before it). The slack lives
outside the DDP-wrapped network: its gradient is averaged over ranks before every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.core.baselines import TRevisionSlack, check_transition, reweight_loss
from pipeline.train.members import scheduled_lr
from pipeline.train.methods.base import register
from pipeline.train.methods.baseline import (
    BaselineMethod,
    average_gradients,
    estimate_transition,
)


@register
class TRevision(BaselineMethod):
    name = "trevision"
    reads_transition = True

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        k = self.num_classes
        self.slack = TRevisionSlack(torch.eye(k, dtype=torch.float64)).to(engine.device)
        self.started = False
        self.revision_optimizer: torch.optim.Optimizer | None = None
        self._revising, self._stage = False, 1
        o = run.optim
        n = o.epochs - o.pretrain_epochs
        self.revision_epoch = o.epochs - int(n * self.cfg.revision_fraction)

    def in_revision(self, epoch: int) -> bool:
        return self.in_noise_phase(epoch) and epoch >= self.revision_epoch

    def stage2_lr(self, epoch: int) -> float:
        """Stage 2's rate at ``epoch``: the run's schedule at the noise-phase epoch this one
        stands for once the phase's length is compressed into stage 2's."""
        o = self.run.optim
        start, n = o.pretrain_epochs, o.epochs - o.pretrain_epochs
        n2 = max(1, self.revision_epoch - start)
        return scheduled_lr(self.run, start + (epoch - start) * n / n2,
                            self.engine.options.lr_values)

    def applied_lr(self, epoch: int) -> float:
        if self.in_revision(epoch):
            return float(self._revision_optimizer().param_groups[0]["lr"])
        return super().applied_lr(epoch)

    def noise_phase_started(self) -> bool:
        return self.started

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        t_hat = check_transition(estimate_transition(self, self.cfg.transition),
                                 self.num_classes, source="T-Revision T_hat")
        with torch.no_grad():
            self.slack.T_hat.copy_(t_hat.to(self.slack.T_hat))
            self.slack.delta.zero_()
        self.started = True
        return {"init_transition_error": self.transition_error()}

    def _revision_optimizer(self) -> torch.optim.Optimizer:
        if self.revision_optimizer is None:
            params = [*self.members[0].model.parameters(), self.slack.delta]
            self.revision_optimizer = torch.optim.Adam(
                params, lr=self.cfg.revision_lr, weight_decay=self.cfg.revision_weight_decay)
        return self.revision_optimizer

    def optimizer(self, epoch: int) -> torch.optim.Optimizer:
        if self.in_revision(epoch):
            return self._revision_optimizer()
        return self.members[0].optimizer

    def current_transition(self) -> Tensor | None:
        if not self.started:
            return None
        return self.slack.transition().detach().cpu().to(torch.float64)

    def loss(self, logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
        if self._revising:
            return self.slack.loss(logits, target, weight=weight)
        return reweight_loss(logits, target, self.slack.T_hat, weight=weight)

    def before_step(self) -> None:
        if self._revising:
            average_gradients(self, [self.slack.delta])

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> None:
        self._revising = self.in_revision(epoch)
        self._stage = 3 if self._revising else 2 if self.in_noise_phase(epoch) else 1
        if self._stage == 2:  # its own schedule, over the member's scheduler's rate
            for group in self.members[0].optimizer.param_groups:
                group["lr"] = self.stage2_lr(epoch)

    def epoch_stats(self) -> dict[str, float]:
        # 1: cross-entropy, 2: reweighting with T_hat fixed, 3: revision
        return {**super().epoch_stats(), "trevision_stage": float(self._stage),
                "transition_rank_gap": self.transition_rank_gap()}

    def state_dict(self) -> dict[str, Any]:
        slack = {k: v.detach().cpu() for k, v in self.slack.state_dict().items()}
        return {"trevision_slack": slack,
                "trevision_started": self.started,
                "trevision_optimizer": (None if self.revision_optimizer is None
                                        else self.revision_optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "trevision_slack" in state:
            self.slack.load_state_dict(state["trevision_slack"])
        self.started = bool(state.get("trevision_started", False))
        opt = state.get("trevision_optimizer")
        if opt is not None:
            self._revision_optimizer().load_state_dict(opt)
