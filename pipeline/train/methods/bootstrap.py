"""Hard bootstrapping (Reed et al., "Training deep neural networks on noisy labels with
bootstrapping", ICLR workshop 2015, Eq. 7; the mode the LCCN paper compares with): after
the cross-entropy pre-training, the target mixes the observed label (weight β) with the
network's own arg max (1 - β), ``BaselineConfig.bootstrap_beta`` = 0.8, the authors'
published value for the hard mode."""

from __future__ import annotations

from torch import Tensor

from pipeline.core.baselines import bootstrap_hard_loss
from pipeline.train.methods.base import register
from pipeline.train.methods.baseline import BaselineMethod


@register
class Bootstrap(BaselineMethod):
    name = "bootstrap"

    def loss(self, logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
        return bootstrap_hard_loss(logits, target, beta=self.cfg.bootstrap_beta,
                                   xi=self.run.lccn.xi, weight=weight)
