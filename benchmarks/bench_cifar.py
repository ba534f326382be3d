"""CE vs LCCN on real CIFAR-10 (the JPEG tarball), small CNN, on the CPU.

For each noise setting, CE and LCCN run the same schedule from the same seed: ``--pretrain-epochs``
of cross-entropy on the noisy labels, then LCCN (Eq. 7 Gibbs sampling, Eq. 8 warm-up for
``--warmup-steps`` steps, initial assignment = the pretrained argmax) or CE continuing, SGD
(momentum 0.9, weight decay 5e-4), step learning rate. Images: all 60k JPEGs decoded once
into memory (cached as ``.npz`` under ``--cache``), per-channel normalisation, batched
random crop (pad 4) + horizontal flip on tensors drawn from the trainer's generator.

Settings (DivideMix convention for symmetric noise, ``include_true=True``)::

    asym0.5   asymmetric (truck->automobile, bird->airplane, deer->horse, cat->dog), r = 0.5
    asym0.3   asymmetric, r = 0.3
    sym0.5    symmetric, r = 0.5 (T = 0.5 I + 0.05)

Usage::

    python benchmarks/bench_cifar.py --time-epoch                 # size the schedule
    python benchmarks/bench_cifar.py --setting asym0.5 [--epochs 16 --pretrain-epochs 6 ...]
    python benchmarks/bench_cifar.py --report      # markdown table of the JSONs under --out

Each setting writes ``<out>/<setting>.json`` (per-epoch history of both methods); ``--report``
prints all of them as one markdown table. Prints a table per setting: CE top-1, LCCN top-1,
delta, LCCN transition error, label recovery, wall time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cifar_memory import (RandomCropFlip, channel_stats, load_cifar10,  # noqa: E402
                                   normalise)
from pipeline.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig  # noqa: E402
from pipeline.labels import LabelView  # noqa: E402
from pipeline.noise import (asymmetric_cifar10, clean_view, format_transition,  # noqa: E402
                            symmetric)
from pipeline.trainer import LocalTrainer, TensorData  # noqa: E402

SETTINGS = {
    "asym0.5": ("asymmetric", 0.5),
    "asym0.3": ("asymmetric", 0.3),
    "sym0.5": ("symmetric", 0.5),
}
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="folder holding cifar10-jpeg.tar.gz")
    p.add_argument("--cache", type=Path,
                   default=Path(tempfile.gettempdir()) / "lccn-cifar10-cache",
                   help="folder for the decoded .npz cache")
    p.add_argument("--out", type=Path,
                   default=Path(tempfile.gettempdir()) / "lccn-bench-cifar",
                   help="folder for the per-setting JSON results")
    p.add_argument("--setting", choices=[*SETTINGS, "all"], default="all")
    p.add_argument("--seed", type=int, default=0, help="noise, init and shuffling seed")
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--pretrain-epochs", type=int, default=6)
    p.add_argument("--milestones", type=int, nargs="*", default=[11, 14])
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=391, help="Eq. 8 warm-up steps (δ)")
    p.add_argument("--warmup", choices=["eq8", "identity"], default="eq8")
    p.add_argument("--init", choices=["argmax", "observed"], default="argmax")
    p.add_argument("--methods", nargs="+", choices=["ce", "lccn"], default=["ce", "lccn"])
    p.add_argument("--no-augment", action="store_true")
    p.add_argument("--no-share-pretrain", action="store_true",
                   help="run LCCN's CE pretraining again instead of starting from CE's state")
    p.add_argument("--limit", type=int, default=None,
                   help="use every (50000 // limit)-th training image (smoke tests)")
    p.add_argument("--time-epoch", action="store_true",
                   help="time one CE epoch (+ test pass) and one LCCN epoch, then exit")
    p.add_argument("--report", action="store_true",
                   help="print the JSON results under --out as a markdown table and exit")
    return p


# -- data ------------------------------------------------------------------------------------


def noisy_view(kind: str, rate: float, clean: np.ndarray, seed: int) -> LabelView:
    if kind == "asymmetric":
        return asymmetric_cifar10(clean, rate, seed=seed)
    if kind == "symmetric":
        return symmetric(clean, 10, rate, include_true=True, seed=seed)
    raise ValueError(f"unknown noise kind {kind!r}")


def load_splits(args: argparse.Namespace) -> tuple[torch.Tensor, np.ndarray, torch.Tensor,
                                                   np.ndarray, RandomCropFlip | None]:
    tar = args.data / "cifar10-jpeg.tar.gz"
    t0 = time.perf_counter()
    arrays = load_cifar10(tar, cache_dir=args.cache)
    mean, std = channel_stats(arrays.train_x)
    train_x = normalise(arrays.train_x, mean, std)
    test_x = normalise(arrays.test_x, mean, std)
    aug = None if args.no_augment else RandomCropFlip(padding=4, fill=-mean / std)
    print(f"loaded CIFAR-10 from {tar} in {time.perf_counter() - t0:.1f}s (cache {args.cache}):"
          f" train {tuple(train_x.shape)}, test {tuple(test_x.shape)}; channel mean "
          f"{[round(float(v), 4) for v in mean]}, std {[round(float(v), 4) for v in std]}",
          flush=True)
    return train_x, arrays.train_y, test_x, arrays.test_y, aug


def run_config(args: argparse.Namespace, method: str, *, epochs: int | None = None,
               pretrain: int | None = None) -> RunConfig:
    return RunConfig(
        method=method, seed=args.seed, model=ModelConfig(args.model, in_channels=3),
        optim=OptimConfig(epochs=epochs or args.epochs,
                          pretrain_epochs=args.pretrain_epochs if pretrain is None else pretrain,
                          batch_size=args.batch_size, lr=args.lr, momentum=0.9,
                          weight_decay=5e-4, milestones=tuple(args.milestones), lr_decay=0.1),
        lccn=LCCNConfig(alpha=args.alpha, warmup_steps=args.warmup_steps, warmup=args.warmup,
                        init=args.init))


# -- runs ------------------------------------------------------------------------------------


def time_epoch(args: argparse.Namespace, train: TensorData, test: TensorData) -> None:
    """One CE epoch, then one LCCN epoch (pretrain 1 epoch, LCCN 1 epoch) to size a run.
    Uses ``--warmup-steps`` etc. as given; the LCCN epoch's step time shows the sampler's
    share."""
    cfg = run_config(args, "lccn", epochs=2, pretrain=1)
    trainer = LocalTrainer(cfg, train, test)
    t0 = time.perf_counter()
    hist = trainer.fit(on_epoch=lambda e, r: print(
        f"  epoch {e}: {'LCCN' if r['phase'] else 'CE'} {r['epoch_time']:.1f}s "
        f"(step {1e3 * r['step_time']:.1f} ms, sampler share {100 * r['sampler_share']:.2f}%)"
        f", test top-1 {r['test_top1']:.3f}", flush=True))
    total = time.perf_counter() - t0
    per = total / len(hist)
    print(f"{per:.1f}s per epoch incl. evaluation. With the shared pretraining a setting of E "
          f"epochs (P pretrain) costs about (2E - P) epochs: E=16, P=6 -> "
          f"{26 * per / 60:.0f} min. Load average {os.getloadavg()}", flush=True)


def _show(method: str, epochs: int, offset: int = 0):
    def show(e: int, r: dict) -> None:
        extra = ""
        if r["phase"]:
            extra = (f"  T-err {r['transition_error']:.4f}  changed {r['changed']:.3f}"
                     f"  sampler {100 * r['sampler_share']:.2f}%")
        print(f"  [{method:4s}] epoch {e + offset + 1:2d}/{epochs}  lr {r['lr']:.4f}  loss "
              f"{r['loss']:.3f}  test {r['test_top1']:.4f}  recovery "
              f"{r['label_recovery']:.3f}{extra}  ({r['epoch_time']:.0f}s)", flush=True)
    return show


def fit_pair(args: argparse.Namespace, train: TensorData, test: TensorData
             ) -> dict[str, tuple[LocalTrainer, list[dict], float]]:
    """CE for all epochs and LCCN continuing from CE's state after ``pretrain_epochs``.

    The pretraining phase of an LCCN run is plain CE on the observed labels from the same
    seed, so it is identical to CE's first ``P`` epochs: instead of repeating it, LCCN
    starts from a snapshot of CE's model, optimiser (momentum) and generator after epoch
    ``P``, with the remaining ``E - P`` epochs and the milestones shifted by ``P`` (the
    same learning rates and the same LCCN max_steps). Returns ``{method: (trainer, history
    of all E epochs, wall seconds)}``; LCCN's wall time includes the shared pretraining.
    """
    e_total, p = args.epochs, args.pretrain_epochs
    if any(m <= p for m in args.milestones):
        raise ValueError(f"sharing the pretraining needs every milestone > pretrain epochs "
                         f"({p}), got {args.milestones}; or pass --no-share-pretrain")
    snap: dict = {}
    ce = LocalTrainer(run_config(args, "ce"), train, test)
    show_ce = _show("ce", e_total)
    t_pre = [0.0]
    t0 = time.perf_counter()

    def on_epoch(e: int, r: dict) -> None:
        show_ce(e, r)
        if e == p - 1:
            snap["model"] = copy.deepcopy(ce.model.state_dict())
            snap["optim"] = copy.deepcopy(ce.optimizer.state_dict())
            snap["gen"] = ce.gen.get_state()
            t_pre[0] = time.perf_counter() - t0

    hist_ce = ce.fit(on_epoch=on_epoch)
    out = {"ce": (ce, hist_ce, time.perf_counter() - t0)}
    if "lccn" not in args.methods:
        return out
    base = run_config(args, "lccn")
    cfg = replace(base, optim=replace(base.optim, epochs=e_total - p, pretrain_epochs=0,
                                      milestones=tuple(m - p for m in args.milestones)))
    t1 = time.perf_counter()
    lc = LocalTrainer(cfg, train, test)
    lc.model.load_state_dict(snap["model"])
    lc.optimizer.load_state_dict(snap["optim"])
    lc.gen.set_state(snap["gen"])
    hist = lc.fit(on_epoch=_show("lccn", e_total, offset=p))
    for r in hist:
        r["epoch"] += p
    out["lccn"] = (lc, hist_ce[:p] + hist, t_pre[0] + time.perf_counter() - t1)
    return out


def fit_separate(args: argparse.Namespace, train: TensorData, test: TensorData
                 ) -> dict[str, tuple[LocalTrainer, list[dict], float]]:
    """Each method runs its full schedule, pretraining included."""
    out = {}
    for method in args.methods:
        t0 = time.perf_counter()
        trainer = LocalTrainer(run_config(args, method), train, test)
        hist = trainer.fit(on_epoch=_show(method, args.epochs))
        out[method] = (trainer, hist, time.perf_counter() - t0)
    return out


def run_setting(args: argparse.Namespace, name: str, data) -> dict:
    train_x, train_y, test_x, test_y, aug = data
    kind, rate = SETTINGS[name]
    if args.limit:
        keep = np.arange(0, len(train_y), max(1, len(train_y) // args.limit))
        train_x, train_y = train_x[keep], train_y[keep]
    view = noisy_view(kind, rate, train_y, args.seed)
    train = TensorData(train_x, view, augment=aug)
    test = TensorData(test_x, clean_view(test_y, 10))
    print(f"\n=== {name}: {kind} r={rate}, realised noise rate {view.noise_rate():.3f}, seed "
          f"{args.seed}, {len(train)} train images, {args.epochs} epochs "
          f"({args.pretrain_epochs} CE pretrain), milestones {args.milestones}, lr {args.lr}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()}", flush=True)
    result: dict = {"setting": name, "kind": kind, "rate": rate,
                    "realised_noise_rate": view.noise_rate(), "argv": sys.argv[1:],
                    "train_size": len(train), "shared_pretrain": not args.no_share_pretrain,
                    "load_avg_start": os.getloadavg(), "threads": torch.get_num_threads(),
                    "methods": {}}
    t0 = time.perf_counter()
    share = not args.no_share_pretrain and set(args.methods) >= {"ce"}
    runs = fit_pair(args, train, test) if share else fit_separate(args, train, test)
    result["setting_wall_s"] = time.perf_counter() - t0
    for method, (trainer, hist, wall) in runs.items():
        entry = {"wall_s": wall, "history": hist, "config": asdict(trainer.cfg),
                 "final": {k: hist[-1][k] for k in ("test_top1", "test_top5", "label_recovery",
                                                    "transition_error", "loss")},
                 "best_test_top1": max(r["test_top1"] for r in hist)}
        if method == "lccn":
            phi = trainer.transition().numpy()
            entry["transition"] = phi.tolist()
            entry["init_transition_error"] = next(
                (r["init_transition_error"] for r in hist if "init_transition_error" in r),
                float("nan"))
            lccn_rows = [r for r in hist if r["phase"]]
            entry["sampler_share"] = float(np.mean([r["sampler_share"] for r in lccn_rows]))
            entry["step_time_ms"] = 1e3 * float(np.mean([r["step_time"] for r in lccn_rows]))
            print(f"Eq. 8 phi_init transition error {entry['init_transition_error']:.4f}; "
                  "learned phi[k, j] = P(observed=j | latent=k):")
            print(format_transition(phi))
            print("true transition:")
            print(format_transition(view.transition))
        result["methods"][method] = entry
    result["load_avg_end"] = os.getloadavg()
    print_table([result])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", flush=True)
    return result


# -- reporting -------------------------------------------------------------------------------


def table_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        ce, lc = r["methods"].get("ce"), r["methods"].get("lccn")
        f = lambda e, k: e["final"][k] if e else float("nan")  # noqa: E731
        ce1, lc1 = f(ce, "test_top1"), f(lc, "test_top1")
        rows.append([r["setting"], f"{100 * ce1:.2f}", f"{100 * lc1:.2f}",
                     f"{100 * (lc1 - ce1):+.2f}", f"{f(lc, 'transition_error'):.4f}",
                     f"{f(ce, 'label_recovery'):.3f} / {f(lc, 'label_recovery'):.3f}",
                     f"{ce['wall_s'] / 60 if ce else float('nan'):.1f} / "
                     f"{lc['wall_s'] / 60 if lc else float('nan'):.1f} / "
                     f"{r.get('setting_wall_s', float('nan')) / 60:.1f}"])
    return rows


HEADER = ["setting", "CE top-1 %", "LCCN top-1 %", "delta (pts)", "LCCN T-error",
          "label recovery CE / LCCN", "wall min CE / LCCN / setting"]


def print_table(results: list[dict]) -> None:
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), flush=True)


def markdown_table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(results)]
    return "\n".join(lines)


def load_results(out: Path) -> list[dict]:
    found = [out / f"{name}.json" for name in SETTINGS if (out / f"{name}.json").is_file()]
    if not found:
        raise FileNotFoundError(f"no <setting>.json results under {out}")
    return [json.loads(p.read_text()) for p in found]


def main(argv: list[str] | None = None) -> list[dict]:
    args = get_args_parser().parse_args(argv)
    if args.report:
        results = load_results(args.out)
        print(markdown_table(results))
        return results
    torch.set_num_threads(args.threads)
    data = load_splits(args)
    if args.time_epoch:
        train_x, train_y, test_x, test_y, aug = data
        view = noisy_view("asymmetric", 0.5, train_y, args.seed)
        time_epoch(args, TensorData(train_x, view, augment=aug),
                   TensorData(test_x, clean_view(test_y, 10)))
        return []
    names = list(SETTINGS) if args.setting == "all" else [args.setting]
    results = [run_setting(args, name, data) for name in names]
    if len(results) > 1:
        print_table(results)
    return results


if __name__ == "__main__":
    main()
