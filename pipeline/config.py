"""Typed, frozen configs, one per concern. Jobs build them; at the Ray boundary they travel
as ``asdict`` dicts and are rebuilt with :func:`from_dict` first thing in the worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

METHODS = ("ce", "lccn")
WARMUPS = ("eq8", "identity")
INITS = ("argmax", "observed")


@dataclass(frozen=True)
class LCCNConfig:
    """The LCCN sampler and its variants.

    alpha: Dirichlet parameter, scalar or one value per observed class (> 0).
    warmup_steps: δ, LCCN steps during which the conditional transition is replaced by
        ``phi_init`` (Eq. 8 soft confusion of the pretrained classifier, or a smoothed identity).
    anneal: power annealing γ = max(exp(-anneal_rate * step / max_step), anneal_floor)
        (the paper's setting on Clothing1M/WebVision); off (γ = 1) by default, as on CIFAR.
    outlier: LCCN*, ``K_latent = K + 1`` with the last latent class = out of distribution.
    use_trusted: LCCN+, trusted samples train on their clean label and are never counted.
    """

    alpha: float | tuple[float, ...] = 1.0
    warmup_steps: int = 0
    warmup: str = "eq8"
    warmup_smoothing: float = 0.1
    init: str = "argmax"
    anneal: bool = False
    anneal_floor: float = 0.5
    anneal_rate: float = 0.8
    xi: float = 1e-20
    outlier: bool = False
    use_trusted: bool = False

    def __post_init__(self) -> None:
        alphas = self.alpha if isinstance(self.alpha, (tuple, list)) else (self.alpha,)
        if isinstance(self.alpha, list):
            object.__setattr__(self, "alpha", tuple(self.alpha))
        if not all(float(a) > 0 for a in alphas):
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {self.warmup!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.anneal_floor <= 1:
            raise ValueError(f"anneal_floor must lie in (0, 1], got {self.anneal_floor}")
        if not 0 < self.xi < 0.5:
            raise ValueError(f"xi must lie in (0, 0.5), got {self.xi}")


@dataclass(frozen=True)
class OptimConfig:
    """SGD with a step schedule. Epoch counts are total epochs of the run; the first
    ``pretrain_epochs`` train with plain cross-entropy on the observed labels (Algorithm 3,
    line 1) for every method."""

    epochs: int = 30
    pretrain_epochs: int = 10
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[int, ...] = ()
    lr_decay: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.milestones, list):
            object.__setattr__(self, "milestones", tuple(self.milestones))
        if self.epochs < 1 or not 0 <= self.pretrain_epochs <= self.epochs:
            raise ValueError(f"need epochs >= 1 and 0 <= pretrain_epochs <= epochs, got "
                             f"{self.epochs} and {self.pretrain_epochs}")
        if self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"batch_size and lr must be positive, got {self.batch_size}, {self.lr}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "small_cnn"
    in_channels: int = 3


@dataclass(frozen=True)
class RunConfig:
    """What to run: ``method`` is ``"ce"`` (baseline) or ``"lccn"`` (variants via LCCNConfig)."""

    method: str = "lccn"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lccn: LCCNConfig = field(default_factory=LCCNConfig)
    check_invariants: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")


T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a (nested) config dataclass from ``asdict`` output; unknown keys are errors."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    kwargs = {}
    for key, value in data.items():
        ftype = names[key].type
        sub = _CONFIGS.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        kwargs[key] = from_dict(sub, value) if sub and isinstance(value, dict) else value
    return cls(**kwargs)


_CONFIGS = {c.__name__: c for c in (LCCNConfig, OptimConfig, ModelConfig, RunConfig)}
