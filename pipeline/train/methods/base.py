"""The method interface and the registry.

A method says what is trained and how; the engine (:mod:`pipeline.train.engine`) owns the
epochs, the data, the session (rank, collectives, checkpoints, reports) and the chain
backend, and the batch loop (:func:`pipeline.train.loop.run_pass`) owns each pass: forward
and loss come from the method's :class:`~pipeline.train.loop.Task`, backward, the optimiser
steps and the statistics are the loop's, for every method alike. The engine calls the
method at fixed points of every epoch::

    build_members()                  the networks, optimizers and schedulers (a list: two
                                     networks fit); num_outputs() logits each
    in_noise_phase(epoch)            after the CE pre-training (Algorithm 3, line 1)?
    start_noise_phase(epoch)         once, at its first epoch (LCCN: phi_init, the initial
                                     assignment, the labeler); not again after a resume
                                     (noise_phase_started() reads the restored state)
    train_views(epoch)               augmented views per image in this epoch's training
                                     pass (2: DivideMix's batches carry images2)
    begin_epoch(epoch, steps)        per-epoch set-up (steps: batches per rank this epoch)
    train_task(epoch)                the Task of this epoch's training pass: per batch and
                                     network, forward and loss (LCCN: the Gibbs draw and
                                     its commit as hooks of the step); run by run_pass
    end_pass(epoch)                  after the pass (LCCN: its posterior windows)
    flush()                          finish asynchronous work before a consistent moment
    observe_chain(state, epoch, row) rank 0, at a checkpoint: metrics from the chain state
                                     (row given at an epoch end: health, monitor)
    epoch_stats()                    extra per-rank row entries
    current_transition()             a chain-free method's transition (MLflow), or None
    noise_model()                    P(observed | latent) for val_nll (default: the above)
    state_dict() / load_state_dict() what a checkpoint carries beyond the members
    final_files()                    rank 0, at the run's last moment: {file name: text}
                                     written next to the run's outputs, into the final
                                     checkpoint and to MLflow (LCCN*: outliers.csv)
    evaluate(model, batches, noisy)  top1/top5/nll/n over the batches' labels (noisy: the
                                     observed ones, nll through noise_model())

Every method runs on every rank; collectives (``engine.session``, ``engine.reduce_cpu``,
:func:`pipeline.train.session.all_gather_rows`) must be called by all ranks alike.

What a method may use of the engine is :class:`EngineView` (the engine,
:class:`pipeline.train.engine.Engine`, is one; ``tests/test_methods.py`` checks that the
methods use nothing else). What the jobs, the driver and Tune need to know of a method
beyond its name are class attributes (``needs_chain``, ``ignores``, ``reads_divide``,
``reads_transition``, ...) and class methods (:meth:`Method.latent_classes`,
:meth:`Method.reads`, :meth:`Method.names_samples`), never a comparison of its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.core.config import RunConfig
from pipeline.core.options import value_at
from pipeline.train.chains import ChainSet, LocalChain, SharedChain
from pipeline.train.loop import LabelTask, Task, evaluate
from pipeline.train.members import Member
from pipeline.train.session import Session


class MethodData(Protocol):
    """What a method reads of the engine's data source
    (:class:`~pipeline.train.sources.TensorSource`,
    :class:`~pipeline.train.shard_source.ShardSource`): the training split's labels by idx
    ``(N,)`` (``observed`` int64; ``clean`` int64, -1 unknown, K an outlier; ``trusted``
    bool), its true transition ``(K, K)`` where the noise is synthetic (else None), the
    noisy validation rows ``held_out (N,) bool`` (or None), and the training split in eval
    mode and the validation split as batches (this rank's share)."""

    num_samples: int
    num_classes: int
    observed: Tensor
    clean: Tensor
    trusted: Tensor
    transition: Any
    held_out: np.ndarray | None

    def train_eval_batches(self) -> Iterable[Any]: ...
    def val_batches(self) -> Iterable[Any] | None: ...


class MethodOptions(Protocol):
    """The engine's options a method reads (:class:`pipeline.train.engine.EngineOptions`)."""

    lr_values: tuple[float, ...]
    raise_on_collapse: bool
    normalize: nn.Module | None
    sample_keys: Sequence[str] | None


class EngineView(Protocol):
    """What a method may use of the engine that runs it: the session (rank, collectives),
    the device, the data, the chain backend (None for a method without a chain; a
    :class:`~pipeline.train.chains.ChainSet` for ``num_chains > 1``), the options above, K
    and K_latent, the members it built, the epoch rows so far, the global step, and five
    services: a new network (``make_member``), a CPU all-reduce (``reduce_cpu``), the
    noisy-validation accuracy (``val_top1``), the learning rate the weights were last
    trained at (``trained_lr``) and a frozen copy of a member (``frozen_copy``)."""

    session: Session
    device: torch.device
    data: MethodData
    chain: LocalChain | SharedChain | ChainSet | None
    options: MethodOptions
    num_classes: int
    k_latent: int
    members: list[Member]
    history: list[dict[str, float]]
    global_step: int

    def make_member(self, index: int = 0, *, num_outputs: int | None = None) -> Member: ...
    def reduce_cpu(self, t: Tensor) -> Tensor: ...
    def val_top1(self) -> float: ...
    def trained_lr(self) -> float | None: ...
    def frozen_copy(self, member: Member, state: dict[str, Tensor] | None = None
                    ) -> tuple[nn.Module, nn.Module]: ...

_REGISTRY: dict[str, type["Method"]] = {}


def register(cls: type["Method"]) -> type["Method"]:
    """Class decorator: make ``cls`` the method named ``cls.name``."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} is registered twice ({_REGISTRY[cls.name].__name__}, "
                         f"{cls.__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_method(name: str) -> type["Method"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(registered())}") from None


def refuse_ignored(method: type["Method"], run: RunConfig) -> None:
    """ValueError naming every field of ``method.ignores`` that ``run`` sets to another
    value than its default (the method would silently not use it)."""
    default = RunConfig()
    bad = []
    for path in method.ignores:
        got, want = value_at(run, path), value_at(default, path)
        if got != want:
            bad.append(f"{path}={got!r} (default {want!r})")
    if bad:
        why = f" ({method.ignores_why})" if method.ignores_why else ""
        raise ValueError(f"method {method.name} does not read {', '.join(bad)}{why}: leave "
                         f"{'it' if len(bad) == 1 else 'them'} at the default")


class Method:
    """Base class: one network trained with cross-entropy on the observed labels for
    every epoch; subclasses override what they change."""

    name = ""
    needs_chain = False  # a Gibbs chain backend (store) is required
    num_chains = 1  # with needs_chain: one chain per network when > 1 (engine.ChainSet)
    # RunConfig fields ("lccn.targets") of a method with a chain that it never reads: it
    # refuses a value other than the default (refuse_ignored), the jobs leave a recipe's
    # value out for it and Tune leaves them out of its space
    ignores: tuple[str, ...] = ()
    ignores_why = ""  # why, said in refuse_ignored's message
    # its loss is clipped at LCCNConfig.xi: the one LCCNConfig field a method without a
    # chain reads (every single-network method's; DivideMix's losses are not clipped)
    clips_at_xi = True
    # it reads DivideConfig (DivideMix, DivideLCCN: the presets table shows those values)
    reads_divide = False
    # it reads BaselineConfig.transition and its file (Forward, T-Revision: the jobs check
    # the file before Ray starts)
    reads_transition = False
    # it ends its CE pre-training where the epoch rows say (OptimConfig.pretrain_auto);
    # a method whose schedule is laid out from a fixed count refuses that
    auto_warmup = False

    def __init__(self, run: RunConfig, engine: EngineView) -> None:
        self.check_run(run)
        self.run, self.engine = run, engine
        self.num_classes = engine.num_classes

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """ValueError for a RunConfig the method cannot run as asked (the driver calls it
        before Ray starts, every method again when it is built)."""
        if run.optim.pretrain_auto and not cls.auto_warmup:
            raise ValueError(
                f"method {cls.name}: --pretrain-epochs auto (OptimConfig.pretrain_auto) is "
                f"for lccn and ce; {cls.name}'s schedule is laid out from a fixed count of "
                f"cross-entropy epochs: give one")

    @classmethod
    def latent_classes(cls, run: RunConfig, num_classes: int) -> int:
        """K_latent, the rows of the chain's counts and the classifier's outputs, for
        ``num_classes`` observed classes (K; LCCN* K + 1)."""
        return num_classes

    @classmethod
    def names_samples(cls, run: RunConfig) -> bool:
        """Whether the method's end-of-run files name every training sample by its key
        (LCCN*'s ``outliers.csv``): the driver then reads the split's keys."""
        return False

    @classmethod
    def reads(cls, path: str) -> bool:
        """Whether the method reads the RunConfig field ``path`` (``"lccn.alpha"``): a
        method with a chain every field but its ``ignores``; one without none of
        LCCNConfig's but ``lccn.xi`` (when its loss is clipped). Tune leaves a field out of a
        method's search space when it does not."""
        if path in cls.ignores:
            return False
        if cls.needs_chain or not path.startswith("lccn."):
            return True
        return path == "lccn.xi" and cls.clips_at_xi

    # -- networks -------------------------------------------------------------------------------

    def applied_lr(self, epoch: int) -> float:
        """The learning rate the optimiser that steps in ``epoch`` applies (the epoch row's
        ``lr``): the first network's by default."""
        return float(self.members[0].optimizer.param_groups[0]["lr"])

    def num_outputs(self) -> int:
        """Logits of the classifier (K; LCCN* K + 1)."""
        return self.latent_classes(self.run, self.num_classes)

    def build_members(self) -> list:
        return [self.engine.make_member(0)]

    @property
    def members(self) -> list:
        return self.engine.members

    # -- phases ---------------------------------------------------------------------------------

    def in_noise_phase(self, epoch: int) -> bool:
        return False

    def noise_phase_started(self) -> bool:
        return True

    def start_noise_phase(self, epoch: int) -> dict[str, float]:
        return {}

    def train_views(self, epoch: int) -> int:
        """Augmented views per image in the training pass of ``epoch`` (1 or 2)."""
        return 1

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> None:
        pass

    def train_task(self, epoch: int) -> Task:
        """The training pass of ``epoch`` as the loop runs it (by default cross-entropy of
        network 0 on the observed labels)."""
        m = self.members[0]
        return LabelTask(m.train_model, m.optimizer, xi=self.run.lccn.xi,
                         known_below=self.num_classes + 1)

    def end_pass(self, epoch: int) -> None:
        """After the training pass of ``epoch`` (every rank; collectives allowed)."""

    def scored(self, epoch: int, row: dict[str, float]) -> None:
        """After epoch ``epoch``'s row is complete (validation and test scored; every rank,
        the same row; collectives allowed), before its checkpoint."""

    def flush(self) -> None:
        pass

    def observe_chain(self, state: dict | None, *, epoch: int,
                      row: dict[str, float] | None) -> dict[str, float]:
        return {}

    def epoch_stats(self) -> dict[str, float]:
        return {"staleness_max": 0.0}

    def current_transition(self) -> Tensor | None:
        """The transition a method without a chain estimates or learns, ``(K, K)`` (rank 0
        logs it to MLflow as a chain's phi: heat maps, ``transition.csv``); None if none."""
        return None

    def final_files(self) -> dict[str, str]:
        """Files the method exports at the end of a run, ``{name: text}`` (rank 0)."""
        return {}

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # -- evaluation -----------------------------------------------------------------------------

    def noise_model(self) -> Tensor | None:
        """The method's current ``P(observed | latent)``, ``(K_latent, K)``, through which its
        model predicts an observed label (the noisy validation likelihood ``val_nll``); by
        default :meth:`current_transition`, None (the identity) without one."""
        return self.current_transition()

    def evaluate(self, model: nn.Module, batches: Iterable[Any], *,
                 noisy: bool = False) -> dict[str, float]:
        """top1/top5 of ``model`` on the batches' labels and ``nll``; ``noisy``: the labels
        are observed ones, ``nll`` goes through :meth:`noise_model`."""
        return evaluate(model, batches, num_classes=self.num_classes, device=self.engine.device,
                        noise=self.noise_model() if noisy else None)
