"""The networks a method trains (:class:`Member`: model, optimiser, epoch schedule, weight
average) and how they are built: parameter groups (normalisation layers' own weight
decay), the learning-rate schedule, the weight average's warm-up decay.

Imports: :mod:`pipeline.core` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.core.config import RunConfig

# -- members: the networks a method trains ----------------------------------------------------


def ema_decay_at(decay: float, step: int) -> float:
    """The weight average's decay after global step ``step`` (:attr:`OptimConfig.ema_decay`):
    ``min(decay, (1 + step) / (10 + step))``, so that early steps are not averaged with the
    random initialisation for ~1/(1 - decay) steps."""
    return min(decay, (1.0 + step) / (10.0 + step))


@dataclass
class Member:
    """One network a method trains: ``model`` (the bare module: checkpoints, evaluation),
    its ``optimizer`` and epoch ``scheduler``; after :meth:`Engine.prepare`, ``train_model``
    (DDP-wrapped in a distributed run, bf16 on CUDA) and ``eval_model`` (no collectives).
    With :attr:`OptimConfig.ema_decay`, ``ema`` is the moving average of the weights and
    ``ema_eval`` its wrapped module; :attr:`scorer` is what evaluation uses."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_model: nn.Module | None = None
    eval_model: nn.Module | None = None
    ema: nn.Module | None = None
    ema_eval: nn.Module | None = None
    # float16 autocast (PerfConfig.amp): the loss scaler of this network's optimiser
    scaler: Any = None
    # the tensor lists update_average works on, built once per (model, ema) pair of modules:
    # walking the module tree for them each step costs more than the fused update itself
    _average_lists: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def averaged(self) -> nn.Module:
        """The bare module whose weights score this network: the weight average when
        there is one, else the model (what :attr:`scorer` wraps, and what a frozen copy or
        an exported predictor takes)."""
        return self.ema if self.ema is not None else self.model

    @property
    def scorer(self) -> nn.Module | None:
        """The module that scores this network (validation, test, the predictions that
        start a noise model): the weight average when there is one."""
        return self.ema_eval if self.ema_eval is not None else self.eval_model

    @torch.no_grad()
    def update_average(self, decay: float) -> None:
        """``ema <- decay * ema + (1 - decay) * weights`` (one fused call per tensor list);
        the buffers (batch-norm statistics) are copied."""
        if self.ema is None:
            return
        cached = self._average_lists
        if cached is None or cached[0] is not self.model or cached[1] is not self.ema:
            cached = self._average_lists = (
                self.model, self.ema, list(self.ema.parameters()), list(self.model.parameters()),
                list(self.ema.buffers()), list(self.model.buffers()))
        _, _, avg, live, avg_bufs, live_bufs = cached
        torch._foreach_lerp_(avg, live, 1.0 - decay)
        if avg_bufs:
            torch._foreach_copy_(avg_bufs, live_bufs)


_NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
                nn.modules.instancenorm._InstanceNorm)


def param_groups(model: nn.Module, weight_decay: float,
                 norm_weight_decay: float | None = None) -> list[dict[str, Any]]:
    """The optimiser's parameter groups: one (every parameter at ``weight_decay``) unless
    ``norm_weight_decay`` differs, then the normalisation layers' parameters and every bias
    (:attr:`OptimConfig.norm_weight_decay`) in a second group after the others."""
    params = list(model.parameters())
    if norm_weight_decay is None or norm_weight_decay == weight_decay:
        return [{"params": params}]
    norm = {id(p) for m in model.modules() if isinstance(m, _NORM_LAYERS)
            for p in m.parameters(recurse=False)}
    norm |= {id(p) for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"}
    groups = [{"params": [p for p in params if id(p) not in norm], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) in norm],
               "weight_decay": norm_weight_decay}]
    return [g for g in groups if g["params"]]


def scheduled_lr(run: RunConfig, epoch: float, lr_values: tuple[float, ...] = ()) -> float:
    """The rate :func:`make_scheduler` gives ``epoch`` (a fraction reads the phase it lies
    in): ``lr * lr_decay ** (milestones passed)``, or with ``lr_values`` the phase's rate."""
    o = run.optim
    phase = sum(epoch >= m for m in o.milestones)
    return float(lr_values[phase]) if lr_values else float(o.lr * o.lr_decay ** phase)


def make_scheduler(optimizer: torch.optim.Optimizer, run: RunConfig,
                   lr_values: tuple[float, ...] = ()):
    """The epoch schedule: ``lr`` decayed by ``lr_decay`` at each milestone, or with
    ``lr_values`` the rate of each phase between milestones."""
    o = run.optim
    if not lr_values:
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(o.milestones),
                                                    gamma=o.lr_decay)
    values = list(lr_values)
    if len(values) != len(o.milestones) + 1:
        raise ValueError(f"lr_values {values} needs len(milestones) + 1 = "
                         f"{len(o.milestones) + 1} entries (milestones {list(o.milestones)})")
    miles = list(o.milestones)
    # LambdaLR multiplies the optimizer's initial lr (o.lr) by the factor
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: values[sum(e >= m for m in miles)] / o.lr)
