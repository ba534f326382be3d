"""The confusion store as a shared, restartable actor, and the worker-side clients that talk
to it.

:class:`StoreActor` is a plain class (a :class:`~pipeline.core.confusion_store.ConfusionStore`
plus what a store shared by a restartable worker group needs). A job wraps it with
``ray.remote`` in the driver (:func:`create_store_actor`); tests use it in-process.

Fencing. Every (re)start of the worker group begins with rank 0 calling :meth:`StoreActor.open`
with the checkpointed state (or ``None`` for a fresh run): the store goes back to exactly
that state and draws a new *fence* token. Every commit carries the fence its worker group
got; a commit with another fence is refused with :class:`FenceError`. So

- a late commit of a worker of a failed group (still in flight when its group died) can
  never touch the restored state;
- if the actor itself dies, Ray restarts it from its constructor arguments with no fence;
  the next commit of the running group fails with :class:`FenceError`, the group fails,
  restarts from the last checkpoint, and ``open`` restores C and z from it.

Every call that reads or writes the chain state (``commit``, ``push``, ``snapshot``,
``check_state``, ``set_meta``/``get_meta``) takes the fence too: a worker group never reads
a restarted actor's fresh state (``version 0``, z = the observed labels) as if it were its
own, e.g. rank 0 reading the state to checkpoint right after the actor died would otherwise
save a reset chain that passes every invariant.

Counters (``opened``, ``calls``, ``refused``, ``duplicates``, ``busy_s``) are part of
:meth:`StoreActor.state_dict`, so they go into every checkpoint. A restarted actor process
starts from the counters of the checkpoint it is reopened with (what happened between that
checkpoint and the actor's death is lost with it) and counts the take-over in ``restored``
(a re-submitted run or a restarted actor);
a live actor reopened after a worker failure keeps its own, larger, counts.

Together with the ``(worker, seq)`` de-duplication of :meth:`ConfusionStore.commit` (a retried
call is applied once) every delta is applied exactly once relative to the checkpoint the
run resumed from: commits after it are discarded with the model steps that made them.

A worker sends ``LCCNConfig.commit_every`` steps' labels per call
(:meth:`StoreActor.push_packed`, one ``seq`` and one fence check per call) and the store
counts the steps it applied (``steps`` in the state): one per LCCN step and rank plus the
initial assignments, whatever the calls, when nothing was lost or applied twice.

Clients (the ``Store`` protocol of :mod:`pipeline.train.labeler` plus the control calls):
:class:`LocalStoreClient` calls a StoreActor in this process; :class:`ActorStoreClient` calls
the Ray actor: ``push`` returns the ObjectRef at once, ``done`` says whether the reply has
arrived and ``resolve`` waits for it, so the round trip overlaps the next steps.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.core.confusion_store import ConfusionStore, Sync

COUNTER_KEYS = ("opened", "calls", "refused", "duplicates", "busy_s", "restored")


class FenceError(RuntimeError):
    """A commit from a worker group the store no longer serves (or before any ``open``)."""


class StoreActor(ConfusionStore):
    """A :class:`ConfusionStore` for a restartable worker group.

    Same arguments as ConfusionStore: ``observed (N,) int64``, ``z_init (N,) int64`` (the
    placeholder assignment until LCCN starts), ``k_latent``, ``num_classes``,
    ``counted (N,) bool`` (False: LCCN+ trusted, never counted). The constructor state is
    kept so that a fresh (re)start of the run can go back to it.
    """

    def __init__(self, observed: Tensor, z_init: Tensor, k_latent: int, num_classes: int, *,
                 counted: Tensor | None = None, log_capacity: int = 4096) -> None:
        super().__init__(observed, z_init, k_latent, num_classes, counted=counted,
                         log_capacity=log_capacity)
        self.fence: str | None = None
        self.meta: dict[str, Any] = {}
        self.opened = 0
        self.refused = 0
        self.busy_s = 0.0
        self.calls = 0
        self.restored = 0
        self._counted_here = False  # this process has taken over a checkpoint's counters
        self._initial = self.state_dict()

    # -- control ------------------------------------------------------------------------------

    def open(self, state: dict | None = None) -> str:
        """Restore ``state`` (a :meth:`state_dict`, e.g. from a checkpoint) or, with None, the
        constructor state; returns the new fence token every commit must carry."""
        self.load_state_dict(self._initial if state is None else state)
        saved = (state or {}).get("counters")
        if saved is not None and not self._counted_here:
            # a fresh actor process (first open, or Ray restarted it): continue the counts
            # of the checkpoint on top of what this process counted before this open
            for key in COUNTER_KEYS:
                setattr(self, key, type(getattr(self, key))(saved.get(key, 0))
                        + getattr(self, key))
            self.restored += 1
        self._counted_here = True
        self.fence = uuid.uuid4().hex
        self.opened += 1
        return self.fence

    def get_fence(self) -> str | None:
        return self.fence

    def _check_fence(self, fence: str | None, what: str = "commit") -> None:
        if fence is not None and fence != self.fence:
            self.refused += 1
            serving = ("no worker group (restarted, not yet reopened)" if self.fence is None
                       else f"fence {self.fence[:8]}")
            raise FenceError(f"{what} with fence {fence[:8]} refused: the store serves {serving}; "
                             "the worker group must restart from its last checkpoint")

    def snapshot(self, *, fence: str | None = None) -> tuple[Tensor, int]:
        """``(C (K_latent, K) int64, version)``: a full replica to start a labeler from."""
        self._check_fence(fence, "snapshot")
        return self.counts.clone(), self.version

    def set_meta(self, key: str, value: Any, *, fence: str | None = None) -> None:
        self._check_fence(fence, "set_meta")
        self.meta[key] = value

    def get_meta(self, key: str, default: Any = None, *, fence: str | None = None) -> Any:
        self._check_fence(fence, "get_meta")
        return self.meta.get(key, default)

    def counters(self) -> dict[str, float]:
        """The counters of the whole run (see the module docstring), as floats."""
        return {key: float(getattr(self, key)) for key in COUNTER_KEYS}

    def stats(self) -> dict[str, float]:
        """``version`` and the counters: ``duplicates`` (retried commits ignored),
        ``refused`` (fenced-off calls), ``opened``, ``calls``, ``busy_s`` (seconds spent in
        commit/push: the actor's load; near wall time = saturated) and ``restored`` (times
        an actor process took over a checkpoint's counters: re-submissions and actor
        restarts). Not fenced: read-only."""
        return {"version": float(self.version), **self.counters()}

    def state_dict(self) -> dict:
        """:meth:`ConfusionStore.state_dict` plus ``counters`` (restored by :meth:`open`)."""
        state = super().state_dict()
        state["counters"] = self.counters()
        return state

    def check_state(self, *, fence: str | None = None) -> dict:
        """Run :meth:`check` (raises AssertionError/ValueError on a broken invariant) and
        return the state it checked, so one call gives a consistent, checked checkpoint.
        Refused with :class:`FenceError` when ``fence`` is not the current one."""
        self._check_fence(fence, "check_state")
        self.check()
        return self.state_dict()

    # -- the worker protocol, fenced ----------------------------------------------------------

    def commit(self, idx: Tensor, z_new: Tensor, *, worker: str = "0", seq: int | None = None,
               steps: int = 1, fence: str | None = None) -> int:
        """:meth:`ConfusionStore.commit`, refused with :class:`FenceError` when ``fence`` is
        given and is not the current one (``None``: unfenced, for in-process use)."""
        self._check_fence(fence)
        return super().commit(idx, z_new, worker=worker, seq=seq, steps=steps)

    def push(self, idx: Tensor, z_new: Tensor, *, since: int, worker: str, seq: int,
             steps: int = 1, full_z: bool = False, fence: str | None = None) -> Sync:
        """:meth:`ConfusionStore.push` (several steps' labels in one commit, the other
        workers' deltas back), refused with :class:`FenceError` on a stale fence."""
        t0 = time.perf_counter()
        try:
            self._check_fence(fence)  # a push is a commit
            return ConfusionStore.push(self, idx, z_new, since=since, worker=worker, seq=seq,
                                       steps=steps, full_z=full_z)
        finally:
            self.calls += 1
            self.busy_s += time.perf_counter() - t0

    def push_packed(self, idx: np.ndarray, z_new: np.ndarray, *, since: int, worker: str,
                    seq: int, steps: int = 1, full_z: bool = False,
                    fence: str | None = None) -> tuple:
        """:meth:`push` with numpy arrays on the wire; returns :func:`pack_sync` of the
        reply (labels and moves in the smallest integer type that holds them)."""
        sync = self.push(_tensor(idx).long(), _tensor(z_new).long(), since=since,
                         worker=worker, seq=seq, steps=steps, full_z=full_z, fence=fence)
        return pack_sync(sync, labels=max(self.k_latent, self.num_classes))

    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """``(observed (N,), counted (N,) bool)`` as numpy arrays (fixed for the run: not
        fenced)."""
        observed, counted = ConfusionStore.layout(self)
        return observed.numpy(), counted.numpy()


def _label_dtype(labels: int) -> type:
    return np.int16 if labels <= np.iinfo(np.int16).max else np.int32


def pack_sync(sync: Sync, *, labels: int | None = None) -> tuple:
    """A :class:`Sync` as a tuple of numpy arrays and ints (the wire format of
    push_packed). With ``labels`` (the number of classes) ``z`` and the moves travel as
    int16 (or int32) and the counts as int32: 4 to 8x less to pickle and send."""
    counts = None if sync.counts is None else sync.counts.numpy()
    arrays = [sync.z.numpy(), sync.delta_obs.numpy(), sync.delta_old.numpy(),
              sync.delta_new.numpy()]
    if labels is not None:
        arrays = [a.astype(_label_dtype(labels)) for a in arrays]
        if counts is not None and int(counts.max(initial=0)) <= np.iinfo(np.int32).max:
            counts = counts.astype(np.int32)
    z, obs, old, new = arrays
    return (z, sync.version, obs, old, new, counts, sync.others)


def _tensor(a: np.ndarray) -> Tensor:
    """A tensor over ``a``; a copy when ``a`` is read-only (Ray's zero-copy arrays are)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def _int64(a: np.ndarray) -> Tensor:
    return torch.from_numpy(a.astype(np.int64)) if a.dtype != np.int64 else _tensor(a)


def unpack_sync(packed: tuple) -> Sync:
    z, version, obs, old, new, counts, others = packed
    return Sync(_int64(z), int(version), _int64(obs), _int64(old), _int64(new),
                None if counts is None else _int64(counts), int(others))


# -- clients ----------------------------------------------------------------------------------


class LocalStoreClient:
    """A worker's view of a :class:`StoreActor` in the same process (tests, one process)."""

    def __init__(self, store: StoreActor) -> None:
        self.store = store
        self.fence: str | None = None

    def open(self, state: dict | None) -> str:
        self.fence = self.store.open(state)
        return self.fence

    def join(self) -> str:
        """Take the fence rank 0 opened (call after a barrier that follows ``open``)."""
        fence = self.store.get_fence()
        if fence is None:
            raise FenceError("the store has not been opened by rank 0")
        self.fence = fence
        return fence

    def push(self, idx: Tensor, z_new: Tensor, *, since: int, worker: str, seq: int,
             steps: int = 1, full_z: bool = False) -> Any:
        return self.store.push(idx, z_new, since=since, worker=worker, seq=seq, steps=steps,
                               full_z=full_z, fence=self.fence)

    def layout(self) -> tuple[Tensor, Tensor]:
        return ConfusionStore.layout(self.store)

    def resolve(self, handle: Any) -> Sync:
        return handle

    def commit(self, idx: Tensor, z_new: Tensor, *, worker: str, seq: int) -> int:
        return self.store.commit(idx, z_new, worker=worker, seq=seq, fence=self.fence)

    def snapshot(self) -> tuple[Tensor, int]:
        return self.store.snapshot(fence=self.fence)

    def check_state(self) -> dict:
        return self.store.check_state(fence=self.fence)

    def set_meta(self, key: str, value: Any) -> None:
        self.store.set_meta(key, value, fence=self.fence)

    def get_meta(self, key: str) -> Any:
        return self.store.get_meta(key, fence=self.fence)

    def stats(self) -> dict[str, float]:
        return self.store.stats()


class ActorStoreClient(LocalStoreClient):
    """A worker's view of the Ray actor holding a :class:`StoreActor`.

    Control calls block (``ray.get``); :meth:`push` returns the ObjectRef without waiting
    and :meth:`resolve` waits for it. ``resolve`` of a refused commit raises the actor's
    :class:`FenceError` (wrapped by Ray), which fails the worker and so the group.
    """

    def __init__(self, handle: Any) -> None:
        import ray  # only here: the library imports without Ray

        self._ray = ray
        self.store = handle
        self.fence = None

    def _get(self, ref: Any) -> Any:
        return self._ray.get(ref)

    def open(self, state: dict | None) -> str:
        self.fence = self._get(self.store.open.remote(state))
        return self.fence

    def join(self) -> str:
        fence = self._get(self.store.get_fence.remote())
        if fence is None:
            raise FenceError("the store has not been opened by rank 0")
        self.fence = fence
        return fence

    def push(self, idx: Tensor, z_new: Tensor, *, since: int, worker: str, seq: int,
             steps: int = 1, full_z: bool = False) -> Any:
        # int32 sample indices and int16 labels: a third of the bytes to pickle and send
        z_np = z_new.numpy()
        if z_new.numel() and int(z_new.max()) <= np.iinfo(np.int16).max:
            z_np = z_np.astype(np.int16)
        idx_np = idx.numpy()
        if idx.numel() and int(idx.max()) <= np.iinfo(np.int32).max:
            idx_np = idx_np.astype(np.int32)
        return self.store.push_packed.remote(idx_np, z_np, since=since, worker=worker,
                                             seq=seq, steps=steps, full_z=full_z,
                                             fence=self.fence)

    def layout(self) -> tuple[Tensor, Tensor]:
        observed, counted = self._get(self.store.layout.remote())
        return _int64(observed), torch.from_numpy(np.array(counted, dtype=bool))

    def resolve(self, handle: Any) -> Sync:
        return unpack_sync(self._get(handle))

    def done(self, handle: Any) -> bool:
        """Whether the reply of a :meth:`push` has arrived (never blocks)."""
        ready, _ = self._ray.wait([handle], timeout=0)
        return bool(ready)

    def commit(self, idx: Tensor, z_new: Tensor, *, worker: str, seq: int) -> int:
        return self._get(self.store.commit.remote(idx, z_new, worker=worker, seq=seq,
                                                  fence=self.fence))

    def snapshot(self) -> tuple[Tensor, int]:
        return self._get(self.store.snapshot.remote(fence=self.fence))

    def check_state(self) -> dict:
        return self._get(self.store.check_state.remote(fence=self.fence))

    def set_meta(self, key: str, value: Any) -> None:
        self._get(self.store.set_meta.remote(key, value, fence=self.fence))

    def get_meta(self, key: str) -> Any:
        return self._get(self.store.get_meta.remote(key, fence=self.fence))

    def stats(self) -> dict[str, float]:
        return self._get(self.store.stats.remote())

    def kill(self) -> None:
        """Kill the actor process and let Ray restart it (fault-injection in tests)."""
        self._ray.kill(self.store, no_restart=False)


def store_actor_name(run_name: str) -> str:
    return f"lccn-store-{run_name}"


def create_store_actor(run_name: str, observed: Tensor, z_init: Tensor, k_latent: int,
                       num_classes: int, *, counted: Tensor | None = None,
                       max_task_retries: int = 3) -> Any:
    """Create the run's confusion actor from the driver (never from a Train worker: an
    actor dies with the process that created it, and Train restarts its workers).

    Named ``lccn-store-<run_name>`` in the job's namespace; ``max_restarts=-1`` so a dead
    actor comes back (empty, unfenced: the worker group then restores it from the last
    checkpoint); ``num_cpus=0`` so it never takes a CPU a Train worker needs; placed on the
    driver's node (the head, under ``ray job submit``), softly: if that node is gone, Ray
    restarts it elsewhere. Raises ValueError if a live run of the same name already holds
    the name.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = store_actor_name(run_name)
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"a confusion actor {name!r} is alive in this namespace: is run "
                         f"{run_name!r} already running? (pick another --run-name)")
    cls = ray.remote(StoreActor)
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(),
                                           soft=True)
    return cls.options(name=name, max_restarts=-1, max_task_retries=max_task_retries,
                       num_cpus=0, scheduling_strategy=here).remote(
        observed, z_init, k_latent, num_classes, counted=counted)
