"""CE vs LCCN on real CIFAR-10 (the JPEG tarball) on the CPU, over seeds, with the noisy
validation protocol.

Protocol (one setting x one seed)::

    class-balanced subset of the training JPEGs (--train-size, default 20,000)
      -> label view: asym0.5 | sym0.5 (include_true) | idn0.4 (instance-dependent, Xia et al.)
                     | clean (every label right: CE's ceiling on this budget)
      -> 5% noisy validation split carved from it (stratified, never trained on)
    CE: --epochs of SGD (lr 0.1, momentum 0.9, wd 5e-4, x0.1 at --milestones), cnn_wide
    LCCN: starts from CE's model, momentum and generator after --pretrain-epochs (the shared
          CE pre-training) and runs the remaining epochs on the same learning-rate schedule

Reported per method: test top-1 at the final epoch and at the epoch with the best noisy
validation accuracy (never the best test epoch), and for LCCN the transition error
(mean |phi - T| over the K x K entries). ``--report`` prints mean +- std over seeds.

Every LCCN epoch also records the chain's diagnostics (latent-class histogram, per-class
label recovery, phi, the collapse monitor's statistics), and the LCCN start records the
warm-up transition and the pretrained classifier's confusion: ``--plots DIR`` draws them
(``docs/fidelity.md`` shows them).

Usage::

    python benchmarks/bench_cifar.py --settings asym0.5 sym0.5 idn0.4 --seeds 0 1
    python benchmarks/bench_cifar.py --report            # the table, from the JSONs
    python benchmarks/bench_cifar.py --plots docs/img    # the diagnosis figures
    python benchmarks/bench_cifar.py --time-epoch        # size the schedule

LCCN options (``--warmup``, ``--targets``, ``--warmup-steps``, ``--alpha``, ``--init``) default
to the library's defaults (:class:`pipeline.core.config.LCCNConfig`); ``--tag`` keeps an
ablation's JSONs apart from the main ones. ``--oracle-phi`` is a diagnostic, not a method:
LCCN samples with the label view's true transition for its whole phase, which bounds what
any estimate of phi can give this classifier and budget.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline.core.config import (
    RunConfig,
)
from pipeline.core.labels import LabelView
from pipeline.core.noise import (
    asymmetric_cifar10,
    clean_view,
    format_transition,
    from_csv,
    instance_dependent,
    symmetric,
)
from pipeline.core.monitor import warmup_end_epoch
from pipeline.core.options import UNSET, add_options, apply_options, apply_point
from pipeline.core.posterior import STATE_KEY
from pipeline.data.cifar_memory import (
    CIFAR10_CLASSES,
    RandomCropFlip,
    channel_stats,
    load_cifar10,
    normalise,
)
from pipeline.data.transforms import PerImageStandardize
from pipeline.train.trainer import LocalTrainer, TensorData, select_epoch

from bench_data import DEFAULT_DATA, HUMAN_LABELS

SETTINGS = {
    "asym0.5": ("asymmetric", 0.5),
    "sym0.5": ("symmetric", 0.5),
    "idn0.4": ("instance", 0.4),
    "asym0.3": ("asymmetric", 0.3),
    "asym0.2": ("asymmetric", 0.2),
    "sym0.2": ("symmetric", 0.2),
    "clean": ("symmetric", 0.0),  # the ceiling: every label right
    # real human noise: CIFAR-10N's label sets (Wei et al. 2022), a column of HUMAN_LABELS
    "aggre": ("human", "aggre"),      # majority vote of three annotators, 9.0% wrong
    "random1": ("human", "random1"),  # the first annotator, 17.2% wrong
}


# the config fields the benchmark takes from the command line, and its protocol's defaults
FLAGS = ("--model", "--epochs", "--pretrain-epochs", "--milestones", "--lr", "--batch-size",
         "--weight-decay", "--ema-decay", "--norm-weight-decay", "--bn-momentum", "--compile", "--val-fraction",
         "--alpha", "--prior-strength", "--warmup-steps", "--warmup", "--targets", "--init", "--warmup-prior",
         "--ramp-epochs", "--refresh-steps", "--guard-drop", "--guard-patience", "--guard-targets",
         "--guard-prior-strength", "--guard-floor", "--guard-sampler", "--teacher",
         "--warmup-weights")
DEFAULTS = {"--model": "cnn_wide", "--epochs": 24, "--pretrain-epochs": 8,
            "--milestones": (16, 21), "--lr": 0.1, "--batch-size": 128,
            "--warmup-steps": UNSET}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="folder holding cifar10-jpeg.tar.gz")
    p.add_argument("--cache", type=Path,
                   default=Path(tempfile.gettempdir()) / "lccn-cifar10-cache",
                   help="folder for the decoded .npz cache")
    p.add_argument("--out", type=Path,
                   default=Path(tempfile.gettempdir()) / "lccn-bench-cifar",
                   help="folder for the per-run JSON results")
    p.add_argument("--tag", default="", help="suffix of the result files (ablations)")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                   default=["asym0.5", "sym0.5", "idn0.4"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                   help="noise, split, init, shuffling and Gibbs seed of each run")
    p.add_argument("--train-size", type=int, default=20000,
                   help="class-balanced subset of the 50,000 training images")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is the robust choice on a shared 2-core machine)")
    p.add_argument("--lr-values", type=float, nargs="*", default=[],
                   help="lr of each phase between milestones (the paper's CIFAR preset: 0.5 "
                        "0.1 0.01 at milestones 40 80); empty: --lr x0.1 per milestone")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the GPU runs of the "
                   "paper's schedule)")
    p.add_argument("--normalise", choices=["channel", "image"], default="channel",
                   help="channel: each channel by the training subset's mean and deviation, "
                        "once, before augmentation; image: each image by its own mean and "
                        "deviation after augmentation (tf.image.per_image_standardization, "
                        "the paper's code and the jobs' cifar preset; uint8 in memory)")
    p.add_argument("--augment", choices=["cropflip", "none"], default="cropflip",
                   help="cropflip: batched random crop (pad 4) and horizontal flip; none: the "
                        "stored images (with --weight-decay 0, the memorisation protocol's "
                        "stress end)")
    p.add_argument("--restart", action="store_true",
                   help="the paper's code's protocol: LCCN starts from CE's final weights "
                        "(after all --epochs; fresh momentum) and runs the whole schedule "
                        "again (--epochs more, the same milestones and rates); "
                        "--pretrain-epochs is not used")
    p.add_argument("--restart-control", action="store_true",
                   help="with --restart: restart CE instead of LCCN (the control: is the gain "
                        "the second schedule's?); its result is stored as 'ce_restart'")
    p.add_argument("--pretrain-out", type=Path, default=None,
                   help="with --methods ce: also write the state after the CE pre-training "
                        "(model, optimiser, generator, epoch rows) to this file, for an LCCN "
                        "run in another process (--pretrain-from)")
    p.add_argument("--pretrain-from", type=Path, default=None,
                   help="with --methods lccn: start LCCN from the state a CE run wrote with "
                        "--pretrain-out (waits until the file appears) instead of "
                        "pre-training here")
    p.add_argument("--pretrain-wait", type=float, default=7200.0,
                   help="seconds to wait for --pretrain-from before giving up")
    p.add_argument("--train-offset", type=int, default=0,
                   help="take each class's images from this file number on (a subset "
                        "disjoint from another run's: the pretrained-backbone case)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start every network from this model state_dict (--save-model of "
                        "another run: fine-tuning from a network trained elsewhere)")
    p.add_argument("--save-model", type=Path, default=None,
                   help="with --methods ce: write the CE model's final state_dict here")
    p.add_argument("--report-state", type=Path, default=None,
                   help="with LCCN: write the label-issue report's inputs (the averaged "
                        "posteriors, the held-out predictions, the chain and the clean "
                        "labels) to this file, for pipeline.track.label_issues.build_report")
    p.add_argument("--oracle-phi", action="store_true",
                   help="diagnostic, not a method: LCCN samples with the true transition of the "
                        "label view for its whole phase (phi_init := truth, warm-up = every "
                        "LCCN step), the bound a perfect estimate of phi gives this classifier "
                        "and budget")
    add_options(p, FLAGS, defaults=DEFAULTS, unset="one epoch of the training split",
                notes={"--ema-decay": "the paper's code: 0.9999",
                       "--norm-weight-decay": "the paper's code: 0",
                       "--bn-momentum": "the paper's code's decay 0.997 is 0.003",
                       "--refresh-steps": "the paper's code: 200"})
    p.add_argument("--methods", nargs="+", choices=["ce", "lccn"], default=["ce", "lccn"])
    p.add_argument("--time-epoch", action="store_true",
                   help="time one CE epoch (+ validation and test passes), then exit")
    p.add_argument("--report", action="store_true",
                   help="print the JSON results under --out as markdown tables and exit")
    p.add_argument("--plots", type=Path, default=None,
                   help="draw the diagnosis figures from the JSONs under --out into this folder")
    return p


# -- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cifar:
    """The benchmark's images and labels. ``features``: the channel-normalised training
    images, flattened, whatever ``--normalise`` (the instance-dependent view draws its
    flips from them, so the label views do not depend on the option; with ``--normalise
    image`` made only when an instance-dependent setting is asked for); ``normalize``: the
    module the networks apply to uint8 batches (``--normalise image``), else None."""

    train_x: torch.Tensor
    train_y: np.ndarray
    test_x: torch.Tensor
    test_y: np.ndarray
    aug: RandomCropFlip | None
    features: torch.Tensor | None
    normalize: nn.Module | None
    rows: np.ndarray | None = None   # the training subset's idx among the 50,000
    human_labels: Path | None = None  # the real-noise label file (HUMAN_LABELS)


def load_data(args: argparse.Namespace) -> Cifar:
    tar = args.data / "cifar10-jpeg.tar.gz"
    t0 = time.perf_counter()
    arrays = load_cifar10(tar, cache_dir=args.cache)
    per, off = args.train_size // 10, args.train_offset
    keep = np.concatenate([np.flatnonzero(arrays.train_y == c)[off:off + per]
                           for c in range(10)])
    if keep.size != 10 * per:
        raise ValueError(f"--train-size {args.train_size} from --train-offset {off}: CIFAR-10 "
                         f"has 5,000 per class")
    mean, std = channel_stats(arrays.train_x[keep])
    features = None
    if args.normalise == "image":  # pad with black, crop, flip, then standardise each image
        train_x = torch.from_numpy(np.ascontiguousarray(arrays.train_x[keep]))
        test_x = torch.from_numpy(np.ascontiguousarray(arrays.test_x))
        aug, norm = RandomCropFlip(padding=4, fill=0.0), PerImageStandardize()
        if any(SETTINGS[s][0] == "instance" for s in args.settings):
            features = normalise(arrays.train_x[keep], mean, std).reshape(len(keep), -1)
    else:
        train_x, test_x = normalise(arrays.train_x[keep], mean, std), normalise(arrays.test_x,
                                                                              mean, std)
        aug, norm = RandomCropFlip(padding=4, fill=-mean / std), None
        features = train_x.reshape(len(keep), -1)  # a view: no copy
    print(f"loaded CIFAR-10 from {tar} in {time.perf_counter() - t0:.1f}s: train subset "
          f"{tuple(train_x.shape)} (first {per} of each class), test {tuple(test_x.shape)}, "
          f"normalised per {args.normalise}, augmentation {args.augment}", flush=True)
    if args.augment == "none":
        aug = None
    return Cifar(train_x, arrays.train_y[keep], test_x, arrays.test_y, aug, features, norm,
                 rows=keep, human_labels=args.data / HUMAN_LABELS)


def cifar10_keys() -> list[str]:
    """The key of each of the 50,000 training JPEGs by idx (class-major, file order):
    ``train/<class>/<k:04d>``, as the tarball names them and CIFAR-10N's file keys them."""
    return [f"train/{c}/{k:04d}" for c in CIFAR10_CLASSES for k in range(5000)]


def human_view(path: Path, column: str, rows: np.ndarray) -> LabelView:
    """Real annotator noise: ``column`` of the label file at ``path`` joined on the file key,
    at the training subset's ``rows``; the clean label is the image's folder. The view's
    ``transition`` is the realised one of those rows (what ``--oracle-phi`` holds and the
    transition error compares with): for image-dependent noise, the best class-conditional
    description of it, not its generating process."""
    keys = cifar10_keys()
    full = from_csv(path, keys, 10, clean=np.arange(len(keys)) // 5000, column=column)
    sub = full.take(rows)
    return replace(sub, transition=sub.realised_transition(k_latent=10))


def noisy_view(name: str, clean: np.ndarray, features: torch.Tensor, seed: int, *,
               rows: np.ndarray | None = None, human_labels: Path | None = None) -> LabelView:
    """The label view of setting ``name`` over the training subset (clean labels ``clean``,
    its idx among the 50,000 ``rows``); real-noise settings read ``human_labels`` and
    ignore ``seed`` (the labels are the annotators')."""
    kind, rate = SETTINGS[name]
    if kind == "human":
        if rows is None or human_labels is None:
            raise ValueError(f"setting {name!r} needs rows= and human_labels= (the label file)")
        view = human_view(human_labels, rate, rows)
        if not np.array_equal(view.clean, clean):
            raise ValueError(f"{human_labels}: the rows' folder classes differ from the subset's")
        return view
    if kind == "asymmetric":
        return asymmetric_cifar10(clean, rate, seed=seed)
    if kind == "symmetric":
        return symmetric(clean, 10, rate, include_true=True, seed=seed)
    # Xia et al. draw the flips from the flattened normalised images
    return instance_dependent(clean, features.reshape(len(clean), -1).numpy(), 10, rate,
                              seed=seed)


def run_config(args: argparse.Namespace, method: str, seed: int, steps_per_epoch: int
               ) -> RunConfig:
    warm = steps_per_epoch if args.warmup_steps is None else args.warmup_steps
    if args.oracle_phi:  # the whole LCCN phase samples with the truth
        warm = args.epochs * steps_per_epoch
    run = apply_options(RunConfig(method=method, seed=seed), args, FLAGS)
    return apply_point(run, {"lccn.warmup_steps": warm})


# -- runs ------------------------------------------------------------------------------------


def _show(method: str, epochs: int, offset: int = 0):
    def show(e: int, r: dict) -> None:
        extra = ""
        if r["phase"]:
            extra = (f"  T-err {r['transition_error']:.4f}  latent-entropy "
                     f"{r['latent_entropy']:.3f}  z=obs {r['z_agreement']:.3f}")
        print(f"  [{method:4s}] epoch {e + offset + 1:2d}/{epochs}  lr {r['lr']:.4f}  loss "
              f"{r['loss']:.3f}  val {r['val_top1']:.4f}  test {r['test_top1']:.4f}  recovery "
              f"{r['label_recovery']:.3f}{extra}  ({r['epoch_time']:.0f}s)", flush=True)
    return show


def _chain_diagnostics(trainer: LocalTrainer) -> dict:
    """Latent histogram, per-class recovery (z = clean among samples of each clean class)
    and phi of the chain now."""
    store, clean = trainer.store, trainer.train.clean
    z = store.z[store.counted]
    c = clean[store.counted]
    rec = [float((z[c == k] == k).double().mean()) if (c == k).any() else float("nan")
           for k in range(trainer.num_classes)]
    return {"latent_hist": torch.bincount(z, minlength=trainer.k_latent).tolist(),
            "recovery_per_class": rec, "phi": store.transition().tolist()}


def _set_schedule(args: argparse.Namespace, trainer: LocalTrainer, *, offset: int) -> None:
    """--lr-values: a piecewise-constant schedule (epoch e + offset of the whole run) in
    place of the trainer's x0.1 steps, for every network of the method (DivideMix's two)."""
    if not args.lr_values:
        return
    if len(args.lr_values) != len(args.milestones) + 1:
        raise ValueError(f"--lr-values needs one value per phase ({len(args.milestones) + 1} "
                         f"for milestones {args.milestones}), got {args.lr_values}")
    base = args.lr

    def factor(e: int) -> float:
        phase = sum(e + offset >= m for m in args.milestones)
        return args.lr_values[phase] / base

    for member in trainer.engine.members:
        for g in member.optimizer.param_groups:
            g["lr"] = g["initial_lr"] = base
        member.scheduler = torch.optim.lr_scheduler.LambdaLR(member.optimizer, factor)


def fit_pair(args: argparse.Namespace, cfg_ce: RunConfig, cfg_lccn: RunConfig,
             train: TensorData, test: TensorData, *, normalize: nn.Module | None = None
             ) -> dict:
    """CE for all epochs; LCCN continuing from CE's state after the pre-training.

    LCCN's pre-training is plain CE on the same labels from the same seed, identical to
    CE's first ``P`` epochs: LCCN starts from a snapshot of CE's model, optimiser (momentum)
    and generator after epoch ``P``, with the milestones shifted by ``P``.

    ``--restart`` (the paper's code): LCCN starts from CE's final weights and runs the whole
    schedule again, with fresh momentum (``2 x epochs`` in all)."""
    e_total, p = args.epochs, args.pretrain_epochs
    auto = p == "auto"  # CE until the noisy validation accuracy stops rising (the jobs' rule)
    if auto:
        if args.restart or args.pretrain_from is not None:
            raise ValueError("--pretrain-epochs auto decides during CE's run: not with "
                             "--restart or --pretrain-from")
        # the cap: half the run, before the first milestone (shifted for LCCN)
        p = min([e_total // 2] + [m - 1 for m in args.milestones])
    if args.restart:  # CE's whole run is LCCN's pre-training
        p = e_total
    elif any(m <= p for m in args.milestones) and not args.lr_values:
        raise ValueError(f"sharing the pre-training needs every milestone > pretrain epochs "
                         f"({p}), got {args.milestones}")
    snap: dict = {}
    out: dict = {}
    if args.pretrain_from is not None:
        snap = _wait_for_pretrain(args.pretrain_from, args.pretrain_wait, args.device)
        theirs, ours = snap.get("key", {}), _run_key(args)
        # a state written before an option existed was written with its default
        differ = sorted(k for k in ours if theirs.get(k, _KEY_DEFAULTS.get(k)) != ours[k])
        if differ:
            raise ValueError(f"{args.pretrain_from} was written by another protocol: "
                             + ", ".join(f"{k} {theirs.get(k)!r} there, {ours[k]!r} here"
                                         for k in differ))
        if snap["epochs"] != p:
            raise ValueError(f"{args.pretrain_from} holds {snap['epochs']} pre-training "
                             f"epochs, this run asks for --pretrain-epochs {p}")
        hist_ce = snap["history"]
    else:
        if "ce" not in args.methods:  # only the pre-training of CE is needed (auto: its cap)
            cfg_ce = replace(cfg_ce, optim=replace(
                cfg_ce.optim, epochs=p, pretrain_epochs=min(cfg_ce.optim.pretrain_epochs, p)))
        ce = LocalTrainer(cfg_ce, train, test, device=args.device, normalize=normalize)
        if args.init_from is not None:
            ce.model.load_state_dict(torch.load(args.init_from, map_location="cpu"))
        _set_schedule(args, ce, offset=0)
        show_ce = _show("ce", e_total)
        t0 = time.perf_counter()
        rows: list[dict] = []

        n_val = int(ce.held_out.sum())
        decided = {"p": None if auto else p}

        def on_epoch(e: int, r: dict) -> None:
            show_ce(e, r)
            rows.append(dict(r))
            # LCCNConfig.warmup_weights "best": the warm-up epoch with the best noisy
            # validation accuracy, whose weights the noise phase then starts from
            if (decided["p"] is None or e < decided["p"]) and e < p and \
                    r["val_top1"] > snap.get("best_val", float("-inf")):
                ema_b = ce.engine.members[0].ema
                snap.update(best_val=r["val_top1"], best_epoch=e,
                            best_model=copy.deepcopy(ce.model.state_dict()),
                            best_ema=None if ema_b is None else copy.deepcopy(
                                ema_b.state_dict()))
            if decided["p"] is None and warmup_end_epoch(rows, n_val=n_val, cap=p) == e + 1:
                decided["p"] = e + 1
                print(f"--pretrain-epochs auto: CE warm-up of {e + 1} epochs (cap {p})",
                      flush=True)
            if decided["p"] is not None and e == decided["p"] - 1:
                snap["model"] = copy.deepcopy(ce.model.state_dict())
                snap["optim"] = copy.deepcopy(ce.optimizer.state_dict())
                snap["gen"] = ce.gen.get_state()
                snap["t"] = time.perf_counter() - t0
                snap["global_step"] = ce.engine.global_step
                ema = ce.engine.members[0].ema
                snap["ema"] = copy.deepcopy(ema.state_dict()) if ema is not None else None
                if args.pretrain_out is not None:
                    _save_pretrain(args.pretrain_out, dict(snap, history=rows[:p], epochs=p,
                                                           key=_run_key(args)))

        hist_ce = ce.fit(on_epoch=on_epoch)
        p = decided["p"]
        if args.save_model is not None:
            args.save_model.parent.mkdir(parents=True, exist_ok=True)
            torch.save(ce.model.state_dict(), args.save_model)
        if "ce" in args.methods:
            out["ce"] = {"history": hist_ce, "wall_s": time.perf_counter() - t0,
                         "config": asdict(cfg_ce)}
    if "lccn" not in args.methods:
        return out
    if args.restart:  # a new run of the whole schedule from CE's final weights
        cfg = replace(cfg_ce if args.restart_control else cfg_lccn,
                      optim=replace(cfg_lccn.optim, pretrain_epochs=0))
    else:
        cfg = replace(cfg_lccn, optim=replace(cfg_lccn.optim, epochs=e_total - p,
                                              pretrain_epochs=0, pretrain_auto=False,
                                              milestones=tuple(m - p for m in args.milestones)))
    t1 = time.perf_counter()
    lc = LocalTrainer(cfg, train, test, device=args.device, normalize=normalize)
    _set_schedule(args, lc, offset=0 if args.restart else p)
    lc.model.load_state_dict(snap["model"])
    from_best = cfg_lccn.lccn.warmup_weights == "best" and not args.restart
    if from_best and "best_model" not in snap:
        raise ValueError("--warmup-weights best needs the warm-up run here (the best epoch's "
                         "weights are not in a --pretrain-from state)")
    if from_best and snap["best_epoch"] != p - 1:
        # as the library does at the noise phase's start: the best warm-up epoch's weights,
        # the last epoch's optimiser state
        lc.model.load_state_dict(snap["best_model"])
        print(f"--warmup-weights best: the noise phase starts from CE epoch "
              f"{snap['best_epoch'] + 1} (noisy validation {snap['best_val']:.4f}; the last "
              f"epoch's {hist_ce[p - 1]['val_top1']:.4f})", flush=True)
    if not args.restart:
        # the same run continued: its CE epochs are the rows before the noise phase (the
        # last one is a candidate for the best noisy-validation epoch, as in the jobs)
        lc.engine.history = [dict(r, epoch=r["epoch"] - p) for r in hist_ce[:p]]
    # the rate the start was last trained at: the collapse monitor compares up to it
    lc.engine.init_lr = hist_ce[p - 1]["lr"]
    if not args.restart:  # the same run continued: momentum and the step count go on
        lc.optimizer.load_state_dict(snap["optim"])
        lc.engine.global_step = snap["global_step"]
    lc.gen.set_state(snap["gen"])
    if args.oracle_phi:
        _use_true_transition(lc)
    if lc.engine.members[0].ema is not None:
        # phi_init and z come from CE's weight average (as the paper's code: its init_C
        # restores the averages; the restarted run's average then follows the new steps)
        if snap.get("ema") is None:
            raise ValueError("--ema-decay is set but the pre-training state has no weight "
                             "average (it was written without --ema-decay)")
        lc.engine.members[0].ema.load_state_dict(
            snap["best_ema"] if from_best and snap["best_epoch"] != p - 1 else snap["ema"])
    diags: list[dict] = []
    total = 2 * e_total if args.restart else e_total
    show_lc = _show("ce2" if args.restart_control else "lccn", total, offset=p)

    def on_lccn(e: int, r: dict) -> None:
        show_lc(e, r)
        if lc.store is not None:
            diags.append(_chain_diagnostics(lc))

    hist = lc.fit(on_epoch=on_lccn)
    for r in hist:
        r["epoch"] += p
    if args.report_state is not None and lc.store is not None:
        # the label-issue report's inputs (pipeline.track.label_issues.build_report)
        args.report_state.parent.mkdir(parents=True, exist_ok=True)
        torch.save({STATE_KEY: lc.engine.method.report.state_dict(),
                    "store": lc.engine.chain.read(), "clean": lc.train.clean.clone()},
                   args.report_state)
    if args.restart and args.restart_control:
        out["ce_restart"] = {"history": hist_ce[:p] + hist, "config": asdict(cfg),
                             "wall_s": snap["t"] + time.perf_counter() - t1}
        return out
    probs = lc.pretrained_probs
    clean = lc.train.clean[torch.from_numpy(lc.train_rows)]   # probs: the trained rows
    conf = torch.bincount(clean * 10 + probs[:, :10].argmax(1), minlength=100)
    out["lccn"] = {"history": hist_ce[:p] + hist, "wall_s": snap["t"] + time.perf_counter() - t1,
                   "config": asdict(cfg_lccn), "diagnostics": diags,
                   "phi_init": lc.phi_init.tolist(), "phi": lc.transition().tolist(),
                   "pretrained_confusion": conf.view(10, 10).tolist(),
                   "collapse_epochs": [int(r["epoch"]) for r in hist if r.get("collapse")],
                   "pretrain_epochs": p}
    print("warm-up phi_init:\n" + format_transition(lc.phi_init.numpy(), rows="latent"))
    print("learned phi[k, j] = P(observed=j | latent=k):\n"
          + format_transition(lc.transition().numpy(), rows="latent"))
    return out


def _use_true_transition(lc: LocalTrainer) -> None:
    """``--oracle-phi``: the chain's warm-up transition is the label view's true one
    (its warm-up spans the run), so LCCN's only error is its classifier's."""
    method = lc.engine.method
    start = method.start_noise_phase

    def start_with_truth(epoch: int) -> dict[str, float]:
        stats = start(epoch)
        truth = lc.engine.data.transition
        if truth is None:
            raise ValueError("--oracle-phi needs a label view with a known transition")
        method.phi_init = torch.as_tensor(truth, dtype=torch.float64).clone()
        return stats

    method.start_noise_phase = start_with_truth


_KEY_DEFAULTS = {"bn_momentum": None, "normalise": "channel", "augment": "cropflip",
                 "weight_decay": 5e-4, "train_offset": 0, "init_from": None}


def _run_key(args: argparse.Namespace) -> dict:
    """What a handed-over pre-training must share with the run that continues it."""
    return {"settings": list(args.settings), "seeds": list(args.seeds),
            "train_size": args.train_size, "model": args.model, "lr": args.lr,
            "lr_values": list(args.lr_values), "milestones": list(args.milestones),
            "batch_size": args.batch_size, "val_fraction": args.val_fraction,
            "ema_decay": args.ema_decay, "norm_weight_decay": args.norm_weight_decay,
            "bn_momentum": args.bn_momentum, "normalise": args.normalise,
            "restart": args.restart, "augment": args.augment,
            "weight_decay": args.weight_decay, "train_offset": args.train_offset,
            "init_from": None if args.init_from is None else args.init_from.name}


def _save_pretrain(path: Path, snap: dict) -> None:
    """Write the pre-training state atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save(snap, tmp)
    os.replace(tmp, path)
    print(f"  wrote the state after {snap['epochs']} pre-training epochs to {path}", flush=True)


def _wait_for_pretrain(path: Path, timeout: float, device: str) -> dict:
    t0 = time.perf_counter()
    while not path.exists():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"--pretrain-from {path}: no such file after {timeout:.0f}s "
                               f"(is the CE run with --pretrain-out {path} running?)")
        time.sleep(2.0)
    snap = torch.load(path, map_location=device, weights_only=False)
    snap["gen"] = snap["gen"].cpu()
    print(f"  loaded the state after {snap['epochs']} CE pre-training epochs from {path} "
          f"(waited {time.perf_counter() - t0:.0f}s)", flush=True)
    return snap


def noise_floor(view: LabelView) -> float:
    """H(observed | clean) in nats, from the view's realised transition: the lowest training
    loss a classifier reaches on the observed labels *without memorising* them, if it knew
    each image's clean class (for class-conditional noise, the floor exactly; for
    instance-dependent noise an upper bound on H(observed | image))."""
    t = view.realised_transition()
    known = view.clean[view.clean >= 0]
    prior = np.bincount(known, minlength=t.shape[0]) / len(known)
    logs = np.log(np.where(t > 0, t, 1.0))
    return float(-(prior[:, None] * t * logs).sum())


def regime(entry: dict, floor: float, start: int = 0) -> dict:
    """Does this run memorise? Its peak test accuracy (epoch), the final epoch's drop from
    it, and the final training loss against the label-noise floor: the memorisation
    protocol asks of CE a drop of at least 5 points *and* a loss below the floor."""
    hist = entry["history"][start:]
    peak = max(range(len(hist)), key=lambda e: hist[e]["test_top1"])
    drop = hist[peak]["test_top1"] - hist[-1]["test_top1"]
    return {"peak_test": hist[peak]["test_top1"], "peak_epoch": start + peak + 1,
            "drop": drop, "final_loss": hist[-1]["loss"], "noise_floor": floor,
            "memorises": bool(drop >= 0.05 and hist[-1]["loss"] < floor)}


# the folders a result's command line names by role, not by the machine's path
_FOLDERS = {"--data": "DATA", "--out": "OUT", "--cache": "CACHE"}
# the files a result's command line names by role and file name
_FILES = {"--pretrain-out": "PRE", "--pretrain-from": "PRE", "--report-state": "OUT",
          "--init-from": "MODELS", "--save-model": "MODELS"}


def recorded_argv(argv: list[str]) -> list[str]:
    """The command line as a result records it: the folders of ``--data``, ``--out`` and
    ``--cache`` written ``DATA``, ``OUT``, ``CACHE``, and the files of the state and model
    options as their role and name (``PRE/mem-random1-0.pt``): they are the machine's, not
    part of the protocol."""
    def said(flag: str, value: str) -> str:
        if flag in _FOLDERS:
            return _FOLDERS[flag]
        return f"{_FILES[flag]}/{Path(value).name}"

    known = {**_FOLDERS, **_FILES}
    out: list[str] = []
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if i and argv[i - 1] in known:
            out.append(said(argv[i - 1], a))
        elif eq and flag in known:
            out.append(f"{flag}={said(flag, value)}")
        else:
            out.append(a)
    return out


def summarise(entry: dict, start: int = 0) -> dict:
    """Final and noisy-validation-selected test accuracy; ``start``: the selection looks
    only at epochs from there on (a restarted run chooses among its own epochs)."""
    hist = entry["history"]
    sel = start + select_epoch(hist[start:])
    return {"final_test": hist[-1]["test_top1"], "selected_test": hist[sel]["test_top1"],
            "selected_epoch": sel + 1, "final_val": hist[-1]["val_top1"],
            "transition_error": hist[-1].get("transition_error", float("nan")),
            "label_recovery": hist[-1]["label_recovery"]}


def run_one(args: argparse.Namespace, name: str, seed: int, data: Cifar) -> dict:
    view = noisy_view(name, data.train_y, data.features, seed, rows=data.rows,
                      human_labels=data.human_labels)
    train = TensorData(data.train_x, view, augment=data.aug)
    test = TensorData(data.test_x, clean_view(data.test_y, 10))
    n_train = len(train) - int(round(args.val_fraction * len(train)))
    steps = -(-n_train // args.batch_size)
    cfg_ce, cfg_lccn = (run_config(args, m, seed, steps) for m in ("ce", "lccn"))
    print(f"\n=== {name} seed {seed}: realised noise rate {view.noise_rate():.3f}, "
          f"{len(train)} train images ({args.val_fraction:.0%} noisy validation), "
          f"{args.epochs} epochs ({args.pretrain_epochs} CE pre-training), milestones "
          f"{args.milestones}, LCCN {asdict(cfg_lccn.lccn)}, {torch.get_num_threads()} "
          f"threads, load average {os.getloadavg()}", flush=True)
    result = {"setting": name, "seed": seed, "argv": getattr(args, "argv", None),
              "realised_noise_rate": view.noise_rate(), "true_transition": view.transition.tolist(),
              "load_avg_start": os.getloadavg(), "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    result["methods"] = fit_pair(args, cfg_ce, cfg_lccn, train, test, normalize=data.normalize)
    result["wall_s"] = time.perf_counter() - t0
    result["load_avg_end"] = os.getloadavg()
    result["noise_floor"] = floor = noise_floor(view)
    for m, entry in result["methods"].items():
        start = args.epochs if args.restart and m != "ce" else 0
        entry["summary"] = summarise(entry, start=start)
        entry["summary"].update(regime(entry, floor, start=start))
        g = entry["summary"]
        print(f"  [{m}] peak test {100 * g['peak_test']:.2f} at epoch {g['peak_epoch']}, final "
              f"{100 * g['final_test']:.2f} (drop {100 * g['drop']:.2f}); final training loss "
              f"{g['final_loss']:.3f} against the noise floor {floor:.3f}: "
              f"{'memorises' if g['memorises'] else 'does not memorise'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-seed{seed}{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    s = {m: e["summary"] for m, e in result["methods"].items()}
    print(f"{name} seed {seed}: " + "  ".join(
        f"{m} final {100 * v['final_test']:.2f} selected {100 * v['selected_test']:.2f} "
        f"(epoch {v['selected_epoch']})" for m, v in s.items())
        + f"  [{result['wall_s'] / 60:.1f} min]  wrote {path}", flush=True)
    return result


def time_epoch(args: argparse.Namespace, data: Cifar) -> None:
    view = noisy_view("asym0.5", data.train_y, data.features, 0)
    cfg = replace(run_config(args, "ce", 0, 1), optim=replace(
        run_config(args, "ce", 0, 1).optim, epochs=1, pretrain_epochs=1, milestones=()))
    trainer = LocalTrainer(cfg, TensorData(data.train_x, view, augment=data.aug),
                           TensorData(data.test_x, clean_view(data.test_y, 10)),
                           normalize=data.normalize)
    hist = trainer.fit()
    per = hist[0]["epoch_time"]
    shared = args.epochs // 2 if args.pretrain_epochs == "auto" else args.pretrain_epochs
    cost = (2 * args.epochs - shared) * per
    print(f"one CE epoch incl. validation and test: {per:.1f}s ({1e3 * hist[0]['step_time']:.0f}"
          f" ms/step); a run of {args.epochs} epochs ({args.pretrain_epochs} shared) costs "
          f"about {cost / 60:.1f} min per setting and seed; load average {os.getloadavg()}")


# -- reporting -------------------------------------------------------------------------------


def load_results(out: Path, tag: str = "") -> list[dict]:
    found = sorted(p for p in out.glob(f"*-seed*{tag}.json")
                   if tag or p.stem.split("seed")[-1].isdigit())
    if not found:
        raise FileNotFoundError(f"no <setting>-seed<N>{tag}.json results under {out}")
    return [json.loads(p.read_text()) for p in found]


def _pm(vals: list[float], scale: float = 100.0, digits: int = 2) -> str:
    v = np.asarray(vals, dtype=np.float64) * scale
    if v.size == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def markdown_report(results: list[dict]) -> str:
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["setting"], []).append(r)
    lines = ["| setting | seeds | CE final | LCCN final | Δ final | CE selected | LCCN selected "
             "| Δ selected | LCCN φ error | LCCN ≥ CE (final, every seed) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SETTINGS:
        rs = sorted(by.get(name, []), key=lambda r: r["seed"])
        if not rs or any("lccn" not in r["methods"] or "ce" not in r["methods"] for r in rs):
            continue
        s = [{m: e["summary"] for m, e in r["methods"].items()} for r in rs]
        ce_f = [x["ce"]["final_test"] for x in s]
        lc_f = [x["lccn"]["final_test"] for x in s]
        ce_s = [x["ce"]["selected_test"] for x in s]
        lc_s = [x["lccn"]["selected_test"] for x in s]
        d_f = [b - a for a, b in zip(ce_f, lc_f)]
        d_s = [b - a for a, b in zip(ce_s, lc_s)]
        lines.append(
            f"| {name} | {','.join(str(r['seed']) for r in rs)} | {_pm(ce_f)} | {_pm(lc_f)} | "
            f"{_pm(d_f)} | {_pm(ce_s)} | {_pm(lc_s)} | {_pm(d_s)} | "
            f"{_pm([x['lccn']['transition_error'] for x in s], 1.0, 4)} | "
            f"{'yes' if all(d >= 0 for d in d_f) else 'no'} |")
    lines += ["", "Per run (test top-1 %, final / noisy-validation-selected epoch; wall minutes; "
              "load average at start and end):", "",
              "| setting | seed | noise | CE | LCCN | LCCN φ error | LCCN recovery | collapse "
              "warnings | wall | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (list(SETTINGS).index(r["setting"]), r["seed"])):
        s = {m: e["summary"] for m, e in r["methods"].items()}
        lc = s.get("lccn")
        f = lambda v: f"{100 * v['final_test']:.2f} / {100 * v['selected_test']:.2f}"
        lines.append(
            f"| {r['setting']} | {r['seed']} | {r['realised_noise_rate']:.3f} | "
            f"{f(s['ce']) if 'ce' in s else '-'} | "
            f"{f(lc) if lc else '-'} | {lc['transition_error'] if lc else float('nan'):.4f} | "
            f"{lc['label_recovery'] if lc else float('nan'):.3f} | "
            f"{len(r['methods']['lccn']['collapse_epochs']) if lc else '-'} | "
            f"{r['wall_s'] / 60:.1f} | {r['load_avg_start'][0]:.1f}-{r['load_avg_end'][0]:.1f} |")
    regimes = [r for r in results if all("drop" in e["summary"] for e in r["methods"].values())]
    if regimes:
        lines += ["", "Regime per run and method (test top-1 %: peak (epoch), drop from it to the "
                  "final epoch; final training loss against the label-noise floor H(observed | "
                  "clean); memorises = drop ≥ 5 and loss < floor):", "",
                  "| setting | seed | method | peak (epoch) | drop | final loss | floor | "
                  "memorises |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(regimes, key=lambda r: (list(SETTINGS).index(r["setting"]), r["seed"])):
            for m, e in r["methods"].items():
                g = e["summary"]
                lines.append(f"| {r['setting']} | {r['seed']} | {m} | {100 * g['peak_test']:.2f} "
                             f"({g['peak_epoch']}) | {100 * g['drop']:.2f} | "
                             f"{g['final_loss']:.3f} | {g['noise_floor']:.3f} | "
                             f"{'yes' if g['memorises'] else 'no'} |")
    return "\n".join(lines)


def draw_plots(results: list[dict], folder: Path) -> list[Path]:
    """Per LCCN run: test/validation curves of both methods, the latent-class histogram
    and per-class recovery over the LCCN epochs, and phi_init / learned phi / truth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        lc = r["methods"].get("lccn")
        if lc is None:
            continue
        tag = f"{r['setting']}-seed{r['seed']}{r.get('tag', '')}"
        fig, ax = plt.subplots(2, 3, figsize=(16, 9))
        for m, e in r["methods"].items():
            h = e["history"]
            ax[0, 0].plot([x["epoch"] + 1 for x in h], [x["test_top1"] for x in h], label=f"{m} test")
            ax[0, 0].plot([x["epoch"] + 1 for x in h], [x["val_top1"] for x in h], "--",
                          label=f"{m} noisy val")
        ax[0, 0].set(title="accuracy", xlabel="epoch")
        ax[0, 0].legend(fontsize=8)
        hist = np.array([d["latent_hist"] for d in lc["diagnostics"]], dtype=float)
        start = len(lc["history"]) - len(hist)
        ax[0, 1].imshow(hist.T / hist.sum(1), aspect="auto", cmap="viridis",
                        extent=[start + 0.5, start + len(hist) + 0.5, hist.shape[1] - 0.5, -0.5])
        ax[0, 1].set(title="latent-class share per LCCN epoch", xlabel="epoch",
                     ylabel="latent class")
        rec = np.array([d["recovery_per_class"] for d in lc["diagnostics"]])
        for k in range(rec.shape[1]):
            ax[0, 2].plot(range(start + 1, start + len(rec) + 1), rec[:, k], label=str(k))
        ax[0, 2].set(title="label recovery per clean class (z = clean)", xlabel="epoch",
                     ylim=(0, 1))
        ax[0, 2].legend(fontsize=7, ncol=2)
        for a, (title, mat) in zip(ax[1], [("phi_init (warm-up)", lc["phi_init"]),
                                           ("learned phi", lc["phi"]),
                                           ("true transition", r["true_transition"])]):
            a.imshow(np.asarray(mat), vmin=0, vmax=1, cmap="magma")
            a.set(title=title, xlabel="observed j", ylabel="latent k")
        fig.suptitle(f"{tag}: CE {100 * r['methods']['ce']['summary']['final_test']:.1f}%, "
                     f"LCCN {100 * lc['summary']['final_test']:.1f}% (final epoch)")
        fig.tight_layout()
        path = folder / f"chain-{tag}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> list[dict]:
    args = get_args_parser().parse_args(argv)
    args.argv = recorded_argv(sys.argv[1:] if argv is None else list(argv))
    if args.report or args.plots:
        results = load_results(args.out, args.tag)
        for r in results:
            r["tag"] = args.tag
        if args.report:
            print(markdown_report(results))
        if args.plots:
            for p in draw_plots(results, args.plots):
                print(f"wrote {p}")
        return results
    if args.pretrain_from is not None and args.methods != ["lccn"]:
        get_args_parser().error("--pretrain-from starts an LCCN run: use it with --methods lccn")
    if args.pretrain_out is not None and "ce" not in args.methods:
        get_args_parser().error("--pretrain-out is written by the CE run: add --methods ce")
    if (args.pretrain_from or args.pretrain_out) and len(args.settings) * len(args.seeds) > 1:
        get_args_parser().error("--pretrain-out/--pretrain-from hold one run's state: give one "
                                "setting and one seed")
    if args.restart_control and not args.restart:
        get_args_parser().error("--restart-control needs --restart")
    if args.oracle_phi and ("lccn" not in args.methods or args.restart_control):
        get_args_parser().error("--oracle-phi changes the LCCN run: use it with --methods lccn "
                                "and without --restart-control")
    if args.restart:  # CE's whole run is LCCN's pre-training
        args.pretrain_epochs = args.epochs
    torch.set_num_threads(args.threads)
    data = load_data(args)
    if args.time_epoch:
        time_epoch(args, data)
        return []
    results = [run_one(args, name, seed, data) for seed in args.seeds for name in args.settings]
    print(markdown_report(results))
    return results


if __name__ == "__main__":
    main()
