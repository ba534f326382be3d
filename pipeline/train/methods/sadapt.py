"""S-adaptation (Goldberger & Ben-Reuven, "Training deep neural-networks using a noise
adaptation layer", ICLR 2017, their "simple" model): a softmax transition layer
``softmax(W)`` stacked on the classifier, ``P(ỹ = j | x) = Σ_i softmax(f(x))_i
softmax(W)[i, j]``, trained by back-propagating ``-log P(ỹ | x)`` into both the network
and ``W``; the network's own ``softmax(f(x))`` is the prediction.

As the authors: ``W`` starts at ``log(T0 + 1e-8)`` with ``T0`` the pretrained network's
confusion against the noisy labels (its soft form, the LCCN paper's Eq. 8, all-reduced over
ranks), at the start of the noise phase; ``W`` then learns with the network's optimiser and
schedule. The layer is the method's: its parameter is a second parameter group of the
member's optimiser (there from the start, so a checkpoint of any epoch loads into a fresh
run; no weight decay, which would pull ``softmax(W)`` towards uniform) and its state is
``sadapt_layer`` in the checkpoint. It lives outside the DDP-wrapped network: its gradient
is averaged over ranks before every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.core.baselines import SAdaptation
from pipeline.train.members import make_scheduler
from pipeline.train.methods.base import register
from pipeline.train.methods.baseline import (
    BaselineMethod,
    average_gradients,
    estimate_transition,
)


@register
class SAdapt(BaselineMethod):
    """State: ``sadapt_layer`` (the layer's ``weight``), ``sadapt_started``."""

    name = "sadapt"

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        # a placeholder until the noise phase sets W from the pretrained network
        self.layer = SAdaptation(torch.eye(self.num_classes, dtype=torch.float64)).to(engine.device)
        self.started = False

    def build_members(self) -> list:
        m = self.engine.make_member(0)
        m.optimizer.add_param_group({"params": list(self.layer.parameters()),
                                     "weight_decay": 0.0})
        # the schedule over both groups (a scheduler made before the group would miss it)
        m.scheduler = make_scheduler(m.optimizer, self.run, self.engine.options.lr_values)
        return [m]

    def noise_phase_started(self) -> bool:
        return self.started

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        t0 = estimate_transition(self, "eq8")
        init = SAdaptation(t0)  # checks T0, W = log(T0 + eps)
        with torch.no_grad():
            self.layer.weight.copy_(init.weight)
        self.started = True
        return {"init_transition_error": self.transition_error()}

    def current_transition(self) -> Tensor | None:
        if not self.started:
            return None
        return self.layer.transition().detach().cpu().to(torch.float64)

    def loss(self, logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
        return self.layer.loss(logits, target, xi=self.run.lccn.xi, weight=weight)

    def before_step(self) -> None:
        average_gradients(self, self.layer.parameters())

    def epoch_stats(self) -> dict[str, float]:
        return {**super().epoch_stats(), "transition_rank_gap": self.transition_rank_gap()}

    def state_dict(self) -> dict[str, Any]:
        return {"sadapt_layer": {k: v.detach().cpu() for k, v in self.layer.state_dict().items()},
                "sadapt_started": self.started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sadapt_layer" in state:
            self.layer.load_state_dict(state["sadapt_layer"])
        self.started = bool(state.get("sadapt_started", False))
