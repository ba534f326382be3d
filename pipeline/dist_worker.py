"""One data-parallel worker of a distributed LCCN run (Algorithm 3 over a shared store).

:func:`run_worker` is the whole per-worker algorithm. It reads nothing from global state: a
:class:`Session` gives it its rank, world size, device, collectives, the checkpoint to
resume from and ``report``; a store client (:mod:`pipeline.store_actor`) gives it the
shared C and z. Under Ray, :mod:`pipeline.ray_train` supplies a session over
``ray.train`` and a client of the confusion actor; tests run it in one process with
:class:`LocalSession` and an in-process store.

Per worker::

    open the store (rank 0: restore the checkpointed C and z, or the initial ones) -> barrier
    for epoch in [start_epoch, epochs):
        epoch == pretrain_epochs and no phi_init yet:             (Algorithm 3, lines 2-3)
            predict this rank's share of the training split (eval transform)
            phi_init = Eq. 8 from the all-reduced numerator sum_n P(k|x_n) 1(obs_n = j)
                       (or a smoothed identity)
            commit the initial assignment (argmax) of this rank's idx -> barrier
        CE epoch, or LCCN epoch: forward -> Gibbs step (Eq. 7, replica of C) -> CE(f(x), z)
            -> backward (DDP) -> commit z (the round trip overlaps the next forward)
        every ``checkpoint_every`` steps and at the end of the epoch: checkpoint
    rank 0 logs to MLflow (metrics, transition heat map, final CSV and checkpoint)

Checkpoint = one consistent moment: every rank flushes its labeler (the steps it still
buffers with ``commit_every > 1`` are sent, and its last commit is applied), barrier, rank 0 reads the store's state through ``check_state`` (invariants
checked by the store) and writes ``state.pt`` (model, optimizer, scheduler, epoch, batch
position, global step, LCCN step, phi_init, store state, MLflow run id, history); every rank
then calls ``report`` (a barrier: no rank commits again before rank 0 has read the store).

Randomness: model init from ``run.seed``; data order and augmentation from the loader
(seed, epoch, rank); the Gibbs step of LCCN step s on rank r draws from a generator seeded
with (seed, r, s). Nothing random is carried in the checkpoint, so a run resumed at a batch
boundary continues exactly as the uninterrupted run would (one worker; with several, only
the interleaving of commits differs).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.config import RunConfig
from pipeline.confusion import transition
from pipeline.data import (LoaderConfig, load_manifest, loader_counters, make_eval_loader,
                           make_train_loader)
from pipeline.labels import LabelView
from pipeline.lccn import GibbsLabeler, SampleStats
from pipeline.loop import evaluate, predict, train_one_epoch
from pipeline.models import build_model
from pipeline.monitor import CollapseMonitor, chain_health
from pipeline.warmup import estimate_phi_init, initial_assignment

STATE_FILE = "state.pt"
META_FILE = "meta.json"
FAILURE_MODES = ("exit", "raise", "kill_store")


@dataclass(frozen=True)
class DistConfig:
    """The distributed side of a run: where data comes from, where the run writes, how
    many workers, checkpoints, tracking. Paths must be absolute (Ray Train workers run in
    their own directory).

    run_name: Ray Train run name (a run re-submitted with the same name and run_dir
        resumes from its last checkpoint) and MLflow run name.
    run_dir: absolute directory of the run (Ray storage ``<run_dir>/train``, MLflow store).
    train_source, test_source: split directories or base URLs (``pipeline.data``).
    num_workers: Ray Train workers (DDP ranks); ``OptimConfig.batch_size`` is the global
        batch, each rank takes ``batch_size // num_workers``.
    loader_workers, shuffle_buffer, preset: the shard loader (``pipeline.data.LoaderConfig``).
    checkpoint_every: also checkpoint every this many steps inside an epoch (0: only at the
        end of each epoch).
    lr_values: learning rate of each phase between ``OptimConfig.milestones`` (len =
        milestones + 1), e.g. the paper's CIFAR 0.5/0.1/0.01; empty: ``lr`` decayed by
        ``lr_decay`` at each milestone.
    pretrained: ImageNet weights for the backbone (``pipeline.models``; resnet50 only).
    tracking_uri / experiment: MLflow; tracking_uri None disables tracking.
    class_names: for the heat maps and the CSV.
    transition_every: log the transition heat map every n LCCN epochs (0: never).
    inject_failure: tests only. Comma-separated ``rank:step:mode`` (mode ``exit``:
        ``os._exit(1)``, ``raise``: RuntimeError, ``kill_store``: kill the store actor) fired
        once after global step ``step`` on rank ``rank`` (a marker file in run_dir makes it
        fire only once across restarts and resubmissions).
    verify_checksums: sha256 of every local shard against the manifest before it is read
        (once per shard and process; ``pipeline.data.LoaderConfig``).
    """

    run_name: str
    run_dir: str
    train_source: str
    test_source: str | None = None
    num_workers: int = 2
    use_gpu: bool = False
    loader_workers: int = 2
    shuffle_buffer: int = 1000
    preset: str = "cifar"
    checkpoint_every: int = 0
    lr_values: tuple[float, ...] = ()
    pretrained: bool = False
    tracking_uri: str | None = None
    experiment: str = "lccn"
    class_names: tuple[str, ...] = ()
    transition_every: int = 1
    inject_failure: str = ""
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        for name in ("lr_values", "class_names"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not os.path.isabs(self.run_dir):
            raise ValueError(f"DistConfig.run_dir must be absolute (Ray workers chdir), got "
                             f"{self.run_dir!r}")
        for name in ("train_source", "test_source"):
            src = getattr(self, name)
            if src and "://" not in src and not os.path.isabs(src):
                raise ValueError(f"DistConfig.{name} must be an absolute path or a URL, "
                                 f"got {src!r}")
        if self.num_workers < 1 or self.loader_workers < 0 or self.checkpoint_every < 0:
            raise ValueError(f"need num_workers >= 1, loader_workers >= 0, checkpoint_every "
                             f">= 0; got {self.num_workers}, {self.loader_workers}, "
                             f"{self.checkpoint_every}")
        parse_failures(self.inject_failure)


def parse_failures(spec: str) -> list[tuple[int, int, str]]:
    """``"1:5:exit,0:9:kill_store"`` -> ``[(1, 5, "exit"), (0, 9, "kill_store")]``."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            rank, step, mode = part.split(":")
            item = (int(rank), int(step), mode)
        except ValueError:
            raise ValueError(f"inject_failure item {part!r} is not rank:step:mode") from None
        if item[2] not in FAILURE_MODES:
            raise ValueError(f"inject_failure mode {item[2]!r} not in {FAILURE_MODES}")
        out.append(item)
    return out


class Session(Protocol):
    """What :func:`run_worker` needs from its distributed runtime."""

    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: nn.Module) -> nn.Module: ...
    def barrier(self) -> None: ...
    def all_reduce_sum(self, t: Tensor) -> Tensor: ...
    def load_checkpoint(self) -> dict | None: ...
    def report(self, metrics: dict[str, float], checkpoint_dir: str | None) -> None: ...


class LocalSession:
    """One worker in this process (world size 1): checkpoints are copied under ``storage``
    (``checkpoint_000000``, ...); the latest one is what :meth:`load_checkpoint` resumes from."""

    def __init__(self, storage: str | os.PathLike) -> None:
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.storage = Path(storage)
        self.storage.mkdir(parents=True, exist_ok=True)
        self.reports: list[dict[str, float]] = []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model

    def barrier(self) -> None:
        pass

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return t

    def checkpoints(self) -> list[Path]:
        return sorted(self.storage.glob("checkpoint_*"))

    def load_checkpoint(self) -> dict | None:
        found = self.checkpoints()
        return load_state(found[-1]) if found else None

    def report(self, metrics: dict[str, float], checkpoint_dir: str | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None:
            dest = self.storage / f"checkpoint_{len(self.checkpoints()):06d}"
            shutil.copytree(checkpoint_dir, dest)


def load_state(checkpoint_dir: str | os.PathLike) -> dict:
    """The ``state.pt`` dict of a checkpoint directory."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: not an LCCN checkpoint (no {STATE_FILE})")
    return torch.load(path, map_location="cpu", weights_only=True)


def _step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for the Gibbs step ``step`` of ``rank`` (independent streams)."""
    state = np.random.SeedSequence([seed, rank, step, 0x6C63636E]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


class DistLabeler(GibbsLabeler):
    """:class:`GibbsLabeler` whose generator is re-seeded from (seed, rank, LCCN step) before
    each step (no generator state to checkpoint) and that records the largest staleness."""

    def __init__(self, *args: Any, seed: int, rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed, self.rank = seed, rank
        self.max_staleness = 0

    def sample(self, probs: Tensor, observed: Tensor, idx: Tensor) -> tuple[Tensor, SampleStats]:
        self.generator.manual_seed(_step_seed(self.seed, self.rank, self.step_count))
        z, stats = super().sample(probs, observed, idx)
        self.max_staleness = max(self.max_staleness, stats.staleness)
        return z, stats


class _Forward(nn.Module):
    """``model`` under bf16 autocast with channels-last inputs on CUDA; float32 logits."""

    def __init__(self, model: nn.Module, *, cuda: bool) -> None:
        super().__init__()
        self.model, self.cuda = model, cuda

    def forward(self, x: Tensor) -> Tensor:
        if not self.cuda:
            return self.model(x)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(x).float()


def _scheduler(optimizer: torch.optim.Optimizer, run: RunConfig, dist: DistConfig):
    o = run.optim
    if not dist.lr_values:
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(o.milestones),
                                                    gamma=o.lr_decay)
    values = list(dist.lr_values)
    if len(values) != len(o.milestones) + 1:
        raise ValueError(f"lr_values {values} needs len(milestones) + 1 = "
                         f"{len(o.milestones) + 1} entries (milestones {list(o.milestones)})")
    miles = list(o.milestones)
    # LambdaLR multiplies the optimizer's initial lr (o.lr) by the factor
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: values[sum(e >= m for m in miles)] / o.lr)


def transition_error(phi: Tensor, truth: Any) -> float:
    """Mean |phi - truth| over the rows both have (NaN without a truth)."""
    if truth is None:
        return float("nan")
    t = torch.as_tensor(np.asarray(truth), dtype=torch.float64)
    rows = min(phi.shape[0], t.shape[0])
    return float((phi[:rows].to(torch.float64) - t[:rows]).abs().mean())


class _Failures:
    """Injected failures (tests): fire each (rank, step, mode) at most once per run_dir."""

    def __init__(self, spec: str, rank: int, run_dir: str) -> None:
        self.items = [(s, m) for r, s, m in parse_failures(spec) if r == rank]
        self.rank, self.run_dir = rank, Path(run_dir)

    def __call__(self, step: int, store: Any) -> None:
        for s, mode in self.items:
            marker = self.run_dir / f".injected-failure-r{self.rank}-s{s}-{mode}"
            if s != step or marker.exists():
                continue
            marker.write_text(f"fired at step {step}\n")
            if mode == "exit":
                os._exit(1)
            if mode == "raise":
                raise RuntimeError(f"injected failure at step {step} on rank {self.rank}")
            store.kill()


def run_worker(run: RunConfig, dist: DistConfig, view: LabelView, store: Any,
               session: Session) -> list[dict[str, float]]:
    """Train this worker's share of the run; returns the epoch rows reported by this worker
    in this (re)start.

    run: what to train (method, model, optimizer schedule, LCCN options); view: the label
    view of the training split (``len(view)`` = N); store: a client of the run's
    StoreActor (None for method "ce"); session: rank/world size/collectives/checkpoints.
    """
    rank, ws, device = session.rank, session.world_size, session.device
    cuda = device.type == "cuda"
    o, lc = run.optim, run.lccn
    is_lccn = run.method == "lccn"
    k = view.num_classes
    k_latent = k + 1 if (is_lccn and lc.outlier) else k
    if is_lccn and store is None:
        raise ValueError("method 'lccn' needs a store client")
    # copies: a view from the object store is read-only
    clean = torch.from_numpy(np.array(view.clean))
    trusted = torch.from_numpy(np.array(view.trusted)) if (is_lccn and lc.use_trusted) else None

    base = build_model(run.model.name, k_latent, in_channels=run.model.in_channels,
                       pretrained=dist.pretrained, seed=run.seed)
    optimizer = torch.optim.SGD(base.parameters(), lr=o.lr, momentum=o.momentum,
                                weight_decay=o.weight_decay)
    scheduler = _scheduler(optimizer, run, dist)

    state = session.load_checkpoint()
    start_epoch = start_batch = global_step = lccn_step = 0
    phi_init: Tensor | None = None
    run_id: str | None = None
    history: list[dict[str, float]] = []
    if state is not None:
        if (state["k_latent"], state["num_samples"]) != (k_latent, len(view)):
            raise ValueError(f"checkpoint is for K_latent={state['k_latent']}, "
                             f"N={state['num_samples']}; this run has {k_latent}, {len(view)}")
        base.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, start_batch = int(state["epoch"]), int(state["batch"])
        global_step, lccn_step = int(state["global_step"]), int(state["lccn_step"])
        phi_init = state["phi_init"]
        run_id = state["mlflow_run_id"]
        history = list(state["history"])
    resumed = ({"resumed_epoch": float(start_epoch), "resumed_batch": float(start_batch)}
               if state is not None else {"resumed_epoch": -1.0, "resumed_batch": -1.0})
    if cuda:
        base = base.to(device, memory_format=torch.channels_last)
    model = _Forward(session.prepare_model(base), cuda=cuda)
    eval_model = _Forward(base, cuda=cuda)  # no DDP collectives in eval

    fence = ""
    if store is not None:
        if rank == 0:
            fence = store.open(state["store"] if state is not None else None)
        session.barrier()
        if rank != 0:
            fence = store.join()

    tracker = None
    if rank == 0 and dist.tracking_uri:
        from pipeline.tracking import Tracker  # rank 0 only

        if run_id is None and store is not None:  # restarted before the first checkpoint
            run_id = store.get_meta("mlflow_run_id")
        tracker = Tracker(tracking_uri=dist.tracking_uri, experiment=dist.experiment,
                          run_name=dist.run_name, run_id=run_id)
        run_id = tracker.start({"run": asdict(run), "dist": _public(dist),
                                "world_size": ws, "num_samples": len(view)})
        if store is not None:
            store.set_meta("mlflow_run_id", run_id)

    per_rank_batch = max(1, o.batch_size // ws)
    loader_cfg = LoaderConfig(batch_size=per_rank_batch, num_workers=dist.loader_workers,
                              shuffle_buffer=dist.shuffle_buffer, seed=run.seed,
                              preset=dist.preset, pin_memory=cuda,
                              verify_checksums=dist.verify_checksums)
    manifest = load_manifest(dist.train_source, cfg=loader_cfg)
    test_manifest = (load_manifest(dist.test_source, cfg=loader_cfg)
                     if dist.test_source else None)
    failures = _Failures(dist.inject_failure, rank, dist.run_dir)
    labeler: DistLabeler | None = None
    monitor = CollapseMonitor(run.monitor)
    collapsed = False
    rows: list[dict[str, float]] = []
    if start_epoch >= o.epochs and rank == 0:
        print(f"run {dist.run_name}: already complete ({start_epoch} of {o.epochs} epochs in "
              f"its last checkpoint); nothing to do", flush=True)
    try:
        for epoch in range(start_epoch, o.epochs):
            t_epoch = time.perf_counter()
            first_batch = start_batch if epoch == start_epoch else 0
            loader = make_train_loader(dist.train_source, view, loader_cfg, rank=rank,
                                       world_size=ws, epoch=epoch, start_batch=first_batch,
                                       manifest=manifest)
            extra: dict[str, float] = {}
            lccn_now = is_lccn and epoch >= o.pretrain_epochs
            if lccn_now and phi_init is None:
                phi_init, extra = _start_lccn(
                    eval_model, run, dist, view, store, session, loader_cfg, manifest,
                    k_latent=k_latent, fence=fence)
            if lccn_now and labeler is None:
                counts, version = store.snapshot()
                max_steps = (o.epochs - o.pretrain_epochs) * loader.steps_per_epoch
                # at most a quarter of an epoch's steps per call: a replica never misses
                # most of an epoch of the other workers (tiny runs, e.g. smoke tests)
                every = min(lc.commit_every, max(1, loader.steps_per_epoch // 4))
                labeler = DistLabeler(
                    replace(lc, commit_every=every), store, counts, version,
                    phi_init=phi_init, max_steps=max_steps,
                    generator=torch.Generator(), trusted=trusted, clean=clean,
                    worker=f"rank{rank}.{fence[:8]}", seed=run.seed, rank=rank)
                labeler.step_count = lccn_step
            active = labeler if lccn_now else None
            if active is not None:
                active.max_staleness = 0
            done_in_epoch = first_batch

            def save(epoch_next: int, batch_next: int, metrics: dict[str, float],
                     final: bool = False) -> None:
                nonlocal lccn_step
                if active is not None:
                    active.flush()
                    lccn_step = active.step_count
                _checkpoint(session, store, tracker=tracker, base=base, optimizer=optimizer,
                            scheduler=scheduler, run=run, dist=dist, view=view,
                            k_latent=k_latent, epoch=epoch_next, batch=batch_next,
                            global_step=global_step, lccn_step=lccn_step, phi_init=phi_init,
                            run_id=run_id, history=history, metrics=metrics, final=final,
                            monitor=monitor if active is not None else None)

            def after_step() -> None:
                nonlocal global_step, done_in_epoch
                global_step += 1
                done_in_epoch += 1
                if (dist.checkpoint_every and global_step % dist.checkpoint_every == 0
                        and done_in_epoch < loader.steps_per_epoch):
                    save(epoch, done_in_epoch, {"epoch": float(epoch),
                                                "global_step": float(global_step)})
                failures(global_step, store)

            stats = train_one_epoch(model, loader, optimizer, labeler=active, trusted=trusted,
                                    xi=lc.xi, device=device, num_classes=k,
                                    after_step=after_step)
            scheduler.step()
            row = _epoch_row(stats, session, epoch=epoch, global_step=global_step,
                             lr=optimizer.param_groups[0]["lr"], lccn=active is not None)
            row.update(_evaluate(eval_model, dist, loader_cfg, test_manifest, session, k))
            row.update(loader_counters(loader.stats, all_reduce_sum=session.all_reduce_sum,
                                       device=session.device))
            row["staleness_max"] = float(active.max_staleness) if active is not None else 0.0
            row.update(resumed)
            row.update(extra)
            row["epoch_time"] = time.perf_counter() - t_epoch
            if labeler is not None:
                lccn_step = labeler.step_count
            history.append(row)
            rows.append(row)
            save(epoch + 1, 0, row, final=epoch + 1 == o.epochs)
            # the collapse monitor ran on rank 0 inside save(); stop every rank together
            flag = torch.tensor([row.get("collapse", 0.0) if run.monitor.stop else 0.0],
                                dtype=torch.float64)
            if float(session.all_reduce_sum(flag.to(device)).cpu()[0]) > 0:
                collapsed = True
                if rank == 0:
                    print(f"run {dist.run_name}: stopped after epoch {epoch}: the LCCN chain "
                          f"collapsed (MonitorConfig.stop)", flush=True)
                break
    except BaseException:
        if tracker is not None:
            try:  # a restarted rank 0 sets it RUNNING again when it resumes
                tracker.end("FAILED")
            except Exception as e:  # never hide the failure itself
                print(f"could not mark MLflow run {run_id} FAILED: {e}", flush=True)
        raise
    if tracker is not None:
        tracker.end("FAILED" if collapsed else "FINISHED")
    return rows


def _public(dist: DistConfig) -> dict[str, Any]:
    d = asdict(dist)
    d.pop("inject_failure")
    d.pop("class_names")
    return d


def _start_lccn(model: nn.Module, run: RunConfig, dist: DistConfig, view: LabelView, store: Any,
                session: Session, loader_cfg: LoaderConfig, manifest: Any, *, k_latent: int,
                fence: str) -> tuple[Tensor, dict[str, float]]:
    """Algorithm 3 lines 2-3 over all ranks: phi_init (K_latent, K) float64 (rows sum to 1)
    and the initial assignment committed to the store for this rank's samples."""
    lc, k = run.lccn, view.num_classes
    rank, ws = session.rank, session.world_size
    loader = make_eval_loader(dist.train_source, view, loader_cfg, rank=rank, world_size=ws,
                              manifest=manifest)
    probs, idx, _ = predict(model, loader, device=session.device)
    observed = torch.from_numpy(np.array(view.observed))[idx]
    phi_init = estimate_phi_init(
        lc, probs, observed, k_latent, k,
        reduce=lambda t: session.all_reduce_sum(t.to(session.device)).cpu())
    z0 = initial_assignment(observed, probs=probs, mode=lc.init)
    store.commit(idx, z0, worker=f"init.rank{rank}.{fence[:8]}", seq=0)
    session.barrier()
    return phi_init, {"init_transition_error": transition_error(phi_init, view.transition)}


_REDUCED = ("loss", "label_recovery", "changed", "staleness", "gamma", "step_time",
            "sampler_time", "sync_time", "sampler_share", "images_per_s", "steps")


def _epoch_row(stats: dict[str, float], session: Session, *, epoch: int, global_step: int,
               lr: float, lccn: bool) -> dict[str, float]:
    """Train stats averaged over ranks (images_per_s summed: the run's throughput)."""
    vals = torch.tensor([stats[key] for key in _REDUCED], dtype=torch.float64)
    vals = torch.nan_to_num(vals, nan=0.0)
    tot = session.all_reduce_sum(vals.to(session.device)).cpu() / session.world_size
    row = dict(zip(_REDUCED, tot.tolist()))
    row["images_per_s"] *= session.world_size
    if math.isnan(stats["label_recovery"]):
        row["label_recovery"] = float("nan")
    row["steps_per_s"] = 1.0 / row["step_time"] if row["step_time"] > 0 else 0.0
    row.update(epoch=float(epoch), global_step=float(global_step), lr=float(lr),
               phase=1.0 if lccn else 0.0)
    return row


def _evaluate(model: nn.Module, dist: DistConfig, loader_cfg: LoaderConfig, manifest: Any,
              session: Session, k: int) -> dict[str, float]:
    """Clean top-1/top-5 on the test split, each rank its share, summed over ranks."""
    if not dist.test_source:
        return {}
    loader = make_eval_loader(dist.test_source, None, loader_cfg, rank=session.rank,
                              world_size=session.world_size, manifest=manifest)
    ev = evaluate(model, loader, num_classes=k, device=session.device)
    n = ev["n"]
    vals = torch.tensor([0.0 if n == 0 else ev["top1"] * n, 0.0 if n == 0 else ev["top5"] * n, n],
                        dtype=torch.float64)
    t1, t5, n = session.all_reduce_sum(vals.to(session.device)).cpu().tolist()
    return {"test_top1": t1 / n if n else float("nan"), "test_top5": t5 / n if n else float("nan")}


def _checkpoint(session: Session, store: Any, *, tracker: Any, base: nn.Module,
                optimizer: torch.optim.Optimizer, scheduler: Any, run: RunConfig,
                dist: DistConfig, view: LabelView, k_latent: int, epoch: int, batch: int,
                global_step: int, lccn_step: int, phi_init: Tensor | None, run_id: str | None,
                history: list[dict[str, float]], metrics: dict[str, float], final: bool,
                monitor: CollapseMonitor | None = None) -> None:
    """Checkpoint at one consistent moment and report it (see the module docstring).

    At an epoch end of the LCCN phase rank 0 also computes the chain's health from the
    store state and runs the collapse ``monitor`` on it; the statistics go into
    ``metrics`` (and, through the caller's row, into the history)."""
    row = metrics
    metrics = dict(metrics)
    session.barrier()  # every rank's last commit is applied
    if session.rank != 0:
        session.report(metrics, None)
        return
    store_state = store.check_state() if store is not None else None
    if store_state is not None:
        phi = transition(store_state["counts"])
        metrics["transition_error"] = transition_error(phi, view.transition)
        metrics["store_version"] = float(store_state["version"])
        if monitor is not None and batch == 0:
            health = chain_health(store_state["z"], store_state["observed"], k_latent,
                                  view.num_classes, counted=store_state["counted"], phi=phi,
                                  phi_init=phi_init)
            health["collapse"] = float(bool(monitor.check(health, epoch=epoch - 1, stop=False)))
            metrics.update(health)
            row.update(health)
        metrics.update({f"store_{key}": v for key, v in store.stats().items()
                        if key in ("duplicates", "refused", "busy_s")})
    state = {
        "model": base.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "epoch": epoch, "batch": batch,
        "global_step": global_step, "lccn_step": lccn_step, "phi_init": phi_init,
        "store": store_state, "mlflow_run_id": run_id, "history": history,
        "k_latent": k_latent, "num_samples": len(view),
    }
    with tempfile.TemporaryDirectory(prefix="lccn-ckpt-") as tmp:
        torch.save(state, Path(tmp) / STATE_FILE)
        meta = {"epoch": epoch, "batch": batch, "global_step": global_step,
                "lccn_step": lccn_step, "mlflow_run_id": run_id, "run_name": dist.run_name,
                "store_version": None if store_state is None else int(store_state["version"])}
        (Path(tmp) / META_FILE).write_text(json.dumps(meta, indent=1))
        if tracker is not None and batch == 0:
            tracker.log_metrics(metrics, step=epoch - 1)
            if (store_state is not None and phi_init is not None and dist.transition_every
                    and (final or epoch % dist.transition_every == 0)):
                tracker.log_transition(phi, epoch=epoch - 1, truth=view.transition,
                                       class_names=list(dist.class_names) or None)
        session.report(metrics, tmp)
        if tracker is not None and final:
            tracker.log_curves(history)
            if store_state is not None:
                tracker.log_final(phi, checkpoint_dir=tmp,
                                  class_names=list(dist.class_names) or None)
