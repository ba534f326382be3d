"""scikit-learn's handwritten digits (1,797 8x8 images shipped inside the package) as an
embedded dataset: a stratified train/test split and a label view with injected noise."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.core.labels import LabelView

DIGIT_CLASSES = [str(i) for i in range(10)]


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """images: (1797, 8, 8) uint8 in [0, 16]; labels: (1797,) int64."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


def split_indices(labels: np.ndarray, *, test_fraction: float, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split; returns sorted train and test row indices."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(len(rows) * test_fraction))
        test.append(rows[:n_test])
        train.append(rows[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, 8, 8) uint8 in [0, 16] -> (N, 1, 8, 8) float standardised to mean 0, std 1."""
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    return (x - 0.3) / 0.37


def clean_view(labels: np.ndarray) -> LabelView:
    return LabelView(observed=labels, clean=labels, num_classes=10, spec={"kind": "clean"})
