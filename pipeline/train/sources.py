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
    """In-memory splits (:class:`pipeline.train.trainer.TensorData`): ``train`` (idx 0..N-1),
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


def loader_geometry(*, world_size: int, batch_per_rank: int, loader_workers: int,
                    shuffle_buffer: int) -> dict[str, int]:
    """The values besides (seed, epoch) that fix the order of a shard epoch's batches."""
    return {"world_size": int(world_size), "batch_per_rank": int(batch_per_rank),
            "loader_workers": int(loader_workers), "shuffle_buffer": int(shuffle_buffer)}
