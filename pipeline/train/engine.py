"""The training engine: one epoch loop for every method, in one process or in a Ray Train
worker.

Three things vary between a run in this process and a run in Ray Train workers, and each is
an object the engine is given; the loop itself is the same:

- the :class:`~pipeline.train.session.Session`: rank, world size, device, collectives (``barrier``,
  ``all_reduce_sum``, ``all_gather``), ``prepare_model`` (DDP), ``load_checkpoint`` and
  ``report``. :class:`~pipeline.train.session.ProcessSession` (one process, nothing kept), ``LocalSession``
  (:mod:`pipeline.cluster.worker`: one process, checkpoints on disk) and ``RaySession``
  (:mod:`pipeline.cluster.ray_train`);
- the data (:class:`~pipeline.train.sources.TensorSource`: in-memory tensors;
  :class:`~pipeline.train.shard_source.ShardSource`: the
  WebDataset loader of :mod:`pipeline.data.stream`, each rank its share): the training pass of an
  epoch, the training split in eval mode, the noisy validation split, the test split;
- the chain backend (:mod:`pipeline.train.chains`; :class:`LocalChain`: an in-process
  :class:`~pipeline.core.confusion_store.ConfusionStore`; :class:`SharedChain`: a client of the
  run's fenced store actor; :class:`ChainSet`: one of those per network, for a method with
  ``num_chains > 1``).

What is trained, and how, is the *method* (:mod:`pipeline.train.methods`), chosen by
``RunConfig.method``. Per (re)start of a worker::

    state = session.load_checkpoint()          members (models, optimizers, schedulers),
                                               position, method state, history
    chain open                                 rank 0 restores C and z (or the initial ones)
    for epoch in [start_epoch, epochs):
        pass = data.train_batches(epoch, start_batch)     held-out idx skipped and counted
        method.start_noise_phase(epoch)        once, at the first noise-handling epoch
        method.begin_epoch(epoch, pass.steps_per_epoch)
        stats = run_pass(method.train_task(epoch), pass, after_step)   the one batch loop;
                                               after_step: global step, mid-epoch
                                               checkpoints, injected faults
        method.end_pass(epoch)
        schedulers step; row = stats averaged over ranks + val_top1 + test + data counters
        moment(): method.flush(), barrier, rank 0 reads the chain state, method.end_epoch
                  (health, monitor), checkpoint, MLflow, report
        collapse flagged (MonitorConfig.stop): every rank stops after this epoch
    the last moment (rank 0): method.final_files() (LCCN*: outliers.csv) into the final
    checkpoint, EngineOptions.out_dir and MLflow

A checkpoint (``state.pt``) holds ``models``/``optimizers``/``schedulers`` (one entry per
member; ``model``/``optimizer``/``scheduler`` name the first; ``emas``: each member's
weight average or None), ``epoch``, ``batch``,
``global_step``, the method's :meth:`~pipeline.train.methods.base.Method.state_dict` entries,
``store`` (the chain state, ``{"chains": [...]}`` for a :class:`ChainSet`, or None),
``mlflow_run_id``, ``history``, ``method_name``, ``k_latent``, ``num_samples`` and ``data``
(the data source's state: the in-memory generator, or None).
"""

from __future__ import annotations

import copy
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.core.config import RunConfig
from pipeline.core.confusion import transition
from pipeline.train.chains import ChainSet, SharedChain, chain_counts
from pipeline.train.checkpoints import (
    META_FILE,
    STATE_FILE,
    geometry_mismatch,
    init_state_file,
    last_lr,
)
from pipeline.train.export import Predictor, export_program
from pipeline.train.fastpath import configure_backends, grad_scaler, wrap_model
from pipeline.train.loop import run_pass
from pipeline.train.members import Member, ema_decay_at, make_scheduler, param_groups
from pipeline.train.methods import get_method
from pipeline.train.models import build_model
from pipeline.train.progress import EpochProgress
from pipeline.train.session import Session


def final_export_path(path: str | Path) -> Path:
    """Where a run exports its final epoch's classifier beside the selected one at
    ``path``: ``<name>-final.pt2``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-final{path.suffix}")


def select_epoch(history: list[dict[str, float]], key: str = "val_top1") -> int:
    """Index of the row with the highest ``key`` (the first on ties): the epoch a
    practitioner would keep, chosen on the noisy validation split. The last row when no
    row has a finite ``key``."""
    vals = [r.get(key, float("nan")) for r in history]
    finite = [i for i, v in enumerate(vals) if v == v]
    if not finite:
        return len(history) - 1
    return max(finite, key=lambda i: (vals[i], -i))


# -- the engine ---------------------------------------------------------------------------------


@dataclass
class Tracking:
    """MLflow for rank 0 (:class:`pipeline.track.tracking.Tracker`)."""

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
    :class:`pipeline.cluster.worker.DistConfig`); raise_on_collapse: the collapse monitor raises
    :class:`~pipeline.core.monitor.ChainCollapsed` itself (one process) instead of every rank
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
    # for those files: the key of each sample of the split, by idx
    sample_keys: Any = None  # a sequence of str by the split's idx, or None
    # a fresh run starts from the weights of another run's checkpoint (init_state_file:
    # a finished CE run, the paper's code's protocol); a resumed run ignores it
    init_from: str | None = None
    # the run's end logs the classifier (pipeline.train.export.Predictor) to MLflow as an
    # MLflow pytorch model (Tracker.log_model; tracked runs only)
    log_model: bool = True
    # rank 0 reports its progress inside an epoch every this many seconds (a tqdm bar on a
    # terminal, else a plain line and two MLflow metrics: pipeline.train.progress); 0: off
    progress_seconds: float = 0.0
    # the transform preset of the run's images (pipeline.data.transforms), recorded in the
    # exported classifier (Predictor.preset); None for in-memory data
    preset: str | None = None
    # the run's end also writes the classifier as a torch.export program to this file
    # (rank 0; pipeline.train.export.export_program: a .pt2 and its .json); None: not
    export_path: str | None = None


_REDUCED = ("loss", "observed_loss", "label_recovery", "changed", "staleness", "gamma",
            "step_time", "sampler_time", "sync_time", "sampler_share", "images_per_s", "steps")


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


class Engine:
    """Runs ``run.method`` (:mod:`pipeline.train.methods`) over ``data`` with ``session``.

    chain: a :class:`LocalChain` or :class:`SharedChain` (needed by methods with a Gibbs
    chain, e.g. LCCN; None otherwise). The members (networks) are built here, so a caller
    may load weights into them before :meth:`fit`.
    """

    def __init__(self, run: RunConfig, session: Session, data: Any, *, chain: Any = None,
                 options: EngineOptions | None = None) -> None:
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
        self._scaler_states: list[dict | None] = []  # set by _load: a checkpoint's loss scales
        # the learning rate the starting weights were last trained at (trained_lr)
        self.init_lr: float | None = None
        self.global_step = 0
        self.run_id: str | None = None
        self.model_uri: str | None = None  # the logged classifier (rank 0, tracked runs)
        self._exported = False  # the torch.export file written (options.export_path)
        self.tracker = None
        self._prepared = False
        # rank 0: the selected epoch (the best noisy validation accuracy, the first of equals:
        # select_epoch) and each network's scored weights after it, what the run exports
        self.selected: dict[str, Any] | None = None

    # -- what methods use ----------------------------------------------------------------------

    def make_member(self, index: int = 0, *, num_outputs: int | None = None) -> Member:
        """A network of ``run.model`` (``num_outputs`` logits, default K_latent), SGD with
        the run's optimiser settings and its epoch schedule. Member i > 0 is initialised
        from ``seed + i`` (two networks must start apart)."""
        run, o = self.run, self.run.optim
        model = build_model(run.model.name, num_outputs or self.k_latent,
                            in_channels=run.model.in_channels, pretrained=self.options.pretrained,
                            seed=run.seed + index, bn_momentum=run.model.bn_momentum,
                            weights=run.model.weights).to(self.device)
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
        the method's noise model) and nll_plain (-log P(label | x), no noise model) of a
        member, over every rank's share."""
        nan = float("nan")
        keys = ("top1", "top5", "nll", "nll_plain")
        if batches is None:
            return {**dict.fromkeys(keys, nan), "n": 0.0}
        model = self.members[member].scorer
        it = iter(batches)
        first = next(it, None)
        ev = ({**dict.fromkeys(keys, nan), "n": 0.0} if first is None else
              self.method.evaluate(model, itertools.chain([first], it), noisy=noisy))
        ev.setdefault("nll_plain", ev["nll"] if not noisy else nan)
        if self.session.world_size == 1:
            return ev
        n = ev["n"]
        vals = torch.tensor([0.0 if n == 0 else ev[k] * n for k in keys] + [n],
                            dtype=torch.float64)
        *sums, n = self.reduce_cpu(vals).tolist()
        return {**{k: v / n if n else nan for k, v in zip(keys, sums)}, "n": n}

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

    def frozen_copy(self, member: Member, state: dict[str, Tensor] | None = None
                    ) -> tuple[nn.Module, nn.Module]:
        """A copy of ``member``'s scored weights (its weight average when it has one) that no
        step trains: ``(bare, wrapped)``, the module (its ``state_dict`` is what a checkpoint
        keeps) and the module wrapped as evaluation wraps it (no collectives, not compiled),
        in eval mode, without gradients. ``state``: such a saved ``state_dict`` (a resumed
        run) instead of the current weights."""
        bare = copy.deepcopy(member.averaged)
        if state is not None:
            bare.load_state_dict(state)
        bare.eval().requires_grad_(False)
        wrapped = wrap_model(bare, replace(self.run.perf, compile="off"), self.device,
                             normalize=self.options.normalize)
        return bare, wrapped.eval()

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
            m.scaler = grad_scaler(perf, self.device)  # float16 autocast only
        # a resumed float16 run goes on with its checkpoint's loss scales (a fresh scaler
        # starts at 2**16 and halves on every overflow until it finds the scale again)
        for m, saved in zip(self.members, self._scaler_states):
            if m.scaler is not None and saved:
                m.scaler.load_state_dict(saved)
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
        self.init_lr = last_lr(state)
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
        self._scaler_states = list(state.get("scalers") or [])
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
        self.selected = state.get("selected")
        self.method.load_state_dict(state)
        if state.get("data") is not None and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(state["data"])

    def _start_tracking(self) -> None:
        from dataclasses import asdict

        from pipeline.track.tracking import Tracker

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
        progress = None
        if self.options.progress_seconds > 0 and session.rank == 0:
            tracker = self.tracker
            progress = EpochProgress(
                label=self.options.run_name, epoch=epoch, epochs=o.epochs,
                steps=train_pass.steps_per_epoch, start=first_batch,
                images_per_step=o.batch_size, every_s=self.options.progress_seconds,
                log=None if tracker is None else
                (lambda metrics, step: tracker.log_metrics(metrics, step=step)))

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
            if progress is not None:
                progress.step(self.global_step)

        try:
            stats = run_pass(method.train_task(epoch), train_pass, device=self.device,
                             after_step=after_step,
                             scalers={id(m.optimizer): m.scaler for m in self.members
                                      if m.scaler is not None})
        finally:
            if progress is not None:
                progress.close()
        method.end_pass(epoch)
        lr = method.applied_lr(epoch)  # this epoch's, not the next's
        for m in self.members:
            m.scheduler.step()
        row = _epoch_row(stats, session, epoch=epoch, global_step=self.global_step, lr=lr,
                         phase=phase)
        val = self.val_scores()
        row["val_top1"], row["val_nll"] = val["top1"], val["nll"]
        # the classifier's own held-out fit of the observed labels (no noise model): the
        # held-out counterpart of the training pass's observed_loss
        row["val_observed_loss"] = val.get("nll_plain", float("nan"))
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
        method.scored(epoch, row)
        self._remember_selected(epoch, row)
        self._moment(epoch + 1, 0, row, row=row, final=epoch + 1 == o.epochs)
        if self.options.on_epoch is not None and session.rank == 0:
            self.options.on_epoch(epoch, row)
        return row

    def _remember_selected(self, epoch: int, row: dict[str, float]) -> None:
        """Rank 0: keep each network's scored weights (on the CPU) after an epoch whose noisy
        validation accuracy beats every earlier one's: the epoch :func:`select_epoch` picks,
        whose classifier the run exports (without a validation split, none is kept and the
        final weights are exported)."""
        val = float(row.get("val_top1", float("nan")))
        if self.session.rank != 0 or not val == val:
            return
        if self.selected is not None and not val > self.selected["val_top1"]:
            return
        self.selected = {"epoch": epoch, "val_top1": val, "states": [
            {k: v.detach().to("cpu", copy=True) for k, v in m.averaged.state_dict().items()}
            for m in self.members]}

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
            if final:
                self._export()
            return
        state = {
            "models": [m.model.state_dict() for m in self.members],
            "optimizers": [m.optimizer.state_dict() for m in self.members],
            "schedulers": [m.scheduler.state_dict() for m in self.members],
            "emas": [m.ema.state_dict() if m.ema is not None else None for m in self.members],
            # float16 autocast: each network's loss scale and its growth count
            "scalers": [m.scaler.state_dict() if m.scaler is not None else None
                        for m in self.members],
            "epoch": epoch, "batch": batch, "global_step": self.global_step,
            "store": chain_state, "mlflow_run_id": self.run_id, "history": self.history,
            "method_name": self.run.method, "k_latent": self.k_latent,
            "num_samples": self.data.num_samples,
            "data": self.data.state_dict() if hasattr(self.data, "state_dict") else None,
            "data_geometry": self.data.geometry() if hasattr(self.data, "geometry") else None,
            "selected": self.selected,
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
        if final:
            self._export()

    def _export(self) -> None:
        """Rank 0 at the run's end: the classifier as a ``torch.export`` program at
        ``options.export_path`` (a model that does not export is a warning, not a failed
        run)."""
        path = self.options.export_path
        if not path or self._exported:
            return
        self._exported = True
        example = self._example_images()
        if example is None:
            print(f"note: no exported model at {path}: no test or validation images to "
                  f"trace it with", flush=True)
            return
        for which, target in (("selected", Path(path)), ("final", final_export_path(path))):
            if which == "final" and self.selected is None:
                continue  # the final weights went to `path`: no validation split
            try:
                export_program(self.predictor(which), example, target)
            except Exception as e:  # noqa: BLE001 - torch.export refuses some models
                print(f"warning: the classifier could not be exported to {target} "
                      f"({type(e).__name__}: {str(e)[:300]}); the MLflow model and the "
                      f"checkpoint have it", flush=True)
                return

    def _track(self, epoch: int, batch: int, metrics: dict[str, float], chain_state: Any, *,
               final: bool, checkpoint_dir: str | None) -> None:
        """Rank 0, at a moment: an epoch end's metrics (step = the epoch) and transition
        heat map; at the run's end the curves, ``transition.csv`` (methods with a transition)
        and the classifier as a LoggedModel (not the checkpoint: ``checkpoint_dir`` is the
        one Ray Train keeps under the run dir)."""
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
            # the checkpoint itself stays in the run dir (Ray Train's storage): the job's
            # driver tags the run with its path (docs/operations.md, "Where checkpoints live")
            tracker.log_final(phi, class_names=list(t.class_names) or None)
            example = self._example_images() if self.options.log_model else None
            if example is not None:
                self.model_uri = tracker.log_model(self.predictor(), example)

    def predictor(self, which: str = "selected") -> Predictor:
        """The trained classifier as one module (:class:`~pipeline.train.export.Predictor`):
        every network's weights (their averages, when kept), images in, the K classes'
        probabilities out. ``which``: ``"selected"`` (default), the weights after the epoch
        with the best noisy validation accuracy (rank 0; the final ones without a
        validation split), or ``"final"``, the weights the run ended with."""
        if which not in ("selected", "final"):
            raise ValueError(f"which must be 'selected' or 'final', got {which!r}")
        nets = [m.averaged for m in self.members]
        last = len(self.history)
        said = f"final epoch {last}"
        if which == "selected" and self.selected is not None:
            nets = [copy.deepcopy(n) for n in nets]
            for net, st in zip(nets, self.selected["states"]):
                net.load_state_dict(st)
            e = self.selected["epoch"]
            said = (f"selected epoch {e + 1} of {last} (best noisy validation accuracy "
                    f"{self.selected['val_top1']:.4f})")
        t = self.options.tracking
        names = t.class_names if t is not None and len(t.class_names) == self.num_classes else ()
        return Predictor(nets, self.num_classes, normalize=self.options.normalize,
                         preset=self.options.preset, class_names=names, weights=said)

    def _example_images(self) -> Tensor | None:
        """Two images of the test (else validation) split, on the CPU, as the networks take
        them: the input example of the logged model's signature."""
        for batches in (self.data.test_batches(), self.data.val_batches()):
            for b in batches or ():
                return b.images[:2].cpu()
        return None
