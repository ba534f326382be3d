"""The batches every data source yields (:class:`Batch`, and :class:`ViewsBatch` for
methods that train on two augmented views of each image). Imports: torch only."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ViewsBatch(NamedTuple):
    """A training batch with two augmented views of every image (DivideMix; ``views=2``):
    ``images`` and ``images2`` (B, C, H, W) are the preset's training augmentation applied
    twice to the same decoded image; the other fields as :class:`Batch`."""

    images: torch.Tensor
    images2: torch.Tensor
    observed: torch.Tensor
    idx: torch.Tensor
    clean: torch.Tensor
    valid: torch.Tensor


class Batch(NamedTuple):
    """One batch of one rank.

    images:   (B, C, H, W) float32, channels first (preset's normalisation applied).
    observed: (B,) int64 observed (noisy) label, from the label view.
    idx:      (B,) int64 sample index in [0, N) of the split.
    clean:    (B,) int64 clean label from the label view (-1 unknown, K outlier).
    valid:    (B,) bool; False marks a padding repeat of an earlier sample (skip it in
              the loss and never send it to the confusion counts).
    """

    images: torch.Tensor
    observed: torch.Tensor
    idx: torch.Tensor
    clean: torch.Tensor
    valid: torch.Tensor
