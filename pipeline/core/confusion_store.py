"""The global state of the Gibbs chain: C and the latent label z of every training sample.

A plain class. In one process the trainer calls it directly; in a distributed run a job
wraps it with ``ray.remote`` (from the driver) and every Train worker talks to that one
actor. The protocol is built for that:

- one call per ``LCCNConfig.commit_every`` steps, :meth:`ConfusionStore.push`: the worker
  keeps ``z`` of its own samples and applies its own moves to its replica at once, sends
  the labels of ``steps`` batches in one commit and gets back only the count deltas of the
  *other* workers since its last reply (its own are left out: it already has them), so
  the payload grows with the batches, not with ``K²``; once per epoch the reply carries the
  whole ``z`` and C, to start the epoch from the store's state;
- a commit carries ``(worker, seq)``; a retried or replayed commit (``seq`` not newer than
  the last one applied for that worker) is ignored, and the delta itself is computed from
  the stored ``z`` so applying the same assignment twice moves nothing: every delta is
  applied exactly once;
- :meth:`state_dict` / :meth:`load_state_dict` carry everything into a checkpoint.

Conventions: ``C[k, j]`` counts samples with latent ``k`` and observed ``j``; shape
``(K_latent, K)``; samples with ``counted = False`` (LCCN+'s trusted set) hold a fixed ``z``
and no count.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.core.confusion import (
    apply_delta_,
    check_invariants,
    count_matrix,
    transition,
)


@dataclass(frozen=True)
class Sync:
    """What a worker gets back from :meth:`ConfusionStore.push`.

    z: (N,) int64 the whole current z when the push asked for it (``full_z``), else empty.
    version: the store's version after this call (number of commits applied).
    delta_obs, delta_old, delta_new: (D,) int64 moves ``[old, obs] -> [new, obs]`` applied
        since the caller's ``since`` version, in order; or ``counts`` (K_latent, K) when the
        caller is too far behind for the log (then the delta arrays are empty).
    others: training steps of other workers carried by the deltas (what the caller's
        replica had not seen: its staleness); -1 when unknown (the whole counts sent).
    """

    z: Tensor
    version: int
    delta_obs: Tensor
    delta_old: Tensor
    delta_new: Tensor
    counts: Tensor | None = None
    others: int = -1


class ConfusionStore:
    """C and z for a whole split.

    observed: (N,) int64 in [0, K); z_init: (N,) int64 in [0, K_latent);
    counted: (N,) bool or None (all counted); log_capacity: how many recent commits are
    kept to serve incremental syncs.
    """

    def __init__(self, observed: Tensor, z_init: Tensor, k_latent: int, num_classes: int, *,
                 counted: Tensor | None = None, log_capacity: int = 4096) -> None:
        observed = torch.as_tensor(observed, dtype=torch.int64).clone()
        z = torch.as_tensor(z_init, dtype=torch.int64).clone()
        if counted is None:
            counted = torch.ones_like(observed, dtype=torch.bool)
        counted = torch.as_tensor(counted, dtype=torch.bool).clone()
        if not (observed.shape == z.shape == counted.shape) or observed.ndim != 1:
            raise ValueError(f"observed, z_init and counted must all be (N,), got "
                             f"{tuple(observed.shape)}, {tuple(z.shape)}, {tuple(counted.shape)}")
        self.observed, self.z, self.counted = observed, z, counted
        self.k_latent, self.num_classes = int(k_latent), int(num_classes)
        self.counts = count_matrix(z, observed, self.k_latent, self.num_classes, counted=counted)
        self.version = 0
        self.steps = 0  # training steps whose labels were applied (a push carries several)
        self.last_seq: dict[str, int] = {}
        # (version, obs, old, new, worker, steps) of each recent commit
        self._log: deque[tuple[int, Tensor, Tensor, Tensor, str, int]] = deque(
            maxlen=log_capacity)
        self.duplicates = 0

    def __len__(self) -> int:
        return self.z.numel()

    # -- the worker protocol ------------------------------------------------------------------

    def commit(self, idx: Tensor, z_new: Tensor, *, worker: str = "0", seq: int | None = None,
               steps: int = 1) -> int:
        """Set ``z[idx] = z_new`` and move the counts; returns the new version.

        idx, z_new: (B,) int64. Entries of samples that are not counted are ignored. A
        commit whose ``seq`` is not newer than the last applied for ``worker`` is a retry:
        nothing changes and it is counted in :attr:`duplicates`. ``steps``: how many
        training steps the commit carries (1, or the batches of a :meth:`push`): added to
        :attr:`steps` (every step applied exactly once: ``steps`` = steps trained) and used
        for the staleness figures.
        """
        idx = torch.as_tensor(idx, dtype=torch.int64)
        z_new = torch.as_tensor(z_new, dtype=torch.int64)
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if idx.shape != z_new.shape or idx.ndim != 1:
            raise ValueError(f"idx and z_new must both be (B,), got {tuple(idx.shape)} and "
                             f"{tuple(z_new.shape)}")
        if seq is not None:
            if seq <= self.last_seq.get(worker, -1):
                self.duplicates += 1
                return self.version
            self.last_seq[worker] = seq
        if idx.numel():
            n = self.z.numel()
            if int(idx.min()) < 0 or int(idx.max()) >= n:
                raise ValueError(f"idx out of range [0, {n}): {int(idx.min())}..{int(idx.max())}")
            if int(z_new.min()) < 0 or int(z_new.max()) >= self.k_latent:
                raise ValueError(f"z_new out of range [0, {self.k_latent}): "
                                 f"{int(z_new.min())}..{int(z_new.max())}")
            keep = self.counted[idx]
            idx, z_new = idx[keep], z_new[keep]
            # last write wins for an idx repeated in one commit (padding); delta from stored z
            if idx.numel() != torch.unique(idx).numel():
                order = torch.arange(idx.numel())
                uniq, inv = torch.unique(idx, return_inverse=True)
                last = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce(
                    0, inv, order, reduce="amax")
                idx, z_new = idx[last], z_new[last]
            z_old = self.z[idx]
            moved = z_old != z_new
            obs, old, new = self.observed[idx][moved], z_old[moved], z_new[moved]
            apply_delta_(self.counts, obs, old, new)
            self.z[idx] = z_new
        else:
            obs = old = new = torch.empty(0, dtype=torch.int64)
        self.version += 1
        self.steps += int(steps)
        self._log.append((self.version, obs, old, new, worker, int(steps)))
        return self.version

    def _since(self, since: int) -> list:
        """The log entries after version ``since``, oldest first (walks only those)."""
        out = []
        for entry in reversed(self._log):
            if entry[0] <= since:
                break
            out.append(entry)
        out.reverse()
        return out

    def push(self, idx: Tensor, z_new: Tensor, *, since: int, worker: str, seq: int,
             steps: int = 1, full_z: bool = False) -> Sync:
        """Commit the labels of ``steps`` batches at once and return what the caller's
        replica misses: the moves of the *other* workers' commits after version ``since``
        (the caller applied its own when it made them), or the whole ``counts`` when
        ``since`` is out of the log (-1 asks for them). ``z`` of the reply is the whole
        ``(N,)`` z when ``full_z`` (the start of an epoch), else empty. ``others`` = the
        other workers' steps in the reply (the replica's staleness).

        Exactly-once as :meth:`commit`: a replayed ``(worker, seq)`` changes nothing (its
        reply still carries the other workers' deltas).
        """
        if steps or torch.as_tensor(idx).numel():  # an empty push (a pull) is no commit
            self.commit(idx, z_new, worker=worker, seq=seq, steps=steps)
        return self.sync_others(since=since, worker=worker, full_z=full_z)

    def sync_others(self, *, since: int, worker: str, full_z: bool = False) -> Sync:
        """The reply of :meth:`push` without a commit (see there)."""
        z = self.z.clone() if full_z else torch.empty(0, dtype=torch.int64)
        e = torch.empty(0, dtype=torch.int64)
        if since == self.version:
            return Sync(z, self.version, e, e, e, others=0)
        oldest = self._log[0][0] if self._log else self.version + 1
        if since < 0 or since > self.version or since + 1 < oldest:
            return Sync(z, self.version, e, e, e, counts=self.counts.clone(), others=-1)
        parts = [entry for entry in self._since(since) if entry[4] != worker]
        if not parts:
            return Sync(z, self.version, e, e, e, others=0)
        return Sync(z, self.version, torch.cat([p[1] for p in parts]),
                    torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]),
                    others=sum(p[5] for p in parts))

    def layout(self) -> tuple[Tensor, Tensor]:
        """``(observed (N,) int64, counted (N,) bool)``: what never changes in a run (a
        worker that keeps its own samples' z applies its own moves with them)."""
        return self.observed.clone(), self.counted.clone()

    # -- views --------------------------------------------------------------------------------

    def transition(self, alpha: float | Tensor = 0.0) -> Tensor:
        """``phi (K_latent, K)`` float64 from the counts smoothed by ``alpha``; rows sum to 1."""
        return transition(self.counts, alpha)

    def check(self) -> None:
        """Assert the invariants of docs/design.md (cheap enough to run at every checkpoint)."""
        check_invariants(self.counts, self.z, self.observed, counted=self.counted)

    def state_dict(self) -> dict:
        return {"observed": self.observed.clone(), "z": self.z.clone(),
                "counted": self.counted.clone(), "counts": self.counts.clone(),
                "k_latent": self.k_latent, "num_classes": self.num_classes,
                "version": self.version, "steps": self.steps,
                "last_seq": dict(self.last_seq)}

    def load_state_dict(self, state: dict) -> None:
        """Go back to a checkpointed ``state`` in place (same split: same ``observed`` and
        ``counted``): restores ``z``, C, ``version`` and ``last_seq``; everything committed
        after that state is discarded, and so is the delta log (a worker syncing from a
        version it saw before gets the full counts instead of deltas)."""
        if not (torch.equal(torch.as_tensor(state["observed"]), self.observed)
                and torch.equal(torch.as_tensor(state["counted"]), self.counted)):
            raise ValueError("checkpointed store state is for another split: its observed "
                             "labels or counted mask differ from this store's")
        if (int(state["k_latent"]), int(state["num_classes"])) != (self.k_latent, self.num_classes):
            raise ValueError(f"checkpointed store state has C of shape ({state['k_latent']}, "
                             f"{state['num_classes']}), this store ({self.k_latent}, "
                             f"{self.num_classes})")
        z = torch.as_tensor(state["z"], dtype=torch.int64).clone()
        counts = count_matrix(z, self.observed, self.k_latent, self.num_classes,
                              counted=self.counted)
        if not torch.equal(counts, torch.as_tensor(state["counts"])):
            raise ValueError("checkpointed C does not equal the recount of its z: corrupt state")
        self.z, self.counts = z, counts
        self.version = int(state["version"])
        self.steps = int(state.get("steps", self.version))  # older states: a step per commit
        self.last_seq = dict(state["last_seq"])
        self._log.clear()

    @classmethod
    def from_state_dict(cls, state: dict, *, log_capacity: int = 4096) -> "ConfusionStore":
        store = cls(state["observed"], state["z"], state["k_latent"], state["num_classes"],
                    counted=state["counted"], log_capacity=log_capacity)
        if not torch.equal(store.counts, state["counts"]):
            raise ValueError("checkpointed C does not equal the recount of its z: corrupt state")
        store.version = int(state["version"])
        store.steps = int(state.get("steps", store.version))
        store.last_seq = dict(state["last_seq"])
        return store
