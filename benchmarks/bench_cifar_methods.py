"""Every method of the engine on real CIFAR-10 JPEGs, on one budget: the fidelity benchmark's
protocol (``benchmarks/bench_cifar.py``) for CE, Bootstrapping, Forward, S-adaptation,
T-Revision, LCCN, LCCN*, LCCN+, DivideMix and DivideLCCN.

Protocol (one setting, seed and method per run; every method the same):

- training images: the first ``--train-size / 10`` of each class; per-channel normalisation
  from them; random crop (pad 4) and horizontal flip (`--augment none`: neither, the
  memorisation protocol of cifar.md); a 5% noisy validation split carved
  from the training labels, never trained on, used for the selected epoch;
- settings: ``asym0.5``, ``sym0.5``, ``idn0.4`` as in bench_cifar.py, and ``open0.3``: 30%
  of the training images replaced by a pixel-shuffled copy (out of distribution, observed
  label kept; ``pipeline.core.noise.open_set``);
- ``cnn_wide``, SGD lr 0.1, momentum 0.9, weight decay 5e-4, batch 128, ``--epochs`` with
  lr x0.1 at ``--milestones``, the first ``--pretrain-epochs`` cross-entropy for every method
  (DivideMix's warm-up, LCCN's pre-training, the baselines' transition estimate);
- each method with the library's defaults (``LCCNConfig()``, ``DivideConfig()``,
  ``BaselineConfig()``), LCCN's warm-up one epoch as in bench_cifar.py. ``lccn_star`` is LCCN
  with the outlier class (``outlier=True``); ``lccn_plus`` is LCCN with 10% of the training
  samples trusted (the paper's 5,000 of 50,000, stratified by clean class, outliers
  included), and with the outlier class too in ``open0.3`` (LCCN*+);
- reported: clean test top-1 at the final epoch and at the noisy-validation-selected epoch
  (never the best test epoch), the transition error where a method estimates one.

    python benchmarks/bench_cifar_methods.py --settings sym0.5 --seeds 0 --methods ce lccn
    python benchmarks/bench_cifar_methods.py --report --out DIR      # the tables
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_cifar  # noqa: E402

from pipeline.core.config import RunConfig  # noqa: E402
from pipeline.core.noise import clean_view, open_set, shuffle_pixels, trusted_subset  # noqa: E402
from pipeline.core.options import FLAGS, UNSET, add_options, apply_point, dest
from pipeline.data.cifar_memory import RandomCropFlip, channel_stats, load_cifar10, normalise
from pipeline.train.trainer import LocalTrainer, TensorData  # noqa: E402

METHODS = ("ce", "bootstrap", "forward", "sadapt", "trevision", "lccn", "lccn_star",
           "lccn_plus", "dividemix", "divide_lccn")
SETTINGS = ("asym0.5", "sym0.5", "idn0.4", "open0.3", "aggre", "random1")
TRUSTED_FRACTION = 0.1
# DivideMix's options a run may set (the library's defaults otherwise)
DIVIDE_FLAGS = ("--lambda-u", "--conf-penalty", "--p-threshold", "--mixmatch-alpha",
                "--division-loss")
# the DivideMix authors' choices for asymmetric noise: the confidence penalty in the
# warm-up (their code's `--noise_mode asym`) and no unlabelled loss (lambda_u 0, their
# answer for asymmetric CIFAR-10 on the project's tracker)
DIVIDE_ASYMMETRIC = {"divide.conf_penalty": True, "divide.lambda_u": 0.0}


def get_args_parser() -> argparse.ArgumentParser:
    p = bench_cifar.get_args_parser()
    p.description = __doc__.split("\n\n")[0]
    for a in p._actions:
        if a.dest == "settings":
            a.choices, a.default = SETTINGS, list(SETTINGS)
        if a.dest == "methods":
            a.choices, a.default = METHODS, list(METHODS)
        if a.dest == "out":
            a.default = Path("/tmp/lccn_methods/results")
    add_options(p, ("--outlier-prior",),
                notes={"--outlier-prior": "of lccn_star and lccn_plus"})
    add_options(p, DIVIDE_FLAGS, defaults={f: UNSET for f in DIVIDE_FLAGS},
                notes={f: "of dividemix and divide_lccn; default: the authors' choice for "
                          "the setting's noise (DIVIDE_ASYMMETRIC under asymmetric noise)"
                       for f in DIVIDE_FLAGS})
    return p


def load_setting(args: argparse.Namespace, name: str, seed: int):
    """Train and test splits of one setting: the open-set images are shuffled as uint8,
    before the normalisation, as the shard reader does."""
    arrays = load_cifar10(args.data / "cifar10-jpeg.tar.gz", cache_dir=args.cache)
    per = args.train_size // 10
    keep = np.concatenate([np.flatnonzero(arrays.train_y == c)[:per] for c in range(10)])
    if keep.size != 10 * per:
        raise ValueError(f"--train-size {args.train_size}: CIFAR-10 has 5,000 per class")
    raw, clean = arrays.train_x[keep], arrays.train_y[keep]
    if name == "open0.3":
        view = open_set(clean, 10, 0.3, seed=seed)
        raw = raw.copy()
        for i in np.flatnonzero(view.ood):   # (N, C, H, W) uint8: shuffle (H, W, C)
            raw[i] = shuffle_pixels(raw[i].transpose(1, 2, 0), idx=int(i),
                                    seed=view.spec["pixel_seed"]).transpose(2, 0, 1)
    mean, std = channel_stats(raw)
    train_x, test_x = normalise(raw, mean, std), normalise(arrays.test_x, mean, std)
    if name != "open0.3":
        view = bench_cifar.noisy_view(name, clean, train_x, seed, rows=keep,
                                      human_labels=args.data / bench_cifar.HUMAN_LABELS)
    aug = RandomCropFlip(padding=4, fill=-mean / std) if args.augment == "cropflip" else None
    return view, train_x, test_x, arrays.test_y, aug


def _show(method: str, epochs: int):
    def show(e: int, r: dict) -> None:
        extra = "".join(f"  {k} {r[k]:.4f}" for k in ("transition_error", "z_agreement")
                        if isinstance(r.get(k), float))
        print(f"  [{method}] epoch {e + 1:2d}/{epochs}  lr {r['lr']:.4f}  loss {r['loss']:.3f}  "
              f"val {r['val_top1']:.4f}  test {r['test_top1']:.4f}{extra}  "
              f"({r['epoch_time']:.0f}s)", flush=True)
    return show


def divide_point(args: argparse.Namespace, setting: str) -> dict:
    """DivideMix's options for ``setting``: the authors' choices for asymmetric noise
    (:data:`DIVIDE_ASYMMETRIC`) under ``asym*``, the library's defaults otherwise, and any
    of ``DIVIDE_FLAGS`` given on the command line over both."""
    point = dict(DIVIDE_ASYMMETRIC) if setting.startswith("asym") else {}
    for flag in DIVIDE_FLAGS:
        value = getattr(args, dest(flag), None)
        if value is not None:
            point[FLAGS[flag]] = value
    return point


def method_config(args: argparse.Namespace, method: str, seed: int, steps: int, view,
                  setting: str = "") -> RunConfig:
    cfg = bench_cifar.run_config(args, "lccn", seed, steps)
    if method in ("dividemix", "divide_lccn"):
        cfg = apply_point(cfg, divide_point(args, setting))
    name, lc = method, cfg.lccn
    prior = {"outlier_prior": args.outlier_prior}
    if method == "lccn_star":
        name, lc = "lccn", replace(lc, outlier=True, **prior)
    elif method == "lccn_plus":
        name, lc = "lccn", replace(lc, use_trusted=True, outlier=view.has_outliers,
                                   **(prior if view.has_outliers else {}))
    return replace(cfg, method=name, lccn=lc)


def run_one(args: argparse.Namespace, name: str, seed: int, method: str) -> dict:
    view, train_x, test_x, test_y, aug = load_setting(args, name, seed)
    if method == "lccn_plus":
        view = trusted_subset(view, TRUSTED_FRACTION, seed=seed)
    n_train = len(view) - int(round(args.val_fraction * len(view)))
    cfg = method_config(args, method, seed, -(-n_train // args.batch_size), view, name)
    print(f"=== {name} seed {seed} {method}: realised noise {view.noise_rate():.3f}, "
          f"{len(view)} train images, {args.epochs} epochs ({args.pretrain_epochs} CE), "
          f"load average {os.getloadavg()}", flush=True)
    trainer = LocalTrainer(cfg, TensorData(train_x, view, augment=aug),
                           TensorData(test_x, clean_view(test_y, 10)), device=args.device)
    bench_cifar._set_schedule(args, trainer, offset=0)
    t0 = time.perf_counter()
    hist = trainer.fit(on_epoch=_show(method, args.epochs))
    entry = {"history": hist, "wall_s": time.perf_counter() - t0, "config": asdict(cfg)}
    entry["summary"] = bench_cifar.summarise(entry)
    entry["summary"].update(bench_cifar.regime(entry, bench_cifar.noise_floor(view)))
    result = {"setting": name, "seed": seed, "method": method, "argv": getattr(args, "argv", None),
              "device": args.device, "realised_noise_rate": view.noise_rate(),
              "load_avg_end": os.getloadavg(), **entry}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-seed{seed}-{method}.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    s = entry["summary"]
    print(f"{name} seed {seed} {method}: final {100 * s['final_test']:.2f} selected "
          f"{100 * s['selected_test']:.2f} (epoch {s['selected_epoch']}); peak "
          f"{100 * s['peak_test']:.2f} at epoch {s['peak_epoch']} (drop {100 * s['drop']:.2f}), "
          f"final training loss {s['final_loss']:.3f} against the noise floor "
          f"{s['noise_floor']:.3f}: {'memorises' if s['memorises'] else 'does not memorise'} "
          f"[{entry['wall_s'] / 60:.1f} min] wrote {path}", flush=True)
    return result


def report(out: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*-seed*-*.json"))]
    if not runs:
        raise FileNotFoundError(f"no <setting>-seed<N>-<method>.json results under {out}")
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in runs)]
    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]

    def cell(s: str, m: str, key: str) -> tuple[str, float]:
        v = [r["summary"][key] for r in runs if r["setting"] == s and r["method"] == m]
        if not v:
            return "-", float("nan")
        a = 100 * np.asarray(v, dtype=np.float64)
        txt = f"{a.mean():.2f}" + (f" ± {a.std(ddof=1):.2f}" if a.size > 1 else "")
        return txt, float(a.mean())

    seeds = sorted({r["seed"] for r in runs})
    lines = [f"Seeds {seeds}; test top-1 %, final epoch / noisy-validation-selected epoch; "
             "transition error (mean |phi - truth|) where the method has one.", "",
             "| method | " + " | ".join(settings) + " |",
             "|---|" + "---|" * len(settings)]
    means: dict[tuple[str, str], float] = {}
    for m in methods:
        row = []
        for s in settings:
            f, mean = cell(s, m, "final_test")
            sel, _ = cell(s, m, "selected_test")
            means[s, m] = mean
            err = [r["summary"]["transition_error"] for r in runs
                   if r["setting"] == s and r["method"] == m
                   and np.isfinite(r["summary"]["transition_error"])]
            e = f" (φ {np.mean(err):.3f})" if err else ""
            row.append(f"{f} / {sel}{e}")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    order = ("divide_lccn", "dividemix", "lccn", "ce")
    lines += ["", "Paper's ordering DivideLCCN ≥ DivideMix ≥ LCCN ≥ CE (final epoch, mean):", ""]
    for s in settings:
        vals = [means.get((s, m), float("nan")) for m in order]
        held = all(a >= b for a, b in zip(vals, vals[1:]))
        lines.append(f"- {s}: " + " ≥ ".join(f"{m} {v:.2f}" for m, v in zip(order, vals))
                     + (" — holds" if held else " — does not hold"))
    regimes = [r for r in runs if "noise_floor" in r["summary"]]
    if regimes:
        lines += ["", "Regime per run (peak test % (epoch), drop to the final epoch, final "
                      "training loss against the noise floor H(observed | clean); memorises = "
                      "drop ≥ 5 and loss < floor):", "",
                  "| setting | seed | method | peak (epoch) | drop | final loss / floor | "
                  "memorises |", "|---|---|---|---|---|---|---|"]
        for r in sorted(regimes, key=lambda r: (SETTINGS.index(r["setting"]), r["seed"],
                                                METHODS.index(r["method"]))):
            g = r["summary"]
            lines.append(f"| {r['setting']} | {r['seed']} | {r['method']} | "
                         f"{100 * g['peak_test']:.2f} ({g['peak_epoch']}) | "
                         f"{100 * g['drop']:.2f} | {g['final_loss']:.3f} / "
                         f"{g['noise_floor']:.3f} | {'yes' if g['memorises'] else 'no'} |")
    walls = {m: np.median([r["wall_s"] for r in runs if r["method"] == m]) / 60 for m in methods}
    lines += ["", "Median wall minutes per run: " + ", ".join(f"{m} {w:.1f}"
                                                            for m, w in walls.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = get_args_parser()
    args = parser.parse_args(argv)
    args.argv = bench_cifar.recorded_argv(sys.argv[1:] if argv is None else list(argv))
    if args.normalise != "channel":
        parser.error("--normalise image is bench_cifar.py's (CE and LCCN); this bench "
                     "normalises per channel")
    if args.report:
        print(report(args.out))
        return
    torch.set_num_threads(args.threads)
    for name in args.settings:
        for seed in args.seeds:
            for method in args.methods:
                run_one(args, name, seed, method)


if __name__ == "__main__":
    main()
