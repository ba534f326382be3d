"""Sessions: what differs between a run in this process and a run in Ray Train workers.

A :class:`Session` gives the engine its rank, world size, device, collectives
(``barrier``, ``all_reduce_sum``, ``all_gather``), ``prepare_model`` (DDP),
``load_checkpoint`` and ``report``. :class:`ProcessSession` is one process with nothing
kept; ``LocalSession`` (:mod:`pipeline.cluster.worker`: one process, checkpoints on disk) and
``RaySession`` (:mod:`pipeline.cluster.ray_train`) build on :class:`ProcessSession` and
:class:`TorchCollectives`. The engine never reads the rank from global state.

Imports: torch only.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


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
