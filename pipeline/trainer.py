"""The single-process trainer: CE pre-training, then LCCN (Algorithm 3), or the CE baseline
on the same schedule. The same pieces (GibbsLabeler, ConfusionStore, train_one_epoch) run
inside Ray Train workers; here the store lives in-process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.config import RunConfig
from pipeline.confusion_store import ConfusionStore
from pipeline.fastpath import configure_backends, wrap_model
from pipeline.labels import LabelView, holdout_split
from pipeline.lccn import GibbsLabeler
from pipeline.loop import evaluate, predict, train_one_epoch
from pipeline.models import build_model
from pipeline.monitor import CollapseMonitor, chain_health
from pipeline.warmup import estimate_phi_init, initial_assignment


class Batch(NamedTuple):
    """images (B,C,H,W) float; observed, idx, clean (B,) int64; valid (B,) bool."""

    images: Tensor
    observed: Tensor
    idx: Tensor
    clean: Tensor
    valid: Tensor


@dataclass
class TensorData:
    """An in-memory split: ``images (N,C,H,W)`` float and the label view over it (idx = row).

    augment: optional ``augment(images (B,C,H,W), generator) -> (B,C,H,W)`` applied to the
    images of every batch of a shuffled (training) pass, i.e. when :meth:`batches` is given
    a generator; it draws from that same generator. Unshuffled passes (prediction,
    evaluation, the Eq. 8 estimate) see the stored images unchanged.
    """

    images: Tensor
    labels: LabelView
    augment: Callable[[Tensor, torch.Generator], Tensor] | None = None

    def __post_init__(self) -> None:
        if self.images.shape[0] != len(self.labels):
            raise ValueError(f"{self.images.shape[0]} images but a label view of "
                             f"{len(self.labels)} samples")
        self.observed = torch.from_numpy(self.labels.observed)
        self.clean = torch.from_numpy(self.labels.clean)

    def __len__(self) -> int:
        return self.images.shape[0]

    def take(self, rows: np.ndarray) -> "TensorData":
        """The samples at ``rows`` as a new split (they become idx ``0..len(rows)-1``)."""
        rows = np.asarray(rows, dtype=np.int64)
        return TensorData(self.images[torch.from_numpy(rows)], self.labels.take(rows),
                          augment=self.augment)

    def to(self, device: str | torch.device) -> "TensorData":
        """The same split with its images on ``device`` (labels stay on the host, where the
        store and the sampler's range checks read them); augmentation then runs there."""
        return TensorData(self.images.to(device), self.labels, augment=self.augment)

    def noisy(self) -> "TensorData":
        """The same images scored against their *observed* labels (a noisy validation
        split: what a user without clean labels can measure)."""
        obs = self.labels.observed
        return TensorData(self.images, LabelView(obs, obs, self.labels.num_classes))

    def batches(self, batch_size: int, *, generator: torch.Generator | None = None
                ) -> Iterator[Batch]:
        """Shuffled (and augmented, if :attr:`augment` is set) when a generator is given;
        the last batch may be smaller."""
        n = len(self)
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            images = self.images[idx.to(self.images.device, non_blocking=True)]
            if generator is not None and self.augment is not None:
                images = self.augment(images, generator)
            yield Batch(images, self.observed[idx], idx, self.clean[idx],
                        torch.ones(idx.numel(), dtype=torch.bool))


def transition_error(phi: Tensor, truth) -> float:
    """Mean absolute difference between ``phi`` and the true transition over the rows both
    have (the first K rows when one of them carries an outlier row)."""
    if truth is None:
        return float("nan")
    t = torch.as_tensor(truth, dtype=torch.float64)
    rows = min(phi.shape[0], t.shape[0])
    return float((phi[:rows].to(torch.float64) - t[:rows]).abs().mean())


def select_epoch(history: list[dict[str, float]], key: str = "val_top1") -> int:
    """Index of the row with the highest ``key`` (the first on ties): the epoch a
    practitioner would keep, chosen on the noisy validation split. The last row when no
    row has a finite ``key``."""
    vals = [r.get(key, float("nan")) for r in history]
    finite = [i for i, v in enumerate(vals) if v == v]
    if not finite:
        return len(history) - 1
    return max(finite, key=lambda i: (vals[i], -i))


class LocalTrainer:
    """Trains one model on one split in this process.

    ``fit`` runs ``optim.pretrain_epochs`` of CE, then (method "lccn") estimates
    ``phi_init`` and the initial assignment from the pretrained model and continues with
    LCCN; method "ce" continues with CE on the same learning-rate schedule.

    ``cfg.val_fraction`` of ``train`` (stratified by observed label, fixed by the seed) is
    held out as a noisy validation split: never trained on, never counted in C, scored
    each epoch against its observed labels (``val_top1``). ``self.train`` is the rest; its
    idx are ``0..len(self.train)-1`` (``self.train_rows`` maps them back to ``train``).
    """

    def __init__(self, cfg: RunConfig, train: TensorData, test: TensorData, *,
                 device: str = "cpu") -> None:
        k = train.labels.num_classes
        if test.labels.num_classes != k:
            raise ValueError(f"train has {k} classes but test has {test.labels.num_classes}")
        self.val: TensorData | None = None
        self.train_rows = np.arange(len(train), dtype=np.int64)
        if cfg.val_fraction > 0:
            self.train_rows, val_rows = holdout_split(train.labels.observed, cfg.val_fraction,
                                                      seed=cfg.seed)
            self.val = train.take(val_rows).noisy()
            train = train.take(self.train_rows)
        configure_backends(cfg.perf, device)
        if cfg.perf.enabled("data_on_device", device) and torch.device(device).type != "cpu":
            train, test = train.to(device), test.to(device)
            self.val = self.val.to(device) if self.val is not None else None
        self.cfg, self.train, self.test, self.device = cfg, train, test, device
        self.num_classes = k
        self.k_latent = k + 1 if (cfg.method == "lccn" and cfg.lccn.outlier) else k
        self.model = build_model(cfg.model.name, self.k_latent, in_channels=cfg.model.in_channels,
                                 seed=cfg.seed).to(device)
        # what the step calls (autocast, channels-last, compile); self.model holds the weights
        self.forward = wrap_model(self.model, cfg.perf, device)
        o = cfg.optim
        # the fused CUDA kernel: one launch for all parameters, the same update
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=o.lr, momentum=o.momentum,
                                         weight_decay=o.weight_decay,
                                         fused=torch.device(device).type == "cuda" or None)
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(
            self.optimizer, milestones=list(o.milestones), gamma=o.lr_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.store: ConfusionStore | None = None
        self.labeler: GibbsLabeler | None = None
        trusted = torch.from_numpy(train.labels.trusted)
        self.trusted = trusted if (cfg.method == "lccn" and cfg.lccn.use_trusted) else None
        self.monitor = CollapseMonitor(cfg.monitor)
        self.phi_init: Tensor | None = None

    def _start_lccn(self) -> dict[str, float]:
        """Algorithm 3 lines 2-3: phi_init and C from the pretrained classifier."""
        lc = self.cfg.lccn
        probs, idx, _ = predict(self.forward, self.train.batches(512), device=self.device)
        order = torch.argsort(idx)
        probs = probs[order]
        observed = self.train.observed
        phi_init = estimate_phi_init(lc, probs, observed, self.k_latent, self.num_classes)
        self.pretrained_probs = probs
        z0 = initial_assignment(observed, probs=probs, mode=lc.init)
        counted = None
        if self.trusted is not None:
            z0 = torch.where(self.trusted, self.train.clean, z0)
            counted = ~self.trusted
        self.store = ConfusionStore(observed, z0, self.k_latent, self.num_classes, counted=counted)
        o = self.cfg.optim
        steps_per_epoch = -(-len(self.train) // o.batch_size)
        self.labeler = GibbsLabeler(
            lc, self.store, self.store.counts, self.store.version, phi_init=phi_init,
            max_steps=(o.epochs - o.pretrain_epochs) * steps_per_epoch, generator=self.gen,
            trusted=self.trusted, clean=self.train.clean, device=self.device,
            compile_mode=self.cfg.perf.compile)
        self.phi_init = phi_init
        self.monitor.start(self._val_top1())
        return {"init_transition_error": transition_error(phi_init, self.train.labels.transition)}

    def _val_top1(self) -> float:
        if self.val is None:
            return float("nan")
        return evaluate(self.forward, self.val.batches(512), num_classes=self.num_classes,
                        device=self.device)["top1"]

    def health(self) -> dict[str, float]:
        """The collapse monitor's statistics of the current chain (LCCN phase only)."""
        if self.store is None:
            return {}
        return chain_health(self.store.z, self.store.observed, self.k_latent, self.num_classes,
                            counted=self.store.counted, phi=self.store.transition(),
                            phi_init=self.phi_init)

    def fit(self, *, on_epoch: Callable[[int, dict[str, float]], None] | None = None
            ) -> list[dict[str, float]]:
        history = []
        o = self.cfg.optim
        for epoch in range(o.epochs):
            extra: dict[str, float] = {}
            if (self.cfg.method == "lccn" and epoch == o.pretrain_epochs) or (
                    self.cfg.method == "lccn" and o.pretrain_epochs == 0 and epoch == 0):
                extra = self._start_lccn()
            labeler = self.labeler if epoch >= o.pretrain_epochs else None
            t0 = time.perf_counter()
            stats = train_one_epoch(
                self.forward, self.train.batches(o.batch_size, generator=self.gen),
                self.optimizer, labeler=labeler, trusted=self.trusted, xi=self.cfg.lccn.xi,
                device=self.device, num_classes=self.num_classes)
            self.scheduler.step()
            ev = evaluate(self.forward, self.test.batches(512), num_classes=self.num_classes,
                          device=self.device)
            row = {"epoch": float(epoch), "phase": 1.0 if labeler is not None else 0.0,
                   "lr": float(self.optimizer.param_groups[0]["lr"]), **stats,
                   "val_top1": self._val_top1(),
                   "test_top1": ev["top1"], "test_top5": ev["top5"],
                   "epoch_time": time.perf_counter() - t0, **extra}
            if self.store is not None:
                if self.cfg.check_invariants:
                    self.store.check()
                row["transition_error"] = transition_error(self.store.transition(),
                                                           self.train.labels.transition)
                health = self.health()
                row.update(health)
                row["collapse"] = float(bool(self.monitor.check(health, row["val_top1"],
                                                                epoch=epoch)))
            else:
                row["transition_error"] = float("nan")
            history.append(row)
            if on_epoch is not None:
                on_epoch(epoch, row)
        return history

    def transition(self) -> Tensor | None:
        """The learned ``phi (K_latent, K)`` (rows sum to 1), or None for CE."""
        return None if self.store is None else self.store.transition()
