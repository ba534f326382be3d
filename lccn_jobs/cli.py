"""The command line the jobs share: the run options, the config flags
(:mod:`pipeline.core.options`, a recipe's value unless given), the LCCN+ trusted set, the
data options, and where a run's files go.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipeline.core import storage
from pipeline.core.cli import run_location
from pipeline.core.options import FLAGS, UNSET, add_option_groups
from pipeline.track.tracking import add_tracking_options
from pipeline.train.methods import registered

# the config fields a job takes from the command line (pipeline.core.options.FLAGS)
JOB_FLAGS = tuple(FLAGS)
# those whose default is the recipe's (a recipe of lccn_jobs.recipes may set them; a field
# none sets keeps the library's default)
RECIPE_FLAGS = ("--model", "--epochs", "--pretrain-epochs", "--batch-size", "--lr",
                "--milestones", "--lr-decay", "--weight-decay", "--ema-decay",
                "--norm-weight-decay", "--bn-momentum", "--alpha", "--warmup-steps", "--warmup",
                "--targets", "--ramp-epochs", "--anneal", "--mixmatch-alpha", "--lambda-u",
                "--p-threshold", "--temperature", "--conf-penalty")
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


# -- where a run's files go ---------------------------------------------------------------------


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


# -- the parser ---------------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser, *, job: str, dataset: str,
                    method: str) -> None:
    """Options every job shares; ``method``: the default of ``--method``; the recipe
    options default to the recipe of ``dataset`` and the method (None: the recipe's)."""
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
    g.add_argument("--decode", choices=["cpu", "device", "auto"], default="cpu",
                   help="where images are decoded and augmented: cpu (the loader processes), "
                        "device (JPEG bytes to the worker, decoded and augmented on its GPU: "
                        "nvJPEG), auto (device on GPU workers); LoaderConfig.decode")
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
    g.add_argument("--experiment", default=f"lccn-{job}",
                   help="MLflow experiment (created by the driver, its artifacts beside a "
                        "local store: <run-dir>/mlartifacts)")
    g.add_argument("--register-model", default=None, metavar="NAME",
                   help="register the run's logged model (an MLflow LoggedModel, always "
                        "logged) in the MLflow Model Registry as NAME, a new version each run")
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

    m = p.add_argument_group(
        f"method and recipe (defaults: the recipe of --method on {dataset}, the papers' "
        f"schedules: the table 'Presets' in docs/methods.md)")
    m.add_argument("--method", choices=registered(), default=method,
                   help="lccn, the ce baseline, dividemix / divide_lccn (two networks), or a "
                        "classic baseline: bootstrap (hard, Reed et al.), forward (Patrini et "
                        "al.), sadapt (S-adaptation, Goldberger & Ben-Reuven), trevision "
                        "(T-Revision, Xia et al.); each after the same CE pre-training "
                        "(docs/methods.md)")
    m.add_argument("--pretrained", action=argparse.BooleanOptionalAction, default=None,
                   help="ImageNet weights for the backbone (default: the recipe's; on for "
                        "clothing1m and your own images): resnet50's from the torch hub "
                        "cache, a timm or torchvision backbone's from --weights FILE "
                        "(`python -m pipeline.train.models fetch timm:NAME --out DIR` writes "
                        "DIR/timm-NAME.pth) or timm's local Hugging Face cache; checked "
                        "before Ray starts")
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


def add_data_args(p: argparse.ArgumentParser, *, noise_default: str | None,
                  noise_help: str) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, default=None,
                   help="shard root with one folder per split (from `python -m shards`)")
    g.add_argument("--train-split", default="train")
    g.add_argument("--test-split", default="test")
    g.add_argument("--train-shards", default=None,
                   help="training split folder or base URL (overrides --data/--train-split)")
    g.add_argument("--test-shards", default=None, help="test split folder or base URL")
    g.add_argument("--noise", default=noise_default,
                   help=f"label view spec as JSON (pipeline/core/noise.py; default {noise_help})")
    g.add_argument("--label-view", type=Path, default=None,
                   help="a saved label view (.npz) instead of --noise (needed for URL sources)")
