"""The engine's data source over WebDataset shards: each rank its share of the training
split through :mod:`pipeline.data.stream`, the test split scored by the first ranks, whole
shards each.

The noisy validation split lives inside the training shards. When the manifest records
each shard's ``first_idx`` (every split :mod:`shards` writes), its samples are left out of
the training pass *before decoding* (the epoch's plan counts only the samples a shard keeps,
so batches stay full) and their raw bytes are kept: the validation pass decodes those in
this process, so the training split is read once per epoch, not once more to validate
(memory: the raw bytes of this rank's share of the split, about 5% of its shards). Until a
training pass has run in this process (a restarted worker scoring before its first pass),
and for manifests without ``first_idx``, the samples are read with the rest and filtered out
after decoding (counted either way in ``val_held_out``).

Kept apart from :mod:`pipeline.train.sources` because it imports WebDataset, which a
GPU node running the in-memory trainer does not need.

Imports: :mod:`pipeline.core`, :mod:`pipeline.data`, :mod:`pipeline.train.sources`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.core.labels import LabelView
from pipeline.data.stream import (
    check_splits,
    decoded_batches,
    eval_ranks,
    load_manifest,
    loader_counters,
    make_eval_loader,
    make_train_loader,
    warn_if_class_sorted,
)
from pipeline.train.session import Session
from pipeline.train.sources import _Pass, loader_geometry


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
    """A training pass; ``held_out`` given: the loader read the held-out samples and they
    are filtered out of its batches (:class:`_SkipHeldOut`); else the loader dropped them
    itself (``stats["dropped"]``). ``on_end(loader)`` runs when a pass has been read to its
    end."""

    def __init__(self, loader: Any, held_out: np.ndarray | None, on_end: Any = None) -> None:
        self.loader, self.on_end = loader, on_end
        self.filter = None if held_out is None else _SkipHeldOut(loader, held_out)
        super().__init__(self.filter if self.filter is not None else loader,
                         loader.steps_per_epoch, loader.start_batch)

    def __iter__(self) -> Iterator[Any]:
        yield from self.batches
        if self.on_end is not None:
            self.on_end(self.loader)

    def counters(self, session: Session) -> dict[str, float]:
        out = loader_counters(self.loader.stats, all_reduce_sum=session.all_reduce_sum,
                              device=session.device)
        held = self.filter.skipped if self.filter else self.loader.stats.get("dropped", 0)
        skipped = torch.tensor([float(held)], dtype=torch.float64)
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


class ShardSource:
    """The training and test shards of a distributed run, this rank's share of each
    (:mod:`pipeline.data.stream`). ``held_out (N,) bool``: the noisy validation split (never in a
    training pass, scored every epoch), or None."""

    def __init__(self, *, train_source: str, test_source: str | None, view: LabelView,
                 loader_cfg: Any, rank: int, world_size: int,
                 held_out: np.ndarray | None, device: torch.device | str | None = None) -> None:
        self.train_source, self.test_source, self.view = train_source, test_source, view
        self.device = device  # where LoaderConfig.decode "device"/"auto" decodes
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
        # the held-out samples are dropped before decoding (the manifest says which shard
        # holds which idx); _val_raw: their raw bytes from this rank's last full pass
        self.drop_early = self.held_out is not None and self.manifest.idx_ranges() is not None
        self._val_raw: list[dict] | None = None
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
        drop = self.held_out if self.drop_early else None
        loader = make_train_loader(self.train_source, self.view, self.cfg, rank=self.rank,
                                   world_size=self.world_size, epoch=epoch,
                                   start_batch=start_batch, manifest=self.manifest,
                                   views=views, drop=drop, keep_dropped=drop is not None,
                                   device=self.device)
        if drop is None:
            return _ShardPass(loader, self.held_out)
        return _ShardPass(loader, None, on_end=self._keep_val)

    def _keep_val(self, loader: Any) -> None:
        self._val_raw = loader.kept

    def _train_eval(self, drop: np.ndarray | None = None) -> Any:
        return make_eval_loader(self.train_source, self.view, self.cfg, rank=self.rank,
                                world_size=self.world_size, manifest=self.manifest, drop=drop,
                                device=self.device)

    def train_eval_batches(self) -> Iterable[Any]:
        if self.drop_early:
            return self._train_eval(drop=self.held_out)
        loader = self._train_eval()
        return loader if self._held_t is None else _without(loader, self._held_t)

    def val_batches(self) -> Iterable[Any] | None:
        """The noisy validation split's samples of this rank (labels: the observed ones):
        decoded from the raw bytes the last training pass kept, else read from the
        training shards."""
        if self._held_t is None:
            return None
        if self._val_raw is not None:
            return (b._replace(clean=b.observed) for b in decoded_batches(
                self._val_raw, self.view, self.cfg, batch_size=self.cfg.batch_size,
                device=self.device))
        return _held_out_only(self._train_eval(), self._held_t)

    def test_batches(self) -> Iterable[Any] | None:
        """This rank's share of the test split; empty on ranks past its shard count (a test
        split with fewer shards than ranks is scored by the first ones, whole shards each,
        and :meth:`Engine.score` sums every rank's counts)."""
        if not self.test_source:
            return None
        ranks = eval_ranks(self.test_manifest, self.world_size)
        if self.rank >= ranks:
            return []
        return make_eval_loader(self.test_source, None, self.cfg, rank=self.rank,
                                world_size=ranks, manifest=self.test_manifest,
                                device=self.device)
