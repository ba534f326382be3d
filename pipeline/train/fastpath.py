"""Fast paths of the training step that leave its maths unchanged: bf16 autocast,
channels-last, ``torch.compile`` with an eager fallback, cuDNN autotuning, and the
device-to-host hand-over of sampled labels without stalling the stream.

Every switch is a field of :class:`pipeline.core.config.PerfConfig`; ``"auto"`` turns it on for a
CUDA device only, so the CPU path (the one the exactness tests and CI run) is unchanged.
Nothing here imports Ray: a GPU node without the cluster packages can run it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeline.core.config import PerfConfig


def configure_backends(perf: PerfConfig, device: str | torch.device) -> None:
    """Process-wide settings: cuDNN autotuning and TF32 float32 matmuls on CUDA."""
    if str(device).startswith("cuda"):
        torch.backends.cudnn.benchmark = perf.enabled("cudnn_benchmark", device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


class Forward(nn.Module):
    """``model`` with channels-last inputs and an autocast forward (bf16 or fp16); float32
    logits.

    Parameters stay with ``model`` (optimisers and checkpoints use it directly); this
    wrapper only changes how the forward pass runs.
    """

    def __init__(self, model: nn.Module, *, amp: bool | str, channels_last: bool,
                 device_type: str, normalize: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.normalize = normalize
        # amp: False, True (bf16) or the autocast dtype's name ("bfloat16", "float16")
        self.amp = "bfloat16" if amp is True else (amp or None)
        self.channels_last, self.device_type = channels_last, device_type

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.uint8:
            if self.normalize is None:
                raise TypeError("uint8 images reached the model but no normalisation was "
                                "given (LoaderConfig.normalize_on='device' needs "
                                "wrap_model(..., normalize=build_batch_transform(preset)))")
            x = self.normalize(x)
        if self.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        if not self.amp:
            return self.model(x)
        with torch.autocast(self.device_type, dtype=getattr(torch, self.amp)):
            return self.model(x).float()


class _CompiledOrEager(nn.Module):
    """``torch.compile(module)``; if compiling fails at the first call (no compiler, an
    unsupported op), warn once and run ``module`` eagerly from then on."""

    def __init__(self, module: nn.Module, mode: str) -> None:
        super().__init__()
        self.eager = module
        self.mode = mode
        self._compiled = torch.compile(module, mode=None if mode == "default" else mode)
        self.failed: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.failed is None:
            try:
                return self._compiled(x)
            except Exception as exc:  # the compiler stack raises many types
                self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                warnings.warn(f"torch.compile(mode={self.mode!r}) failed, running eagerly: "
                              f"{self.failed}", RuntimeWarning, stacklevel=2)
        return self.eager(x)


def amp_dtype(perf: PerfConfig, device: str | torch.device) -> str | None:
    """The autocast dtype's name on ``device`` (:meth:`PerfConfig.amp_dtype`, asking CUDA
    whether it has bf16), or None."""
    dev = torch.device(device)
    bf16 = dev.type != "cuda" or torch.cuda.is_bf16_supported()
    return perf.amp_dtype(dev, bf16_supported=bf16)


def grad_scaler(perf: PerfConfig, device: str | torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for one network when its forward pass autocasts to float16."""
    if amp_dtype(perf, device) != "float16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def wrap_model(model: nn.Module, perf: PerfConfig, device: str | torch.device, *,
               normalize: nn.Module | None = None) -> nn.Module:
    """The module the training step calls: ``model`` (already on ``device``) with the fast
    paths ``perf`` enables for ``device``. Channels-last also converts the parameters.
    ``normalize``: applied on the device to uint8 batches (``LoaderConfig.normalize_on``)."""
    dev = torch.device(device)
    amp = amp_dtype(perf, dev)
    cl = perf.enabled("channels_last", dev)
    if cl:
        model.to(memory_format=torch.channels_last)
    if normalize is not None:
        normalize = normalize.to(dev)
    fwd: nn.Module = Forward(model, amp=amp, channels_last=cl, device_type=dev.type,
                             normalize=normalize)
    if perf.compile != "off":
        if not hasattr(torch, "compile"):
            warnings.warn("torch.compile is not available in this torch; running eagerly",
                          RuntimeWarning, stacklevel=2)
        else:
            fwd = _CompiledOrEager(fwd, perf.compile)
    return fwd


class HostStage:
    """Hands a device tensor to the host without blocking the stream that made it.

    :meth:`put` enqueues a copy into a reused pinned buffer and records an event; :meth:`get`
    waits for that event only (not for work enqueued after it) and returns a host copy.
    Host tensors pass through untouched.
    """

    def __init__(self) -> None:
        self._buf: Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._out: Tensor | None = None

    def put(self, t: Tensor) -> None:
        if t.device.type == "cpu":
            self._out, self._event = t, None
            return
        n = t.numel()
        if self._buf is None or self._buf.numel() < n or self._buf.dtype != t.dtype:
            self._buf = torch.empty(max(n, 1024), dtype=t.dtype, pin_memory=True)
        out = self._buf[:n].view(t.shape)
        out.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(t.device))
        self._out = out

    def get(self) -> Tensor:
        if self._out is None:
            raise RuntimeError("HostStage.get() before put()")
        if self._event is None:
            return self._out
        self._event.synchronize()
        return self._out.clone()  # the pinned buffer is reused by the next put()


def to_device(tensors: Sequence[Tensor], device: str | torch.device) -> list[Tensor]:
    """Host integer/bool tensors of one length ``(B,)`` on ``device`` with ONE copy (packed
    into a pinned ``(R, B)`` int64 buffer); returned with their dtypes. A no-op on the CPU."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return list(tensors)
    packed = torch.stack([t.to(torch.int64) for t in tensors]).pin_memory()
    on_dev = packed.to(dev, non_blocking=True)
    return [row.to(t.dtype) for row, t in zip(on_dev, tensors)]
