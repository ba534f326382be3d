"""Label views: the labels a run trains on, keyed by sample ``idx``, kept apart from the images.

A label view is what turns one set of shards into many experiments: synthetic noise of any
type and rate, or real annotator noise from a ``key,label`` file, all over the same shards.

Conventions (see docs/design.md):

- ``observed: (N,) int64`` in ``[0, K)``: the label the model sees (noisy / web label).
- ``clean: (N,) int64``: the true label where known, ``-1`` where unknown, ``K`` for an
  out-of-distribution sample (LCCN*'s outlier class).
- ``trusted: (N,) bool``: LCCN+ trains these on ``clean`` and never counts them in C.
- ``ood: (N,) bool``: the image of this sample is replaced at read time by a pixel-shuffled
  copy (open-set noise); its latent truth is the outlier class.
- ``transition: (K_latent, K) float64`` or None: the true noise transition
  ``T[k, j] = P(observed = j | clean = k)``; rows sum to 1 (rows with no sample are zero).
- ``split_fingerprint: str`` or None: :meth:`pipeline.data.manifest.Manifest.fingerprint` of the
  split the view was built over (``shards.labelview.build_view`` sets it). A run refuses a
  view over a split with another fingerprint: there the same idx names another image.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1


@dataclass(frozen=True)
class LabelView:
    """Per-sample labels of one split, indexed by ``idx`` in ``[0, N)``."""

    observed: np.ndarray
    clean: np.ndarray
    num_classes: int
    trusted: np.ndarray | None = None
    ood: np.ndarray | None = None
    transition: np.ndarray | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    split_fingerprint: str | None = None

    def __post_init__(self) -> None:
        n = len(self.observed)
        k = int(self.num_classes)
        if k < 2:
            raise ValueError(f"num_classes must be >= 2, got {k}")
        obs = np.asarray(self.observed, dtype=np.int64)
        clean = np.asarray(self.clean, dtype=np.int64)
        if obs.ndim != 1 or clean.shape != obs.shape:
            raise ValueError(
                f"observed and clean must both be (N,), got {obs.shape} and {clean.shape}"
            )
        bad = np.flatnonzero((obs < 0) | (obs >= k))
        if bad.size:
            raise ValueError(
                f"observed label {int(obs[bad[0]])} at idx {int(bad[0])} is outside [0, {k})"
            )
        bad = np.flatnonzero((clean < -1) | (clean > k))
        if bad.size:
            raise ValueError(
                f"clean label {int(clean[bad[0]])} at idx {int(bad[0])} is outside [-1, {k}]"
            )
        trusted = np.zeros(n, bool) if self.trusted is None else np.asarray(self.trusted, bool)
        ood = np.zeros(n, bool) if self.ood is None else np.asarray(self.ood, bool)
        for name, arr in (("trusted", trusted), ("ood", ood)):
            if arr.shape != (n,):
                raise ValueError(f"{name} must be ({n},), got {arr.shape}")
        bad = np.flatnonzero(trusted & (clean < 0))
        if bad.size:
            raise ValueError(f"idx {int(bad[0])} is trusted but has no clean label")
        object.__setattr__(self, "observed", obs)
        object.__setattr__(self, "clean", clean)
        object.__setattr__(self, "trusted", trusted)
        object.__setattr__(self, "ood", ood)
        object.__setattr__(self, "num_classes", k)
        if self.transition is not None:
            t = np.asarray(self.transition, dtype=np.float64)
            if t.ndim != 2 or t.shape[1] != k or t.shape[0] not in (k, k + 1):
                raise ValueError(f"transition must be (K or K+1, {k}), got {t.shape}")
            object.__setattr__(self, "transition", t)

    def __len__(self) -> int:
        return len(self.observed)

    @property
    def pixel_seed(self) -> int:
        """The seed of the open-set pixel shuffle of the ``ood`` samples: the spec's
        ``pixel_seed``, else its ``seed`` (0 without either)."""
        return int(self.spec.get("pixel_seed", self.spec.get("seed", 0)))

    @property
    def has_outliers(self) -> bool:
        return bool(self.ood.any() or (self.clean == self.num_classes).any())

    def noise_rate(self) -> float:
        """Fraction of samples with a known clean label whose observed label differs."""
        known = self.clean >= 0
        if not known.any():
            return float("nan")
        return float((self.observed[known] != self.clean[known]).mean())

    def take(self, rows: np.ndarray) -> "LabelView":
        """The view of the samples at ``rows`` (int64, in that order; they become idx
        ``0..len(rows)-1`` of the new view). The generating ``transition`` is kept; the
        split fingerprint is not (the subset is no longer that split)."""
        rows = np.asarray(rows, dtype=np.int64)
        return LabelView(self.observed[rows], self.clean[rows], self.num_classes,
                         trusted=self.trusted[rows], ood=self.ood[rows],
                         transition=self.transition, spec=dict(self.spec))

    def realised_transition(self, *, k_latent: int | None = None) -> np.ndarray:
        """Empirical ``T[k, j]`` from samples with a known clean label; rows sum to 1 (or 0)."""
        k = self.num_classes
        kl = k_latent or (k + 1 if self.has_outliers else k)
        known = self.clean >= 0
        counts = np.zeros((kl, k), np.float64)
        np.add.at(counts, (self.clean[known], self.observed[known]), 1.0)
        rows = counts.sum(1, keepdims=True)
        return np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0)

    # -- persistence -------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to ``path`` (an ``.npz``); a reader never sees a partial file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format_version": FORMAT_VERSION, "num_classes": self.num_classes,
                "spec": self.spec, "split_fingerprint": self.split_fingerprint}
        arrays = dict(observed=self.observed, clean=self.clean, trusted=self.trusted,
                      ood=self.ood, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
        if self.transition is not None:
            arrays["transition"] = self.transition
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide it from other users
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LabelView":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                arrays = {k: z[k] for k in z.files if k != "meta"}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            # BadZipFile, EOFError: a truncated or foreign file
            raise ValueError(f"{path}: not a readable label view ({e})") from e
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported label view version {meta.get('format_version')}")
        fingerprint = meta.get("split_fingerprint")
        if "split_fingerprint" not in meta:
            warnings.warn(f"{path}: the label view does not record the split it was built over "
                          f"(saved by an older version), so a run cannot check that its idx "
                          f"name the same images in these shards; rebuild it with "
                          f"lccn-labelview", stacklevel=2)
        return cls(observed=arrays["observed"], clean=arrays["clean"],
                   num_classes=meta["num_classes"], trusted=arrays.get("trusted"),
                   ood=arrays.get("ood"), transition=arrays.get("transition"),
                   spec=meta.get("spec", {}), split_fingerprint=fingerprint)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def holdout_split(observed: np.ndarray, fraction: float, *, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Carve a noisy validation split from a training label view.

    Stratified by observed label: ``round(fraction * n_j)`` samples of each observed class
    j, drawn with a generator seeded by ``seed`` alone (the same split for every method and
    run of one seed). Returns ``(train_rows, val_rows)``, disjoint, sorted, int64, covering
    ``0..N-1``. ``fraction`` 0 gives an empty validation split.
    """
    observed = np.asarray(observed, dtype=np.int64)
    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must lie in [0, 1), got {fraction}")
    rng = np.random.default_rng([int(seed), 0x76616C])
    val = []
    for j in np.unique(observed):
        rows = np.flatnonzero(observed == j)
        n_val = int(round(fraction * rows.size))
        if n_val:
            val.append(rng.choice(rows, n_val, replace=False))
    val_rows = np.sort(np.concatenate(val)) if val else np.zeros(0, np.int64)
    mask = np.ones(observed.size, bool)
    mask[val_rows] = False
    return np.flatnonzero(mask).astype(np.int64), val_rows.astype(np.int64)
