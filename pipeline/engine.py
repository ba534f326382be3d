"""The training engine: one epoch loop for every method, in one process or in a Ray Train
worker.

Three things vary between a run in this process and a run in Ray Train workers, and each is
an object the engine is given; the loop itself is the same:

- the :class:`Session`: rank, world size, device, collectives (``barrier``,
  ``all_reduce_sum``, ``all_gather``), ``prepare_model`` (DDP), ``load_checkpoint`` and
  ``report``. :class:`ProcessSession` (one process, nothing kept), ``LocalSession``
  (:mod:`pipeline.dist_worker`: one process, checkpoints on disk) and ``RaySession``
  (:mod:`pipeline.ray_train`);
- the data (:class:`TensorSource`: in-memory tensors; :class:`ShardSource`: the
  WebDataset loader of :mod:`pipeline.data`, each rank its share): the training pass of an
  epoch, the training split in eval mode, the noisy validation split, the test split;
- the chain backend (:class:`LocalChain`: an in-process
  :class:`~pipeline.confusion_store.ConfusionStore`; :class:`SharedChain`: a client of the
  run's fenced store actor; :class:`ChainSet`: one of those per network, for a method with
  ``num_chains > 1``).

What is trained, and how, is the *method* (:mod:`pipeline.methods`), chosen by
``RunConfig.method``. Per (re)start of a worker::

    state = session.load_checkpoint()          members (models, optimizers, schedulers),
                                               position, method state, history
    chain open                                 rank 0 restores C and z (or the initial ones)
    for epoch in [start_epoch, epochs):
        pass = data.train_batches(epoch, start_batch)     held-out idx skipped and counted
        method.start_noise_phase(epoch)        once, at the first noise-handling epoch
        method.begin_epoch(epoch, pass.steps_per_epoch)
        stats = method.train_epoch(epoch, pass, after_step)     after_step: global step,
                                               mid-epoch checkpoints, injected faults
        schedulers step; row = stats averaged over ranks + val_top1 + test + data counters
        moment(): method.flush(), barrier, rank 0 reads the chain state, method.end_epoch
                  (health, monitor), checkpoint, MLflow, report
        collapse flagged (MonitorConfig.stop): every rank stops after this epoch
    the last moment (rank 0): method.final_files() (LCCN*: outliers.csv) into the final
    checkpoint, EngineOptions.out_dir and MLflow

A checkpoint (``state.pt``) holds ``models``/``optimizers``/``schedulers`` (one entry per
member; ``model``/``optimizer``/``scheduler`` name the first; ``emas``: each member's
weight average or None), ``epoch``, ``batch``,
``global_step``, the method's :meth:`~pipeline.methods.base.Method.state_dict` entries,
``store`` (the chain state, ``{"chains": [...]}`` for a :class:`ChainSet`, or None),
``mlflow_run_id``, ``history``, ``method_name``, ``k_latent``, ``num_samples`` and ``data``
(the data source's state: the in-memory generator, or None).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.config import RunConfig
from pipeline.confusion import transition
from pipeline.confusion_store import ConfusionStore
from pipeline.fastpath import configure_backends, wrap_model
from pipeline.labels import LabelView, holdout_split
from pipeline.lccn import GibbsLabeler
from pipeline.loop import evaluate
from pipeline.models import build_model

STATE_FILE = "state.pt"
META_FILE = "meta.json"


class Session(Protocol):
    """What the engine needs from its runtime (one process, or one Ray Train worker)."""

    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: nn.Module) -> nn.Module: ...
    def barrier(self) -> None: ...
    def all_reduce_sum(self, t: Tensor) -> Tensor: ...
    def all_gather(self, t: Tensor) -> list[Tensor]: ...
    def load_checkpoint(self) -> dict | None: ...
    def report(self, metrics: dict[str, float], checkpoint_dir: str | None) -> None: ...


class ProcessSession:
    """Rank 0 of 1 in this process; keeps the reported metrics, never a checkpoint (the
    local trainer's session: a run starts from scratch)."""

    checkpointing = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.rank, self.world_size, self.device = 0, 1, torch.device(device)
        self.reports: list[dict[str, float]] = []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model

    def barrier(self) -> None:
        pass

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return t

    def all_gather(self, t: Tensor) -> list[Tensor]:
        return [t]

    def load_checkpoint(self) -> dict | None:
        return None

    def report(self, metrics: dict[str, float], checkpoint_dir: str | None) -> None:
        self.reports.append(dict(metrics))


class TorchCollectives:
    """``barrier`` / ``all_reduce_sum`` / ``all_gather`` over ``torch.distributed`` (the
    process group Ray Train sets up; no-ops in a single process). Sessions inherit them
    and set ``rank``, ``world_size`` and ``device``."""

    rank: int
    world_size: int
    device: torch.device

    @staticmethod
    def _dist() -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def barrier(self) -> None:
        if self._dist():
            torch.distributed.barrier()

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        if self._dist():
            torch.distributed.all_reduce(t)
        return t

    def all_gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""
        if not self._dist():
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, t.contiguous())
        return out


def all_gather_rows(session: Session, t: Tensor) -> Tensor:
    """Concatenate every rank's ``t (n_r, ...)`` along dim 0, in rank order (the ranks'
    ``n_r`` may differ: padded to the largest for the collective, then cut)."""
    if session.world_size == 1:
        return t
    dev = session.device
    sizes = torch.zeros(session.world_size, dtype=torch.int64, device=dev)
    sizes[session.rank] = t.shape[0]
    sizes = session.all_reduce_sum(sizes).cpu().tolist()
    pad = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype, device=dev)
    pad[:t.shape[0]] = t.to(dev)
    parts = session.all_gather(pad)
    return torch.cat([p[:n].cpu() for p, n in zip(parts, sizes)])


def transition_error(phi: Tensor, truth: Any) -> float:
    """Mean |phi - truth| over the rows both have (the first K when one of them carries an
    outlier row); NaN without a truth."""
    if truth is None:
        return float("nan")
    t = torch.as_tensor(np.asarray(truth), dtype=torch.float64)
    rows = min(phi.shape[0], t.shape[0])
    return float((phi[:rows].to(torch.float64) - t[:rows]).abs().mean())


def select_epoch(history: list[dict[str, float]], key: str = "val_top1") -> int:
    """Index of the row with the highest ``key`` (the first on ties): the epoch a
    practitioner would keep, chosen on the noisy validation split. The last row when no
    row has a finite ``key``."""
    vals = [r.get(key, float("nan")) for r in history]
    finite = [i for i, v in enumerate(vals) if v == v]
    if not finite:
        return len(history) - 1
    return max(finite, key=lambda i: (vals[i], -i))


def init_state_file(path: str | os.PathLike) -> Path:
    """The ``state.pt`` that :attr:`EngineOptions.init_from` names: the file itself, a
    checkpoint folder holding one, or a folder of ``checkpoint_*`` folders (a run's
    ``<run_dir>/train/<run_name>``; ``<run_dir>`` itself when it holds one run) whose
    newest complete checkpoint (largest global step) is taken."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if (p / STATE_FILE).is_file():
        return p / STATE_FILE
    # the resume path's own choice (a folder that does not load is skipped); imported here:
    # pipeline.ray_train imports this module (and Ray only inside its functions)
    from pipeline.ray_train import newest_complete_checkpoint

    roots = [p] + ([r for r in sorted((p / "train").iterdir()) if r.is_dir()]
                   if (p / "train").is_dir() else [])
    found = {r: d for r in roots if (d := newest_complete_checkpoint(r)) is not None}
    if not found:
        raise FileNotFoundError(f"--init-from {path}: no {STATE_FILE}, checkpoint folder or "
                                f"run with a complete checkpoint there")
    if len(found) > 1:
        raise ValueError(f"--init-from {path}: it holds the checkpoints of {len(found)} runs "
                         f"({', '.join(str(r) for r in found)}); name one")
    return next(iter(found.values())) / STATE_FILE


def _last_lr(state: dict) -> float | None:
    """The learning rate a checkpoint's weights were last trained at: its last epoch row's;
    without a history its first optimiser's, which is the rate of the step it would take
    next (the same unless a milestone falls just after its last epoch); else None."""
    hist = state.get("history") or []
    if hist and "lr" in hist[-1]:
        return float(hist[-1]["lr"])
    opts = state.get("optimizers") or ([state["optimizer"]] if "optimizer" in state else [])
    try:
        return float(opts[0]["param_groups"][0]["lr"])
    except (IndexError, KeyError, TypeError):
        return None


def held_out_mask(view: LabelView, fraction: float, *, seed: int) -> np.ndarray | None:
    """``(N,) bool``: the noisy validation split of a training label view, the same
    stratified split as :func:`pipeline.labels.holdout_split` (and the local trainer) for
    this view and seed; None when ``fraction`` is 0."""
    if fraction <= 0:
        return None
    _, val_rows = holdout_split(view.observed, fraction, seed=seed)
    mask = np.zeros(len(view), dtype=bool)
    mask[val_rows] = True
    return mask


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
    # the tensor lists update_average works on, built once per (model, ema) pair of modules:
    # walking the module tree for them each step costs more than the fused update itself
    _average_lists: tuple | None = field(default=None, repr=False, compare=False)

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


# -- data ---------------------------------------------------------------------------------------


class _Pass:
    """One training pass: iterable of batches with ``steps_per_epoch``, ``start_batch``
    (the batches of the epoch already done before it: a resumed pass starts there) and
    ``counters``."""

    def __init__(self, batches: Iterable[Any], steps_per_epoch: int,
                 start_batch: int = 0) -> None:
        self.batches, self.steps_per_epoch = batches, steps_per_epoch
        self.start_batch = start_batch

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def counters(self, session: Session) -> dict[str, float]:
        return {}


class TensorSource:
    """In-memory splits (:class:`pipeline.trainer.TensorData`): ``train`` (idx 0..N-1),
    ``val`` (the held-out split, scored against its observed labels, or None) and ``test``.
    The training pass is shuffled and augmented from ``generator`` (the local trainer's one
    generator: data order, augmentation and the Gibbs draws share it)."""

    def __init__(self, train: Any, val: Any | None, test: Any, *, batch_size: int,
                 generator: torch.Generator, eval_batch_size: int = 512) -> None:
        self.train, self.val, self.test = train, val, test
        self.batch_size, self.generator, self.eval_batch_size = batch_size, generator, eval_batch_size
        labels = train.labels
        self.num_samples, self.num_classes = len(train), labels.num_classes
        self.observed, self.clean = train.observed, train.clean
        self.trusted = torch.from_numpy(labels.trusted)
        self.transition = labels.transition
        self.held_out: np.ndarray | None = None  # the idx space holds training samples only

    def train_batches(self, epoch: int, start_batch: int = 0, *, views: int = 1) -> _Pass:
        """views=2: batches with two augmented views of every image (``ViewsBatch``)."""
        if start_batch:
            raise ValueError("an in-memory pass cannot start mid-epoch (no checkpoints here)")
        return _Pass(self.train.batches(self.batch_size, generator=self.generator, views=views),
                     -(-len(self.train) // self.batch_size))

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (data order, augmentation, the local Gibbs draws): what
        an epoch-end checkpoint needs for a resumed run to continue as an uninterrupted
        one."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    def train_eval_batches(self) -> Iterable[Any]:
        return self.train.batches(self.eval_batch_size)

    def val_batches(self) -> Iterable[Any] | None:
        return None if self.val is None else self.val.batches(self.eval_batch_size)

    def test_batches(self) -> Iterable[Any] | None:
        return self.test.batches(self.eval_batch_size)


class _SkipHeldOut:
    """A shard loader's pass without the held-out idx; ``skipped`` counts the real
    (``valid``) held-out samples left out. A batch made only of held-out samples keeps its
    first one as padding (``valid=False``): every rank still steps."""

    def __init__(self, loader: Any, held_out: np.ndarray) -> None:
        self.loader, self.held_out = loader, torch.from_numpy(held_out)
        self.steps_per_epoch = loader.steps_per_epoch
        self.skipped = 0

    def __iter__(self) -> Iterator[Any]:
        self.skipped = 0
        for b in self.loader:
            out = self.held_out[b.idx]
            if not out.any():
                yield b
                continue
            self.skipped += int((out & b.valid).sum())
            keep = ~out
            if not keep.any():
                keep[0] = True
                b = b._replace(valid=torch.zeros_like(b.valid))
            sel = torch.nonzero(keep)[:, 0]
            yield type(b)(*(t[sel] for t in b))


class _ShardPass(_Pass):
    def __init__(self, loader: Any, held_out: np.ndarray | None) -> None:
        self.loader = loader
        self.filter = None if held_out is None else _SkipHeldOut(loader, held_out)
        super().__init__(self.filter if self.filter is not None else loader,
                         loader.steps_per_epoch, loader.start_batch)

    def counters(self, session: Session) -> dict[str, float]:
        from pipeline.data import loader_counters

        out = loader_counters(self.loader.stats, all_reduce_sum=session.all_reduce_sum,
                              device=session.device)
        skipped = torch.tensor([float(self.filter.skipped if self.filter else 0)],
                               dtype=torch.float64)
        out["val_held_out"] = float(session.all_reduce_sum(skipped.to(session.device)).cpu()[0])
        return out


def _held_out_only(batches: Iterable[Any], held_out: Tensor) -> Iterator[Any]:
    """The held-out samples of an eval pass, scored against their observed labels."""
    for b in batches:
        keep = held_out[b.idx] & b.valid
        if keep.any():
            sel = torch.nonzero(keep)[:, 0]
            b = type(b)(*(t[sel] for t in b))
            yield b._replace(clean=b.observed)


def _without(batches: Iterable[Any], held_out: Tensor) -> Iterator[Any]:
    """An eval pass without the held-out samples (they are marked padding)."""
    for b in batches:
        yield b._replace(valid=b.valid & ~held_out[b.idx])


def loader_geometry(*, world_size: int, batch_per_rank: int, loader_workers: int,
                    shuffle_buffer: int) -> dict[str, int]:
    """The values besides (seed, epoch) that fix the order of a shard epoch's batches."""
    return {"world_size": int(world_size), "batch_per_rank": int(batch_per_rank),
            "loader_workers": int(loader_workers), "shuffle_buffer": int(shuffle_buffer)}


class ShardSource:
    """The training and test shards of a distributed run, this rank's share of each
    (:mod:`pipeline.data`). ``held_out (N,) bool``: the noisy validation split (never in a
    training pass, scored every epoch), or None."""

    def __init__(self, *, train_source: str, test_source: str | None, view: LabelView,
                 loader_cfg: Any, rank: int, world_size: int,
                 held_out: np.ndarray | None) -> None:
        from pipeline.data import check_splits, load_manifest, warn_if_class_sorted

        self.train_source, self.test_source, self.view = train_source, test_source, view
        self.cfg, self.rank, self.world_size = loader_cfg, rank, world_size
        self.manifest = load_manifest(train_source, cfg=loader_cfg)
        if rank == 0:
            warn_if_class_sorted(self.manifest, where=str(train_source))
        self.test_manifest = (load_manifest(test_source, cfg=loader_cfg)
                              if test_source else None)
        check_splits(self.manifest, self.test_manifest, world_size=world_size,
                     train_where=str(train_source), test_where=str(test_source))
        self.held_out = held_out if held_out is not None and held_out.any() else None
        self._held_t = None if self.held_out is None else torch.from_numpy(self.held_out)
        self.num_samples, self.num_classes = len(view), view.num_classes
        # copies: a view from the object store is read-only
        self.observed = torch.from_numpy(np.array(view.observed))
        self.clean = torch.from_numpy(np.array(view.clean))
        self.trusted = torch.from_numpy(np.array(view.trusted))
        self.transition = view.transition

    def geometry(self) -> dict[str, int]:
        """What fixes the order of an epoch's batches besides (seed, epoch): a checkpoint
        taken mid-epoch resumes at its batch only under the same values."""
        return loader_geometry(world_size=self.world_size, batch_per_rank=self.cfg.batch_size,
                               loader_workers=self.cfg.num_workers,
                               shuffle_buffer=self.cfg.shuffle_buffer)

    def train_batches(self, epoch: int, start_batch: int = 0, *, views: int = 1) -> _ShardPass:
        from pipeline.data import make_train_loader

        loader = make_train_loader(self.train_source, self.view, self.cfg, rank=self.rank,
                                   world_size=self.world_size, epoch=epoch,
                                   start_batch=start_batch, manifest=self.manifest,
                                   views=views)
        return _ShardPass(loader, self.held_out)

    def _train_eval(self) -> Any:
        from pipeline.data import make_eval_loader

        return make_eval_loader(self.train_source, self.view, self.cfg, rank=self.rank,
                                world_size=self.world_size, manifest=self.manifest)

    def train_eval_batches(self) -> Iterable[Any]:
        loader = self._train_eval()
        return loader if self._held_t is None else _without(loader, self._held_t)

    def val_batches(self) -> Iterable[Any] | None:
        if self._held_t is None:
            return None
        return _held_out_only(self._train_eval(), self._held_t)

    def test_batches(self) -> Iterable[Any] | None:
        """This rank's share of the test split; empty on ranks past its shard count (a test
        split with fewer shards than ranks is scored by the first ones, whole shards each,
        and :meth:`Engine.score` sums every rank's counts)."""
        from pipeline.data import eval_ranks, make_eval_loader

        if not self.test_source:
            return None
        ranks = eval_ranks(self.test_manifest, self.world_size)
        if self.rank >= ranks:
            return []
        return make_eval_loader(self.test_source, None, self.cfg, rank=self.rank,
                                world_size=ranks, manifest=self.test_manifest)


# -- chain backends -----------------------------------------------------------------------------


class LocalChain:
    """The Gibbs chain's state in this process: a :class:`ConfusionStore` made when the
    noise phase starts; labelers draw from the engine's ``generator``."""

    shared = False
    # set by the Engine: where the replica of C and the Gibbs step live, and whether the
    # step's device core is compiled (PerfConfig.compile)
    device: torch.device | None = None
    compile_mode: str = "off"

    def __init__(self, observed: Tensor, num_classes: int, *, generator: torch.Generator,
                 check_invariants: bool = True) -> None:
        self.observed, self.num_classes = observed, num_classes
        self.generator, self.check_invariants = generator, check_invariants
        self.store: ConfusionStore | None = None

    def open(self, state: dict | None, session: Session) -> None:
        if state is not None:
            self.store = ConfusionStore.from_state_dict(state)

    def start(self, idx: Tensor, z0: Tensor, *, k_latent: int, trusted: Tensor | None,
              clean: Tensor) -> None:
        """Initial assignment ``z0`` of samples ``idx`` (all of them, in one process)."""
        z = self.observed.clone()
        z[idx] = z0
        counted = None
        if trusted is not None:
            z = torch.where(trusted, clean, z)
            counted = ~trusted
        self.store = ConfusionStore(self.observed, z, k_latent, self.num_classes,
                                    counted=counted)

    def labeler(self, cfg: Any, *, phi_init: Tensor, max_steps: int, trusted: Tensor | None,
                clean: Tensor, steps_per_epoch: int) -> GibbsLabeler:
        """The worker's labeler over the in-process store (no other worker: ``commit_every``
        as configured)."""
        labeler = GibbsLabeler(cfg, self.store, self.store.counts, self.store.version,
                               phi_init=phi_init, max_steps=max_steps, generator=self.generator,
                               trusted=trusted, clean=clean, device=self.device,
                               compile_mode=self.compile_mode, steps_per_epoch=steps_per_epoch)
        # a store restored from a checkpoint has seen this worker's commits up to last_seq:
        # continue the sequence (a restarted one would be refused as duplicates)
        labeler.seq = self.store.last_seq.get(labeler.worker, -1) + 1
        return labeler

    def read(self) -> dict | None:
        """The chain state now (rank 0): counts, z, observed, counted, version."""
        if self.store is None:
            return None
        if self.check_invariants:
            self.store.check()
        return self.store.state_dict()

    def stats(self) -> dict[str, float]:
        return {}


class SharedChain:
    """The chain in the run's fenced store actor (:mod:`pipeline.store_actor`): rank 0
    opens it (restoring the checkpointed C and z) and every rank joins its fence."""

    shared = True
    # set by the Engine: where the replica of C and the Gibbs step live, and whether the
    # step's device core is compiled (PerfConfig.compile)
    device: torch.device | None = None
    compile_mode: str = "off"

    def __init__(self, client: Any, session: Session, *, seed: int,
                 held_out: np.ndarray | None = None) -> None:
        self.client, self.session, self.seed = client, session, seed
        self.held_out = held_out if held_out is not None and held_out.any() else None
        self.fence = ""

    def open(self, state: dict | None, session: Session) -> None:
        if session.rank == 0:
            self.fence = self.client.open(state)
        session.barrier()
        if session.rank != 0:
            self.fence = self.client.join()

    def _check_not_counted(self, state: dict) -> None:
        """Refuse a store that counts samples of the noisy validation split in C."""
        if self.held_out is None:
            return
        bad = np.flatnonzero(state["counted"].numpy() & self.held_out)
        if bad.size:
            raise ValueError(f"the store counts {bad.size} samples of the noisy validation "
                             f"split (idx {bad[:5].tolist()}...): create it with "
                             f"pipeline.ray_train.initial_assignment_placeholder(view, run)")

    def start(self, idx: Tensor, z0: Tensor, *, k_latent: int, trusted: Tensor | None,
              clean: Tensor) -> None:
        """Commit this rank's initial assignment (the store ignores samples it does not
        count: trusted and held-out ones), then wait for every rank's."""
        self.client.commit(idx, z0, worker=f"init.rank{self.session.rank}.{self.fence[:8]}",
                           seq=0)
        self.session.barrier()

    def labeler(self, cfg: Any, *, phi_init: Tensor, max_steps: int, trusted: Tensor | None,
                clean: Tensor, steps_per_epoch: int) -> GibbsLabeler:
        """This rank's labeler over the store actor. ``commit_every`` is capped at a quarter
        of an epoch's steps, so a replica never misses most of an epoch of the other
        workers' labels (tiny runs, e.g. smoke tests)."""
        from pipeline.dist_worker import DistLabeler

        cfg = replace(cfg, commit_every=min(cfg.commit_every, max(1, steps_per_epoch // 4)))
        counts, version = self.client.snapshot()
        rank = self.session.rank
        return DistLabeler(cfg, self.client, counts, version, phi_init=phi_init,
                           max_steps=max_steps, generator=torch.Generator(), trusted=trusted,
                           clean=clean, worker=f"rank{rank}.{self.fence[:8]}", seed=self.seed,
                           rank=rank, device=self.device, compile_mode=self.compile_mode,
                           steps_per_epoch=steps_per_epoch)

    def read(self) -> dict | None:
        """The chain state (rank 0; the store checks its invariants), with no held-out
        sample counted."""
        state = self.client.check_state()
        self._check_not_counted(state)
        return state

    def stats(self) -> dict[str, float]:
        return {f"store_{key}": v for key, v in self.client.stats().items()
                if key in ("duplicates", "refused", "busy_s")}


class ChainSet:
    """One chain per network (DivideLCCN: each network keeps its own C and z, see
    docs/methods.md), behind the single-chain interface the engine uses: ``open`` gives
    chain i ``state["chains"][i]``; ``read`` returns ``{"chains": [state_0, ...],
    "version": sum of the versions}`` (None before any chain started). ``chains[i]`` is
    what a method starts and draws labelers from."""

    def __init__(self, chains: list[Any]) -> None:
        if len(chains) < 2:
            raise ValueError(f"a ChainSet holds two or more chains, got {len(chains)}")
        self.chains = list(chains)
        self.shared = any(c.shared for c in self.chains)

    def __len__(self) -> int:
        return len(self.chains)

    def __getitem__(self, i: int) -> Any:
        return self.chains[i]

    # the engine sets these once; every chain's labelers follow them
    @property
    def device(self) -> torch.device | None:
        return self.chains[0].device

    @device.setter
    def device(self, value: torch.device | None) -> None:
        for c in self.chains:
            c.device = value

    @property
    def compile_mode(self) -> str:
        return self.chains[0].compile_mode

    @compile_mode.setter
    def compile_mode(self, value: str) -> None:
        for c in self.chains:
            c.compile_mode = value

    def open(self, state: dict | None, session: Session) -> None:
        states = [None] * len(self.chains) if state is None else list(state["chains"])
        if len(states) != len(self.chains):
            raise ValueError(f"the checkpoint holds {len(states)} chains; this run has "
                             f"{len(self.chains)}")
        for c, st in zip(self.chains, states):
            c.open(st, session)

    def read(self) -> dict | None:
        states = [c.read() for c in self.chains]
        if all(st is None for st in states):
            return None
        return {"chains": states,
                "version": sum(int(st["version"]) for st in states if st is not None)}

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, c in enumerate(self.chains):
            out.update({f"{key}_chain{i}": v for key, v in c.stats().items()})
        return out


def chain_counts(state: dict | None) -> Tensor | None:
    """The counts C of a chain state (a :class:`ChainSet`'s: the first network's), or
    None."""
    if state is None:
        return None
    if "chains" in state:
        return chain_counts(state["chains"][0])
    return state["counts"]


# -- the engine ---------------------------------------------------------------------------------


@dataclass
class Tracking:
    """MLflow for rank 0 (:class:`pipeline.tracking.Tracker`)."""

    uri: str
    experiment: str
    run_name: str
    params: dict[str, Any]
    class_names: tuple[str, ...] = ()
    transition_every: int = 1
    tags: tuple[tuple[str, str], ...] = ()  # set on the MLflow run when it is created


@dataclass
class EngineOptions:
    """checkpoint_every: also checkpoint every n global steps inside an epoch (0: epoch
    ends only); pretrained: ImageNet weights; lr_values: per-phase learning rates (see
    :class:`pipeline.dist_worker.DistConfig`); raise_on_collapse: the collapse monitor raises
    :class:`~pipeline.monitor.ChainCollapsed` itself (one process) instead of every rank
    stopping together after the epoch; after_step: called with the global step after each
    step (fault injection); on_epoch: called on rank 0 with (epoch, row)."""

    run_name: str = "run"
    checkpoint_every: int = 0
    pretrained: bool = False
    lr_values: tuple[float, ...] = ()
    raise_on_collapse: bool = False
    tracking: Tracking | None = None
    after_step: Callable[[int], None] | None = None
    on_epoch: Callable[[int, dict[str, float]], None] | None = None
    # uint8 batches (LoaderConfig.normalize_on="device") are normalised by this module on
    # the device, inside the model wrapper
    normalize: nn.Module | None = None
    # the method's end-of-run files (Method.final_files) are also written here (rank 0)
    out_dir: str | None = None
    # for those files: the split's idx of each sample of the run (a run that re-indexed
    # its samples, e.g. the local trainer without its validation split) and its key
    sample_idx: np.ndarray | None = None
    sample_keys: Any = None  # a sequence of str by the split's idx, or None
    # a fresh run starts from the weights of another run's checkpoint (init_state_file:
    # a finished CE run, the paper's code's protocol); a resumed run ignores it
    init_from: str | None = None


_REDUCED = ("loss", "label_recovery", "changed", "staleness", "gamma", "step_time",
            "sampler_time", "sync_time", "sampler_share", "images_per_s", "steps")


def geometry_mismatch(saved: dict | None, now: dict | None, *, epoch: int,
                      batch: int) -> str | None:
    """Why a checkpoint taken at ``batch`` of ``epoch`` under the loader geometry ``saved``
    (:meth:`ShardSource.geometry`) cannot resume under ``now``, or None: inside an epoch
    the batch order depends on it (at an epoch boundary any geometry resumes)."""
    if batch <= 0 or saved is None or now is None or saved == now:
        return None
    diff = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(now)
                     if saved.get(k) != now.get(k))
    return (f"the checkpoint was taken at batch {batch} of epoch {epoch}, whose batch order "
            f"depends on the workers ({diff}): resuming there would train some samples twice "
            f"and skip others; resume with the checkpoint's values (world_size = "
            f"--num-workers, loader_workers = --loader-workers, batch_per_rank = --batch-size "
            f"/ --num-workers, --shuffle-buffer) or start a new run")


def _epoch_row(stats: dict[str, float], session: Session, *, epoch: int, global_step: int,
               lr: float, phase: bool) -> dict[str, float]:
    """Train stats averaged over the ranks that measured them (NaN: no known clean label in
    a rank's share, or not measured; NaN only when no rank has a value), the same on every
    rank; images_per_s summed: the run's throughput."""
    vals = torch.tensor([stats.get(key, float("nan")) for key in _REDUCED], dtype=torch.float64)
    have = torch.isfinite(vals)
    both = torch.cat([torch.where(have, vals, torch.zeros_like(vals)), have.double()])
    tot = session.all_reduce_sum(both.to(session.device)).cpu()
    sums, ranks = tot[:len(_REDUCED)], tot[len(_REDUCED):]
    mean = torch.where(ranks > 0, sums / ranks.clamp(min=1), torch.full_like(sums, float("nan")))
    row = dict(zip(_REDUCED, mean.tolist()))
    i = _REDUCED.index("images_per_s")
    row["images_per_s"] = float(sums[i]) if ranks[i] > 0 else float("nan")
    row["steps_per_s"] = 1.0 / row["step_time"] if row["step_time"] > 0 else 0.0
    row.update(epoch=float(epoch), global_step=float(global_step), lr=float(lr),
               phase=1.0 if phase else 0.0)
    return row


_NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
                nn.modules.instancenorm._InstanceNorm)


def param_groups(model: nn.Module, weight_decay: float,
                 norm_weight_decay: float | None = None) -> list[dict[str, Any]]:
    """The optimiser's parameter groups: one (every parameter at ``weight_decay``) unless
    ``norm_weight_decay`` differs, then the normalisation layers' parameters
    (:attr:`OptimConfig.norm_weight_decay`) in a second group after the others."""
    params = list(model.parameters())
    if norm_weight_decay is None or norm_weight_decay == weight_decay:
        return [{"params": params}]
    norm = {id(p) for m in model.modules() if isinstance(m, _NORM_LAYERS)
            for p in m.parameters(recurse=False)}
    groups = [{"params": [p for p in params if id(p) not in norm], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) in norm],
               "weight_decay": norm_weight_decay}]
    return [g for g in groups if g["params"]]


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


class Engine:
    """Runs ``run.method`` (:mod:`pipeline.methods`) over ``data`` with ``session``.

    chain: a :class:`LocalChain` or :class:`SharedChain` (needed by methods with a Gibbs
    chain, e.g. LCCN; None otherwise). The members (networks) are built here, so a caller
    may load weights into them before :meth:`fit`.
    """

    def __init__(self, run: RunConfig, session: Session, data: Any, *, chain: Any = None,
                 options: EngineOptions | None = None) -> None:
        from pipeline.methods import get_method

        self.run, self.session, self.data, self.chain = run, session, data, chain
        self.options = options or EngineOptions()
        self.device = session.device
        configure_backends(run.perf, self.device)
        if chain is not None:
            chain.device, chain.compile_mode = self.device, run.perf.compile
        self.num_classes = data.num_classes
        self.method = get_method(run.method)(run, self)
        self.k_latent = self.method.num_outputs()
        if self.method.needs_chain and chain is None:
            raise ValueError(f"method {run.method!r} needs a store client")
        self.members: list[Member] = self.method.build_members()
        self.history: list[dict[str, float]] = []
        # the learning rate the starting weights were last trained at (trained_lr)
        self.init_lr: float | None = None
        self.global_step = 0
        self.run_id: str | None = None
        self.tracker = None
        self._prepared = False

    # -- what methods use ----------------------------------------------------------------------

    def make_member(self, index: int = 0, *, num_outputs: int | None = None) -> Member:
        """A network of ``run.model`` (``num_outputs`` logits, default K_latent), SGD with
        the run's optimiser settings and its epoch schedule. Member i > 0 is initialised
        from ``seed + i`` (two networks must start apart)."""
        run, o = self.run, self.run.optim
        model = build_model(run.model.name, num_outputs or self.k_latent,
                            in_channels=run.model.in_channels, pretrained=self.options.pretrained,
                            seed=run.seed + index,
                            bn_momentum=run.model.bn_momentum).to(self.device)
        # the fused CUDA kernel: one launch for all parameters, the same update
        optimizer = torch.optim.SGD(param_groups(model, o.weight_decay, o.norm_weight_decay),
                                    lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                                    fused=self.device.type == "cuda" or None)
        ema = None
        if o.ema_decay > 0:
            ema = copy.deepcopy(model).requires_grad_(False)
        return Member(model, optimizer, make_scheduler(optimizer, run, self.options.lr_values),
                      ema=ema)

    def reduce_cpu(self, t: Tensor) -> Tensor:
        """All-reduce (sum) a CPU tensor over ranks; returns it on the CPU."""
        return self.session.all_reduce_sum(t.to(self.device)).cpu()

    def score(self, batches: Iterable[Any] | None, member: int = 0, *,
              noisy: bool = False) -> dict[str, float]:
        """top1/top5/nll (the labels of ``batches``; ``noisy``: observed labels, nll through
        the method's noise model) of a member, over every rank's share."""
        nan = float("nan")
        if batches is None:
            return {"top1": nan, "top5": nan, "nll": nan, "n": 0.0}
        model = self.members[member].scorer
        it = iter(batches)
        first = next(it, None)
        ev = ({"top1": nan, "top5": nan, "nll": nan, "n": 0.0} if first is None else
              self.method.evaluate(model, itertools.chain([first], it), noisy=noisy))
        if self.session.world_size == 1:
            return ev
        n = ev["n"]
        vals = torch.tensor([0.0 if n == 0 else ev[k] * n for k in ("top1", "top5", "nll")]
                            + [n], dtype=torch.float64)
        t1, t5, nll, n = self.reduce_cpu(vals).tolist()
        return {"top1": t1 / n if n else nan, "top5": t5 / n if n else nan,
                "nll": nll / n if n else nan, "n": n}

    def val_scores(self) -> dict[str, float]:
        """On the noisy validation split, against its observed labels (NaN without one):
        ``top1`` and ``nll``, the held-out negative log-likelihood of the observed labels
        under the model and the method's noise model (:meth:`Method.noise_model`)."""
        return self.score(self.data.val_batches(), noisy=True)

    def trained_lr(self) -> float | None:
        """The learning rate the members' weights were last trained at: this run's last
        epoch's, else the one :attr:`init_lr` names (the run ``--init-from`` started from,
        or what a caller that loaded weights itself set); None when unknown."""
        if self.history and "lr" in self.history[-1]:
            return float(self.history[-1]["lr"])
        return self.init_lr

    def val_top1(self) -> float:
        """Accuracy on the noisy validation split against its observed labels (NaN
        without one)."""
        return self.val_scores()["top1"]

    # -- the loop ------------------------------------------------------------------------------

    def prepare(self) -> dict:
        """Load the checkpoint to resume from (if any), wrap the members for training, open
        the chain and start tracking. Returns the ``resumed_*`` row entries."""
        session, run = self.session, self.run
        state = session.load_checkpoint()
        self.start_epoch = self.start_batch = 0
        if state is not None:
            self._load(state)
        elif self.options.init_from:
            self._init_weights(self.options.init_from)
        perf = run.perf  # the step's fast paths: RunConfig.perf alone decides them
        for m in self.members:
            # channels-last converts the parameters in place: the optimizer keeps them
            norm = self.options.normalize
            m.train_model = wrap_model(session.prepare_model(m.model), perf, self.device,
                                       normalize=norm)
            # no DDP collectives (and no second compiled graph set) in evaluation
            m.eval_model = wrap_model(m.model, replace(perf, compile="off"), self.device,
                                      normalize=norm)
            if m.ema is not None:
                m.ema_eval = wrap_model(m.ema, replace(perf, compile="off"), self.device,
                                        normalize=norm)
        if self.chain is not None:
            self.chain.open(state["store"] if state is not None else None, session)
        if self.options.tracking is not None and session.rank == 0:
            self._start_tracking()
        self._prepared = True
        return ({"resumed_epoch": float(self.start_epoch), "resumed_batch": float(self.start_batch)}
                if state is not None else {"resumed_epoch": -1.0, "resumed_batch": -1.0})

    def _init_weights(self, where: str) -> None:
        """Every member's weights (and weight average) from another run's checkpoint; the
        optimiser, schedule, position and chain start fresh."""
        path = init_state_file(where)
        state = torch.load(path, map_location="cpu", weights_only=False)
        models = state.get("models", [state["model"]] if "model" in state else [])
        if len(models) != len(self.members):
            raise ValueError(f"--init-from {path}: it holds {len(models)} networks; method "
                             f"{self.run.method!r} trains {len(self.members)}")
        emas = state.get("emas") or [None] * len(models)
        self.init_lr = _last_lr(state)
        for i, (m, ms, es) in enumerate(zip(self.members, models, emas)):
            try:
                m.model.load_state_dict(ms)
                if m.ema is not None:
                    m.ema.load_state_dict(es if es is not None else ms)
            except RuntimeError as e:
                raise ValueError(f"--init-from {path}: network {i} does not fit this run's "
                                 f"model {self.run.model.name!r} with {self.k_latent} outputs: "
                                 f"{str(e).splitlines()[0]}") from None
        if self.session.rank == 0:
            print(f"run {self.options.run_name}: starting from the weights of {path} (method "
                  f"{state.get('method_name', '?')!r}, after epoch {state.get('epoch', '?')})",
                  flush=True)

    def _load(self, state: dict) -> None:
        name = state.get("method_name", self.run.method)
        if name != self.run.method:
            raise ValueError(f"checkpoint is for method {name!r}; this run is {self.run.method!r}")
        if (state["k_latent"], state["num_samples"]) != (self.k_latent, self.data.num_samples):
            raise ValueError(f"checkpoint is for K_latent={state['k_latent']}, "
                             f"N={state['num_samples']}; this run has {self.k_latent}, "
                             f"{self.data.num_samples}")
        models = state.get("models", [state["model"]])
        optimizers = state.get("optimizers", [state["optimizer"]])
        schedulers = state.get("schedulers", [state["scheduler"]])
        if len(models) != len(self.members):
            raise ValueError(f"checkpoint has {len(models)} networks; method "
                             f"{self.run.method!r} trains {len(self.members)}")
        emas = state.get("emas") or [None] * len(models)
        for m, ms, os_, ss, es in zip(self.members, models, optimizers, schedulers, emas):
            m.model.load_state_dict(ms)
            ours = [g["weight_decay"] for g in m.optimizer.param_groups]
            if len(os_["param_groups"]) != len(ours):
                raise ValueError(
                    f"checkpoint's optimiser has {len(os_['param_groups'])} parameter "
                    f"group(s), this run's {len(ours)}: was it started with another "
                    f"norm_weight_decay (--norm-weight-decay; this run: "
                    f"{self.run.optim.norm_weight_decay})?")
            m.optimizer.load_state_dict(os_)
            for g, wd in zip(m.optimizer.param_groups, ours):  # the run's config decides
                g["weight_decay"] = wd
            m.scheduler.load_state_dict(ss)
            if m.ema is not None:  # a checkpoint of a run without the average: its weights
                m.ema.load_state_dict(es if es is not None else ms)
        self.start_epoch, self.start_batch = int(state["epoch"]), int(state["batch"])
        problem = geometry_mismatch(state.get("data_geometry"),
                                    self.data.geometry() if hasattr(self.data, "geometry")
                                    else None, epoch=self.start_epoch, batch=self.start_batch)
        if problem:
            raise ValueError(problem)
        self.global_step = int(state["global_step"])
        self.run_id = state["mlflow_run_id"]
        self.history = list(state["history"])
        self.method.load_state_dict(state)
        if state.get("data") is not None and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(state["data"])

    def _start_tracking(self) -> None:
        from dataclasses import asdict

        from pipeline.tracking import Tracker

        t = self.options.tracking
        # the run's metadata lives in the (first) shared chain's actor
        meta = self.chain[0] if isinstance(self.chain, ChainSet) else self.chain
        if self.run_id is None and isinstance(meta, SharedChain):
            self.run_id = meta.client.get_meta("mlflow_run_id")  # restarted before
        self.tracker = Tracker(tracking_uri=t.uri, experiment=t.experiment,  # a checkpoint
                               run_name=t.run_name, run_id=self.run_id, tags=dict(t.tags))
        self.run_id = self.tracker.start({"run": asdict(self.run), **t.params})
        if isinstance(meta, SharedChain):
            meta.client.set_meta("mlflow_run_id", self.run_id)

    def fit(self) -> list[dict[str, float]]:
        """Train from the checkpoint (or the start) to ``optim.epochs``; returns the rows of
        the epochs run by this call (rank 0's rows carry the chain's health)."""
        resumed = self.prepare() if not self._prepared else {}
        o, session = self.run.optim, self.session
        rows: list[dict[str, float]] = []
        collapsed = False
        if self.start_epoch >= o.epochs and session.rank == 0:
            print(f"run {self.options.run_name}: already complete ({self.start_epoch} of "
                  f"{o.epochs} epochs in its last checkpoint); nothing to do", flush=True)
        try:
            for epoch in range(self.start_epoch, o.epochs):
                row = self._epoch(epoch, resumed)
                rows.append(row)
                flag = torch.tensor([row.get("collapse", 0.0) if self.run.monitor.stop else 0.0],
                                    dtype=torch.float64)
                if float(self.reduce_cpu(flag)[0]) > 0:
                    collapsed = True
                    if session.rank == 0:
                        print(f"run {self.options.run_name}: stopped after epoch {epoch}: the "
                              f"chain collapsed (MonitorConfig.stop)", flush=True)
                    break
        except BaseException:
            if self.tracker is not None:
                try:  # a restarted rank 0 sets it RUNNING again when it resumes
                    self.tracker.end("FAILED")
                except Exception as e:  # never hide the failure itself
                    print(f"could not mark MLflow run {self.run_id} FAILED: {e}", flush=True)
            raise
        if self.tracker is not None:
            self.tracker.end("FAILED" if collapsed else "FINISHED")
        return rows

    def _epoch(self, epoch: int, resumed: dict[str, float]) -> dict[str, float]:
        o, session, method = self.run.optim, self.session, self.method
        t_epoch = time.perf_counter()
        first_batch = self.start_batch if epoch == self.start_epoch else 0
        views = method.train_views(epoch)
        train_pass = (self.data.train_batches(epoch, first_batch) if views == 1 else
                      self.data.train_batches(epoch, first_batch, views=views))
        extra: dict[str, float] = {}
        phase = method.in_noise_phase(epoch)
        if phase and not method.noise_phase_started():
            extra = method.start_noise_phase(epoch)
        method.begin_epoch(epoch, train_pass.steps_per_epoch)
        done = {"in_epoch": first_batch}

        ema = self.run.optim.ema_decay

        def after_step() -> None:
            self.global_step += 1
            if ema > 0:
                d = ema_decay_at(ema, self.global_step)
                for m in self.members:
                    m.update_average(d)
            done["in_epoch"] += 1
            if (self.options.checkpoint_every and self.global_step % self.options.checkpoint_every == 0
                    and done["in_epoch"] < train_pass.steps_per_epoch):
                self._moment(epoch, done["in_epoch"], {"epoch": float(epoch),
                                                       "global_step": float(self.global_step)})
            if self.options.after_step is not None:
                self.options.after_step(self.global_step)

        stats = method.train_epoch(epoch, train_pass, after_step)
        lr = self.members[0].optimizer.param_groups[0]["lr"]  # this epoch's, not the next's
        for m in self.members:
            m.scheduler.step()
        row = _epoch_row(stats, session, epoch=epoch, global_step=self.global_step, lr=lr,
                         phase=phase)
        val = self.val_scores()
        row["val_top1"], row["val_nll"] = val["top1"], val["nll"]
        test = self.data.test_batches()
        if test is not None:
            ev = self.score(test)
            row.update(test_top1=ev["top1"], test_top5=ev["top5"])
        row.update(train_pass.counters(session))
        row.update(method.epoch_stats())
        row.update(resumed)
        row.update(extra)
        row["epoch_time"] = time.perf_counter() - t_epoch
        self.history.append(row)
        self._moment(epoch + 1, 0, row, row=row, final=epoch + 1 == o.epochs)
        if self.options.on_epoch is not None and session.rank == 0:
            self.options.on_epoch(epoch, row)
        return row

    def _final_files(self, checkpoint_dir: str | None) -> list[Path]:
        """Rank 0, at the run's last moment: the method's end-of-run files, written into
        the final checkpoint (``checkpoint_dir``), into ``options.out_dir`` and to MLflow.
        Returns the paths written outside the checkpoint."""
        files = self.method.final_files()
        written: list[Path] = []
        if not files:
            return written
        with tempfile.TemporaryDirectory(prefix="lccn-files-") as tmp:
            for name, text in files.items():
                dirs = [Path(d) for d in (checkpoint_dir, self.options.out_dir, tmp) if d]
                for d in dirs:
                    d.mkdir(parents=True, exist_ok=True)
                    (d / name).write_text(text)
                if self.options.out_dir:
                    written.append(Path(self.options.out_dir) / name)
                if self.tracker is not None:
                    self.tracker.log_file(Path(tmp) / name)
        return written

    def _moment(self, epoch: int, batch: int, metrics: dict[str, float], *,
                row: dict[str, float] | None = None, final: bool = False) -> None:
        """One consistent moment: every rank's async work is done (method.flush), barrier,
        rank 0 reads the chain state, updates ``row`` (epoch ends) and writes the checkpoint;
        every rank reports (a barrier: no rank commits again before rank 0 has read the
        chain)."""
        session = self.session
        self.method.flush()
        checkpointing = getattr(session, "checkpointing", True)
        session.barrier()
        if session.rank != 0:
            if checkpointing:
                session.report(dict(metrics), None)
            return
        metrics = dict(metrics)
        chain_state = self.chain.read() if self.chain is not None else None
        observed = self.method.observe_chain(chain_state, epoch=epoch - 1,
                                             row=row if batch == 0 else None)
        if row is not None and batch == 0:
            row.update(observed)
            row.setdefault("transition_error", float("nan"))
        metrics.update(observed)
        if chain_state is not None:
            metrics["store_version"] = float(chain_state["version"])
            metrics.update(self.chain.stats())
        if not checkpointing:  # (the local trainer) tracked all the same
            if final:
                self._final_files(None)
            session.report(metrics, None)
            self._track(epoch, batch, metrics, chain_state, final=final, checkpoint_dir=None)
            return
        state = {
            "models": [m.model.state_dict() for m in self.members],
            "optimizers": [m.optimizer.state_dict() for m in self.members],
            "schedulers": [m.scheduler.state_dict() for m in self.members],
            "emas": [m.ema.state_dict() if m.ema is not None else None for m in self.members],
            "epoch": epoch, "batch": batch, "global_step": self.global_step,
            "store": chain_state, "mlflow_run_id": self.run_id, "history": self.history,
            "method_name": self.run.method, "k_latent": self.k_latent,
            "num_samples": self.data.num_samples,
            "data": self.data.state_dict() if hasattr(self.data, "state_dict") else None,
            "data_geometry": self.data.geometry() if hasattr(self.data, "geometry") else None,
        }
        state.update(model=state["models"][0], optimizer=state["optimizers"][0],
                     scheduler=state["schedulers"][0])
        method_state = self.method.state_dict()
        clash = set(method_state) & set(state)
        if clash:
            raise RuntimeError(f"method {self.run.method!r} state keys {sorted(clash)} clash "
                               f"with the engine's")
        state.update(method_state)
        with tempfile.TemporaryDirectory(prefix="lccn-ckpt-") as tmp:
            torch.save(state, Path(tmp) / STATE_FILE)
            meta = {"epoch": epoch, "batch": batch, "global_step": self.global_step,
                    "lccn_step": int(method_state.get("lccn_step", 0)),
                    "mlflow_run_id": self.run_id, "run_name": self.options.run_name,
                    "store_version": None if chain_state is None else int(chain_state["version"]),
                    "data_geometry": state["data_geometry"]}
            (Path(tmp) / META_FILE).write_text(json.dumps(meta, indent=1))
            if final:
                self._final_files(tmp)
            session.report(metrics, tmp)
            # tracked once the checkpoint is registered: a group restarted before it re-runs
            # the epoch and logs that run's figures, never two sets for one step
            self._track(epoch, batch, metrics, chain_state, final=final, checkpoint_dir=tmp)

    def _track(self, epoch: int, batch: int, metrics: dict[str, float], chain_state: Any, *,
               final: bool, checkpoint_dir: str | None) -> None:
        """Rank 0, at a moment: an epoch end's metrics (step = the epoch) and transition
        heat map; at the run's end the curves, ``transition.csv`` (methods with a transition)
        and the final checkpoint under ``checkpoint/``."""
        tracker, t = self.tracker, self.options.tracking
        if tracker is None or batch != 0:
            return
        counts = chain_counts(chain_state)
        phi = transition(counts) if counts is not None else self.method.current_transition()
        tracker.log_metrics(metrics, step=epoch - 1)
        if (phi is not None and self.method.noise_phase_started() and t.transition_every
                and (final or epoch % t.transition_every == 0)):
            tracker.log_transition(phi, epoch=epoch - 1, truth=self.data.transition,
                                   class_names=list(t.class_names) or None)
        if final:
            tracker.log_curves(self.history)
            tracker.log_final(phi, checkpoint_dir=checkpoint_dir,
                              class_names=list(t.class_names) or None)
