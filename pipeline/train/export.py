"""The trained classifier as a user takes it away: :class:`Predictor`, the run's networks
behind one module that maps images to class probabilities, logged to the run as an MLflow
pytorch model (:meth:`pipeline.track.tracking.Tracker.log_model`: a signature, the project's
code beside it) at a run's end.

Imports: :mod:`pipeline.core` and torch (MLflow only inside :mod:`pipeline.track.tracking`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn


class Predictor(nn.Module):
    """``images (B, C, H, W)`` as the run's networks take them (float, normalised; uint8 when
    the run normalised on the device, then ``normalize`` does it here) -> class
    probabilities ``(B, K)`` float32: the mean over the networks (DivideMix's two) of the
    softmax of their first K logits (LCCN*'s outlier logit left out of the class
    distribution). The networks are copies, on the CPU, in eval mode.

    ``preset``: the transform preset of the run's images (:mod:`pipeline.data.transforms`;
    None when the run did not read shards), ``class_names``: the K names (empty when
    unknown): what ``lccn-predict`` (:mod:`pipeline.track.predict`) needs to feed the model
    a user's images and name its classes. ``weights`` says which epoch's weights the
    networks hold (the run's selected epoch by default, :meth:`Engine.predictor`)."""

    def __init__(self, nets: Sequence[nn.Module], num_classes: int,
                 normalize: nn.Module | None = None, *, preset: str | None = None,
                 class_names: Sequence[str] = (), weights: str = "") -> None:
        super().__init__()
        self.nets = nn.ModuleList(copy.deepcopy(n).cpu().eval() for n in nets)
        for m in self.nets.modules():  # the training run's hooks (its divergence check) stay
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
        self.normalize = copy.deepcopy(normalize).cpu() if normalize is not None else None
        self.num_classes = int(num_classes)
        self.preset = preset
        self.class_names = tuple(str(c) for c in class_names)
        # which weights these are: "selected epoch 12 (best noisy validation accuracy
        # 0.6253)" or "final epoch 40" (the run's end); "" when not said
        self.weights = str(weights)
        if self.class_names and len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} "
                             f"classes")

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        x = self.normalize(images) if self.normalize is not None else images.float()
        probs = [torch.softmax(net(x).float()[:, :self.num_classes], 1) for net in self.nets]
        return torch.stack(probs).mean(0)


# the sidecar of an exported program: <name>.pt2 -> <name>.json (read by
# pipeline.track.predict.ExportedClassifier)
EXPORT_META = ".json"


def export_program(predictor: Predictor, example: Tensor, path: str | Path) -> Path:
    """``predictor`` as a ``torch.export`` program file (``.pt2``, any batch size), loadable
    with ``torch.export.load(path).module()`` where torch is installed, without this
    project; beside it ``<name>.json``: the transform preset, the class names, the input
    (``(C, H, W)``, uint8 or float32) and which weights the networks hold (``weights``:
    the selected epoch's or the final's). Written under a temporary name, then renamed: never
    a half-written file. ``example``: a batch as the networks take it."""
    import json
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    example = example.cpu()
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    program = torch.export.export(predictor, (example,), dynamic_shapes={"images": {0: batch}})
    partial = path.with_name(path.stem + ".partial.pt2")
    torch.export.save(program, str(partial))
    meta = {"preset": predictor.preset, "class_names": list(predictor.class_names),
            "num_classes": predictor.num_classes, "input_shape": list(example.shape[1:]),
            "input_dtype": str(example.dtype).removeprefix("torch."),
            "weights": predictor.weights, "torch": torch.__version__}
    meta_path = path.with_suffix(EXPORT_META)
    meta_partial = meta_path.with_name(meta_path.name + ".partial")
    meta_partial.write_text(json.dumps(meta, indent=1))
    os.replace(meta_partial, meta_path)
    os.replace(partial, path)
    return path
