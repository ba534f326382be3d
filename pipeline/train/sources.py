"""Data sources of the engine: the training pass of an epoch, the noisy validation split
and the test split, from in-memory tensors (:class:`TensorSource`) or from WebDataset
shards (:class:`~pipeline.train.shard_source.ShardSource`, which imports WebDataset).

Imports: :mod:`pipeline.core`, :mod:`pipeline.train.session`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from pipeline.core.labels import LabelView, holdout_split
from pipeline.train.session import Session


def held_out_mask(view: LabelView, fraction: float, *, seed: int) -> np.ndarray | None:
    """``(N,) bool``: the noisy validation split of a training label view, the same
    stratified split as :func:`pipeline.core.labels.holdout_split` (and the local trainer) for
    this view and seed; None when ``fraction`` is 0."""
    if fraction <= 0:
        return None
    _, val_rows = holdout_split(view.observed, fraction, seed=seed)
    mask = np.zeros(len(view), dtype=bool)
    mask[val_rows] = True
    return mask


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
    """In-memory splits (:class:`pipeline.train.trainer.TensorData`): ``train`` (idx 0..N-1,
    its noisy validation split included, as in :class:`~pipeline.train.shard_source.ShardSource`)
    and ``test``. ``held_out (N,) bool`` marks the noisy validation rows of ``train``: the
    training pass and ``train_eval_batches`` leave them out, ``val_batches`` gives them
    (scored against their observed labels, idx = their rows). The training pass is shuffled
    and augmented from ``generator`` (the local trainer's one generator: data order,
    augmentation and the Gibbs draws share it)."""

    def __init__(self, train: Any, test: Any, *, batch_size: int,
                 generator: torch.Generator, eval_batch_size: int = 512,
                 held_out: np.ndarray | None = None) -> None:
        self.train, self.test = train, test
        self.batch_size, self.generator, self.eval_batch_size = batch_size, generator, eval_batch_size
        labels = train.labels
        self.num_samples, self.num_classes = len(train), labels.num_classes
        self.observed, self.clean = train.observed, train.clean
        self.trusted = torch.from_numpy(labels.trusted)
        self.transition = labels.transition
        if held_out is not None and (held_out.shape != (len(train),) or held_out.dtype != bool):
            raise ValueError(f"held_out must be ({len(train)},) bool, got "
                             f"{held_out.shape} {held_out.dtype}")
        self.held_out = held_out if held_out is not None and held_out.any() else None
        self._rows = self._val_rows = None
        if self.held_out is not None:
            self._rows = torch.from_numpy(np.flatnonzero(~self.held_out))
            self._val_rows = torch.from_numpy(np.flatnonzero(self.held_out))
            self._val = train.noisy()

    def train_batches(self, epoch: int, start_batch: int = 0, *, views: int = 1) -> _Pass:
        """views=2: batches with two augmented views of every image (``ViewsBatch``)."""
        if start_batch:
            raise ValueError("an in-memory pass cannot start mid-epoch (no checkpoints here)")
        n = len(self.train) if self._rows is None else self._rows.numel()
        return _Pass(self.train.batches(self.batch_size, generator=self.generator, views=views,
                                        rows=self._rows), -(-n // self.batch_size))

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (data order, augmentation, the local Gibbs draws): what
        an epoch-end checkpoint needs for a resumed run to continue as an uninterrupted
        one."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    def train_eval_batches(self) -> Iterable[Any]:
        """The training samples (validation rows left out), unshuffled, in idx order."""
        return self.train.batches(self.eval_batch_size, rows=self._rows)

    def val_batches(self) -> Iterable[Any] | None:
        if self.held_out is None:
            return None
        return self._val.batches(self.eval_batch_size, rows=self._val_rows)

    def test_batches(self) -> Iterable[Any] | None:
        return self.test.batches(self.eval_batch_size)


def loader_geometry(*, world_size: int, batch_per_rank: int, loader_workers: int,
                    shuffle_buffer: int) -> dict[str, int]:
    """The values besides (seed, epoch) that fix the order of a shard epoch's batches."""
    return {"world_size": int(world_size), "batch_per_rank": int(batch_per_rank),
            "loader_workers": int(loader_workers), "shuffle_buffer": int(shuffle_buffer)}
