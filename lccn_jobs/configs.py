"""A job's configs from its recipe and its command line (:func:`job_config`): one point of
the RunConfig, the recipe's values with the options given on the command line over them
(and ``--smoke-test``'s over both), applied with :func:`pipeline.core.options.apply_point`;
the LCCN+ trusted set and the baselines' options the arguments ask for; the checks a job
makes before Ray starts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lccn_jobs.cli import JOB_FLAGS, RECIPE_FLAGS, normal_run_dir, work_dir
from lccn_jobs.recipes import RECIPES, Recipe, recipe
from pipeline.core.baselines import load_transition
from pipeline.core.config import BaselineConfig, LCCNConfig, RunConfig, scaled_lr_values
from pipeline.core.options import FLAGS, apply_point, dest, options_point, value_at
from pipeline.data.manifest import Manifest
from pipeline.data.stream import plan_epoch
from pipeline.train.methods import get_method
from pipeline.train.models import pretrained_weights_problem

# the recipe options (dest names): the config flags whose default is the recipe's, and the
# recipe's two values outside the RunConfig
RECIPE_OPTIONS = (*(dest(f) for f in RECIPE_FLAGS), "lr_values", "pretrained")
# what --smoke-test sets whatever was given (its other settings: apply_smoke)
SMOKE_POINT = {"model.name": "small_cnn", "optim.epochs": 3, "optim.pretrain_epochs": 1,
               "optim.batch_size": 64, "optim.milestones": (), "optim.lr": 0.05}
SMOKE_FIXED = ("model", "pretrained", "epochs", "pretrain_epochs", "batch_size", "milestones",
               "lr_values", "lr")  # the recipe options --smoke-test replaces


@dataclass(frozen=True)
class JobConfig:
    """What a job runs: ``run`` and the two values of a recipe outside the RunConfig
    (``lr_values``, ``pretrained``: :class:`pipeline.cluster.worker.DistConfig`'s), from
    ``recipe``; ``given``: the recipe options the command line set (dest names, sorted)."""

    run: RunConfig
    recipe: Recipe
    lr_values: tuple[float, ...]
    pretrained: bool
    given: tuple[str, ...]


def given_options(args: argparse.Namespace) -> tuple[str, ...]:
    """The recipe options set on the command line (those left unset are None)."""
    return tuple(sorted(n for n in RECIPE_OPTIONS if getattr(args, n, None) is not None))


def job_config(args: argparse.Namespace, dataset: str) -> JobConfig:
    """The configs of the parsed arguments: the recipe of ``dataset`` and ``args.method``
    (a recipe value of a field the method never reads, ``Method.ignores``, left out: the
    library's default instead), the options given over it, then ``--smoke-test``'s.

    A recipe's per-phase rates yield to the schedule options given: ``--milestones`` or
    ``--lr-decay`` replace them (lr x lr-decay at each milestone), ``--lr`` scales them to
    start at it; ``--scale-lr`` scales the recipe's lr and rates by ``--batch-size`` / the
    recipe's batch. One clear line (SystemExit) for a schedule that does not fit or a value a
    config refuses."""
    rec = recipe(dataset, args.method)
    given = given_options(args)
    ignored = get_method(args.method).ignores
    point = {k: v for k, v in rec.point.items() if k not in ignored}
    rec_run = apply_point(RunConfig(), point)

    def chosen(name: str) -> Any:  # the given value, else the recipe's
        value = getattr(args, name)
        return value if value is not None else value_at(rec_run, FLAGS[_flag(name)])

    lr_values = list(args.lr_values if args.lr_values is not None else rec.lr_values)
    if rec.lr_values and "lr_values" not in given:
        if {"milestones", "lr_decay"} & set(given):  # lr decayed by lr_decay at the milestones
            lr_values = []
        elif "lr" in given:  # the recipe's phases, scaled to start at --lr
            try:
                lr_values = list(scaled_lr_values(rec.lr_values, args.lr))
            except ValueError as e:
                raise SystemExit(f"error: --lr: {e}") from None
    extra: dict[str, Any] = {"method": args.method}
    if getattr(args, "scale_lr", False):
        if {"lr", "lr_values"} & set(given):
            raise SystemExit("error: --scale-lr scales the recipe's lr to --batch-size: give "
                             "it or --lr / --lr-values, not both")
        factor = chosen("batch_size") / rec.get("optim.batch_size")
        extra["optim.lr"] = rec.get("optim.lr") * factor
        lr_values = [v * factor for v in lr_values]
    epochs, pre = chosen("epochs"), chosen("pretrain_epochs")
    if not args.smoke_test and pre != "auto" and not 0 <= pre <= epochs:
        whose = {k: "" if k in given else f" (the {rec.name} recipe's)"
                 for k in ("epochs", "pretrain_epochs")}
        raise SystemExit(f"error: --epochs {epochs}{whose['epochs']} is fewer than "
                         f"--pretrain-epochs {pre}{whose['pretrain_epochs']}, "
                         f"the cross-entropy epochs it starts with: give both")
    milestones = list(chosen("milestones"))
    if lr_values and len(lr_values) != len(milestones) + 1:
        raise SystemExit(f"error: --lr-values {' '.join(f'{v:g}' for v in lr_values)} "
                         f"needs one rate per phase, len(--milestones) + 1 = "
                         f"{len(milestones) + 1} (milestones {milestones})")
    pretrained = args.pretrained if args.pretrained is not None else rec.pretrained
    if rec.pretrained and not pretrained and rec.scratch_pretrain_share is not None \
            and "pretrain_epochs" not in given and not args.smoke_test:
        # from scratch: a third of the run (the paper's CIFAR recipe: 40 of 120 epochs); on
        # CIFAR-10N random1, seed 0 (cifar_real.md), 3 CE epochs of 30 left LCCN 2.30 points
        # below CE at the final epoch, 10 of 30 0.79 (with the chain's warm-up of half an
        # epoch, own_images.WARMUP_EPOCHS, level with CE over three seeds)
        extra["optim.pretrain_epochs"] = max(int(rec.get("optim.pretrain_epochs")),
                                             round(epochs * rec.scratch_pretrain_share))
    if args.smoke_test:
        extra.update(SMOKE_POINT, **{"lccn.warmup_steps": min(chosen("warmup_steps"), 2)})
        lr_values, pretrained = [], False
    own = [f for f in JOB_FLAGS if not FLAGS[f].startswith("baseline.")]
    base = RunConfig(lccn=LCCNConfig(use_trusted=uses_trusted(args)),
                     baseline=baseline_config(args))
    try:  # a config value out of range (--alpha 0, --ema-decay 1, ...)
        run = apply_point(base, {**point, **options_point(args, own), **extra})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    weights = run.model.weights
    if weights is not None and "://" not in weights:
        # the workers chdir into Ray's run directory: the file by its absolute path
        path = Path(weights).expanduser().resolve()
        if not path.is_file():
            raise SystemExit(f"error: --weights {weights}: no such file (write it with "
                             f"`python -m pipeline.train.models fetch {run.model.name} --out DIR`)")
        run = replace(run, model=replace(run.model, weights=str(path)))
    if weights is not None and not pretrained:
        raise SystemExit("error: --weights is read with --pretrained: add it, or leave "
                         "--weights out")
    return JobConfig(run=run, recipe=rec, lr_values=tuple(lr_values), pretrained=pretrained,
                     given=given)


def check_pretrained(cfg: JobConfig, *, smoke: bool = False) -> None:
    """The pretrained backbone's weights where the run will look for them (a file, timm's
    local cache, the torch hub cache), checked on the driver before Ray starts and before
    any data is converted: one line naming ``--no-pretrained`` and the fetch command
    (SystemExit) instead of failed workers."""
    if smoke or not cfg.pretrained:
        return
    problem = pretrained_weights_problem(cfg.run.model.name, cfg.run.model.weights)
    if problem:
        raise SystemExit(f"error: {problem}")


def _flag(name: str) -> str:
    """A recipe option's dest name as the command line spells it: ``--pretrain-epochs``."""
    return "--" + name.replace("_", "-")


def _options(names: Any) -> str:
    """Recipe option names as the command line spells them: ``--pretrain-epochs ...``."""
    return " ".join(map(_flag, names))


def apply_smoke(args: argparse.Namespace) -> None:
    """--smoke-test's run options: 2 CPU workers, no loader processes, a small shuffle
    buffer, a mid-epoch checkpoint (its configs: :data:`SMOKE_POINT`)."""
    args.num_workers, args.gpu, args.loader_workers = 2, False, 0
    args.shuffle_buffer = 64
    args.checkpoint_every = args.checkpoint_every or 10


def prepare(args: argparse.Namespace, *, job: str, dataset: str
            ) -> tuple[JobConfig, list[str]]:
    """The job's configs (:func:`job_config`) and the normalised arguments every job
    shares (run name, run dir, --smoke-test's options); returns the configs and the log
    lines to print."""
    log = []
    cfg = job_config(args, dataset)
    rec, given = cfg.recipe, cfg.given
    pre, rec_pre = cfg.run.optim.pretrain_epochs, rec.get("optim.pretrain_epochs")
    if "pretrain_epochs" not in given and pre != rec_pre and not args.smoke_test:
        log.append(f"[{job}] --no-pretrained: the cross-entropy warm-up is {pre} of the "
                   f"{cfg.run.optim.epochs} epochs (the {rec.name} recipe's {rec_pre} are for "
                   f"an ImageNet backbone; --pretrain-epochs to choose)")
    if rec is not RECIPES[rec.name] and not args.smoke_test:
        log.append(f"[{job}] --method {args.method} runs its own {rec.name} recipe: "
                   f"{rec.get('optim.epochs')} epochs ({rec.get('optim.pretrain_epochs')} "
                   f"warm-up), batch {rec.get('optim.batch_size')}, lr "
                   f"{rec.get('optim.lr'):g} ({rec.source})")
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
    return cfg, log


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
    if run.baseline.transition != "file" or not get_method(run.method).reads_transition:
        return
    try:
        load_transition(run.baseline.transition_file, num_classes)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


def noise_phase_steps(run: RunConfig, manifest: Manifest, world_size: int) -> list[int]:
    """The steps of every epoch of the noise phase (after the CE pre-training) per worker,
    from the loader's own plan of each epoch (whole shards per rank; the noisy-validation
    samples are dropped from the batches, not from the count of steps)."""
    counts = [s.num_samples for s in manifest.shards]
    per_rank = max(1, run.optim.batch_size // world_size)
    return [plan_epoch(counts, world_size=world_size, num_workers=1, batch_size=per_rank,
                       seed=run.seed, epoch=e, shuffle=True).steps
            for e in range(run.optim.pretrain_epochs, run.optim.epochs)]


def warmup_covers_phase(run: RunConfig, manifest: Manifest, world_size: int, *,
                        per_epoch: Sequence[int] | None = None) -> str | None:
    """A warning when δ (``warmup_steps``) lasts at least the whole LCCN phase: Eq. 7 then
    never reads the counts, so α and the learned transition change nothing (a sweep over α
    on a short run measures noise). None otherwise, for methods without a chain, and without
    an LCCN phase. The phase's steps are every rank's, from the loader's own plan of each
    epoch (whole shards per rank; the noisy-validation samples are dropped from the batches,
    not from the count of steps), or ``per_epoch`` where the caller has planned them
    (:func:`noise_phase_steps`)."""
    epochs = run.optim.epochs - run.optim.pretrain_epochs
    if not get_method(run.method).needs_chain or run.lccn.warmup_steps == 0 or epochs <= 0:
        return None
    if per_epoch is None:
        per_epoch = noise_phase_steps(run, manifest, world_size)
    steps = sum(per_epoch)
    if run.lccn.warmup_steps < steps:
        return None
    return (f"--warmup-steps {run.lccn.warmup_steps:,} covers the whole LCCN phase ({epochs} "
            f"epochs, {steps:,} steps per worker): Eq. 7 never reads the counts, so alpha and "
            f"the learned transition change nothing; give --warmup-steps below {steps:,} (one "
            f"epoch: {per_epoch[0]:,})")
