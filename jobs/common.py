"""Shared plumbing of the Ray jobs in ``jobs/``: dataset presets, the argument parser, the
configs built from it, tiny generated shards for ``--smoke-test``, and the driver that runs
a job (:func:`run_job`).

Every job runs the same two ways::

    python jobs/<name>.py ...                               # starts a local Ray itself
    ray job submit --working-dir . -- python jobs/<name>.py ...   # on a running cluster

(The driver connects to ``RAY_ADDRESS`` when it is set, which ``ray job submit`` does,
else starts a local Ray instance.) A job re-submitted with the same ``--run-name`` and
``--run-dir`` resumes from its last checkpoint. Under ``ray job submit`` the working
directory is a per-job copy: give an absolute ``--run-dir`` (the default, ``$LCCN_RUNS`` or
``~/lccn_runs/<job>``, is absolute) so that a resubmission finds its run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import storage
from pipeline.core.cli import run_location
from pipeline.core.config import (
    BaselineConfig,
    DivideConfig,
    LCCNConfig,
    ModelConfig,
    RunConfig,
    json_safe,
    scaled_lr_values,
)
from pipeline.core.labels import LabelView
from pipeline.core.noise import format_transition
from pipeline.core.options import (
    FLAGS,
    UNSET,
    add_option_groups,
    apply_options,
    dest,
    value_at,
)
from pipeline.data.manifest import Manifest
from pipeline.data.stream import check_label_view, check_splits
from pipeline.cluster.worker import DistConfig
from pipeline.track.tracking import (
    add_tracking_options,
    tracking_access_problem,
    tracking_uri_of,
)
from pipeline.track.uris import redact_uri
from pipeline.train.methods import get_method, registered

_LCCN, _DIVIDE = LCCNConfig(), DivideConfig()


@dataclass(frozen=True)
class Preset:
    """A training recipe: a dataset's (the paper's Sec. 4.1.3, shared by every method that
    follows the paper's schedule) or a method's own on that dataset (DivideMix's, which
    DivideMix and DivideLCCN follow), with the shard/transform preset. The table in
    docs/methods.md ("Presets") is :func:`presets_table` of :data:`RECIPES`.

    lr_values: learning rate per phase between ``milestones`` (empty: ``lr`` decayed by
    ``lr_decay`` at each milestone). ``epochs`` counts every epoch, the first
    ``pretrain_epochs`` of them cross-entropy (Algorithm 3, line 1; DivideMix's warm-up).
    ``source``: where the numbers come from.
    """

    name: str
    model: str
    transform: str
    batch_size: int
    lr: float
    epochs: int
    pretrain_epochs: int
    weight_decay: float
    warmup_steps: int
    # unless a recipe says otherwise, the library's defaults (LCCNConfig, DivideConfig)
    warmup: str = _LCCN.warmup
    targets: str = _LCCN.targets
    ramp_epochs: float = _LCCN.ramp_epochs
    anneal: bool = _LCCN.anneal
    milestones: tuple[int, ...] = ()
    lr_values: tuple[float, ...] = ()
    lr_decay: float = 0.1
    ema_decay: float = 0.0
    # normalisation layers and biases out of the L2 penalty, as the paper's released code
    # (its CIFAR recipe) and most CIFAR/ImageNet recipes (OptimConfig.norm_weight_decay)
    norm_weight_decay: float | None = 0.0
    bn_momentum: float | None = None
    alpha: float = _LCCN.alpha
    pretrained: bool = False
    in_channels: int = 3
    note: str = ""
    method: str = "lccn"
    # DivideMix / DivideLCCN (DivideConfig)
    mixmatch_alpha: float = _DIVIDE.mixmatch_alpha
    lambda_u: float = _DIVIDE.lambda_u
    p_threshold: float = _DIVIDE.p_threshold
    temperature: float = _DIVIDE.temperature
    conf_penalty: bool = _DIVIDE.conf_penalty
    source: str = ""


PRESETS: dict[str, Preset] = {p.name: p for p in (
    # PreAct ResNet-32, SGD 0.9, wd 5e-4, batch 128, 120 epochs, lr 0.5 / 0.1 / 0.01 split at
    # epochs 40 and 80; warm-up 20,000 steps with Eq. 8 (CIFAR-10) or the identity
    # (CIFAR-100); alpha 1. Our choices: the first lr phase (40 epochs) is the CE pre-training;
    # the warm-up transition is the anchor-point estimate, not Eq. 8 (--warmup eq8 for the
    # paper's), and the classifier trains on the posterior (--targets sample for the
    # paper's): the library defaults, which do not collapse from a weak start (docs/fidelity.md)
    Preset("cifar10", "preact_resnet32", "cifar", 128, 0.5, 120, 40, 5e-4, 20_000, "anchor",
           milestones=(40, 80), lr_values=(0.5, 0.1, 0.01),
           note="the first 40 epochs (lr 0.5) are the CE pre-training",
           source="LCCN paper Sec. 4.1.3 (CIFAR); Tables 2-4, OTS"),
    Preset("cifar100", "preact_resnet32", "cifar", 128, 0.5, 120, 40, 5e-4, 20_000, "identity",
           milestones=(40, 80), lr_values=(0.5, 0.1, 0.01),
           note="the first 40 epochs (lr 0.5) are the CE pre-training",
           source="LCCN paper Sec. 4.1.3 (CIFAR); Tables 2-4, OTS"),
    # ResNet-50 (ImageNet weights), batch 32, lr 0.001 fixed, 5 epochs, wd 1e-3, warm-up
    # 40,000 steps, power annealing on. Our choices: 1 of the 5 epochs is CE pre-training;
    # anchor warm-up and posterior targets as above.
    Preset("clothing1m", "resnet50", "clothing1m", 32, 0.001, 5, 1, 1e-3, 40_000, "anchor",
           anneal=True, pretrained=True, note="1 of the 5 epochs is CE pre-training",
           source="LCCN paper Sec. 4.1.3 (Clothing1M); Table 5, OTS"),
    # Inception-ResNet-v2, batch 64, lr 0.01 divided by 10 after 40 epochs, annealing on.
    # The paper gives neither the epoch count nor wd nor warm-up: ours are 80, 5e-4, 40,000.
    # The method is DivideLCCN with DivideMix's WebVision settings (MixMatch alpha 0.5,
    # lambda_u 0; docs/methods.md).
    Preset("webvision", "inception_resnet_v2", "webvision", 64, 0.01, 80, 10, 5e-4, 40_000,
           "anchor", anneal=True, milestones=(40,), method="divide_lccn", mixmatch_alpha=0.5,
           lambda_u=0.0,
           note="80 epochs (10 CE), wd 5e-4 and 40,000 warm-up steps are our choices",
           source="LCCN paper Sec. 4.1.3 (WebVision) and Table 7; MixMatch alpha, lambda_u: "
                  "DivideMix's WebVision settings"),
    # one's own images (jobs/train.py): an ImageNet backbone fine-tuned from its weights at
    # the usual fine-tuning rate; the job sets the warm-up from the data (half the noise
    # phase's steps, between the paper's CIFAR and Clothing1M shares) and the transform
    # from --image-size
    Preset("images", "resnet50", "imagenet224", 64, 0.01, 30, 3, 5e-4, 0, "anchor",
           milestones=(20,), pretrained=True,
           note="the job sets the warm-up to half the noise phase's steps unless "
                "--warmup-steps is given",
           source="ours (jobs/train.py, one's own images)"),
    # the quickstart: scikit-learn digits, small CNN on the CPU
    # targets "sample": on 1,257 digits a small CNN memorises the noisy labels, and the
    # sampled z (which relabels) beats the posterior target (which follows the labels once
    # memorised): +8.2 vs +2.4 points over CE on three seeds; no ramp: 8 CE epochs make a
    # strong start here, and the ramp costs most of the gain (docs/fidelity.md)
    Preset("digits", "small_cnn", "digits", 32, 0.1, 30, 8, 5e-4, 0, "anchor",
           targets="sample", ramp_epochs=0.0, milestones=(20,), in_channels=1,
           norm_weight_decay=None,
           source="ours (the CPU quickstart; docs/fidelity.md)"),
)}


def _dividemix(dataset: str, **kw: Any) -> Preset:
    """DivideMix's own schedule on ``dataset`` (its authors' code), which DivideMix and,
    per the LCCN paper's tables, DivideLCCN follow; the LCCN sampler settings stay the
    dataset's."""
    # DivideMix's code decays every parameter (one SGD weight decay)
    return replace(PRESETS[dataset], lr_values=(), norm_weight_decay=None, **kw)


_DM_CIFAR = "DivideMix (Li et al. 2020) Sec. 4.1 and its code (Train_cifar.py); LCCN " \
            "paper Table 2: DivideLCCN follows DivideMix's schedule"
_DM_CLOTHING = "DivideMix Sec. 4.1 and its code (Train_clothing1M.py); LCCN paper " \
               "Table 5 (DivideLCCN on its schedule)"

# (dataset, method) -> the method's own recipe where it differs from the dataset's (every
# other method follows the dataset's: the LCCN paper's "OTS", Tables 1-4)
METHOD_PRESETS: dict[tuple[str, str], Preset] = {}
for _m in ("dividemix", "divide_lccn"):
    METHOD_PRESETS[("cifar10", _m)] = _dividemix(
        "cifar10", model="preact_resnet18", batch_size=64, lr=0.02, epochs=300,
        pretrain_epochs=10, milestones=(150,), method=_m,
        note="lambda_u 25 is DivideMix's for 50% symmetric noise (0/25/50/150 by level); "
             "add --conf-penalty under asymmetric noise", source=_DM_CIFAR)
    METHOD_PRESETS[("cifar100", _m)] = _dividemix(
        "cifar100", model="preact_resnet18", batch_size=64, lr=0.02, epochs=300,
        pretrain_epochs=30, milestones=(150,), lambda_u=150.0, method=_m,
        note="lambda_u 150 is DivideMix's for 50% symmetric noise (25/150 by level)",
        source=_DM_CIFAR)
    METHOD_PRESETS[("clothing1m", _m)] = _dividemix(
        "clothing1m", batch_size=32, lr=0.002, epochs=80, pretrain_epochs=1, milestones=(40,),
        mixmatch_alpha=0.5, lambda_u=0.0, conf_penalty=True, method=_m,
        note="an epoch is the whole split here, not DivideMix's 1,000 sampled batches",
        source=_DM_CLOTHING)
METHOD_PRESETS[("webvision", "dividemix")] = _dividemix(
    "webvision", batch_size=32, pretrain_epochs=1, method="dividemix", note="",
    source="DivideMix Sec. 4.1 and its code (Train_webvision.py)")


def recipe(dataset: str, method: str) -> Preset:
    """The recipe ``method`` runs on ``dataset`` with: its own where it has one
    (:data:`METHOD_PRESETS`), else the dataset's (:data:`PRESETS`)."""
    return METHOD_PRESETS.get((dataset, method), PRESETS[dataset])


# the Preset fields the jobs take from the recipe unless given on the command line
RECIPE_ARGS = ("model", "pretrained", "epochs", "pretrain_epochs", "batch_size", "lr",
               "milestones", "lr_values", "lr_decay", "weight_decay", "ema_decay",
               "norm_weight_decay", "bn_momentum", "alpha",
               "warmup_steps", "warmup", "targets", "ramp_epochs", "anneal", "mixmatch_alpha",
               "lambda_u", "p_threshold", "temperature", "conf_penalty")


def resolve_recipe(args: argparse.Namespace) -> Preset:
    """Fill every recipe option left unset (None) from the recipe of the job's dataset
    (``args.dataset`` or ``args.preset_name``) and ``args.method``; returns that recipe.
    Idempotent."""
    dataset = getattr(args, "dataset", None) or args.preset_name
    rec = recipe(dataset, args.method)
    given = {name for name in RECIPE_ARGS if getattr(args, name, None) is not None}
    if not hasattr(args, "recipe_given"):  # the first call sees what the command line set
        args.recipe_given = tuple(sorted(given))
    # a recipe's value of a field the method never reads (get_method(m).ignores, e.g. the
    # digits recipe's targets for divide_lccn) stays out: the library's default instead
    ignored = {path.partition(".")[2]: value_at(RunConfig(), path)
               for path in get_method(args.method).ignores}
    for name in RECIPE_ARGS:
        if name not in given:
            value = ignored[name] if name in ignored else getattr(rec, name)
            setattr(args, name, list(value) if isinstance(value, tuple) else value)
    if rec.lr_values and "lr_values" not in given:
        # the recipe's piecewise schedule yields to the schedule options given
        if given & {"milestones", "lr_decay"}:  # lr decayed by lr_decay at the milestones
            args.lr_values = []
        elif "lr" in given:  # the recipe's phases, scaled to start at --lr
            try:
                args.lr_values = list(scaled_lr_values(rec.lr_values, args.lr))
            except ValueError as e:
                raise SystemExit(f"error: --lr: {e}") from None
    if getattr(args, "scale_lr", False) and not getattr(args, "lr_scaled", False):
        if {"lr", "lr_values"} & set(args.recipe_given):
            raise SystemExit("error: --scale-lr scales the recipe's lr to --batch-size: give "
                             "it or --lr / --lr-values, not both")
        factor = args.batch_size / rec.batch_size
        args.lr = rec.lr * factor
        args.lr_values = [v * factor for v in args.lr_values]
        args.lr_scaled = True
    if args.epochs is not None and args.pretrain_epochs is not None \
            and not getattr(args, "smoke_test", False) \
            and not 0 <= args.pretrain_epochs <= args.epochs:
        whose = {k: "" if k in given else f" (the {rec.name} recipe's)"
                 for k in ("epochs", "pretrain_epochs")}
        raise SystemExit(f"error: --epochs {args.epochs}{whose['epochs']} is fewer than "
                         f"--pretrain-epochs {args.pretrain_epochs}{whose['pretrain_epochs']}, "
                         f"the cross-entropy epochs it starts with: give both")
    if args.lr_values and len(args.lr_values) != len(args.milestones) + 1:
        raise SystemExit(f"error: --lr-values {' '.join(f'{v:g}' for v in args.lr_values)} "
                         f"needs one rate per phase, len(--milestones) + 1 = "
                         f"{len(args.milestones) + 1} (milestones {list(args.milestones)})")
    return rec


PRESET_COLUMNS = ("dataset", "methods", "model", "epochs (CE / warm-up)", "batch", "lr",
                  "lr schedule", "wd", "LCCN: α, δ, warm-up", "DivideMix: α_mix, λu, τ, T",
                  "source")


def presets_table() -> str:
    """The Markdown table of every recipe (docs/methods.md, "Presets")."""
    rows = ["| " + " | ".join(PRESET_COLUMNS) + " |", "|" + "---|" * len(PRESET_COLUMNS)]
    for name, p in PRESETS.items():
        own = {m: METHOD_PRESETS[(name, m)] for (d, m) in METHOD_PRESETS if d == name}
        others = [m for m in registered() if m not in own]
        groups = [(", ".join(others), p)] + [(m, r) for m, r in own.items()]
        for methods, r in groups:
            if r.lr_values:
                sched = " / ".join(f"{v:g}" for v in r.lr_values) + " from epochs " + \
                    ", ".join(["0", *map(str, r.milestones)])
            elif r.milestones:
                sched = f"/{1 / r.lr_decay:g} at " + ", ".join(map(str, r.milestones))
            else:
                sched = "fixed"
            dm = (f"{r.mixmatch_alpha:g}, {r.lambda_u:g}, {r.p_threshold:g}, {r.temperature:g}"
                  + (", conf. penalty" if r.conf_penalty else ""))
            lccn = ("—" if r.method == "dividemix" else
                    f"{r.alpha:g}, {r.warmup_steps:,} steps, {r.warmup}"
                    + (", annealing" if r.anneal else ""))
            if r.method != "dividemix" and r.method != "divide_lccn" and "divide" not in methods:
                dm = "—"
            model = r.model + (" (ImageNet weights)" if r.pretrained else "")
            note = f" {r.note[0].upper()}{r.note[1:]}." if r.note else ""
            rows.append("| " + " | ".join((
                name, methods, model, f"{r.epochs} ({r.pretrain_epochs})", str(r.batch_size),
                f"{r.lr:g}", sched, f"{r.weight_decay:g}" + (
                    "" if r.norm_weight_decay is None else
                    f" ({r.norm_weight_decay:g} on norm layers, biases)"),
                lccn, dm, r.source + "." + note))
                + " |")
    return "\n".join(rows) + "\n"


def default_run_dir(job: str) -> Path:
    return Path(os.environ.get("LCCN_RUNS", Path.home() / "lccn_runs")).expanduser().resolve() / job


def normal_run_dir(run_dir: Path | str) -> Path | str:
    """A run dir as the run uses it: an ``s3://`` prefix as given, a path made absolute."""
    return run_dir if storage.is_remote(run_dir) else Path(run_dir).expanduser().resolve()


def local_mirror(loc: str, job: str) -> Path:
    """The local folder that stands in for an ``s3://`` run or sweep dir where a job writes
    files of its own: ``$LCCN_RUNS/<job>/s3/<bucket>/<prefix>`` (else under ~/lccn_runs)."""
    return default_run_dir(job) / "s3" / str(loc).split("://", 1)[1]


def work_dir(args: argparse.Namespace, job: str) -> Path:
    """The local folder for the files a job generates itself (the quickstart's digits
    shards, --smoke-test's shards, converted images): the run dir, or for an ``s3://`` run
    dir its :func:`local_mirror`."""
    if storage.is_remote(args.run_dir):
        return local_mirror(args.run_dir, job)
    return normal_run_dir(args.run_dir)


def local_data_note(args: argparse.Namespace, job: str, where: Path) -> list[str]:
    """With an ``s3://`` run dir, the line saying that the shards this job generated at
    ``where`` are on this machine only; [] otherwise."""
    if not storage.is_remote(args.run_dir):
        return []
    return [f"[{job}] note: the run dir is {args.run_dir}, but the shards this job made are "
            f"on this machine only ({where}); a Train worker on another node cannot read "
            f"them: upload them (python -m pipeline.data.s3 upload) and pass --train-shards "
            f"s3://... (and --test-shards), or put them on a folder every node shares"]


def add_common_args(p: argparse.ArgumentParser, preset: Preset, *, job: str) -> None:
    """Options every job shares; recipe options default to ``preset`` (None = preset's)."""
    g = p.add_argument_group("run")
    g.add_argument("--run-name", default=None,
                   help="Ray Train / MLflow run name (default: <job>-<method>-<timestamp>, a new run); the same name "
                        "and run dir again resumes the run from its last checkpoint")
    g.add_argument("--run-dir", type=run_location, default=default_run_dir(job),
                   help="run directory on a file system every node shares, or "
                        "s3://BUCKET/PREFIX (endpoint: --s3-endpoint-url, else "
                        "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL): checkpoints "
                        "<run-dir>/train, results, the exported model; a local one also "
                        "holds the MLflow store <run-dir>/mlflow.db and generated data "
                        "(default $LCCN_RUNS/<job>, else ~/lccn_runs/<job>)")
    g.add_argument("--num-workers", type=int, default=2, help="Ray Train workers (DDP ranks)")
    g.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl; autocast bf16, or fp16 with a grad scaler on GPUs without bf16)")
    g.add_argument("--cpus-per-worker", type=float, default=1.0)
    g.add_argument("--sync-bn", action="store_true",
                   help="with --gpu: batch-norm statistics over the global batch "
                        "(torch.nn.SyncBatchNorm), for few images per GPU")
    g.add_argument("--scale-lr", action="store_true",
                   help="the linear scaling rule: the recipe's lr (and lr phases) times "
                        "--batch-size / the recipe's batch (instead of giving --lr)")
    g.add_argument("--loader-workers", type=int, default=2,
                   help="DataLoader processes per worker (0 = read in the worker)")
    g.add_argument("--shuffle-buffer", type=int, default=1000)
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N steps inside an epoch (0: end of epoch only)")
    g.add_argument("--progress-seconds", type=float, default=60.0,
                   help="inside an epoch, a progress line (images/s, the epoch's ETA) every "
                        "this many seconds; a bar on a terminal; 0: per-epoch lines only")
    g.add_argument("--export-model", action=argparse.BooleanOptionalAction, default=True,
                   help="at the end, write the classifier as a torch.export program "
                        "<run-dir>/models/<run>.pt2 (with a .json of its preset and "
                        "classes; lccn-predict reads it); off with --smoke-test")
    g.add_argument("--max-failures", type=int, default=1,
                   help="worker-group restarts from the last checkpoint before giving up")
    add_tracking_options(g, store="<run-dir>")
    g.add_argument("--experiment", default=f"lccn-{job}", help="MLflow experiment")
    g.add_argument("--smoke-test", action="store_true",
                   help="2 CPU workers on tiny shards generated under the run dir, small CNN, "
                        "a few steps")
    g.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=True,
                   help="check every shard's sha256 against its manifest before reading it "
                        "(once per shard and process; default on)")
    g.add_argument("--s3-endpoint-url", default=None,
                   help="endpoint of an S3-compatible store (MinIO, Ceph, R2...) for s3:// "
                        "shards (default $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else AWS)")
    g.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)  # tests only

    p.set_defaults(preset_name=preset.name)
    m = p.add_argument_group(
        f"method and recipe (defaults: the recipe of --method on {preset.name}, the papers' "
        f"schedules: the table 'Presets' in docs/methods.md)")
    m.add_argument("--method", choices=registered(), default=preset.method,
                   help="lccn, the ce baseline, dividemix / divide_lccn (two networks), or a "
                        "classic baseline: bootstrap (hard, Reed et al.), forward (Patrini et "
                        "al.), sadapt (S-adaptation, Goldberger & Ben-Reuven), trevision "
                        "(T-Revision, Xia et al.); each after the same CE pre-training "
                        "(docs/methods.md)")
    m.add_argument("--pretrained", action=argparse.BooleanOptionalAction, default=None,
                   help="ImageNet weights for the backbone (resnet50 only)")
    m.add_argument("--init-from", default=None, metavar="RUN_OR_CHECKPOINT",
                   help="start from the weights of another run: its run folder "
                        "(<run-dir>/train/<run-name>), a checkpoint folder or state.pt. With "
                        "--pretrain-epochs 0 after a finished CE run this is the paper's code's "
                        "protocol (docs/guide.md)")
    m.add_argument("--lr-values", type=float, nargs="*", default=None,
                   help="lr of each phase between milestones, len(milestones) + 1 values "
                        "(empty: lr x lr-decay per milestone)")
    add_option_groups(p, JOB_FLAGS, defaults=dict.fromkeys(RECIPE_FLAGS, UNSET), notes=JOB_NOTES)
    t = p.add_argument_group("LCCN+ trusted samples (a label view's 'trusted' entry)")
    t.add_argument("--trusted-fraction", type=float, default=0.0,
                   help="LCCN+: this fraction of samples with a clean label is trusted")
    t.add_argument("--trusted", type=int, default=0, metavar="N",
                   help="LCCN+: N in-distribution samples with a clean label are trusted "
                        "(stratified by class; 5000 in the paper's CIFAR runs)")
    t.add_argument("--trusted-outliers", type=int, default=0, metavar="M",
                   help="LCCN*+: M labelled out-of-distribution samples are trusted too "
                        "(500 in the paper; needs --outlier and an open-set --noise)")
    t.add_argument("--trusted-keys", type=Path, default=None, metavar="FILE",
                   help="LCCN+: the samples whose dataset key is listed in FILE (one per "
                        "line) are trusted, e.g. Clothing1M's clean_train_key_list.txt")


# the config fields a job takes from the command line (pipeline.core.options.FLAGS), and
# those of them whose default is the recipe's (RECIPE_ARGS)
JOB_FLAGS = tuple(FLAGS)
RECIPE_FLAGS = tuple(f for f in JOB_FLAGS if dest(f) in RECIPE_ARGS)
# what a job's user needs to know beyond the field's own documentation
JOB_NOTES = {
    "--lr": "a recipe's per-phase rates are scaled to start at it",
    "--milestones": "given without --lr-values: lr x lr-decay at each",
    "--lr-decay": "given without --lr-values: replaces a recipe's per-phase rates",
    "--warmup-prior": "'deconvolved' is for pair-flip noise; it collapses under symmetric "
                      "noise",
    "--report-epochs": "docs/label-issues.md",
    "--collapse-val-drop": "checked in epochs at or below the learning rate the noise "
                           "phase's start was trained at (after --init-from: once the "
                           "restarted schedule is back at the finished run's rate)",
    "--compile": "'reduce-overhead' halves a small CIFAR model's GPU epoch after ~1.5 min of "
                 "compilation (benchmarks/results/gpu.md)",
    "--amp": "auto = on for CUDA workers",
    "--transition-file": "implies --transition file",
    "--val-fraction": "val_top1 (accuracy against the observed labels) each epoch selects "
                      "the epoch reported as 'selected' (0: none)",
}


def add_data_args(p: argparse.ArgumentParser, *, noise_default: str) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, default=None,
                   help="shard root with one folder per split (from `python -m shards`)")
    g.add_argument("--train-split", default="train")
    g.add_argument("--test-split", default="test")
    g.add_argument("--train-shards", default=None,
                   help="training split folder or base URL (overrides --data/--train-split)")
    g.add_argument("--test-shards", default=None, help="test split folder or base URL")
    g.add_argument("--noise", default=noise_default,
                   help=f"label view spec as JSON (pipeline/core/noise.py; default {noise_default})")
    g.add_argument("--label-view", type=Path, default=None,
                   help="a saved label view (.npz) instead of --noise (needed for URL sources)")


def run_config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of the parsed arguments (options left unset: the recipe's)."""
    resolve_recipe(args)
    base = RunConfig(model=ModelConfig(in_channels=args.in_channels),
                     lccn=LCCNConfig(use_trusted=uses_trusted(args)),
                     baseline=baseline_config(args))
    own = [f for f in JOB_FLAGS if not FLAGS[f].startswith("baseline.")]
    run = apply_options(base, args, own)
    weights = run.model.weights
    if weights is not None and "://" not in weights:
        # the workers chdir into Ray's run directory: the file by its absolute path
        path = Path(weights).expanduser().resolve()
        if not path.is_file():
            raise SystemExit(f"error: --weights {weights}: no such file (write it with "
                             f"`python -m pipeline.train.models fetch {run.model.name} --out DIR`)")
        run = replace(run, model=replace(run.model, weights=str(path)))
    if weights is not None and not args.pretrained:
        raise SystemExit("error: --weights is read with --pretrained: add it, or leave "
                         "--weights out")
    return replace(run, method=args.method)


def uses_trusted(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for an LCCN+ trusted set (and check they agree)."""
    fraction = getattr(args, "trusted_fraction", 0.0)
    count, outliers = getattr(args, "trusted", 0), getattr(args, "trusted_outliers", 0)
    keys = getattr(args, "trusted_keys", None)
    if count < 0 or outliers < 0:
        raise SystemExit(f"error: --trusted and --trusted-outliers must be >= 0, got {count} "
                         f"and {outliers}")
    given = [name for name, on in (("--trusted-fraction", fraction > 0),
                                   ("--trusted/--trusted-outliers", count > 0 or outliers > 0),
                                   ("--trusted-keys", keys is not None)) if on]
    if len(given) > 1:
        raise SystemExit(f"error: give one way of choosing the trusted set, not {' and '.join(given)}")
    if outliers > 0 and not getattr(args, "outlier", False):
        raise SystemExit("error: --trusted-outliers needs --outlier (LCCN*+): a trusted "
                         "outlier trains on the outlier class K, which only LCCN* has")
    return bool(given)


def trusted_spec(args: argparse.Namespace) -> dict[str, Any] | None:
    """The label view's ``"trusted"`` entry the arguments ask for (pipeline/core/noise.py), or
    None."""
    if not uses_trusted(args):
        return None
    if args.trusted_keys is not None:
        path = Path(args.trusted_keys).expanduser().resolve()
        if not path.is_file():
            raise SystemExit(f"error: --trusted-keys {path}: no such file")
        return {"keys": str(path)}
    if args.trusted_fraction > 0:
        return {"fraction": args.trusted_fraction, "seed": args.seed}
    spec: dict[str, Any] = {"count": args.trusted, "seed": args.seed}
    if args.trusted_outliers:
        spec["outliers"] = args.trusted_outliers
    return spec


def baseline_config(args: argparse.Namespace) -> BaselineConfig:
    """The BaselineConfig of the parsed arguments; a transition file is made absolute (every
    worker reads it) and implies ``--transition file``."""
    path = args.transition_file
    transition = "file" if path is not None else args.transition
    if path is not None:
        path = str(Path(path).expanduser().resolve())
    try:
        return BaselineConfig(bootstrap_beta=args.bootstrap_beta, transition=transition,
                              transition_file=path, revision_fraction=args.revision_fraction)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def check_transition_file(run: RunConfig, num_classes: int) -> None:
    """Read the run's transition file (if any) before Ray starts: one clear line naming the
    file when it is missing, malformed or of another class count."""
    from pipeline.core.baselines import load_transition

    if run.baseline.transition != "file" or run.method not in ("forward", "trevision"):
        return
    try:
        load_transition(run.baseline.transition_file, num_classes)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


SMOKE_FIXED = ("model", "pretrained", "epochs", "pretrain_epochs", "batch_size", "milestones",
               "lr_values", "lr")  # the recipe options --smoke-test sets whatever was given


def apply_smoke(args: argparse.Namespace) -> None:
    """--smoke-test: 2 CPU workers, small CNN, 3 epochs (1 CE), tiny batches, no loader
    processes, a mid-epoch checkpoint; every choice here is printed in the job's log."""
    resolve_recipe(args)
    args.num_workers, args.gpu, args.loader_workers = 2, False, 0
    args.model, args.pretrained = "small_cnn", False
    args.epochs, args.pretrain_epochs = 3, 1
    args.batch_size = 64
    args.milestones, args.lr_values = [], []
    args.lr = 0.05
    args.warmup_steps = min(args.warmup_steps, 2)
    args.shuffle_buffer = 64
    args.checkpoint_every = args.checkpoint_every or 10


# below this many images per GPU, batch-norm statistics are noisy enough to cost accuracy
MIN_BATCH_PER_GPU = 16


def small_batch_warning(run: RunConfig, dist: DistConfig) -> str | None:
    """A warning when ``OptimConfig.batch_size`` (global) split over the GPUs leaves fewer
    than :data:`MIN_BATCH_PER_GPU` images per GPU (e.g. the Clothing1M recipe's 32 over 8
    GPUs), with the batch and the linearly scaled lr that reach the floor; None otherwise."""
    if not dist.use_gpu:
        return None
    per = run.optim.batch_size / dist.num_workers
    if per >= MIN_BATCH_PER_GPU:
        return None
    batch = MIN_BATCH_PER_GPU * dist.num_workers
    lr = run.optim.lr * batch / run.optim.batch_size
    return (f"warning: global batch {run.optim.batch_size} over {dist.num_workers} GPUs is "
            f"{per:g} images per GPU: batch-norm statistics from so few are noisy. Consider "
            f"--batch-size {batch} with the lr scaled linearly (--scale-lr: --lr {lr:g}, "
            f"{run.optim.lr:g} x {batch}/{run.optim.batch_size}), --sync-bn (statistics over "
            f"the global batch), or fewer GPUs")


def dist_config(args: argparse.Namespace, *, run_name: str, train: str, test: str | None,
                class_names: list[str], transform: str) -> DistConfig:
    resolve_recipe(args)
    if getattr(args, "sync_bn", False) and not args.gpu:
        raise SystemExit("error: --sync-bn needs --gpu (torch.nn.SyncBatchNorm has no CPU "
                         "kernel)")
    run_dir = normal_run_dir(args.run_dir)
    try:
        tracking = tracking_uri_of(args, run_dir)
    except ValueError as e:
        raise SystemExit(f"error: --run-dir {e}") from None
    problem = storage.check_bucket(run_dir, endpoint_url=args.s3_endpoint_url)
    if problem:
        raise SystemExit(f"error: {problem}")
    return DistConfig(
        run_name=run_name, run_dir=str(run_dir), train_source=train, test_source=test,
        num_workers=args.num_workers, use_gpu=args.gpu, loader_workers=args.loader_workers,
        shuffle_buffer=args.shuffle_buffer, preset=transform,
        checkpoint_every=args.checkpoint_every, lr_values=tuple(args.lr_values),
        pretrained=args.pretrained, tracking_uri=tracking, experiment=args.experiment,
        class_names=tuple(class_names), inject_failure=args.inject_failure,
        verify_checksums=args.verify_checksums,
        # resolved here: the workers of a cluster need not have the driver's environment
        s3_endpoint_url=storage.endpoint(args.s3_endpoint_url),
        sync_bn=getattr(args, "sync_bn", False),
        export_model=bool(getattr(args, "export_model", True)) and not args.smoke_test,
        init_from=_init_from(args, storage.join(run_dir, "train", run_name),
                             endpoint_url=args.s3_endpoint_url),
        progress_seconds=args.progress_seconds)


def _init_from(args: argparse.Namespace, own_checkpoints: Path | str, *,
               endpoint_url: str | None = None) -> str | None:
    """--init-from as the absolute path of the state file it names, checked before any
    worker starts (a wrong path is one line, not a failed run). A run that resumes from
    its own checkpoints ignores it, so then a path that no longer resolves is no error."""
    if not getattr(args, "init_from", None):
        return None
    from pipeline.train.checkpoints import checkpoint_dirs, init_state_file

    try:
        path = str(init_state_file(args.init_from).resolve())
    except (OSError, ValueError) as e:
        if checkpoint_dirs(own_checkpoints, endpoint_url=endpoint_url):
            return None  # resuming: the weights come from the run's own checkpoint
        raise SystemExit(str(e)) from None
    if args.pretrain_epochs:
        print(f"note: --init-from with {args.pretrain_epochs} CE pre-training epochs first; "
              f"--pretrain-epochs 0 starts the noise phase at once (the paper's code's "
              f"protocol after a finished CE run)", flush=True)
    return path


def _source(path_or_url: str | os.PathLike | None) -> str | None:
    if path_or_url is None:
        return None
    s = str(path_or_url)
    return s if "://" in s else str(Path(s).expanduser().resolve())


def _check_local_split(path: Path, *, option: str, split: str) -> None:
    """One clear line (SystemExit) when a local split folder is not there or is no split."""
    from pipeline.data.manifest import MANIFEST_NAME

    if (path / MANIFEST_NAME).is_file():
        return
    if option == "--data":
        root = path.parent
        if not root.is_dir():
            raise SystemExit(f"error: --data {root}: no such folder")
        if (root / MANIFEST_NAME).is_file():
            raise SystemExit(f"error: --data {root} is a split folder (it holds "
                             f"{MANIFEST_NAME}); --data takes the shard root that holds "
                             f"{split}/ (or pass --train-shards {root})")
        have = sorted(p.name for p in root.iterdir() if (p / MANIFEST_NAME).is_file())
        hint = (f"its splits are {have}: pick one with --train-split" if have else
                "convert a dataset first with `python -m shards` (lccn-shards)")
        raise SystemExit(f"error: --data {root}: no split {split!r} ({path / MANIFEST_NAME} "
                         f"is missing); {hint}")
    if not path.is_dir():
        raise SystemExit(f"error: {option} {path}: no such folder")
    splits = sorted(p.name for p in path.iterdir() if (p / MANIFEST_NAME).is_file())
    if splits:
        raise SystemExit(f"error: {option} {path} is a shard root with splits {splits}, not "
                         f"a split folder; pass {option} {path / splits[0]} or --data {path}")
    raise SystemExit(f"error: {option} {path}: no {MANIFEST_NAME} (not a converted split)")


def resolve_sources(args: argparse.Namespace) -> tuple[str, str | None]:
    train = args.train_shards or (args.data / args.train_split if args.data else None)
    test = args.test_shards or (args.data / args.test_split if args.data else None)
    if train is None:
        raise SystemExit("error: give --data DIR (or --train-shards), or run --smoke-test")
    if "://" not in str(train):
        _check_local_split(Path(train).expanduser(),
                           option="--train-shards" if args.train_shards else "--data",
                           split=args.train_split)
    if test is not None and "://" not in str(test) and not Path(test).is_dir():
        print(f"note: no test split at {test}; training without evaluation", flush=True)
        test = None
    return _source(train), _source(test)


def check_sources(args: argparse.Namespace, train: str, test: str | None) -> Manifest:
    """The splits' manifests (local or remote) as every worker will check them, before Ray
    starts: the same classes, a shard per worker (one clear line otherwise). Returns the
    training split's."""
    train_manifest = split_manifest(train, args)
    try:
        check_splits(train_manifest, split_manifest(test, args) if test else None,
                     world_size=args.num_workers, train_where=train, test_where=test)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return train_manifest


def split_manifest(source: str, args: argparse.Namespace) -> Manifest:
    """The manifest of a split folder or URL (s3://, http(s)://), as the workers read it;
    one clear line (SystemExit) when it cannot be read."""
    from pipeline.data.stream import LoaderConfig, load_manifest

    try:
        return load_manifest(source, cfg=LoaderConfig(
            s3_endpoint_url=getattr(args, "s3_endpoint_url", None)))
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {source}: cannot read its manifest ({e})") from None


def load_view(args: argparse.Namespace, train: str, *,
              manifest: Manifest | None = None) -> LabelView:
    """--label-view (checked against the training split's ``manifest``, read when not
    given), else the --noise spec applied to the training split's labels. With --label-view
    the trusted-set options only switch LCCN+ on: the saved view carries its trusted set
    (``lccn-labelview --trusted``)."""
    if args.label_view is not None:
        view = LabelView.load(args.label_view)
        check_label_view(view, manifest or split_manifest(train, args), where=train)
        if trusted_spec(args) is not None and not view.trusted.any():
            raise SystemExit(f"error: --label-view {args.label_view} has no trusted samples, and "
                             f"the trusted-set options choose them only for a view built from "
                             f"--noise; build the view with lccn-labelview --trusted '...'")
        return view
    if "://" in train:
        raise SystemExit("error: a remote training split needs --label-view (a saved .npz; "
                         "build it with `python -m shards.labelview`)")
    from shards.labelview import build_view

    try:
        spec = json.loads(args.noise)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --noise is not valid JSON ({e}): {args.noise!r}") from None
    trusted = trusted_spec(args)
    if trusted is not None:
        spec["trusted"] = trusted
    return build_view(train, spec, checksums=getattr(args, "verify_checksums", True))


# -- tiny generated shards for --smoke-test ---------------------------------------------------


def write_synthetic_shards(out: Path, *, dataset: str, num_classes: int, size: tuple[int, int],
                           n_train: int, n_test: int, seed: int, shard_size: int,
                           noisy_web_labels: bool,
                           classes: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Generated RGB images of ``size`` (H, W) (a class colour plus noise, encoded as PNG)
    as ``out/train`` and ``out/test`` splits. ``noisy_web_labels``: the training split
    stores a web-like noisy ``label`` (30% flipped to the next class) with ``clean`` known
    for every other sample (as Clothing1M); otherwise ``label`` = ``clean`` (as CIFAR).
    Reuses splits already written there. Returns the two split folders."""
    from shards.writer import SampleRecord, WriterOptions, write_split

    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(num_classes, 3))
    classes = list(classes) or [f"class{c}" for c in range(num_classes)]
    if len(classes) != num_classes:
        raise ValueError(f"{len(classes)} class names for {num_classes} classes")
    dirs = []
    for split, n in (("train", n_train), ("test", n_test)):
        if (out / split / "manifest.json").is_file():
            dirs.append(out / split)
            continue
        labels = np.arange(n) % num_classes
        records = []
        for i, c in enumerate(labels):
            px = np.clip(colours[c] + rng.normal(0, 40, size=(*size, 3)), 0, 255).astype(np.uint8)
            label, clean = int(c), int(c)
            if noisy_web_labels and split == "train":
                if rng.random() < 0.3:
                    label = (int(c) + 1) % num_classes
                clean = int(c) if i % 2 == 0 else -1
            records.append(SampleRecord(idx=i, label=label, clean=clean, key=f"{split}/{i:05d}.png",
                                        pixels=px))
        write_split(records, out, dataset=dataset, split=split, classes=classes,
                    options=WriterOptions(shard_size=shard_size, progress=False))
        dirs.append(out / split)
    return dirs[0], dirs[1]


# -- the driver --------------------------------------------------------------------------------


def connect_ray() -> bool:
    """Connect to the cluster at ``RAY_ADDRESS`` (set by ``ray job submit``) or, without
    it, start a local Ray instance bound to 127.0.0.1 (``address="local"``: never attach to
    some other cluster found through ``/tmp/ray/ray_current_cluster``). No-op when already
    connected; returns whether this call connected (:func:`pipeline.cluster.ray_train.init_ray`)."""
    from pipeline.cluster.ray_train import init_ray

    return init_ray()


def stop_on_sigterm() -> Any:
    """SIGTERM (``kill``, ``timeout``, a pod's termination) stops the run as Ctrl-C does:
    Ray Train's SIGINT handler, registered while the run trains, aborts it gracefully (its
    checkpoints kept, the resume hint printed). Without this, Ray's own handler in the
    driver aborts the process with a stack dump. Main thread only (a sweep's trials run in
    threads, and Tune handles the signals there). Returns the handler it replaced, for
    :func:`restore_sigterm` (None where it installed none, or where the replaced one was not
    set from Python, as Ray's in a driver: that one cannot be put back, and this one stays)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def forward(signum: int, frame: Any) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, forward)


def restore_sigterm(previous: Any) -> None:
    import signal

    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def run_job(args: argparse.Namespace, *, job: str, run: RunConfig, dist: DistConfig,
            view: LabelView, log: list[str] | None = None,
            callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Fit (or resume) the run on Ray, print a summary and write ``results/<run>.json``
    under the run dir (and the method's end-of-run files beside it, LCCN*'s
    ``results/<run>-outliers.csv``). Returns the summary dict. ``callbacks``: Ray Train callbacks for the
    trainer (a sweep trial's report to Tune)."""
    import ray

    from pipeline.cluster.ray_train import fit_distributed
    from pipeline.train.checkpoints import resume_problem

    problem = resume_problem(run, dist) or tracking_access_problem(dist.tracking_uri)
    if problem:
        raise SystemExit(f"error: {problem}")
    if run.lccn.use_trusted and not view.trusted.any():
        raise SystemExit("error: LCCN+ (a trusted-set option) was asked for, but the label view "
                         "has no trusted samples")
    for line in [*(log or []), *filter(None, [small_batch_warning(run, dist)])]:
        print(line, flush=True)
    print(f"[{job}] run {dist.run_name!r} in {dist.run_dir}: {dist.num_workers} workers "
          f"({'GPU' if dist.use_gpu else 'CPU'}), method {run.method}, model {run.model.name}, "
          f"{run.optim.epochs} epochs ({run.optim.pretrain_epochs} CE), global batch "
          f"{run.optim.batch_size}, N = {len(view)}, K = {view.num_classes}; MLflow "
          f"{redact_uri(dist.tracking_uri) or 'off'}", flush=True)
    keys = None
    if run.method == "lccn" and run.lccn.outlier and "://" not in dist.train_source:
        from pipeline.data.split_labels import read_split_labels  # outliers.csv names each sample

        keys = list(read_split_labels(dist.train_source)["key"])
    started = connect_ray()
    previous_sigterm = stop_on_sigterm()
    t0 = time.perf_counter()
    try:
        out = fit_distributed(run, dist, view, max_failures=args.max_failures,
                              cpus_per_worker=args.cpus_per_worker, callbacks=callbacks,
                              sample_keys=keys)
    except (KeyboardInterrupt, SystemExit):  # Ray Train's Ctrl-C handler aborts, then exits
        print(f"[{job}] interrupted: to resume from the run's last checkpoint, run the same "
              f"command with --run-name {dist.run_name} --run-dir {dist.run_dir}", flush=True)
        raise
    finally:
        restore_sigterm(previous_sigterm)
        if started:
            ray.shutdown()
    seconds = time.perf_counter() - t0
    metrics = dict(out["metrics"] or {})
    state = out["state"] or {}
    summary = {
        "job": job, "run_name": dist.run_name, "run_dir": dist.run_dir, "seconds": seconds,
        "metrics": metrics, "checkpoint": out["checkpoint"], "store": out["store"],
        "mlflow_run_id": state.get("mlflow_run_id"),
        "tracking_uri": redact_uri(dist.tracking_uri),
        "epoch": state.get("epoch"), "global_step": state.get("global_step"),
        "history": state.get("history"),  # one row per epoch, data counters included
        "selected": selected_epoch(state.get("history") or []),
        "transition": None if out["phi"] is None else out["phi"].tolist(),
        "true_transition": None if view.transition is None else view.transition.tolist(),
    }
    if out["phi"] is not None:
        print("learned transition phi[k, j] = P(observed=j | latent=k):")
        print(format_transition(out["phi"].numpy(), rows="latent"))
        if view.transition is not None:
            print("true transition:")
            print(format_transition(view.transition))
    print(f"[{job}] done in {seconds:.0f} s: " + summary_line(metrics), flush=True)
    sel = summary["selected"]
    if sel is not None and sel["by"] == "val_top1":
        test = sel["test_top1"]
        test = f"{test:.4f}" if isinstance(test, float) else "not measured"
        print(f"[{job}] selected epoch {sel['epoch'] + 1} (best noisy-validation accuracy "
              f"{sel['val_top1']:.4f}): clean test accuracy {test}", flush=True)
    summary["metrics"] = measured(metrics)
    summary["label_issues"] = label_issue_report(state, view=view, dist=dist,
                                                 run_id=summary["mlflow_run_id"])
    results = storage.join(dist.run_dir, "results")
    summary["files"] = {}
    with storage.staged(results, endpoint_url=dist.s3_endpoint_url) as out_dir:
        for name, text in (out.get("files") or {}).items():  # LCCN*: outliers.csv
            (out_dir / f"{dist.run_name}-{name}").write_text(text)
            path = storage.join(results, f"{dist.run_name}-{name}")
            summary["files"][name] = str(path)
            print(f"[{job}] {name}: {path}" + (f" ({_flagged(text)})"
                                               if name.startswith("outliers") else ""),
                  flush=True)
        exported = dist.export_path
        if dist.export_model and storage.is_file(exported, endpoint_url=dist.s3_endpoint_url):
            summary["files"]["model"] = str(exported)
            print(f"[{job}] model: {exported} (torch.export; `lccn-predict {exported} IMAGES "
                  f"--out predictions.csv`" + (", once downloaded" if storage.is_remote(exported)
                                               else "") + ")", flush=True)
        (out_dir / f"{dist.run_name}.json").write_text(
            json.dumps(json_safe(summary), indent=1, default=str, allow_nan=False))
    return summary


def label_issue_report(state: dict[str, Any], *, view: LabelView, dist: DistConfig,
                       run_id: str | None) -> dict[str, Any] | None:
    """The run's label-issue report (an LCCN method's run with ``--report-epochs`` > 0):
    files under ``<run-dir>/label_issues/<run>/``, the same as MLflow artifacts
    ``label_issues/`` of the run; None for other methods."""
    from pipeline.track.label_issues import job_report

    out = storage.join(dist.run_dir, "label_issues", dist.run_name)
    with storage.staged(out, endpoint_url=dist.s3_endpoint_url) as local:
        rep = job_report(state, clean=view.clean, train_source=dist.train_source,
                         class_names=dist.class_names, out_dir=local,
                         tracking_uri=dist.tracking_uri, run_id=run_id)
    if rep is not None and local != out:
        rep["files"] = [str(storage.join(out, Path(f).name)) for f in rep["files"]]
    if rep is not None:
        flagged = rep["flagged_mislabelled"]
        lines = [f"label-issue report: {flagged} suspected mislabelled samples"
                 + ("" if rep["flagged_outliers"] is None else
                    f", {rep['flagged_outliers']} suspected out of distribution")
                 + f" in {out}"]
        for ev in rep["evaluation"]:
            lines.append(f"  {ev['split']} {ev['kind']} ({ev['issues']} of the "
                         f"{ev['evaluated']} with a clean label): {ev['method']} precision "
                         f"at {ev['issues']} {ev['r_precision']:.3f}, flagged {ev['flagged']} "
                         f"of those {ev['evaluated']}")
        print("\n".join(lines), flush=True)
    return rep


def _flagged(outliers_csv: str) -> str:
    """``"F of N samples flagged"`` for an ``outliers.csv`` text."""
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(outliers_csv)))
    flagged = sum(r["flag"] == "1" for r in rows)
    return f"{flagged} of {len(rows)} training samples flagged as outliers"


def selected_epoch(history: list[dict[str, float]]) -> dict[str, Any] | None:
    """The epoch a practitioner keeps: the highest noisy-validation accuracy ``val_top1``
    (:func:`pipeline.train.engine.select_epoch`; the last epoch without a validation split), with
    its clean test accuracy. ``epoch`` is the history row's 0-based index (as every
    ``epoch`` in the results JSON and the MLflow steps); ``epoch_number`` counts from 1, as
    the printed lines do."""
    from pipeline.train.engine import select_epoch

    if not history:
        return None
    i = select_epoch(history)
    row = history[i]
    e = int(row.get("epoch", i))
    return {"epoch": e, "epoch_number": e + 1, "val_top1": row.get("val_top1"),
            "test_top1": row.get("test_top1"),
            "by": "val_top1" if any(math.isfinite(r.get("val_top1", math.nan)) for r in history)
            else "last"}


SUMMARY_KEYS = ("test_top1", "val_top1", "label_recovery", "transition_error", "staleness",
                "staleness_max", "sync_time", "sampler_share", "steps_per_s", "images_per_s")


def measured(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without the values that could not be measured (NaN or infinite: e.g. the
    transition error of a run on the dataset's own labels, which has no true transition)."""
    return {k: v for k, v in metrics.items()
            if not (isinstance(v, float) and not math.isfinite(v))}


def summary_line(metrics: dict[str, Any], keys: tuple[str, ...] = SUMMARY_KEYS) -> str:
    """``key value`` pairs of the measured ``keys`` (what cannot be measured is left out)."""
    m = measured(metrics)
    return "  ".join(f"{key} {m[key]:.4g}" for key in keys if isinstance(m.get(key), float))


def noise_phase_steps(run: RunConfig, manifest: Manifest, world_size: int) -> list[int]:
    """The steps of every epoch of the noise phase (after the CE pre-training) per worker,
    from the loader's own plan of each epoch (whole shards per rank; the noisy-validation
    samples are dropped from the batches, not from the count of steps)."""
    from pipeline.data.stream import plan_epoch

    counts = [s.num_samples for s in manifest.shards]
    per_rank = max(1, run.optim.batch_size // world_size)
    return [plan_epoch(counts, world_size=world_size, num_workers=1, batch_size=per_rank,
                       seed=run.seed, epoch=e, shuffle=True).steps
            for e in range(run.optim.pretrain_epochs, run.optim.epochs)]


def warmup_covers_phase(run: RunConfig, manifest: Manifest, world_size: int) -> str | None:
    """A warning when δ (``warmup_steps``) lasts at least the whole LCCN phase: Eq. 7 then
    never reads the counts, so α and the learned transition change nothing (a sweep over α
    on a short run measures noise). None otherwise, for methods without a chain, and without
    an LCCN phase. The phase's steps are every rank's, from the loader's own plan of each
    epoch (whole shards per rank; the noisy-validation samples are dropped from the batches,
    not from the count of steps)."""
    epochs = run.optim.epochs - run.optim.pretrain_epochs
    if run.method not in ("lccn", "divide_lccn") or run.lccn.warmup_steps == 0 or epochs <= 0:
        return None
    per_epoch = noise_phase_steps(run, manifest, world_size)
    steps = sum(per_epoch)
    if run.lccn.warmup_steps < steps:
        return None
    return (f"--warmup-steps {run.lccn.warmup_steps:,} covers the whole LCCN phase ({epochs} "
            f"epochs, {steps:,} steps per worker): Eq. 7 never reads the counts, so alpha and "
            f"the learned transition change nothing; give --warmup-steps below {steps:,} (one "
            f"epoch: {per_epoch[0]:,})")


def _options(names: Any) -> str:
    """Recipe field names as the command line spells them: ``--pretrain-epochs ...``."""
    return " ".join("--" + n.replace("_", "-") for n in names)


def prepare(args: argparse.Namespace, *, job: str, preset: Preset) -> list[str]:
    """Normalise parsed arguments shared by every job; returns log lines to print."""
    log = []
    args.in_channels = preset.in_channels
    rec = resolve_recipe(args)
    given = args.recipe_given
    if rec is not PRESETS.get(rec.name) and rec.name == preset.name and not args.smoke_test:
        log.append(f"[{job}] --method {args.method} runs its own {rec.name} recipe: "
                   f"{rec.epochs} epochs ({rec.pretrain_epochs} warm-up), batch "
                   f"{rec.batch_size}, lr {rec.lr:g} ({rec.source})")
    if args.smoke_test:
        apply_smoke(args)
        fixed = [g for g in given if g in SMOKE_FIXED]
        log.append(f"[{job}] --smoke-test: 2 CPU workers, small_cnn, 3 epochs (1 CE), global "
                   f"batch 64, tiny generated shards under {work_dir(args, job)}/smoke-data"
                   + (f" (these replace {_options(fixed)} from the command line)"
                      if fixed else ""))
    if args.run_name is None:  # a new run each time; pass --run-name to resume one
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.run_name = f"{job}-{args.method}" + ("-smoke" if args.smoke_test else "") + f"-{stamp}"
    if rec.note and not args.smoke_test:
        if given:  # the note speaks of the preset's own schedule, which these options change
            log.append(f"[{job}] preset {rec.name}, with {_options(given)} from the command "
                       f"line (the preset itself: {rec.note})")
        else:
            log.append(f"[{job}] preset {rec.name}: {rec.note}")
    args.run_dir = normal_run_dir(args.run_dir)
    return log


def manifest_classes(train: str) -> list[str]:
    if "://" in train:
        return []
    return list(Manifest.load(train).classes)




@dataclass(frozen=True)
class SmokeData:
    """What ``--smoke-test`` generates for a dataset job (see :func:`write_synthetic_shards`)."""

    dataset: str
    num_classes: int
    size: tuple[int, int]
    n_train: int = 256
    n_test: int = 64
    shard_size: int = 32
    noisy_web_labels: bool = False
    noise: str | None = None  # the label view spec used in the smoke test (None: --noise)
    classes: tuple[str, ...] = ()  # class names (default class0, class1, ...)


def dataset_parser(*, job: str, preset: Preset, description: str, epilog: str,
                   noise_default: str, train_split: str, test_split: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(p, noise_default=noise_default)
    add_common_args(p, preset, job=job)
    p.set_defaults(train_split=train_split, test_split=test_split)
    return p


@dataclass
class JobRun:
    """Everything a job hands to :func:`run_job`: the configs, the label view and the log
    lines to print first (built by a job's ``prepare_run(args)``; a sweep trial changes
    ``run`` before running it). ``run_warnings`` are the lines that speak of ``run`` (the
    warm-up warning): a trial that changes ``run`` replaces them with its own."""

    run: RunConfig
    dist: DistConfig
    view: LabelView
    log: list[str]
    manifest: Manifest | None = None  # the training split's, where the job read it
    run_warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What the run prints first: ``log``, then ``run_warnings``."""
        return [*self.log, *self.run_warnings]


def dataset_main(args: argparse.Namespace, *, job: str, preset: Preset, smoke: SmokeData,
                 extra_log: list[str] | None = None) -> dict[str, Any]:
    """The body of a dataset job: smoke data or the given shards -> label view -> run."""
    jr = dataset_setup(args, job=job, preset=preset, smoke=smoke, extra_log=extra_log)
    return run_job(args, job=job, run=jr.run, dist=jr.dist, view=jr.view, log=jr.lines())


def dataset_setup(args: argparse.Namespace, *, job: str, preset: Preset, smoke: SmokeData,
                  extra_log: list[str] | None = None) -> JobRun:
    """A dataset job up to the run: smoke data or the given shards -> label view ->
    configs (nothing is trained)."""
    log = prepare(args, job=job, preset=preset) + list(extra_log or [])
    if args.smoke_test:
        out = work_dir(args, job) / "smoke-data" / smoke.dataset
        train_dir, test_dir = write_synthetic_shards(
            out, dataset=smoke.dataset, num_classes=smoke.num_classes, size=smoke.size,
            n_train=smoke.n_train, n_test=smoke.n_test, seed=args.seed,
            shard_size=smoke.shard_size, noisy_web_labels=smoke.noisy_web_labels,
            classes=smoke.classes)
        args.train_shards, args.test_shards = str(train_dir), str(test_dir)
        log += local_data_note(args, job, out)
        if smoke.noise is not None:
            args.noise = smoke.noise
        log.append(f"[{job}] smoke data: {smoke.n_train}/{smoke.n_test} generated "
                   f"{smoke.size[0]}x{smoke.size[1]} images, {smoke.num_classes} classes in {out}; "
                   f"label view {args.noise}")
    train, test = resolve_sources(args)
    train_manifest = check_sources(args, train, test)
    try:
        view = load_view(args, train, manifest=train_manifest)
    except ValueError as e:  # ManifestError (a shard that does not match), a bad --noise spec
        raise SystemExit(f"error: {e}") from None
    try:
        run = run_config(args)
    except ValueError as e:  # a config value out of range (--alpha 0, --ema-decay 1, ...)
        raise SystemExit(f"error: {e}") from None
    check_transition_file(run, view.num_classes)
    note = warmup_covers_phase(run, train_manifest, args.num_workers)
    dist = dist_config(args, run_name=args.run_name, train=train, test=test,
                       class_names=manifest_classes(train), transform=preset.transform)
    return JobRun(run=run, dist=dist, view=view, log=log, manifest=train_manifest,
                  run_warnings=[f"[{job}] warning: {note}"] if note else [])
