"""LCCN*'s exported p(outlier) on the digits with planted out-of-distribution samples.

``--fraction`` of the training digits are pixel-shuffled (an open-set label view; their
label is kept, as the shard loader does at read time), and the local trainer runs LCCN*
(``--epochs``, the first ``--pretrain-epochs`` of them CE) once per seed and per outlier
prior ε of the outlier row's own warm-up (``LCCNConfig.outlier_prior``; 0 = none). From
``outliers.csv`` (p(outlier) averaged over the last ``outlier_epochs`` epochs' Eq. 7
posteriors) it reports, over the training samples:

    in class     share of the planted samples whose latent z is the outlier class at the end
    flagged      samples with p(outlier) > 0.5, and the share of them that are planted
    recall       share of the planted samples flagged
    P@|ood|      precision of the |planted| samples with the highest p(outlier)
    AP           average precision of p(outlier) (scikit-learn)
    test         clean test accuracy

    python benchmarks/bench_outliers.py [--seeds 0 1 2] [--priors 0 0.3] [--write]

``--write`` writes ``benchmarks/results/outliers.md`` (the command, the machine, the load
and the table); without it the table is only printed.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig  # noqa: E402
from pipeline.core.noise import open_set  # noqa: E402
from pipeline.core.options import add_options
from pipeline.data.digits import clean_view, load_digits_arrays, split_indices, to_tensor  # noqa: E402
from pipeline.train.trainer import LocalTrainer, TensorData, open_set_images  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--priors", type=float, nargs="+", default=[0.0, 0.3])
    p.add_argument("--outlier-warmup", type=float, default=LCCNConfig.outlier_warmup,
                   help="fraction of the LCCN phase the prior applies to")
    p.add_argument("--fraction", type=float, default=0.2)
    add_options(p, ("--epochs", "--pretrain-epochs"),
                defaults={"--epochs": 6, "--pretrain-epochs": 2})
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true",
                   help="write benchmarks/results/outliers.md")
    return p


def one_run(seed: int, prior: float, args: argparse.Namespace) -> dict[str, float]:
    from sklearn.metrics import average_precision_score

    images, labels = load_digits_arrays()
    tr, te = split_indices(labels, test_fraction=0.3, seed=seed)
    x = to_tensor(images)
    view = open_set(labels[tr], 10, args.fraction, seed=seed)
    cfg = RunConfig(method="lccn", seed=seed, model=ModelConfig("small_cnn", 1),
                    optim=OptimConfig(epochs=args.epochs, pretrain_epochs=args.pretrain_epochs,
                                      batch_size=64, lr=0.05),
                    lccn=LCCNConfig(outlier=True, outlier_prior=prior,
                                    outlier_warmup=args.outlier_warmup))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        trainer = LocalTrainer(cfg, TensorData(open_set_images(x[tr], view), view),
                               TensorData(x[te], clean_view(labels[te])), out_dir=out)
        hist = trainer.fit()
        with open(Path(out) / "outliers.csv") as f:
            rows = list(csv.DictReader(f))
    seconds = time.perf_counter() - t0
    idx = np.array([int(r["idx"]) for r in rows])
    p = np.array([float(r["p_outlier"]) for r in rows])
    flag = p > 0.5
    ood = view.ood[idx]
    top = np.argsort(-p)[:int(ood.sum())]
    in_class = trainer.store.z.numpy() == 10
    return {"in_class": float(in_class[trainer.train_rows][view.ood[trainer.train_rows]].mean()),
            "flagged": int(flag.sum()),
            "flag_precision": float(ood[flag].mean()) if flag.any() else float("nan"),
            "recall": float(flag[ood].mean()), "p_at_ood": float(ood[top].mean()),
            "ap": float(average_precision_score(ood, p)), "test": hist[-1]["test_top1"],
            "seconds": seconds}


def main(argv: list[str] | None = None) -> list[dict]:
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    results = []
    for prior in args.priors:
        for seed in args.seeds:
            r = {"prior": prior, "seed": seed, **one_run(seed, prior, args)}
            results.append(r)
            print(r, flush=True)
    head = ("| ε (outlier_prior) | seed | in class | flagged (planted) | recall | P@\\|ood\\| "
            "| AP | test | s |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        prec = "-" if r["flagged"] == 0 else f"{r['flag_precision']:.2f}"
        lines.append(f"| {r['prior']:g} | {r['seed']} | {r['in_class']:.3f} | {r['flagged']} "
                     f"({prec}) | {r['recall']:.2f} | {r['p_at_ood']:.2f} | {r['ap']:.2f} "
                     f"| {r['test']:.3f} | {r['seconds']:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        cmd = "python benchmarks/bench_outliers.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:])
        text = (
            "# LCCN*: p(outlier) of planted out-of-distribution digits\n\n"
            f"```\n{cmd.strip()}\n```\n\n"
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
            f"shared with other jobs (load average {load[0]:.1f} at the start), torch "
            f"{torch.__version__}, {args.threads} thread(s).\n\n"
            f"{args.fraction:.0%} of the 1,258 training digits pixel-shuffled (label kept), "
            f"small CNN, {args.epochs} epochs ({args.pretrain_epochs} CE), batch 64, "
            f"lr 0.05; 5% noisy validation split held out. ε is the outlier row's own warm-up "
            f"(over the first {args.outlier_warmup:g} of the LCCN phase); 0 turns it off. \"in class\": planted "
            "samples whose z is the outlier class at the end; \"flagged\": p(outlier) > 0.5 "
            "(in brackets the share of them planted); P@|ood|: precision of the |planted| "
            "highest p(outlier); AP: average precision.\n\n" + table)
        out = REPO / "benchmarks" / "results" / "outliers.md"
        out.write_text(text)
        print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
