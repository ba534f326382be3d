"""Forward correction (Patrini et al., "Making deep neural networks robust to label noise:
a loss correction approach", CVPR 2017, Sec. 3.2): the loss is the cross-entropy of the
noisy posterior the network implies through ``T``, ``-log (softmax(f(x)) @ T)[ỹ]``.

``T[i, j] = P(observed = j | clean = i)`` is fixed once, at the start of the noise phase,
from the network pre-trained with cross-entropy (``BaselineConfig.transition``): anchor
points at the 97th percentile (the authors' estimator and quantile, the default), the LCCN
paper's Eq. 8, or an oracle file. The authors retrain from scratch with the corrected
loss; here the network continues from the pre-training on the run's schedule, as every
method of the engine does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.core.baselines import forward_loss
from pipeline.train.methods.base import register
from pipeline.train.methods.baseline import BaselineMethod, estimate_transition


@register
class Forward(BaselineMethod):
    """State: ``forward_T`` (K, K) float64, None until the noise phase starts."""

    name = "forward"
    reads_transition = True

    def __init__(self, run, engine) -> None:
        super().__init__(run, engine)
        self.T: Tensor | None = None
        self._T_dev: Tensor | None = None

    def noise_phase_started(self) -> bool:
        return self.T is not None

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        self._set(estimate_transition(self, self.cfg.transition))
        return {"init_transition_error": self.transition_error()}

    def _set(self, T: Tensor | None) -> None:
        self.T = T
        self._T_dev = None if T is None else T.to(self.engine.device, torch.float32)

    def current_transition(self) -> Tensor | None:
        return self.T

    def loss(self, logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
        return forward_loss(logits, target, self._T_dev, xi=self.run.lccn.xi, weight=weight)

    def state_dict(self) -> dict[str, Any]:
        return {"forward_T": self.T}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set(state.get("forward_T"))
