"""Backbone factory: a small dict of builders, one per classifier the experiments use.

Every model maps images ``x: (N, C, H, W) float`` to logits ``(N, num_classes) float``
(no softmax). ``num_classes`` is the number of *latent* classes the sampler draws from:
``K`` for LCCN and LCCN+, ``K + 1`` for LCCN* (the last logit is the outlier class).

name                 what                                          input           params*
-------------------  --------------------------------------------  --------------  -------
small_cnn            3 conv-BN-ReLU blocks (32/64/128), for CPU    any >= 8x8      0.09M
preact_resnet32      He et al. 2016 pre-activation ResNet-32       CIFAR 32x32     0.46M
preact_resnet18      DivideMix's pre-activation ResNet-18          CIFAR 32x32     11.2M
resnet50             torchvision ResNet-50 (Clothing1M)            224x224         23.5M
inception_resnet_v2  timm Inception-ResNet-v2 (WebVision)          299 (>= 75)     54.3M

(*) with 10 classes; the ResNets and small_cnn end in global average pooling, so they take
other sizes too. Weights are initialised from torch's global RNG, as torch modules always
are; pass ``seed=`` to ``build_model`` for a reproducible initialisation that leaves the
global RNG state as it was.
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.core.config import check_bn_momentum

__all__ = [
    "MODELS",
    "PreActBlock",
    "PreActResNet",
    "SmallCNN",
    "available_models",
    "build_model",
    "count_parameters",
    "preact_resnet18",
    "preact_resnet32",
    "resnet50",
    "inception_resnet_v2",
    "set_bn_momentum",
    "small_cnn",
    "cnn_wide",
]


# --------------------------------------------------------------------------- small_cnn


def _conv_bn_relu(cin: int, cout: int, *, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU blocks (widths 32/64/128) for fast CPU runs.

    The first conv has stride 2 and the first two blocks end in a 2x2 max-pool, so a
    32x32 CIFAR image is 16 -> 8 -> 4 px at the three blocks (8x8 digits: 4 -> 2 -> 1);
    adaptive average pooling then makes the head independent of the input size.

    It is a stand-in for smoke runs and tests, not a model for large images: an input
    larger than 64 px on its short side is first average-pooled by the integer factor
    ``short // 32`` (224 px -> 32, 299 px -> 33), so a WebVision- or Clothing1M-shaped
    smoke run costs about what a CIFAR one does instead of ~90x more.

    x: (N, in_channels, H, W) float, H, W >= 8  ->  logits (N, num_classes).
    """

    def __init__(
        self, num_classes: int, *, in_channels: int = 3, widths: tuple[int, int, int] = (32, 64, 128)
    ) -> None:
        super().__init__()
        w1, w2, w3 = widths
        self.features = nn.Sequential(
            *_conv_bn_relu(in_channels, w1, stride=2),
            nn.MaxPool2d(2),
            *_conv_bn_relu(w1, w2),
            nn.MaxPool2d(2),
            *_conv_bn_relu(w2, w3),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] < 8 or x.shape[-2] < 8:
            raise ValueError(f"small_cnn needs inputs of at least 8x8, got {tuple(x.shape)}")
        short = min(x.shape[-2], x.shape[-1])
        if short > 64:
            x = F.avg_pool2d(x, short // 32)
        return self.fc(self.features(x))


# --------------------------------------------------------------------- pre-act ResNets


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016, "Identity Mappings"):

    ``out = conv2(relu(bn2(conv1(relu(bn1(x)))))) + shortcut``

    ``shortcut`` is selected by ``shortcut``:

    - ``"zero_pad"`` (CIFAR option A): ``x`` itself, or where shape changes, ``x``
      average-pooled by ``stride`` and zero-padded to ``cout`` channels; no parameters.
    - ``"conv"`` (option B, as DivideMix's ``PreResNet.py``): a 1x1 strided conv of
      ``relu(bn1(x))`` where the shape changes, else ``relu(bn1(x))`` itself (DivideMix's
      empty ``nn.Sequential`` shortcut applied to the pre-activation, not to ``x``).

    x: (N, cin, H, W) -> (N, cout, H / stride, W / stride).
    """

    def __init__(self, cin: int, cout: int, *, stride: int = 1, shortcut: str = "conv") -> None:
        super().__init__()
        if shortcut not in ("conv", "zero_pad"):
            raise ValueError(f"shortcut must be 'conv' or 'zero_pad', got {shortcut!r}")
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.stride, self.shortcut = stride, shortcut
        self.pad_channels = 0
        self.proj: nn.Module | None = None
        if stride != 1 or cin != cout:
            if shortcut == "conv":
                self.proj = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
            else:
                if cout < cin:
                    raise ValueError(f"zero_pad shortcut cannot shrink channels {cin} -> {cout}")
                self.pad_channels = cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        if self.proj is not None:
            shortcut = self.proj(pre)
        elif self.stride != 1 or self.pad_channels:
            shortcut = F.avg_pool2d(x, self.stride) if self.stride != 1 else x
            lo = self.pad_channels // 2
            shortcut = F.pad(shortcut, (0, 0, 0, 0, lo, self.pad_channels - lo))
        else:  # the identity: of x (option A, He et al.), of relu(bn1(x)) (DivideMix)
            shortcut = pre if self.shortcut == "conv" else x
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + shortcut


class PreActResNet(nn.Module):
    """Pre-activation ResNet with a CIFAR stem (one 3x3 conv, stride 1, no max-pool).

    ``widths[i]`` channels and ``depths[i]`` blocks in stage ``i``; stage ``i > 0``
    halves the resolution. With ``stem_bn_relu`` the stem conv is followed by BN-ReLU
    (DivideMix), with ``final_bn_relu`` the last block by BN-ReLU (He et al. 2016). The head
    is global average pooling and one linear layer.

    x: (N, in_channels, H, W) float -> logits (N, num_classes).
    """

    def __init__(
        self,
        num_classes: int,
        *,
        in_channels: int = 3,
        widths: tuple[int, ...],
        depths: tuple[int, ...],
        shortcut: str,
        stem_bn_relu: bool,
        final_bn_relu: bool,
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.stem_act = (
            nn.Sequential(nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
            if stem_bn_relu
            else nn.Identity()
        )
        stages = []
        cin = widths[0]
        for i, (w, d) in enumerate(zip(widths, depths)):
            blocks = [
                PreActBlock(cin if b == 0 else w, w, stride=2 if (i > 0 and b == 0) else 1,
                            shortcut=shortcut)
                for b in range(d)
            ]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.final_act = (
            nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True))
            if final_bn_relu
            else nn.Identity()
        )
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stem_act(self.stem(x))
        out = self.final_act(self.stages(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def _kaiming_init(model: nn.Module) -> None:
    """He-normal convs (fan_out), BN weight 1 / bias 0: the initialisation of He et al."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# ------------------------------------------------------------------------- builders


def _no_pretrained(name: str, pretrained: bool) -> None:
    if pretrained:
        raise ValueError(f"{name} has no pretrained weights; build it with pretrained=False")


def small_cnn(num_classes: int, *, in_channels: int = 3, pretrained: bool = False) -> nn.Module:
    """Small CPU CNN (see :class:`SmallCNN`); ~0.09M parameters."""
    _no_pretrained("small_cnn", pretrained)
    return SmallCNN(num_classes, in_channels=in_channels)


def cnn_wide(num_classes: int, *, in_channels: int = 3, pretrained: bool = False) -> nn.Module:
    """:class:`SmallCNN` with widths 64/128/256 (~0.37M parameters): the CPU benchmarks'
    model, strong enough to show a noise model on CIFAR-10 (about 4x small_cnn's step)."""
    _no_pretrained("cnn_wide", pretrained)
    return SmallCNN(num_classes, in_channels=in_channels, widths=(64, 128, 256))


def preact_resnet32(
    num_classes: int, *, in_channels: int = 3, pretrained: bool = False
) -> nn.Module:
    """The paper's CIFAR classifier: pre-activation ResNet-32 (He et al. 2016).

    3 stages x 5 basic pre-act blocks, widths 16/32/64, parameter-free (zero-pad) shortcuts
    as in the original CIFAR ResNets, BN-ReLU before the pooled head; 0.46M parameters
    with 10 classes.
    """
    _no_pretrained("preact_resnet32", pretrained)
    model = PreActResNet(
        num_classes,
        in_channels=in_channels,
        widths=(16, 32, 64),
        depths=(5, 5, 5),
        shortcut="zero_pad",
        stem_bn_relu=False,
        final_bn_relu=True,
    )
    _kaiming_init(model)
    return model


def preact_resnet18(
    num_classes: int, *, in_channels: int = 3, pretrained: bool = False
) -> nn.Module:
    """DivideMix's PreAct ResNet-18 for CIFAR (``PreResNet.py``): 3x3 stem with BN-ReLU,
    4 stages x 2 pre-act blocks, widths 64/128/256/512, 1x1 conv projection shortcuts, no
    BN-ReLU before the head, PyTorch default initialisation; 11.2M parameters with 10
    classes."""
    _no_pretrained("preact_resnet18", pretrained)
    return PreActResNet(
        num_classes,
        in_channels=in_channels,
        widths=(64, 128, 256, 512),
        depths=(2, 2, 2, 2),
        shortcut="conv",
        stem_bn_relu=True,
        final_bn_relu=False,
    )


def _torch_hub_checkpoint(url: str) -> Path:
    """Where ``torch.hub.load_state_dict_from_url`` caches ``url``:
    ``$TORCH_HOME/hub/checkpoints/<file name>`` (default ``~/.cache/torch``)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def resnet50(num_classes: int, *, in_channels: int = 3, pretrained: bool = False) -> nn.Module:
    """torchvision's ResNet-50 with a fresh ``num_classes`` head (Clothing1M).

    ``pretrained=True`` loads torchvision's ``ResNet50_Weights.IMAGENET1K_V1`` (the
    classic ImageNet weights, 76.1% top-1, what ``pretrained=True`` meant in torchvision
    before 0.13) through torchvision's own loader, but only if the file is already in the
    torch hub cache; it never downloads. Everything except ``fc`` comes from the weights.
    Raises FileNotFoundError naming the expected path when the file is missing.
    """
    from torchvision.models import ResNet50_Weights
    from torchvision.models import resnet50 as tv_resnet50

    if not pretrained:
        model = tv_resnet50(weights=None, num_classes=num_classes)
    else:
        if in_channels != 3:
            raise ValueError(
                f"resnet50 ImageNet weights take 3 input channels, got in_channels={in_channels}"
            )
        weights = ResNet50_Weights.IMAGENET1K_V1
        path = _torch_hub_checkpoint(weights.url)
        if not path.is_file():
            raise FileNotFoundError(
                f"resnet50 pretrained=True needs torchvision's ImageNet weights in the local "
                f"torch hub cache, but {path} does not exist, and this factory does not "
                f"download at run time. On a machine with internet run `python -m "
                f"pipeline.train.models fetch resnet50` (or fetch {weights.url}) and copy the "
                f"file to {path} (set TORCH_HOME to move the cache; infra/Dockerfile and "
                f"infra/ray-cluster.yaml put it there)."
            )
        model = tv_resnet50(weights=weights)  # finds the cached file; no network access
        model.fc = nn.Linear(model.fc.in_features, num_classes)
    if in_channels != 3:
        old = model.conv1
        model.conv1 = nn.Conv2d(
            in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False
        )
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def inception_resnet_v2(
    num_classes: int, *, in_channels: int = 3, pretrained: bool = False
) -> nn.Module:
    """timm's Inception-ResNet-v2 (WebVision), randomly initialised. Native input is
    299x299; anything from 75x75 up works. Needs the ``timm`` package (imported here only).
    """
    _no_pretrained("inception_resnet_v2", pretrained)
    try:
        import timm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "inception_resnet_v2 needs the `timm` package: pip install timm"
        ) from e
    return timm.create_model(
        "inception_resnet_v2", pretrained=False, num_classes=num_classes, in_chans=in_channels
    )


Builder = Callable[..., nn.Module]
"""``builder(num_classes, *, in_channels, pretrained) -> nn.Module`` (arguments checked)."""

MODELS: dict[str, Builder] = {
    "small_cnn": small_cnn,
    "cnn_wide": cnn_wide,
    "preact_resnet32": preact_resnet32,
    "preact_resnet18": preact_resnet18,
    "resnet50": resnet50,
    "inception_resnet_v2": inception_resnet_v2,
}


def available_models() -> list[str]:
    """The registered names :func:`build_model` accepts, sorted (besides them: any timm
    model, ``timm:<name>``, and any torchvision classification model, ``tv:<name>``)."""
    return sorted(MODELS)


def resolve_name(name: str) -> tuple[str, str]:
    """``(family, model)`` of a backbone name: ``("ours", name)`` for a registered one (the
    papers' CIFAR nets, ``resnet50``, ``inception_resnet_v2``), ``("timm", m)`` for
    ``timm:m`` or a bare name timm knows (``convnext_tiny``), ``("tv", m)`` for ``tv:m`` (a
    torchvision classification model). ValueError names the three forms otherwise."""
    if name in MODELS:
        return "ours", name
    family, sep, model = name.partition(":")
    if sep and family in ("timm", "tv") and model:
        return family, model
    try:
        import timm
    except ImportError:  # pragma: no cover - depends on the environment
        timm = None
    if not sep and timm is not None and timm.is_model(name):
        return "timm", name
    raise ValueError(f"unknown model {name!r}; available models: {', '.join(available_models())}"
                     f", any timm model (timm:NAME, e.g. timm:convnext_tiny) or torchvision "
                     f"model (tv:NAME, e.g. tv:resnet18)")


def _missing_weights(name: str, detail: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{name} pretrained=True: {detail}. This factory never downloads at run time: on a "
        f"machine with the network run `python -m pipeline.train.models fetch {name} --out DIR` "
        f"and pass the file it writes as weights= (the jobs' --weights FILE), on storage every "
        f"node reads")


def _timm_model(name: str, num_classes: int, in_channels: int, pretrained: bool,
                weights: str | None) -> nn.Module:
    """timm's ``name`` with a ``num_classes`` head; pretrained from the file ``weights``
    (timm's ``pretrained_cfg_overlay=dict(file=...)``: a .safetensors or .pth of the model,
    its head replaced) or, without one, from timm's local cache only (the Hugging Face hub
    cache, offline)."""
    import timm

    if not timm.is_model(name):
        raise ValueError(f"timm has no model {name!r} (timm.list_models('*{name[:6]}*') lists "
                         f"the near names)")
    kwargs: dict = {"num_classes": num_classes, "in_chans": in_channels}
    if not pretrained:
        if weights is not None:
            raise ValueError(f"{name}: weights={weights!r} given without pretrained=True")
        return timm.create_model(name, pretrained=False, **kwargs)
    if weights is not None:
        if not Path(weights).is_file():
            raise _missing_weights(f"timm:{name}", f"the weights file {weights} does not exist")
        return timm.create_model(name, pretrained=True,
                                 pretrained_cfg_overlay={"file": str(weights)}, **kwargs)
    cached = _timm_cached_file(name)
    if cached is None:
        raise _missing_weights(f"timm:{name}", "its weights are not in the local Hugging Face "
                               "cache ($HF_HOME/hub)")
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay={"file": cached},
                             **kwargs)


def pretrained_weights_problem(name: str, weights: str | None) -> str | None:
    """Why :func:`build_model` ``(name, pretrained=True, weights=weights)`` would fail for
    want of weights, checked without building anything (a job's driver, before Ray starts
    and before any data is converted); None when the weights are there (a file, timm's local
    Hugging Face cache, the torch hub cache for ``resnet50``) or on remote storage (read by
    the workers). The line names ``--no-pretrained`` and the fetch command."""
    try:
        family, model = resolve_name(name)
    except ValueError as e:
        return str(e)
    fetch = f"`python -m pipeline.train.models fetch {name} --out DIR`"
    scratch = "or train from scratch with --no-pretrained"
    if weights is not None:
        if "://" in str(weights) or Path(weights).is_file():
            return None
        return (f"--weights {weights}: no such file (write it once, on a machine with the "
                f"network, with {fetch}), {scratch}")
    if family == "ours":
        if model != "resnet50":
            return f"--model {name} has no pretrained weights: add --no-pretrained"
        from torchvision.models import ResNet50_Weights

        path = _torch_hub_checkpoint(ResNet50_Weights.IMAGENET1K_V1.url)
        if path.is_file():
            return None
        return (f"--model resnet50 with ImageNet weights (--pretrained) reads them from the "
                f"torch hub cache, but {path} does not exist: put them there once with "
                f"`python -m pipeline.train.models fetch resnet50` (on a machine with the "
                f"network; TORCH_HOME moves the cache), {scratch}")
    if family == "timm" and _timm_cached_file(model) is not None:
        return None
    safe = model.replace("/", "_")
    where = ("timm's local Hugging Face cache ($HF_HOME/hub) does not hold them either"
             if family == "timm" else "a torchvision backbone reads them from a file only")
    return (f"--model {name} with ImageNet weights (--pretrained) needs --weights FILE, and "
            f"{where}: write the file once, on a machine with the network, with {fetch} "
            f"(it writes DIR/{family}-{safe}.pth) and pass --weights DIR/{family}-{safe}.pth, "
            f"{scratch}")


def _timm_cached_file(name: str) -> str | None:
    """The file of timm model ``name``'s default pretrained weights in the local Hugging
    Face cache (``huggingface_hub.try_to_load_from_cache``: no network), or None."""
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    repo = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
    if not repo:
        return None
    from huggingface_hub import try_to_load_from_cache

    for filename in ("model.safetensors", "pytorch_model.bin"):
        got = try_to_load_from_cache(repo, filename)
        if isinstance(got, str):
            return got
    return None


def _replace_head(model: nn.Module, num_classes: int) -> None:
    """A fresh ``num_classes``-way last linear layer for a torchvision classifier."""
    for attr in ("fc", "classifier", "head", "heads"):
        head = getattr(model, attr, None)
        if isinstance(head, nn.Linear):
            setattr(model, attr, nn.Linear(head.in_features, num_classes))
            return
        if isinstance(head, nn.Sequential) and any(isinstance(m, nn.Linear) for m in head):
            i = max(i for i, m in enumerate(head) if isinstance(m, nn.Linear))
            head[i] = nn.Linear(head[i].in_features, num_classes)
            return
    raise ValueError(f"{type(model).__name__}: no linear head (fc, classifier, head) to replace")


def _tv_model(name: str, num_classes: int, in_channels: int, pretrained: bool,
              weights: str | None) -> nn.Module:
    """torchvision's ``name``; pretrained from the state dict file ``weights`` (the
    ImageNet head dropped) and a fresh ``num_classes`` head."""
    import torchvision

    if name not in torchvision.models.list_models(module=torchvision.models):
        raise ValueError(f"torchvision has no classification model {name!r}")
    if in_channels != 3:
        raise ValueError(f"tv:{name} takes 3 input channels, got in_channels={in_channels}")
    if not pretrained:
        if weights is not None:
            raise ValueError(f"tv:{name}: weights={weights!r} given without pretrained=True")
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if weights is None or not Path(weights).is_file():
        raise _missing_weights(f"tv:{name}", "a torchvision backbone needs its weights as a "
                               f"file (weights=); {weights or 'none'} was given")
    model = torchvision.models.get_model(name, weights=None)
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
    _replace_head(model, num_classes)
    return model


def _as_int(name: str, value: object, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def build_model(
    name: str,
    num_classes: int,
    *,
    in_channels: int = 3,
    pretrained: bool = False,
    seed: int | None = None,
    bn_momentum: float | None = None,
    weights: str | None = None,
) -> nn.Module:
    """Build backbone ``name`` with a ``num_classes``-way linear head.

    Returns a module mapping ``x: (N, in_channels, H, W) float`` to logits
    ``(N, num_classes)``. For LCCN* pass ``num_classes = K + 1``; the last logit is the
    outlier class.

    ``name``: a registered backbone (:func:`available_models`), any timm model
    (``timm:convnext_tiny``, or the bare name) or torchvision model (``tv:resnet18``):
    :func:`resolve_name`. ``pretrained`` loads ImageNet weights where the model has them,
    never from the network: the registered ``resnet50`` from the local torch hub cache (see
    :func:`resnet50`), a timm model from the file ``weights`` or timm's local cache, a
    torchvision model from the file ``weights``; a missing file is a FileNotFoundError that
    names it and the command that fetches it. The registered CIFAR nets have none
    (ValueError).
    ``seed``, if given, makes the random initialisation reproducible: the model is built
    under ``torch.random.fork_rng`` seeded with it, so the caller's global RNG state is
    left untouched. Without it the global RNG is used, as by any torch module.

    ``bn_momentum`` sets the momentum of every batch-norm layer's running statistics
    (:func:`set_bn_momentum`; None keeps PyTorch's 0.1).

    Raises ValueError for an unknown name (listing the available ones), ``num_classes < 2``,
    ``in_channels < 1`` or a ``bn_momentum`` outside (0, 1].
    """
    family, model_name = resolve_name(name)
    num_classes = _as_int("num_classes", num_classes, 2)
    in_channels = _as_int("in_channels", in_channels, 1)
    if family == "ours":
        if weights is not None:
            raise ValueError(f"{name}: weights= is for timm and torchvision backbones; "
                             f"{name} reads its own (see build_model)")

        def builder() -> nn.Module:
            return MODELS[model_name](num_classes, in_channels=in_channels,
                                      pretrained=bool(pretrained))
    else:
        make = _timm_model if family == "timm" else _tv_model

        def builder() -> nn.Module:
            return make(model_name, num_classes, in_channels, bool(pretrained), weights)
    if seed is None:
        model = builder()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = builder()
    if bn_momentum is not None:
        set_bn_momentum(model, bn_momentum)
    return model


def set_bn_momentum(model: nn.Module, momentum: float) -> int:
    """Set the running-statistics momentum of every batch-norm layer of ``model``:
    ``running = (1 - momentum) * running + momentum * batch`` (PyTorch's convention;
    TensorFlow's ``decay`` is ``1 - momentum``). Returns how many layers were set; a model
    without batch norm raises ValueError, since the option would then do nothing."""
    m = check_bn_momentum(momentum)
    layers = [mod for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    if not layers:
        raise ValueError(f"bn_momentum {momentum}: {type(model).__name__} has no batch-norm "
                         f"layer to set it on")
    for mod in layers:
        mod.momentum = m
    return len(layers)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of scalar parameters of ``model`` (all, or only ``requires_grad`` ones).
    Buffers (BN running stats) are not parameters and are not counted."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def fetch_resnet50() -> Path:
    """Put torchvision's ``ResNet50_Weights.IMAGENET1K_V1`` (``resnet50``'s pretrained
    weights: the clothing1m and own-images presets) in the torch hub cache
    (``$TORCH_HOME/hub/checkpoints``), where :func:`resnet50` reads them without the
    network; a file already there is kept. Returns its path."""
    from torchvision.models import ResNet50_Weights

    url = ResNet50_Weights.IMAGENET1K_V1.url
    path = _torch_hub_checkpoint(url)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.hub.download_url_to_file(url, str(partial), progress=True)
        os.replace(partial, path)
    return path


def fetch_weights(name: str, out_dir: str | os.PathLike | None) -> Path:
    """Download the ImageNet weights of backbone ``name`` (a timm or torchvision name, as
    :func:`build_model` takes it) into ``out_dir`` as one file, and return its path: what
    ``weights=`` (the jobs' ``--weights``) reads on machines without the network. The
    registry's ``resnet50`` goes to the torch hub cache instead (:func:`fetch_resnet50`;
    ``out_dir`` is not used: set ``TORCH_HOME`` to choose the cache)."""
    family, model_name = resolve_name(name)
    if family != "timm" and family != "tv" and model_name == "resnet50":
        return fetch_resnet50()
    if out_dir is None:
        raise ValueError(f"{name}: give the folder for its weights file (--out DIR)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    safe = model_name.replace("/", "_")
    if family == "timm":
        import timm

        model = timm.create_model(model_name, pretrained=True)
    elif family == "tv":
        import torchvision

        model = torchvision.models.get_model(model_name, weights="DEFAULT")
    else:
        raise ValueError(f"{name}: fetch is for timm and torchvision backbones and "
                         f"resnet50; {model_name} has no pretrained weights")
    path = out / f"{family}-{safe}.pth"
    partial = path.with_suffix(".pth.partial")
    torch.save(model.state_dict(), partial)
    os.replace(partial, path)   # never a half-written file under the final name
    return path


def get_args_parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.train.models",
                                description="backbones: fetch pretrained weights into a folder")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download a timm or torchvision model's weights to a file")
    f.add_argument("name", help="timm:NAME, a bare timm name, or tv:NAME; resnet50 (the "
                                "presets' backbone) fills the torch hub cache ($TORCH_HOME)")
    f.add_argument("--out", default=None, help="folder for the weights file (timm and tv)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    try:
        path = fetch_weights(args.name, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out is not None and not path.is_relative_to(Path(args.out).resolve()):
        print(f"note: {args.name} reads the torch hub cache, not --out: set TORCH_HOME to "
              f"choose it", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
