"""CE, LCCN, DivideMix and DivideLCCN on noisy digits in one process: accuracy and cost.

scikit-learn's digits (train 1,258 / test 539), ``--rate`` symmetric label noise
(``pipeline.core.noise.symmetric``, seed = run seed), small CNN, SGD lr 0.05, batch 64,
``--epochs`` epochs of which ``--pretrain`` cross-entropy (both networks for the two-network
methods), the library's defaults for everything else (LCCN: anchor warm-up, posterior
targets; DivideMix: DivideConfig, lambda_u 25). Per method and seed: the clean test
accuracy of the last epoch (DivideMix/DivideLCCN: the two-network ensemble), the last
epoch's division precision (network 0), and the median seconds per noise-phase epoch.
Prints a markdown table, and writes it to ``--out`` only when asked.

    python benchmarks/bench_divide_methods.py [--seeds 0 1 2] [--rate 0.4] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch


from pipeline.core.config import ModelConfig, OptimConfig, RunConfig  # noqa: E402
from pipeline.core.noise import symmetric  # noqa: E402
from pipeline.core.options import add_options
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor  # noqa: E402
from pipeline.train.trainer import LocalTrainer, TensorData  # noqa: E402

METHODS = ("ce", "lccn", "dividemix", "divide_lccn")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rate", type=float, default=0.4)
    add_options(p, ("--epochs", "--pretrain-epochs"),
                defaults={"--epochs": 8, "--pretrain-epochs": 2})
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    return p


def run(method: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=seed)
    x = to_tensor(images)
    view = symmetric(labels[tr], 10, args.rate, seed=seed)
    cfg = RunConfig(method=method, seed=seed, model=ModelConfig("small_cnn", 1),
                    optim=OptimConfig(epochs=args.epochs, pretrain_epochs=args.pretrain_epochs,
                                      batch_size=64, lr=0.05))
    trainer = LocalTrainer(cfg, TensorData(x[tr], view), TensorData(x[te], clean_view(labels[te])))
    t0 = time.perf_counter()
    hist = trainer.fit()
    wall = time.perf_counter() - t0
    noise = [r for r in hist if r["phase"] == 1.0] or hist
    return {"test_top1": hist[-1]["test_top1"],
            "precision": hist[-1].get("division_precision", float("nan")),
            "epoch_s": statistics.median(r["epoch_time"] for r in noise), "wall_s": wall}


def main(argv: list[str] | None = None) -> str:
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for method in args.methods:
        res = [run(method, s, args) for s in args.seeds]
        acc = [r["test_top1"] for r in res]
        prec = [r["precision"] for r in res]
        rows.append(
            f"| {method} | {np.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}) | "
            + (f"{np.mean(prec):.3f}" if all(p == p for p in prec) else "-")
            + f" | {statistics.median(r['epoch_s'] for r in res):.2f} | "
            f"{statistics.median(r['wall_s'] for r in res):.1f} |")
        print(rows[-1], flush=True)
    table = "\n".join(["| method | test top-1, mean (min-max) | division precision | "
                       "s / noise epoch | s / run |", "|---|---|---|---|---|", *rows])
    load = os.getloadavg()[0]
    print(f"\nseeds {args.seeds}, rate {args.rate}, {args.epochs} epochs ({args.pretrain_epochs} CE), "
          f"{args.threads} thread(s), load average {load:.1f}\n")
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
