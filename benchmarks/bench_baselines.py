"""Every method of the engine on the noisy digits, in one process on the CPU, over seeds.

Protocol (one seed): scikit-learn's digits, 70/30 stratified split; pair-flip noise at
``--rate`` on the training labels (9->1, 2->0, 4->7, 3->5, the CIFAR-10 asymmetric map on
digit indices); a 5% noisy validation split carved from them; small CNN, SGD lr 0.1,
momentum 0.9, weight decay 5e-4, batch 32, ``--epochs`` with lr x0.1 at two thirds, the
first ``--pretrain-epochs`` cross-entropy for every method (the quickstart's recipe). Each
method runs with its defaults (LCCN: the digits preset, ``targets="sample"``, ``ramp_epochs=0``);
``forward-oracle`` is Forward with the true transition read from a file.

Reported per method: clean test top-1 at the final epoch and at the epoch with the best
noisy-validation accuracy, and the transition error (mean |T - true T|) where the method
has a transition; mean +- std over seeds, and the wall time of one run.

    python benchmarks/bench_baselines.py --seeds 0 1 2 [--write benchmarks/results/baselines.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


from pipeline.core.config import BaselineConfig, LCCNConfig, ModelConfig, OptimConfig, RunConfig
from pipeline.core.noise import CIFAR10_ASYM_MAP, pair_flip  # noqa: E402
from pipeline.core.options import add_options
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor  # noqa: E402
from pipeline.train.trainer import LocalTrainer, TensorData, select_epoch  # noqa: E402

METHODS = ("ce", "bootstrap", "forward", "forward-oracle", "sadapt", "trevision", "lccn")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--rate", type=float, default=0.4)
    add_options(p, ("--epochs", "--pretrain-epochs"),
                defaults={"--epochs": 40, "--pretrain-epochs": 8})
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", type=Path, default=None, help="write the table here (Markdown)")
    return p


def run_config(args: argparse.Namespace, method: str, seed: int, oracle: Path) -> RunConfig:
    name, baseline = method, BaselineConfig()
    if method == "forward-oracle":
        name, baseline = "forward", BaselineConfig(transition="file", transition_file=str(oracle))
    return RunConfig(method=name, seed=seed, model=ModelConfig("small_cnn", in_channels=1),
                     optim=OptimConfig(epochs=args.epochs, pretrain_epochs=args.pretrain_epochs,
                                       batch_size=32, lr=0.1, weight_decay=5e-4,
                                       milestones=(int(args.epochs * 2 / 3),)),
                     lccn=LCCNConfig(targets="sample", ramp_epochs=0.0), baseline=baseline)


def one(args: argparse.Namespace, method: str, seed: int, tmp: Path) -> dict:
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=seed)
    x = to_tensor(images)
    view = pair_flip(labels[tr], 10, CIFAR10_ASYM_MAP, args.rate, seed=seed)
    oracle = tmp / f"T-seed{seed}.npy"
    np.save(oracle, view.transition)
    trainer = LocalTrainer(run_config(args, method, seed, oracle), TensorData(x[tr], view),
                           TensorData(x[te], clean_view(labels[te])))
    t0 = time.perf_counter()
    hist = trainer.fit()
    wall = time.perf_counter() - t0
    sel = hist[select_epoch(hist)]
    return {"final": hist[-1]["test_top1"], "selected": sel["test_top1"],
            "transition_error": hist[-1].get("transition_error", float("nan")), "wall_s": wall}


def fmt(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    v = np.asarray(values, dtype=float)
    if np.isnan(v).all():
        return "-"
    return f"{scale * v.mean():.{digits}f} ± {scale * v.std():.{digits}f}"


def main(argv: list[str] | None = None) -> str:
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for m in args.methods:
                r = one(args, m, seed, Path(tmp))
                results[m].append(r)
                print(f"seed {seed} {m:15s} final {r['final']:.4f}  selected {r['selected']:.4f}"
                      f"  transition_error {r['transition_error']:.4f}  {r['wall_s']:.1f} s",
                      flush=True)
    lines = ["| method | test top-1, final epoch (%) | test top-1, noisy-val-selected (%) | "
             "transition error | s per run |", "|---|---|---|---|---|"]
    for m, rs in results.items():
        lines.append(f"| `{m}` | {fmt([r['final'] for r in rs])} | "
                     f"{fmt([r['selected'] for r in rs])} | "
                     f"{fmt([r['transition_error'] for r in rs], 1.0, 4)} | "
                     f"{np.mean([r['wall_s'] for r in rs]):.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.write is not None:
        cmd = "python benchmarks/bench_baselines.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:])
        load = os.getloadavg()
        text = f"""# Every method on the noisy digits (one process, CPU)

Script: `benchmarks/bench_baselines.py` (the protocol is in its docstring): pair-flip noise
at {args.rate} on 4 of the 10 digit classes, small CNN, {args.epochs} epochs of which the
first {args.pretrain_epochs} are cross-entropy for every method, seeds
{", ".join(map(str, args.seeds))}; mean ± std over seeds.

Command:

```
{cmd}
```

Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average
{load[0]:.1f} at the end), torch {torch.__version__}, {args.threads} torch thread(s).

{table}
"""
        args.write.write_text(text)
    return table


if __name__ == "__main__":
    main()
