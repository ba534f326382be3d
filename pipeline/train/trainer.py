"""The single-process trainer: the engine (:mod:`pipeline.train.engine`) over in-memory tensors,
with the Gibbs chain's store in this process. The method (``RunConfig.method``, see
:mod:`pipeline.train.methods`) is the same plug-in a Ray Train worker runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.core.batch import Batch, ViewsBatch
from pipeline.core.config import RunConfig
from pipeline.core.confusion import transition_error
from pipeline.core.confusion_store import ConfusionStore
from pipeline.core.labels import LabelView, holdout_split
from pipeline.core.monitor import CollapseMonitor, chain_health
from pipeline.core.noise import shuffle_pixels
from pipeline.train.chains import ChainSet, LocalChain
from pipeline.train.engine import Engine, EngineOptions, Tracking, select_epoch
from pipeline.train.labeler import GibbsLabeler
from pipeline.train.methods import get_method
from pipeline.train.session import ProcessSession, Session
from pipeline.train.sources import TensorSource


@dataclass
class TensorData:
    """An in-memory split: ``images (N,C,H,W)`` float and the label view over it (idx = row).
    uint8 images work too when the trainer is given ``normalize=`` (the networks then
    normalise each batch themselves, after augmentation).

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

    def batches(self, batch_size: int, *, generator: torch.Generator | None = None,
                views: int = 1, rows: Tensor | None = None
                ) -> Iterator[Batch] | Iterator[ViewsBatch]:
        """Shuffled (and augmented, if :attr:`augment` is set) when a generator is given;
        the last batch may be smaller. ``views=2``: :class:`ViewsBatch` es whose two views
        are :attr:`augment` applied twice (in that order, from the same generator; the
        stored images twice without augmentation). ``rows (M,) int64``: only those samples
        (in that order unshuffled, else in an order drawn by ``randperm(M)``); their idx
        stay the rows of this split."""
        if views not in (1, 2):
            raise ValueError(f"views must be 1 or 2, got {views}")
        n = len(self) if rows is None else rows.numel()
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        if rows is not None:
            order = rows[order]
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            stored = self.images[idx.to(self.images.device, non_blocking=True)]
            augment = generator is not None and self.augment is not None
            images = self.augment(stored, generator) if augment else stored
            labels = (self.observed[idx], idx, self.clean[idx],
                      torch.ones(idx.numel(), dtype=torch.bool))
            if views == 1:
                yield Batch(images, *labels)
            else:
                yield ViewsBatch(images, self.augment(stored, generator) if augment else stored,
                                 *labels)


def open_set_images(images: Tensor, view: LabelView) -> Tensor:
    """``images (N, C, H, W)`` as the shard loader shows them under an open-set ``view``:
    each ``view.ood`` sample's pixels permuted by :func:`pipeline.core.noise.shuffle_pixels`
    (seed ``view.spec["pixel_seed"]``, as :mod:`pipeline.data.stream` does at read time); a new
    tensor, the others unchanged."""
    if images.shape[0] != len(view):
        raise ValueError(f"{images.shape[0]} images but a label view of {len(view)} samples")
    out = images.clone()
    seed = view.pixel_seed
    for i in np.flatnonzero(view.ood):
        hwc = out[i].permute(1, 2, 0).cpu().numpy()
        out[i] = torch.from_numpy(shuffle_pixels(hwc, idx=int(i), seed=seed)).permute(2, 0, 1)
    return out


__all__ = ["Batch", "LocalTrainer", "TensorData", "ViewsBatch", "open_set_images",
           "select_epoch", "transition_error"]


class LocalTrainer:
    """Trains ``cfg.method`` on one split in this process.

    ``fit`` runs ``optim.pretrain_epochs`` of CE, then the method's noise-handling phase
    (method "lccn": ``phi_init`` and the initial assignment from the pretrained model, then
    LCCN; method "ce": CE on the same learning-rate schedule).

    ``cfg.val_fraction`` of ``train`` (stratified by observed label, fixed by the seed) is
    held out as a noisy validation split (``self.held_out (N,) bool``, or None): never
    trained on, never counted in C, scored each epoch against its observed labels
    (``val_top1``). The idx of every sample is its row of ``train`` (``self.train``), as in
    a distributed run over the same view: the chain's ``z`` and C, the posteriors and
    ``outliers.csv`` all use that one numbering; ``self.train_rows`` are the rows trained
    on (ascending).

    One generator (``self.gen``, seeded by ``cfg.seed``) draws the data order, the
    augmentations and the Gibbs steps. The networks exist from construction on (a caller
    may load weights into :attr:`model` before :meth:`fit`).

    session: by default a :class:`~pipeline.train.session.ProcessSession` (no checkpoints); a
    ``pipeline.cluster.worker.LocalSession`` writes a checkpoint at every epoch end (with the
    generator's state) and a new trainer on the same session resumes from the newest.

    out_dir: where the method's end-of-run files go (LCCN*: ``outliers.csv``, whose idx
    are ``train``'s rows and whose keys are ``keys[idx]`` when given); tracking: an MLflow run for the metrics and those files
    (:class:`~pipeline.train.engine.Tracking`); normalize: a module every network applies to
    uint8 batches before its forward (training, evaluation and prediction alike), for
    images stored as uint8 and normalised after augmentation (e.g.
    :class:`~pipeline.data.transforms.PerImageStandardize`); progress_seconds: a progress
    line inside each epoch every this many seconds (:mod:`pipeline.train.progress`; 0: off).
    """

    def __init__(self, cfg: RunConfig, train: TensorData, test: TensorData, *,
                 device: str = "cpu", session: Session | None = None,
                 out_dir: str | None = None, keys: Sequence[str] | None = None,
                 tracking: Tracking | None = None,
                 normalize: nn.Module | None = None, progress_seconds: float = 0.0) -> None:
        k = train.labels.num_classes
        if test.labels.num_classes != k:
            raise ValueError(f"train has {k} classes but test has {test.labels.num_classes}")
        self.held_out: np.ndarray | None = None
        self.train_rows = np.arange(len(train), dtype=np.int64)
        if cfg.val_fraction > 0:
            self.train_rows, val_rows = holdout_split(train.labels.observed, cfg.val_fraction,
                                                      seed=cfg.seed)
            self.held_out = np.zeros(len(train), dtype=bool)
            self.held_out[val_rows] = True
        if cfg.perf.enabled("data_on_device", device) and torch.device(device).type != "cpu":
            # in-memory splits live on the device: batches and crop/flip are made there
            train, test = train.to(device), test.to(device)
        self.cfg, self.train, self.test, self.device = cfg, train, test, device
        self.num_classes = k
        self.gen = torch.Generator().manual_seed(cfg.seed)
        data = TensorSource(train, test, batch_size=cfg.optim.batch_size,
                            generator=self.gen, held_out=self.held_out)

        method = get_method(cfg.method)
        chain = None
        if method.needs_chain:
            chains = [LocalChain(train.observed, k, generator=self.gen,
                                 check_invariants=cfg.check_invariants,
                                 held_out=self.held_out)
                      for _ in range(method.num_chains)]
            chain = chains[0] if len(chains) == 1 else ChainSet(chains)
        self.engine = Engine(cfg, session or ProcessSession(device), data, chain=chain,
                             options=EngineOptions(run_name="local",
                                                   raise_on_collapse=True,
                                                   out_dir=None if out_dir is None else str(out_dir),
                                                   sample_keys=keys, tracking=tracking,
                                                   normalize=normalize,
                                                   progress_seconds=progress_seconds))
        self.k_latent = self.engine.k_latent

    # -- the engine's state, under the names callers use ---------------------------------------

    @property
    def method(self):
        return self.engine.method

    @property
    def model(self) -> nn.Module:
        return self.engine.members[0].model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.members[0].optimizer

    @property
    def scheduler(self):
        return self.engine.members[0].scheduler

    @scheduler.setter
    def scheduler(self, value) -> None:  # e.g. a benchmark's own learning-rate schedule
        self.engine.members[0].scheduler = value

    @property
    def forward(self) -> nn.Module:
        """What the training step calls (the fast paths of ``cfg.perf`` around :attr:`model`)."""
        m = self.engine.members[0]
        return m.train_model if m.train_model is not None else self.model

    @property
    def store(self) -> ConfusionStore | None:
        """The chain's store (the first network's when each network has its own)."""
        stores = self.stores
        return stores[0] if stores else None

    @property
    def stores(self) -> list[ConfusionStore | None]:
        """Every chain's store, one per network with a chain ([] without a chain)."""
        chain = self.engine.chain
        if chain is None:
            return []
        return [c.store for c in chain.chains] if isinstance(chain, ChainSet) else [chain.store]

    @property
    def labeler(self) -> GibbsLabeler | None:
        return getattr(self.method, "labeler", None)

    @property
    def trusted(self) -> Tensor | None:
        return getattr(self.method, "trusted", None)

    @property
    def monitor(self) -> CollapseMonitor | None:
        return getattr(self.method, "monitor", None)

    @property
    def phi_init(self) -> Tensor | None:
        return getattr(self.method, "phi_init", None)

    @property
    def pretrained_probs(self) -> Tensor | None:
        """The pretrained classifier's probabilities over ``self.train`` (idx order),
        from which the noise phase started."""
        return getattr(self.method, "pretrained_probs", None)

    def health(self) -> dict[str, float]:
        """The collapse monitor's statistics of the current chain (LCCN phase only)."""
        store = self.store
        if store is None:
            return {}
        return chain_health(store.z, store.observed, self.k_latent, self.num_classes,
                            counted=store.counted, phi=store.transition(),
                            phi_init=self.phi_init)

    def fit(self, *, on_epoch: Callable[[int, dict[str, float]], None] | None = None
            ) -> list[dict[str, float]]:
        """Train every epoch; returns one row per epoch. ``on_epoch(epoch, row)`` after
        each."""
        self.engine.options = replace(self.engine.options, on_epoch=on_epoch)
        return self.engine.fit()

    def transition(self) -> Tensor | None:
        """The learned ``phi (K_latent, K)`` (rows sum to 1) of the chain, or the
        transition a baseline uses (Forward's ``T``, S-adaptation's layer, T-Revision's
        ``T_hat + ΔT``); None without either."""
        if self.store is not None:
            return self.store.transition()
        return self.method.current_transition()
