"""One data-parallel worker of a distributed run: the engine (:mod:`pipeline.train.engine`) over
the WebDataset shards, with the Gibbs chain in the run's fenced store actor.

:func:`run_worker` reads nothing from global state: a session gives it its rank, world
size, device, collectives, the checkpoint to resume from and ``report``; a store client
(:mod:`pipeline.cluster.store_actor`) gives it the shared C and z. Under Ray,
:mod:`pipeline.cluster.ray_train` supplies a session over ``ray.train`` and a client of the
confusion actor; tests run it in one process with :class:`LocalSession` and an in-process
store. The method (``RunConfig.method``) is a plug-in of :mod:`pipeline.train.methods`.

Per worker::

    open the store (rank 0: restore the checkpointed C and z, or the initial ones) -> barrier
    for epoch in [start_epoch, epochs):
        first epoch of the noise phase, no phi_init yet:          (Algorithm 3, lines 2-3)
            predict this rank's share of the training split (eval transform, held-out
            samples left out); phi_init from all-reduced statistics
            commit the initial assignment of this rank's idx -> barrier
        CE epoch, or LCCN epoch: forward -> Gibbs step (Eq. 7, replica of C) -> loss
            -> backward (DDP) -> commit z (the round trip overlaps the next forward);
            the noisy validation split (``RunConfig.val_fraction``) is skipped and counted
            (``val_held_out``)
        every rank scores its share of the held-out samples against their observed labels
            (all-reduced: ``val_top1``) and of the test split
        every ``checkpoint_every`` steps and at the end of the epoch: checkpoint
    rank 0 logs to MLflow (metrics, transition heat map, final CSV and checkpoint)

Checkpoint = one consistent moment: every rank flushes its labeler (the steps it still
buffers with ``commit_every > 1`` are sent, and its last commit is applied), barrier, rank 0
reads the store's state through ``check_state`` (invariants checked by the store) and writes
``state.pt`` (networks, optimizers, schedulers, epoch, batch position, global step, the
method's state: LCCN step, phi_init, monitor; store state, MLflow run id, history); every
rank then calls ``report`` (a barrier: no rank commits again before rank 0 has read the
store).

Randomness: model init from ``run.seed``; data order and augmentation from the loader
(seed, epoch, rank); the Gibbs step of LCCN step s on rank r draws from a generator seeded
with (seed, r, s); the validation split from ``run.seed`` alone. Nothing random is carried
in the checkpoint, so a run resumed at a batch boundary continues exactly as the
uninterrupted run would (one worker; with several, only the interleaving of commits
differs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core import storage
from pipeline.core.config import RunConfig
from pipeline.core.labels import LabelView
from pipeline.data.stream import LoaderConfig
from pipeline.data.transforms import build_batch_transform
from pipeline.track.uris import redact_uri
from pipeline.train.chains import ChainSet, SharedChain, chain_seed
from pipeline.train.checkpoints import load_state
from pipeline.train.engine import Engine, EngineOptions, Tracking, final_export_path
from pipeline.train.export import EXPORT_META
from pipeline.train.members import make_scheduler
from pipeline.train.methods import get_method
from pipeline.train.session import ProcessSession, Session
from pipeline.train.shard_source import ShardSource
from pipeline.train.sources import held_out_mask

__all__ = ["DistConfig", "LocalSession", "parse_failures", "run_worker"]

FAILURE_MODES = ("exit", "raise", "kill_store")


@dataclass(frozen=True)
class DistConfig:
    """The distributed side of a run: where data comes from, where the run writes, how
    many workers, checkpoints, tracking. Paths must be absolute (Ray Train workers run in
    their own directory).

    run_name: Ray Train run name (a run re-submitted with the same name and run_dir
        resumes from its last checkpoint) and MLflow run name.
    run_dir: absolute directory of the run (Ray storage ``<run_dir>/train``, MLflow store),
        or an ``s3://bucket/prefix`` (``pipeline.core.storage``; endpoint
        ``s3_endpoint_url``): checkpoints, results and the exported model go there.
    train_source, test_source: split directories or base URLs (``pipeline.data.stream``).
    num_workers: Ray Train workers (DDP ranks); ``OptimConfig.batch_size`` is the global
        batch, each rank takes ``batch_size // num_workers``.
    loader_workers, shuffle_buffer, preset: the shard loader (``pipeline.data.stream.LoaderConfig``).
    checkpoint_every: also checkpoint every this many steps inside an epoch (0: only at the
        end of each epoch).
    lr_values: learning rate of each phase between ``OptimConfig.milestones`` (len =
        milestones + 1), e.g. the paper's CIFAR 0.5/0.1/0.01; empty: ``lr`` decayed by
        ``lr_decay`` at each milestone.
    pretrained: ImageNet weights for the backbone (``pipeline.train.models``; a file or cache).
    tracking_uri / experiment: MLflow; tracking_uri None disables tracking.
    class_names: for the heat maps and the CSV.
    transition_every: log the transition heat map every n LCCN epochs (0: never).
    inject_failure: tests only. Comma-separated ``rank:step:mode`` (mode ``exit``:
        ``os._exit(1)``, ``raise``: RuntimeError, ``kill_store``: kill the store actor) fired
        once after global step ``step`` on rank ``rank`` (a marker file in run_dir makes it
        fire only once across restarts and resubmissions).
    verify_checksums: sha256 of every local shard against the manifest before it is read
        (once per shard and process; ``pipeline.data.stream.LoaderConfig``).
    s3_endpoint_url: endpoint of an S3-compatible store for ``s3://`` sources (None:
        ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` on each worker, else AWS).
    init_from: a fresh run starts from the weights of this checkpoint, checkpoint folder
        or finished run (``pipeline.train.checkpoints.init_state_file``); a resumed run ignores it.
    progress_seconds: rank 0 reports its progress inside an epoch every this many seconds
        (images/s, the epoch's ETA; ``pipeline.train.progress``); 0: one line per epoch only.
    mlflow_tags: ``(key, value)`` pairs set on the MLflow run when it is created (a sweep
        trial: ``mlflow.parentRunId`` of the sweep's parent run and its trial id).
    sync_bn: batch-norm statistics over the global batch (``torch.nn.SyncBatchNorm``)
        instead of each GPU's share of it; for small per-GPU batches. GPU workers only
        (SyncBatchNorm has no CPU kernel).
    export_model: rank 0 writes the classifier as a ``torch.export`` program to
        ``<run_dir>/models/<run_name>.pt2`` (and its ``.json``) at the run's end.
    decode: where the shard loader decodes and augments images (``LoaderConfig.decode``:
        "cpu", "device" on the worker's device, "auto").
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
    s3_endpoint_url: str | None = None
    init_from: str | None = None
    progress_seconds: float = 60.0
    mlflow_tags: tuple[tuple[str, str], ...] = ()
    sync_bn: bool = False
    export_model: bool = False
    decode: str = "cpu"

    @property
    def export_path(self) -> str:
        """Where ``export_model`` writes the classifier: ``<run_dir>/models/<run_name>.pt2``."""
        return f"{self.run_dir}/models/{self.run_name}.pt2"

    def __post_init__(self) -> None:
        for name in ("lr_values", "class_names"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "mlflow_tags",
                           tuple((str(k), str(v)) for k, v in self.mlflow_tags))
        object.__setattr__(self, "run_dir",
                           storage.check_location(self.run_dir, what="DistConfig.run_dir"))
        if not storage.is_remote(self.run_dir) and not os.path.isabs(self.run_dir):
            raise ValueError(f"DistConfig.run_dir must be absolute (Ray workers chdir) or an "
                             f"s3:// URI, got {self.run_dir!r}")
        for name in ("train_source", "test_source"):
            src = getattr(self, name)
            if src and "://" not in src and not os.path.isabs(src):
                raise ValueError(f"DistConfig.{name} must be an absolute path or a URL, "
                                 f"got {src!r}")
        if self.num_workers < 1 or self.loader_workers < 0 or self.checkpoint_every < 0:
            raise ValueError(f"need num_workers >= 1, loader_workers >= 0, checkpoint_every "
                             f">= 0; got {self.num_workers}, {self.loader_workers}, "
                             f"{self.checkpoint_every}")
        if self.sync_bn and not self.use_gpu:
            raise ValueError("DistConfig.sync_bn needs GPU workers (use_gpu): "
                             "torch.nn.SyncBatchNorm has no CPU kernel")
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


class LocalSession(ProcessSession):
    """One worker in this process (world size 1): checkpoints are copied under ``storage``
    (``checkpoint_000000``, ...); the latest one is what :meth:`load_checkpoint` resumes from."""

    checkpointing = True

    def __init__(self, storage: str | os.PathLike) -> None:
        super().__init__("cpu")
        self.storage = Path(storage)
        self.storage.mkdir(parents=True, exist_ok=True)

    def checkpoints(self) -> list[Path]:
        return sorted(self.storage.glob("checkpoint_*"))

    def load_checkpoint(self) -> dict | None:
        found = self.checkpoints()
        return load_state(found[-1]) if found else None

    def report(self, metrics: dict[str, float], checkpoint_dir: str | None) -> None:
        super().report(metrics, checkpoint_dir)
        if checkpoint_dir is not None:
            dest = self.storage / f"checkpoint_{len(self.checkpoints()):06d}"
            shutil.copytree(checkpoint_dir, dest)


def _scheduler(optimizer: torch.optim.Optimizer, run: RunConfig, dist: DistConfig):
    """The run's epoch schedule (``dist.lr_values``: per-phase rates)."""
    return make_scheduler(optimizer, run, dist.lr_values)


class _Failures:
    """Injected failures (tests): fire each (rank, step, mode) at most once per run_dir."""

    def __init__(self, spec: str, rank: int, run_dir: str,
                 endpoint_url: str | None = None) -> None:
        self.items = [(s, m) for r, s, m in parse_failures(spec) if r == rank]
        self.rank, self.run_dir, self.endpoint_url = rank, run_dir, endpoint_url

    def __call__(self, step: int, store: Any) -> None:
        for s, mode in self.items:
            marker = storage.join(self.run_dir, f".injected-failure-r{self.rank}-s{s}-{mode}")
            if s != step or storage.exists(marker, endpoint_url=self.endpoint_url):
                continue
            storage.write_text(marker, f"fired at step {step}\n",
                               endpoint_url=self.endpoint_url)
            if mode == "exit":
                os._exit(1)
            if mode == "raise":
                raise RuntimeError(f"injected failure at step {step} on rank {self.rank}")
            store.kill()


def run_worker(run: RunConfig, dist: DistConfig, view: LabelView, store: Any,
               session: Session, *, keys: Any = None) -> list[dict[str, float]]:
    """Train this worker's share of the run; returns the epoch rows reported by this worker
    in this (re)start.

    run: what to train (method, model, optimizer schedule, method options, the noisy
    validation split ``val_fraction``); view: the label view of the training split
    (``len(view)`` = N); store: a client of the run's StoreActor (None for a method
    without a chain, e.g. "ce"; a list of one client per chain for a method with several,
    e.g. "divide_lccn"); session: rank/world size/collectives/checkpoints; keys: the key
    of each idx (the ``key`` column of the method's end-of-run files) or None.
    """
    rank, ws = session.rank, session.world_size
    cuda = session.device.type == "cuda"
    method = get_method(run.method)
    if method.needs_chain and store is None:
        raise ValueError(f"method {run.method!r} needs a store client")
    stores = list(store) if isinstance(store, (list, tuple)) else [store]
    if method.needs_chain and len(stores) != method.num_chains:
        raise ValueError(f"method {run.method!r} needs {method.num_chains} store client(s), "
                         f"one per chain; got {len(stores)}")
    held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
    loader_cfg = LoaderConfig(batch_size=max(1, run.optim.batch_size // ws),
                              num_workers=dist.loader_workers, shuffle_buffer=dist.shuffle_buffer,
                              seed=run.seed, preset=dist.preset, pin_memory=cuda,
                              verify_checksums=dist.verify_checksums,
                              s3_endpoint_url=dist.s3_endpoint_url,
                              # a GPU worker pins and copies uint8 pixels (4x fewer bytes)
                              # and normalises them on the device
                              normalize_on="device" if cuda else "host", decode=dist.decode)
    data = ShardSource(train_source=dist.train_source, test_source=dist.test_source, view=view,
                       loader_cfg=loader_cfg, rank=rank, world_size=ws, held_out=held_out,
                       device=session.device)
    chain = None
    if store is not None:
        # chain i > 0 draws from its own seed stream (two labelers step in lockstep)
        chains = [SharedChain(c, session, seed=run.seed if i == 0 else chain_seed(run.seed, i),
                              held_out=held_out) for i, c in enumerate(stores)]
        chain = chains[0] if len(chains) == 1 else ChainSet(chains)
    failures = _Failures(dist.inject_failure, rank, dist.run_dir, dist.s3_endpoint_url)
    tracking = None
    if dist.tracking_uri:
        tracking = Tracking(uri=dist.tracking_uri, experiment=dist.experiment,
                            run_name=dist.run_name,
                            params={"dist": _public(dist), "world_size": ws,
                                    "num_samples": len(view)},
                            class_names=dist.class_names, transition_every=dist.transition_every,
                            tags=dist.mlflow_tags)
    target = dist.export_path if dist.export_model else None
    remote = target is not None and storage.is_remote(target)
    with tempfile.TemporaryDirectory(prefix="lccn-export-") as tmp:
        # torch.export writes a local file: for a run dir in object storage rank 0 writes
        # it here and uploads it (its .json first) when the run ends
        export_path = str(Path(tmp) / storage.name(target)) if remote else target
        options = EngineOptions(run_name=dist.run_name, checkpoint_every=dist.checkpoint_every,
                                pretrained=dist.pretrained, lr_values=dist.lr_values,
                                tracking=tracking,
                                after_step=lambda step: failures(step, stores[0]),
                                normalize=build_batch_transform(dist.preset) if cuda else None,
                                sample_keys=keys, init_from=dist.init_from,
                                progress_seconds=dist.progress_seconds, preset=dist.preset,
                                export_path=export_path)
        rows = Engine(run, session, data, chain=chain, options=options).fit()
        if remote and Path(export_path).is_file():
            folder = str(target).rsplit("/", 1)[0]
            for main in (Path(export_path), final_export_path(export_path)):  # selected, final
                for f in (main.with_suffix(EXPORT_META), main):
                    if f.is_file():
                        storage.upload(f, storage.join(folder, f.name),
                                       endpoint_url=dist.s3_endpoint_url)
    return rows


def _public(dist: DistConfig) -> dict[str, Any]:
    d = asdict(dist)
    d.pop("inject_failure")
    d.pop("class_names")
    d.pop("mlflow_tags")
    d["tracking_uri"] = redact_uri(d["tracking_uri"])  # a parameter: no password
    return d


