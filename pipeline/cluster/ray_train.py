"""The Ray side of a distributed LCCN run: the Train worker entry point and the driver.

Driver (:func:`fit_distributed`, called by the jobs in ``jobs/``)::

    init_ray()                        RAY_ADDRESS if set (ray job submit), else a new local Ray
                                      bound to 127.0.0.1
    label view -> ray.put             every worker gets it by reference
    StoreActor (ray.remote)           "lccn-store-<run_name>", created here, never by a worker:
                                      observed labels, z_init = observed (clean for LCCN+
                                      trusted samples, which are not counted)
    TorchTrainer(train_loop_per_worker, DDP: gloo on CPU, nccl on GPU)
        RunConfig(name=run_name, storage_path=<run_dir>/train, FailureConfig(max_failures))
    fit() -> final checkpoint: C and z re-checked here (C == recount of z)

Train V2 keeps ``checkpoint_manager_snapshot.json`` under ``<storage_path>/<name>``; a new
``fit()`` with the same name and storage path (a re-submitted job) loads it and hands the
latest checkpoint to ``ray.train.get_checkpoint()``, so the run resumes: model, optimizer,
data position and, through rank 0's ``StoreActor.open``, C and z. The worker resumes from
the newest *complete* checkpoint on disk, which may be newer than the one Ray registered
(:func:`newest_complete_state`); after ``fit()`` the driver removes the checkpoint
folders Ray does not manage (:func:`prune_checkpoints`).

Worker (:func:`train_loop_per_worker`): rebuilds the configs from their ``asdict`` form,
reads rank and world size from ``ray.train.get_context()`` into a :class:`RaySession`, gets
the actor by name and runs :func:`pipeline.cluster.worker.run_worker`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.core import storage
from pipeline.core.config import RunConfig, from_dict
from pipeline.core.confusion_store import ConfusionStore
from pipeline.core.labels import LabelView
from pipeline.core.storage import Location
from pipeline.cluster.store_actor import ActorStoreClient, create_store_actor, store_actor_name
from pipeline.cluster.worker import DistConfig, run_worker
from pipeline.train.checkpoints import (
    checkpoint_step,
    load_state,
    newest_complete_state,
    prune_checkpoints,
)
from pipeline.train.methods import get_method
from pipeline.train.methods.lccn import OUTLIERS_FILE
from pipeline.train.session import TorchCollectives
from pipeline.train.sources import held_out_mask

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(**kwargs: Any) -> bool:
    """Connect to the cluster at ``RAY_ADDRESS`` (set by ``ray job submit``) or, without it,
    start a local Ray instance bound to 127.0.0.1 only. No-op when already connected;
    returns whether this call connected. ``kwargs`` go to ``ray.init``.

    Local only: Ray's servers (GCS, raylet, workers, object manager) bind to the node's IP,
    which Ray on Linux takes from the network, so a plain ``ray.init()`` listens on every
    interface. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` Ray uses the loopback address as
    the node IP (what it does on macOS) and every server binds 127.0.0.1. The variable is
    set for this process and the ones Ray starts (read when ``ray`` is imported, so the
    module's constant is set too if ``ray`` is already loaded). Never used with
    ``RAY_ADDRESS``: a cluster keeps its own addresses.
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**kwargs)
        return True
    os.environ[LOCAL_ONLY_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(address="local", **kwargs)
    return True


class RaySession(TorchCollectives):
    """:class:`pipeline.train.session.Session` over ``ray.train`` and ``torch.distributed``."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world_size = int(ctx.get_world_rank()), int(ctx.get_world_size())
        self.device = torch.device(ray.train.torch.get_device())
        self._train = ray.train
        # set by the entry point: <run_dir>/train/<run_name>, the progress-line settings,
        # an injected fault (tests) and the number of reports made
        self.checkpoint_root: Location | None = None
        self.endpoint_url: str | None = None  # of an s3:// checkpoint_root
        self.progress: dict[str, Any] | None = None
        self.fault: ReportFault | None = None
        self.reports = 0
        self.sync_bn = False  # DistConfig.sync_bn, set by the entry point

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        stop_on_non_finite(model, rank=self.rank)
        if self.sync_bn and self.world_size > 1:
            # in place: the parameters and buffers are the same tensors (the optimiser, the
            # weight average and the checkpoints keep them; the state-dict keys are unchanged)
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return ray.train.torch.prepare_model(model)


    def load_checkpoint(self) -> dict | None:
        """The newest complete checkpoint of the run: the one Ray Train hands over, or a
        newer complete one on disk (see :func:`newest_complete_state`). Rank 0 decides
        and every rank loads the same one."""
        ckpt = self._train.get_checkpoint()
        chosen: str | None = None
        endpoint = self.endpoint_url
        loaded: dict | None = None  # rank 0's state of ``found``, read once
        if self.rank == 0:
            registered = self._location(ckpt)
            # strict: a checkpoint that cannot be read now (a network error) fails this
            # start, and Ray Train starts the group again, rather than resuming from an
            # older one or from nothing
            newest = (newest_complete_state(self.checkpoint_root, endpoint_url=endpoint,
                                            strict=True)
                      if self.checkpoint_root is not None else None)
            found, loaded = newest if newest is not None else (None, None)
            chosen = str(found) if found is not None else registered
            if found is not None and registered is not None and \
                    storage.name(registered) != storage.name(found):
                reg_step = checkpoint_step(registered, endpoint_url=endpoint)
                found_step = checkpoint_step(found, endpoint_url=endpoint)
                if reg_step is not None and found_step is not None and found_step < reg_step:
                    why = (f"older than the last checkpoint Ray Train registered, "
                           f"{storage.name(registered)} (step {reg_step}), which does not load")
                else:
                    why = (f"newer than the last checkpoint Ray Train registered, "
                           f"{storage.name(registered)} (step {reg_step}): its report was lost "
                           f"with the failure")
                print(f"resuming from {storage.name(found)} (step {found_step}), {why}",
                      file=sys.__stdout__, flush=True)
            elif chosen is not None:  # a restart or a rerun of the same run name
                step = checkpoint_step(chosen, endpoint_url=endpoint)
                print(f"resuming from {storage.name(chosen)}"
                      + ("" if step is None else f" (step {step})"),
                      file=sys.__stdout__, flush=True)
        if self._dist():
            box = [chosen]
            torch.distributed.broadcast_object_list(box, src=0)
            chosen = box[0]
        elif self.rank != 0:
            chosen = self._location(ckpt)
        if chosen is None:
            return None
        if loaded is not None and chosen == str(found):
            return loaded
        if self.checkpoint_root is None and ckpt is not None and chosen == ckpt.path:
            with ckpt.as_directory() as d:  # Ray's own storage: Ray fetches it
                return load_state(d)
        return load_state(chosen, endpoint_url=endpoint)

    def _location(self, ckpt: Any) -> str | None:
        """Ray's checkpoint as a location under ``checkpoint_root`` (Ray's own path of one
        in object storage is ``bucket/key``, without the scheme)."""
        if ckpt is None or self.checkpoint_root is None:
            return None if ckpt is None else ckpt.path
        return str(storage.join(self.checkpoint_root, storage.name(ckpt.path)))

    def report(self, metrics: dict[str, float], checkpoint_dir: str | None) -> None:
        self.reports += 1
        if self.fault is not None:
            self.fault(self.rank, self.reports)
        ckpt = (self._train.Checkpoint.from_directory(checkpoint_dir)
                if checkpoint_dir is not None else None)
        if self.rank == 0 and self.progress is not None and "loss" in metrics:
            # sys.__stdout__: Ray Train's print patch would also tee a print to a wrapped
            # sys.stdout, and the line would show twice
            print(progress_line(metrics, **self.progress), file=sys.__stdout__, flush=True)
        self._train.report(metrics, checkpoint=ckpt)



class ReportFault:
    """Fault injection for tests and benchmarks: rank ``rank`` exits (``os._exit(1)``, as a
    SIGKILL would leave it) at its ``report``-th report of this worker group, i.e. while the
    group takes a checkpoint (rank 0 has written it; the other ranks have not reported it).
    Fires once per ``marker`` file."""

    def __init__(self, rank: int, report: int, marker: str) -> None:
        self.rank, self.report, self.marker = rank, report, Path(marker)

    def __call__(self, rank: int, count: int) -> None:
        if rank == self.rank and count == self.report and not self.marker.exists():
            self.marker.write_text(f"rank {rank} exited at report {count}\n")
            os._exit(1)


class NonFiniteError(FloatingPointError):
    """The model produced NaN or infinite logits: training diverged."""


def stop_on_non_finite(model: nn.Module, *, rank: int) -> None:
    """Raise :class:`NonFiniteError` at the first forward pass whose output is not finite.

    Without it a diverged model trains on: the Gibbs step turns NaN probabilities into some
    valid-looking label and commits it, corrupting C and z silently. Stopping at the
    forward pass keeps every commit of that batch out of the store; the worker group then
    restarts from the last checkpoint and, if the divergence repeats, the run fails with
    this message.
    """
    steps = {"n": 0}

    def check(module: nn.Module, args: Any, out: Any) -> None:
        steps["n"] += 1
        if isinstance(out, Tensor) and not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).sum())
            raise NonFiniteError(
                f"rank {rank}: {bad} non-finite logits in forward pass {steps['n']} of this "
                f"worker: the model diverged (loss NaN/inf); lower the learning rate or "
                f"check the inputs")

    model.register_forward_hook(check)


PROGRESS_KEYS = ("loss", "val_top1", "test_top1", "label_recovery", "transition_error")


def progress_line(row: dict[str, float], *, run_name: str, epochs: int,
                  pretrain_epochs: int, method: str) -> str:
    """One line per epoch (rank 0): ``[run] epoch 3/30 lccn  loss 0.321  test_top1 0.912
    ... 4.1 s``; values that were not measured (NaN) are left out."""
    import math

    e = int(row.get("epoch", -1)) + 1
    # the row's own phase (an automatic warm-up ends where the rows decide)
    noise = row["phase"] > 0 if "phase" in row else e > pretrain_epochs
    phase = method if noise else "ce"
    vals = "  ".join(f"{k} {row[k]:.3f}" for k in PROGRESS_KEYS
                     if isinstance(row.get(k), float) and math.isfinite(row[k]))
    took = f"  {row['epoch_time']:.1f} s" if "epoch_time" in row else ""
    data = "  ".join(f"{k.removeprefix('data_')} {int(row[k])}" for k in DATA_KEYS
                     if row.get(k))
    return (f"[{run_name}] epoch {e}/{epochs} {phase:4s} {vals}{took}"
            + (f"  data: {data}" if data else ""))


DATA_KEYS = ("data_skipped_samples", "data_skipped_shards", "data_missing", "data_padded",
             "data_checksum_mismatch", "data_read_retries")


def _quiet_ray_train_reports() -> None:
    """Ray Train logs every ``ray.train.report`` call (the whole metrics dict, every rank)
    and every checkpoint at INFO; the per-epoch progress line replaces them."""
    import logging

    try:
        from ray.train.v2._internal.execution import context, storage
    except ImportError:  # another Ray layout: keep its logging
        return
    for module in (context, storage):  # "Reporting training result", "Checkpoint ... created"
        logging.getLogger(module.__file__).setLevel(logging.WARNING)
        logging.getLogger(module.__name__).setLevel(logging.WARNING)


def _writable(view: LabelView) -> LabelView:
    """A copy of ``view`` whose arrays are writable (``ray.get`` returns read-only numpy
    arrays; torch warns on every ``from_numpy`` of one)."""
    import numpy as np

    def copy(a: Any) -> Any:
        return None if a is None else np.array(a)

    return replace(view, observed=copy(view.observed), clean=copy(view.clean),
                   trusted=copy(view.trusted), ood=copy(view.ood),
                   transition=copy(view.transition))


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point: ``config = {"run": asdict(RunConfig), "dist": asdict(DistConfig),
    "view": ObjectRef of the LabelView, "store": actor name or None, "namespace": str}``."""
    import ray

    run = from_dict(RunConfig, config["run"])
    dist = DistConfig(**config["dist"])
    view = _writable(ray.get(config["view"]))
    keys = ray.get(config["keys"]) if config.get("keys") is not None else None
    _quiet_ray_train_reports()
    store = None
    names = config["store"]
    if isinstance(names, list):  # one actor per chain
        store = [ActorStoreClient(ray.get_actor(n, namespace=config["namespace"])) for n in names]
    elif names is not None:
        store = ActorStoreClient(ray.get_actor(names, namespace=config["namespace"]))
    torch.set_num_threads(max(1, int(config.get("threads", 1))))
    session = RaySession()
    session.checkpoint_root = storage.join(dist.run_dir, "train", dist.run_name)
    session.endpoint_url = dist.s3_endpoint_url
    session.sync_bn = dist.sync_bn
    if config.get("fault"):
        session.fault = ReportFault(**config["fault"])
    session.progress = {"run_name": dist.run_name, "epochs": run.optim.epochs,
                        "pretrain_epochs": run.optim.pretrain_epochs, "method": run.method}
    run_worker(run, dist, view, store, session, keys=keys)


def release_orphaned_placement_groups() -> list[str]:
    """Remove the placement groups of this job whose creating actor is dead (not detached
    ones); returns their ids. Call it from the driver (a sweep's).

    A Ray Train run's worker group reserves its CPUs/GPUs in a placement group created by the
    run's controller actor. When the controller is killed (Tune stopping a trial early kills
    the trial's actor, and the controller with it), Ray keeps the group as long as the job
    lives, and Train's own cleaner actor removes it only when Ray's state API answers: with
    several local Ray instances on one machine it cannot tell which to ask, and the reserved
    CPUs stay blocked, so the next trial's workers never start. The GCS table says which
    creator is dead; this reads it through the connected driver (the public
    ``placement_group_table`` leaves the creator out).
    """
    import ray
    from ray._private.state import state as global_state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = ray.get_runtime_context().get_job_id()
    removed = []
    for blob in global_state._connect_and_get_accessor().get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(blob)
        if pg.creator_job_id.hex() != job:  # another job's: not ours to judge
            continue
        by_actor = bool(pg.creator_actor_id) and not ray.ActorID(pg.creator_actor_id).is_nil()
        # a group created by a driver (Tune's trials) has no creator actor: never touched
        if (pg.state == gcs_pb2.PlacementGroupTableData.REMOVED or pg.is_detached
                or not by_actor or not pg.creator_actor_dead):
            continue
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
        removed.append(pg.placement_group_id.hex())
    return removed


def initial_assignment_placeholder(view: LabelView, run: RunConfig) -> tuple[Tensor, Tensor | None]:
    """``z_init (N,)`` and ``counted (N,) bool | None`` the actor starts from: the observed
    labels until LCCN starts (the workers then commit the argmax assignment); LCCN+ trusted
    samples hold their clean label and are never counted; nor are the samples of the noisy
    validation split (``run.val_fraction``, :func:`pipeline.train.sources.held_out_mask`): C and
    the chain cover the training samples only."""
    observed = torch.from_numpy(np.array(view.observed))
    z, counted = observed.clone(), None
    if run.lccn.use_trusted:
        trusted = torch.from_numpy(np.array(view.trusted))
        z, counted = torch.where(trusted, torch.from_numpy(np.array(view.clean)), observed), ~trusted
    held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
    if held_out is not None and held_out.any():
        counted = torch.ones_like(observed, dtype=torch.bool) if counted is None else counted
        counted = counted & ~torch.from_numpy(held_out)
    return z, counted


def worker_resources(use_gpu: bool, cpus_per_worker: float) -> dict[str, float]:
    """What each Train worker reserves: ``cpus_per_worker`` CPUs (its loader processes
    decode on them), and one GPU with ``use_gpu``."""
    if cpus_per_worker <= 0:
        raise ValueError(f"cpus_per_worker must be > 0, got {cpus_per_worker}")
    return {"CPU": float(cpus_per_worker), **({"GPU": 1.0} if use_gpu else {})}


def placement_group_keeper() -> Any:
    """A Ray Train controller callback that removes the placement group of a worker group
    the controller started but never shut down, when the controller ends.

    Ray Train (2.60) leaks it in one case: a worker that dies while the controller launches
    the training function on a just-started group (see :func:`died_while_starting`). The
    group's actors were made, so its placement group holds their CPUs; the launch fails
    outside the code that would shut the group down, the controller ends with an error,
    and its placement-group cleaner is stopped by the controller's own shutdown. The run
    submitted again then waits for those CPUs forever (seen on 2 CPUs in the soak). The
    callback tracks the group started last and forgets it once the controller shuts it
    down; what is left at the controller's end is removed."""
    import ray.util
    from ray.train.v2._internal.execution.callback import (
        ControllerCallback,
        WorkerGroupCallback,
    )

    class PlacementGroupKeeper(ControllerCallback, WorkerGroupCallback):
        def __init__(self) -> None:
            self._pg: Any = None

        def after_worker_group_start(self, worker_group: Any) -> None:
            state = worker_group.get_worker_group_state()
            self._pg = state.placement_group_handle.placement_group

        def after_worker_group_shutdown(self, worker_group_context: Any) -> None:
            self._pg = None

        def after_worker_group_abort(self, worker_group_context: Any) -> None:
            self._pg = None

        def _remove(self) -> None:
            pg, self._pg = self._pg, None
            if pg is None:
                return
            try:
                state = ray.util.placement_group_table(pg).get("state")
                if state not in (None, "REMOVED"):
                    ray.util.remove_placement_group(pg)
                    print(f"removed the placement group {pg.id.hex()} of a worker group the "
                          f"controller did not shut down", file=sys.__stdout__, flush=True)
            except Exception as e:  # noqa: BLE001 - best effort at the controller's end
                print(f"could not remove placement group {pg.id.hex()}: {e}",
                      file=sys.__stdout__, flush=True)

        async def before_controller_shutdown(self) -> None:
            self._remove()

        def after_controller_finish(self, result: Any) -> None:
            self._remove()

    return PlacementGroupKeeper()


def died_while_starting(error: BaseException) -> bool:
    """Whether ``error`` is Ray Train's controller giving up on a worker that died while
    its group was being started: a ``ControllerError`` around a ``RayActorError``.

    Ray Train (2.60) retries a worker group that fails to *initialise*, but a worker that
    dies in the moment after, while the controller launches the training function on the
    group, ends the whole run as a non-retryable controller error whatever
    ``max_failures`` says. The soak (``benchmarks/bench_soak.py``) hit it: one kill of a
    worker as its group restarted after an earlier kill."""
    import ray.exceptions
    import ray.train

    return (isinstance(error, ray.train.ControllerError)
            and isinstance(getattr(error, "controller_failure", None),
                           ray.exceptions.RayActorError))


def fit_resubmitting(make_trainer: Callable[[], Any], *, max_failures: int) -> Any:
    """``make_trainer().fit()``; when Ray Train gives up on a worker that died while its
    group was starting (:func:`died_while_starting`), submit the run again under the same
    name and storage, which resumes it from its newest checkpoint as any restart does, up
    to ``max_failures`` times (-1: without limit). Any other failure is raised."""
    resubmitted = 0
    while True:
        try:
            return make_trainer().fit()
        except Exception as e:  # noqa: BLE001 - re-raised unless it is the startup death
            if not died_while_starting(e) or (0 <= max_failures <= resubmitted):
                raise
            resubmitted += 1
            cause = str(getattr(e, "controller_failure", e)).splitlines()[0]
            print(f"Ray Train stopped the run on a worker that died while its group started "
                  f"({cause}); submitting it again ({resubmitted} of "
                  f"{'unlimited' if max_failures < 0 else max_failures}): it resumes from "
                  f"its newest checkpoint", file=sys.__stdout__, flush=True)


def fit_distributed(run: RunConfig, dist: DistConfig, view: LabelView, *,
                    max_failures: int = 1, threads_per_worker: int | None = None,
                    cpus_per_worker: float = 1.0,
                    fault: dict[str, Any] | None = None,
                    callbacks: list[Any] | None = None,
                    sample_keys: Any = None) -> dict[str, Any]:
    """Run (or resume) ``dist.run_name`` on the Ray cluster this process is connected to
    (:func:`init_ray` first if it is not).

    Returns ``{"metrics": rank 0's last reported metrics, "checkpoint": path of the final
    checkpoint, "state": its state dict, "phi": (K_latent, K) float64 learned transition
    (None for CE; with one chain per network the first network's, and "phis" all of
    them), "store": the final StoreActor stats (the first chain's), "files": the method's
    end-of-run files found in the final checkpoint, ``{name: text}`` (LCCN*:
    ``outliers.csv``)}``. ``sample_keys``: the key of each idx of the training split (the
    ``key`` column of those files; empty without). Raises
    ``ray.train.TrainingFailedError`` when the run fails more than ``max_failures`` times.
    ``fault``: tests only, ``{"rank", "report", "marker"}`` of a :class:`ReportFault`.
    ``callbacks``: Ray Train ``UserCallback`` objects for the trainer's RunConfig (a sweep
    trial forwards each epoch's report to Tune through one, :mod:`tune.reporting`).
    """
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray()

    k = view.num_classes
    method = get_method(run.method)
    k_latent = method.latent_classes(run, k)
    handles: list[Any] = []
    name: str | list[str] | None = None
    if method.needs_chain:
        z_init, counted = initial_assignment_placeholder(view, run)
        # one actor per chain (DivideLCCN: one per network), each with its own fence
        names = [dist.run_name] + [f"{dist.run_name}-chain{i}"
                                   for i in range(1, method.num_chains)]
        try:
            for n in names:
                handles.append(create_store_actor(n, torch.from_numpy(view.observed), z_init,
                                                  k_latent, k, counted=counted))
        except BaseException:
            for h in handles:
                ray.kill(h, no_restart=True)
            raise
        name = [store_actor_name(n) for n in names]
        name = name[0] if len(name) == 1 else name
    handle = handles[0] if handles else None
    threads = threads_per_worker or max(1, int(cpus_per_worker))
    config = {"run": asdict(run), "dist": asdict(dist), "view": ray.put(view), "store": name,
              "namespace": ray.get_runtime_context().namespace, "threads": threads,
              "fault": fault,
              "keys": None if sample_keys is None else ray.put(list(sample_keys))}

    # a run dir in object storage: Ray Train writes and reads the checkpoints through the
    # same pyarrow file system (and endpoint) as the project's own discovery and pruning
    train_root = storage.join(dist.run_dir, "train")
    storage_fs, storage_path = (storage.filesystem(train_root, endpoint_url=dist.s3_endpoint_url)
                                if storage.is_remote(train_root) else (None, str(train_root)))
    run_root = storage.join(train_root, dist.run_name)

    def make_trainer() -> Any:
        return TorchTrainer(
            train_loop_per_worker, train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(
                num_workers=dist.num_workers, use_gpu=dist.use_gpu,
                resources_per_worker=worker_resources(dist.use_gpu, cpus_per_worker)),
            torch_config=TorchConfig(backend="nccl" if dist.use_gpu else "gloo"),
            run_config=ray.train.RunConfig(
                name=dist.run_name, storage_path=storage_path, storage_filesystem=storage_fs,
                failure_config=ray.train.FailureConfig(max_failures=max_failures),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
                callbacks=[*(callbacks or []), placement_group_keeper()]))

    try:
        result = fit_resubmitting(make_trainer, max_failures=max_failures)
        store_stats = ray.get(handle.stats.remote()) if handle is not None else None
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)  # the name is free for the next run
        pruned = prune_checkpoints(run_root, endpoint_url=dist.s3_endpoint_url)
        if pruned:
            print(f"removed {len(pruned)} checkpoint folder(s) Ray Train did not register: "
                  f"{', '.join(pruned)}", flush=True)
    out: dict[str, Any] = {"metrics": result.metrics, "checkpoint": None, "state": None,
                           "phi": None, "store": store_stats, "files": {}}
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as d:
            state = load_state(d)
            for name in (OUTLIERS_FILE,):
                if (Path(d) / name).is_file():
                    out["files"][name] = (Path(d) / name).read_text()
        out["checkpoint"] = str(storage.join(run_root, storage.name(result.checkpoint.path)))
        out["state"] = state
        if state["store"] is not None:
            # re-check the invariants on the driver side: raises if C != recount(z)
            chains = state["store"].get("chains", [state["store"]])
            phis = []
            for st in chains:
                store = ConfusionStore.from_state_dict(st)
                store.check()
                phis.append(store.transition())
            out["phi"] = phis[0]  # the first network's with one chain per network
            if len(phis) > 1:
                out["phis"] = phis
    return out
