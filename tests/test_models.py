"""Backbone factory: shapes, sizes, gradients, pretrained loading and argument checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.train.models import MODELS, available_models, build_model, count_parameters

# (name, input (C, H, W), num_classes): the smallest inputs each model is meant for
CASES = [
    ("small_cnn", (3, 32, 32), 10),
    ("cnn_wide", (3, 32, 32), 10),
    ("preact_resnet32", (3, 32, 32), 11),  # LCCN*: K + 1
    ("preact_resnet18", (3, 32, 32), 100),
    ("resnet50", (3, 64, 64), 14),
    ("inception_resnet_v2", (3, 75, 75), 7),
]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_every_model_is_covered():
    assert sorted(name for name, _, _ in CASES) == available_models() == sorted(MODELS)


@pytest.mark.parametrize(("name", "chw", "k"), CASES)
def test_forward_shape(name, chw, k, gen):
    model = build_model(name, k, seed=0).eval()
    x = torch.randn(2, *chw, generator=gen)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (2, k)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # the two samples differ, so the logits must too (catches a head fed a constant)
    assert not torch.allclose(logits[0], logits[1])


@pytest.mark.parametrize(
    ("name", "lo", "hi"),
    [("preact_resnet32", 0.45e6, 0.48e6), ("preact_resnet18", 11.0e6, 11.3e6)],
)
def test_parameter_counts(name, lo, hi):
    n = count_parameters(build_model(name, 10))
    assert lo <= n <= hi, f"{name}: {n} parameters"


def test_exact_parameter_counts():
    # ResNet-32 of He et al. (zero-pad shortcuts) and DivideMix's PreResNet18, 10 classes
    assert count_parameters(build_model("preact_resnet32", 10)) == 464_154
    assert count_parameters(build_model("preact_resnet18", 10)) == 11_171_274
    # resnet50: torchvision's 25,557,032 with its 1000-way head swapped for a 14-way one
    assert count_parameters(build_model("resnet50", 14)) == 25_557_032 - 2049 * 1000 + 2049 * 14


def test_count_parameters_trainable_only():
    model = build_model("small_cnn", 10)
    total = count_parameters(model)
    for p in model.fc.parameters():
        p.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == total - (128 * 10 + 10)
    assert count_parameters(model) == total


def test_head_width_tracks_num_classes():
    a = count_parameters(build_model("preact_resnet32", 10))
    b = count_parameters(build_model("preact_resnet32", 11))
    assert b - a == 64 + 1  # one more row of the 64 -> K linear head


def test_small_cnn_digits_input(gen):
    model = build_model("small_cnn", 10, in_channels=1, seed=0).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, 8, 8, generator=gen))
    assert out.shape == (2, 10)
    with pytest.raises(ValueError, match="8x8"):
        model(torch.randn(2, 1, 7, 7, generator=gen))


def test_small_cnn_pools_large_inputs_to_about_32_px_first(gen):
    """A 299 px (WebVision-shaped) input is the 9x9-average-pooled 33 px image to the
    convolutions; 64 px and below go in as they are."""
    from torch.nn import functional as F

    model = build_model("small_cnn", 5, seed=0).eval()
    x = torch.randn(2, 3, 299, 299, generator=gen)
    small = torch.randn(2, 3, 64, 64, generator=gen)
    with torch.no_grad():
        assert torch.equal(model(x), model.fc(model.features(F.avg_pool2d(x, 9))))
        assert torch.equal(model(small), model.fc(model.features(small)))


@pytest.mark.parametrize("name", ["preact_resnet32", "resnet50"])
def test_other_in_channels(name, gen):
    model = build_model(name, 5, in_channels=1, seed=0).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 1, 32, 32, generator=gen)).shape == (1, 5)


def test_small_cnn_backward_reaches_every_parameter_and_learns(gen):
    model = build_model("small_cnn", 3, seed=0).train()
    x = torch.randn(16, 3, 16, 16, generator=gen)
    y = torch.randint(0, 3, (16,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if len(losses) == 1:
            for pname, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, pname
        opt.step()
    # one fixed batch must be memorised
    assert losses[-1] < 0.5 * losses[0]


def test_seed_makes_init_reproducible_without_touching_global_rng():
    state = torch.random.get_rng_state()
    a = build_model("preact_resnet32", 10, seed=3)
    b = build_model("preact_resnet32", 10, seed=3)
    c = build_model("preact_resnet32", 10, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[key], sb[key]) for key in sa)
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(name="resnet_9000", num_classes=10), "unknown model 'resnet_9000'.*small_cnn"),
        (dict(name="small_cnn", num_classes=1), "num_classes must be >= 2, got 1"),
        (dict(name="small_cnn", num_classes=0), "num_classes must be >= 2, got 0"),
        (dict(name="small_cnn", num_classes=2.5), "num_classes .* got 2.5"),
        (dict(name="small_cnn", num_classes=True), "num_classes .* got True"),
        (dict(name="small_cnn", num_classes=10, in_channels=0), "in_channels must be >= 1, got 0"),
        (dict(name="preact_resnet18", num_classes=10, pretrained=True), "no pretrained"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model(**kwargs)


def test_unknown_name_lists_every_model():
    with pytest.raises(ValueError) as info:
        build_model("nope", 10)
    for name in available_models():
        assert name in str(info.value)


def test_resnet50_pretrained_missing_cache_file_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        build_model("resnet50", 14, pretrained=True)
    msg = str(info.value)
    assert str(tmp_path / "hub" / "checkpoints" / "resnet50-0676ba61.pth") in msg
    assert "does not download" in msg


def test_resnet50_pretrained_loads_cached_weights(tmp_path, monkeypatch):
    """A state dict placed where torch hub caches the ImageNet weights is loaded by
    torchvision's own loader (no network), and only the head is replaced."""
    from torchvision.models import resnet50

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)  # a reference "ImageNet" model, not the one build_model draws
        reference = resnet50(weights=None)  # 1000 classes, like the real file
    ckpt = tmp_path / "hub" / "checkpoints" / "resnet50-0676ba61.pth"
    ckpt.parent.mkdir(parents=True)
    torch.save({k: v.half() for k, v in reference.state_dict().items()}, ckpt)  # 50 MB

    model = build_model("resnet50", 14, pretrained=True, seed=0)
    got, ref = model.state_dict(), reference.state_dict()
    assert model.fc.out_features == 14
    assert set(got) == set(ref)
    for key, value in ref.items():
        if key.startswith("fc.") or not value.is_floating_point():
            continue
        assert torch.equal(got[key], value.half().float()), key
    assert not torch.equal(got["fc.weight"][:14], ref["fc.weight"][:14].half().float())
    with pytest.raises(ValueError, match="in_channels=1"):
        build_model("resnet50", 14, in_channels=1, pretrained=True)


def test_preact_blocks_follow_their_references(gen):
    """preact_resnet18 is DivideMix's PreResNet.py: the identity shortcut carries
    relu(bn1(x)); preact_resnet32 (He et al. 2016, option A) carries x itself."""
    import torch.nn.functional as F

    from pipeline.train.models import PreActBlock

    x = torch.randn(2, 16, 8, 8, generator=gen)
    for shortcut in ("conv", "zero_pad"):
        block = PreActBlock(16, 16, shortcut=shortcut).eval()
        with torch.no_grad():
            for bn in (block.bn1, block.bn2):  # non-trivial statistics
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2)
            pre = F.relu(block.bn1(x))
            body = block.conv2(F.relu(block.bn2(block.conv1(pre))))
            want = body + (pre if shortcut == "conv" else x)
            assert torch.allclose(block(x), want, atol=1e-6), shortcut
    net = build_model("preact_resnet18", 10)
    assert all(b.shortcut == "conv" for b in net.modules() if isinstance(b, PreActBlock))


def test_bn_momentum_sets_the_running_statistics_update_of_every_batch_norm_layer():
    """build_model(bn_momentum=m): every BN layer's running mean moves by m of the way to
    the batch mean in one training forward (PyTorch's convention); None keeps 0.1; a value
    outside (0, 1] or a model without batch norm is an error naming the value."""
    from pipeline.train.models import set_bn_momentum

    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 3 + 2
    for m, want in ((None, 0.1), (0.003, 0.003), (1.0, 1.0)):
        model = build_model("preact_resnet32", 10, seed=0, bn_momentum=m)
        bns = [b for b in model.modules() if isinstance(b, torch.nn.BatchNorm2d)]
        assert bns and all(b.momentum == want for b in bns)
        first = bns[0]  # its input is the stem conv's output
        seen = {}
        first.register_forward_pre_hook(lambda mod, inp: seen.setdefault("x", inp[0].detach()))
        model.train()(x)
        batch_mean = seen["x"].mean(dim=(0, 2, 3))
        assert torch.allclose(first.running_mean, want * batch_mean, atol=1e-5), m
    for bad in (0.0, -0.1, 1.5, 0.997 + 1):
        with pytest.raises(ValueError, match=rf"bn_momentum must lie in \(0, 1\].*{bad}"):
            build_model("small_cnn", 10, bn_momentum=bad)
    with pytest.raises(ValueError, match="Linear has no batch-norm layer"):
        set_bn_momentum(torch.nn.Linear(3, 2), 0.01)


# -- timm and torchvision backbones, pretrained from local files only ---------------------------


def _equal_tensors(a: dict, b: dict) -> int:
    return sum(1 for k, v in a.items() if k in b and b[k].shape == v.shape and torch.equal(b[k], v))


def test_any_timm_model_by_name_with_weights_from_a_local_file(tmp_path):
    """``timm:NAME`` (or a bare name timm knows) builds timm's model with a fresh head; with
    ``pretrained`` it loads every other tensor from the file given (timm's
    pretrained_cfg_overlay), never from the network."""
    timm = pytest.importorskip("timm")
    from pipeline.train.models import resolve_name

    src = timm.create_model("test_convnext", pretrained=False)
    path = tmp_path / "test_convnext.pth"
    torch.save(src.state_dict(), path)
    model = build_model("timm:test_convnext", 7, pretrained=True, weights=str(path), seed=0)
    got, want = model.state_dict(), src.state_dict()
    head = {k for k in want if k.startswith("head.fc.")}
    assert head and _equal_tensors(want, got) == len(want) - len(head)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)
    fresh = build_model("test_convnext", 7, seed=0)    # a bare timm name, random weights
    assert not torch.equal(fresh.state_dict()["stem.0.weight"], want["stem.0.weight"])
    assert resolve_name("convnext_tiny") == ("timm", "convnext_tiny")
    assert resolve_name("tv:resnet18") == ("tv", "resnet18")
    with pytest.raises(ValueError, match=r"any timm model \(timm:NAME"):
        build_model("no_such_net", 3)


def test_a_missing_timm_weight_names_the_fetch_command_and_the_cache_is_read(
        tmp_path, monkeypatch):
    """Without a file, a timm model's weights come from the local Hugging Face cache only:
    absent, one FileNotFoundError naming ``python -m pipeline.train.models fetch``; present
    (a cache the test lays out as the hub does), they load."""
    timm = pytest.importorskip("timm")
    from huggingface_hub import constants
    from safetensors.torch import save_file

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="pipeline.train.models fetch timm:test_convnext"):
        build_model("timm:test_convnext", 7, pretrained=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_model("timm:test_convnext", 7, pretrained=True, weights=str(tmp_path / "x.pth"))
    repo = timm.models.get_pretrained_cfg("test_convnext").hf_hub_id
    folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    src = timm.create_model("test_convnext", pretrained=False)
    save_file(src.state_dict(), str(folder / "snapshots" / "abc123" / "model.safetensors"))
    model = build_model("timm:test_convnext", 7, pretrained=True)
    assert _equal_tensors(src.state_dict(), model.state_dict()) == len(src.state_dict()) - 2


def test_torchvision_models_by_name_with_weights_from_a_file(tmp_path):
    import torchvision

    src = torchvision.models.resnet18()
    path = tmp_path / "resnet18.pth"
    torch.save(src.state_dict(), path)
    model = build_model("tv:resnet18", 5, pretrained=True, weights=str(path))
    assert model.fc.out_features == 5
    assert _equal_tensors(src.state_dict(), model.state_dict()) == len(src.state_dict()) - 2
    with pytest.raises(FileNotFoundError, match="fetch tv:resnet18"):
        build_model("tv:resnet18", 5, pretrained=True)
    with pytest.raises(ValueError, match="weights= is for timm and torchvision"):
        build_model("small_cnn", 5, weights=str(path))


def test_fetch_resnet50_fills_the_torch_hub_cache_the_presets_read(tmp_path, monkeypatch,
                                                                   capsys):
    """``python -m pipeline.train.models fetch resnet50`` (what infra/Dockerfile and
    infra/ray-cluster.yaml run) downloads the presets' weights into $TORCH_HOME's hub cache
    under their final name only when complete, and ``resnet50(pretrained=True)`` then loads
    them without the network (the download is a local file here)."""
    import torchvision

    from pipeline.train import models

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    src = torchvision.models.resnet50()
    served = tmp_path / "served.pth"
    torch.save(src.state_dict(), served)
    calls = []

    def download(url, dst, progress=True):
        calls.append(url)
        assert dst.endswith(".partial")
        Path(dst).write_bytes(served.read_bytes())

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    with pytest.raises(FileNotFoundError, match="python -m pipeline.train.models fetch resnet50"):
        build_model("resnet50", 14, pretrained=True)
    assert models.main(["fetch", "resnet50"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path / "torch" / "hub" / "checkpoints" and path.is_file()
    assert not list(path.parent.glob("*.partial"))
    model = build_model("resnet50", 14, pretrained=True)
    assert model.fc.out_features == 14
    assert _equal_tensors(src.state_dict(), model.state_dict()) == len(src.state_dict()) - 2
    assert models.main(["fetch", "resnet50"]) == 0 and len(calls) == 1  # kept, not fetched again
    assert models.main(["fetch", "small_cnn", "--out", str(tmp_path)]) == 2
    assert "small_cnn has no pretrained weights" in capsys.readouterr().err
