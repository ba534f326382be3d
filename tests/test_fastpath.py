"""The fast paths of the training step (pipeline.train.fastpath, PerfConfig) on the CPU: every
switch trains on real data without error, the default CPU path is unchanged, and the
device hand-over helpers keep values and dtypes."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, PerfConfig, RunConfig
from pipeline.core.noise import symmetric
from pipeline.core.sampler import gibbs_posterior
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor
from pipeline.data.transforms import build_batch_transform
from pipeline.train.fastpath import Forward, HostStage, to_device, wrap_model
from pipeline.train.models import build_model
from pipeline.train.trainer import LocalTrainer, TensorData


def _data():
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=0)
    x = to_tensor(images)
    view = symmetric(labels[tr], 10, 0.3, include_true=True, seed=0)
    return TensorData(x[tr], view), TensorData(x[te], clean_view(labels[te]))


def _cfg(perf: PerfConfig) -> RunConfig:
    return RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", 1), perf=perf,
                     optim=OptimConfig(epochs=2, pretrain_epochs=1, batch_size=64, lr=0.05),
                     lccn=LCCNConfig(warmup_steps=3))


def test_perf_auto_is_off_on_cpu_and_on_for_cuda():
    p = PerfConfig()
    for name in ("amp", "channels_last", "cudnn_benchmark", "data_on_device"):
        assert not p.enabled(name, "cpu") and p.enabled(name, "cuda:0"), name
    assert PerfConfig(amp="bf16").enabled("amp", "cpu")
    assert not PerfConfig(amp="off").enabled("amp", "cuda")
    with pytest.raises(ValueError, match="amp"):
        PerfConfig(amp="fp8")
    with pytest.raises(ValueError, match="compile"):
        PerfConfig(compile="fast")


def test_default_cpu_path_is_the_plain_model():
    """On the CPU the defaults wrap nothing that changes the numbers: the wrapper's logits
    equal the bare model's bit for bit."""
    model = build_model("small_cnn", 10, in_channels=1, seed=0)
    fwd = wrap_model(model, PerfConfig(), "cpu")
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(fwd(x), model(x))


@pytest.mark.parametrize("perf", [
    PerfConfig(amp="bf16"),
    PerfConfig(channels_last="on"),
    PerfConfig(amp="bf16", channels_last="on"),
    PerfConfig(compile="default"),
], ids=["bf16", "channels_last", "bf16+channels_last", "compile"])
def test_each_switch_trains_ce_and_lccn_on_the_cpu(perf):
    """1 CE + 1 LCCN epoch on real digits under the switch: finite loss, the chain's
    invariants hold (checked every epoch by the trainer), and the model learned. A compiler
    that cannot run here falls back to eager with a warning instead of failing."""
    train, test = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = LocalTrainer(_cfg(perf), train, test)
        hist = trainer.fit()
    assert [r["phase"] for r in hist] == [0.0, 1.0]
    assert all(math.isfinite(r["loss"]) for r in hist)
    assert hist[-1]["test_top1"] > 0.3
    if perf.compile != "off":
        fallback = [w for w in caught if "torch.compile" in str(w.message)]
        # either it compiled, or it said why it did not
        assert trainer.forward.failed is None or fallback


def test_compile_falls_back_to_eager_with_a_warning(monkeypatch):
    def broken(module, mode=None):
        def call(x):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    model = build_model("small_cnn", 10, in_channels=1, seed=0)
    fwd = wrap_model(model, PerfConfig(compile="default"), "cpu")
    x = torch.randn(3, 1, 8, 8)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        out = fwd(x)
    assert torch.equal(out, model(x))
    assert torch.equal(fwd(x), out)  # eager from then on, no second warning needed


def test_uint8_batches_are_normalised_by_the_wrapper_or_refused():
    model = build_model("small_cnn", 10, in_channels=3, seed=0)
    norm = build_batch_transform("cifar")
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    fwd = Forward(model, amp=False, channels_last=False, device_type="cpu", normalize=norm)
    assert torch.equal(fwd(x), model(norm(x)))
    bare = Forward(model, amp=False, channels_last=False, device_type="cpu")
    with pytest.raises(TypeError, match="normalize_on"):
        bare(x)


def test_host_stage_and_packed_copies_keep_values_and_dtypes():
    stage = HostStage()
    with pytest.raises(RuntimeError):
        stage.get()
    z = torch.tensor([3, 1, 4])
    stage.put(z)
    assert stage.get() is z  # host tensors pass through
    a = torch.tensor([1, 2, 3])
    b = torch.tensor([True, False, True])
    out = to_device([a, b], "cpu")
    assert out[0] is a and out[1] is b


def test_sampler_refuses_a_replica_on_another_device():
    probs = torch.full((2, 3), 1 / 3)
    counts = torch.ones(3, 3, dtype=torch.int64).to("meta")
    with pytest.raises(ValueError, match="replica of C"):
        gibbs_posterior(probs, torch.tensor([0, 1]), torch.tensor([0, 2]), counts, 1.0)


def test_sampler_range_checks_name_the_values():
    probs = torch.full((2, 3), 1 / 3)
    counts = torch.ones(3, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"observed labels must lie in \[0, 3\), got range \[0, 5\]"):
        gibbs_posterior(probs, torch.tensor([0, 5]), torch.tensor([0, 2]), counts, 1.0)


def test_gpu_code_paths_import_without_the_cluster_packages(tmp_path):
    """A GPU node with only a CUDA PyTorch image runs the trainer, the engine, the methods
    and benchmarks/gpu_check.py: none of them may import Ray, MLflow, WebDataset, boto3 or
    cleanlab at import time, and numba (the CPU labeler's kernels) is optional."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "blocked.py"
    script.write_text(
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('ray', 'mlflow', 'webdataset', 'boto3', 'cleanlab', 'numba'):\n"
        "        raise ImportError('blocked: ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "import pipeline.train.trainer, pipeline.train.engine, pipeline.train.methods, pipeline.train.fastpath\n"
        "import pipeline.track.label_issues, pipeline.core.sampler, pipeline.train.labeler\n"
        "assert pipeline.core.sampler.numba is None and not pipeline.train.labeler.host_kernel\n"
        "import runpy\n"
        "sys.argv = ['gpu_check.py', '--device', 'cpu', '--no-shards', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(root / 'benchmarks' / 'gpu_check.py')!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print('imported')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "imported" in out.stdout


def test_gpu_check_fails_fast_without_a_gpu():
    """Asked for CUDA on a machine without it, the GPU check exits with status 2 and one
    line that says so, before doing any work."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")  # CI never does
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--no-shards"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_decode_check_fails_fast_and_writes_nothing_without_a_gpu(tmp_path):
    """``--decode-check`` (ResNet-50 from shards decoded on the GPU against the synthetic
    rate, for the next GPU session): on a machine without CUDA, status 2, one line, no
    figure files; asked to skip the shards it needs, one line too."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")  # CI never does
    root = Path(__file__).resolve().parents[1]
    md, js = tmp_path / "gpu-decode.md", tmp_path / "gpu-decode.json"
    for extra, says in (([], "no CUDA device"),
                        (["--no-shards"], "--decode-check reads JPEG shards")):
        out = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"),
                              "--decode-check", "--out", str(md), "--json", str(js), *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert not md.exists() and not js.exists()


def test_gpu_check_runs_end_to_end_at_tiny_sizes_on_the_cpu(tmp_path):
    """The GPU check's code (ResNet-32 CE and LCCN epochs, ResNet-50 against a plain loop,
    real JPEG shards through the loader with device-side normalisation) at tiny sizes on
    the CPU: every section reports, the report is written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--device",
                          "cpu", "--tiny", "--out", str(tmp_path / "gpu.md"), "--json",
                          str(tmp_path / "gpu.json")], capture_output=True, text=True,
                         timeout=900, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["phase"] for r in res["resnet32_lccn"]] == [0.0, 1.0]
    assert res["resnet32_lccn"][-1]["sampler_time"] > 0
    assert res["resnet50_synthetic"]["ours_images_per_s"] > 0
    assert res["resnet50_shards"][0]["steps"] == 4  # 8 JPEGs in batches of 2
    assert "Ratio this pipeline / plain loop" in (tmp_path / "gpu.md").read_text()
    fp16 = res["resnet32_ce_fp16"]  # the fp16 + GradScaler epoch, beside the default one
    assert len(fp16) == 1 and math.isfinite(fp16[0]["loss"]) and "fp16_error" not in res
    assert "under float16 autocast with a GradScaler" in (tmp_path / "gpu.md").read_text()
    # part 5: the same shards decoded on the device (here the CPU), beside decode="cpu"
    dec = res["resnet50_decode"]
    assert [(r["decode"], r["workers"]) for r in dec] == [("device", 1), ("cpu", 1)]
    assert all(r["steps"] == 4 and r["decode_fallback"] == 0 and r["cpu_s_per_1000"] > 0
               for r in dec)
    assert "decoded on the device" in (tmp_path / "gpu.md").read_text()


def test_fp16_autocasts_and_scales_the_loss_of_every_network():
    """``amp="fp16"`` (GPUs without bf16): the forward pass autocasts to float16, every
    network's optimiser steps through a GradScaler, and a run trains to finite weights; a
    non-finite gradient skips the step and lowers the scale. ``"auto"`` picks bf16 where the
    device has it, fp16 where it does not, nothing on the CPU."""
    from pipeline.train.fastpath import grad_scaler

    p = PerfConfig(amp="fp16")
    assert p.amp_dtype("cpu") == "float16" and p.enabled("amp", "cpu")
    assert PerfConfig().amp_dtype("cuda:0") == "bfloat16"
    assert PerfConfig().amp_dtype("cuda:0", bf16_supported=False) == "float16"
    assert PerfConfig().amp_dtype("cpu") is None and grad_scaler(PerfConfig(), "cpu") is None
    assert grad_scaler(PerfConfig(amp="bf16"), "cpu") is None  # bf16 needs no scaling
    model = build_model("small_cnn", 10, in_channels=1, seed=0)
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    fwd = Forward(model, amp="float16", channels_last=False, device_type="cpu")
    assert fwd(torch.randn(4, 1, 8, 8)).dtype == torch.float32 and seen == [torch.float16]

    train, test = _data()
    trainer = LocalTrainer(replace(_cfg(p), method="ce"), train, test)
    scalers = []
    run_pass = trainer.engine.fit.__globals__["run_pass"]

    def recording(*a, **kw):
        scalers.append(kw.get("scalers"))
        return run_pass(*a, **kw)

    trainer.engine.fit.__globals__["run_pass"] = recording
    try:
        hist = trainer.fit()
    finally:
        trainer.engine.fit.__globals__["run_pass"] = run_pass
    member = trainer.engine.members[0]
    assert isinstance(member.scaler, torch.amp.GradScaler)
    assert scalers and all(s == {id(member.optimizer): member.scaler} for s in scalers)
    assert all(torch.isfinite(q).all() for q in trainer.model.parameters())
    assert hist[-1]["test_top1"] > 0.3

    # an inf gradient: the step is skipped, the weights unchanged, the scale halved
    scaler = member.scaler
    before = [q.detach().clone() for q in trainer.model.parameters()]
    scale = scaler.get_scale()
    member.optimizer.zero_grad()
    loss = trainer.model(train.images[:8]).sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(member.optimizer)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
