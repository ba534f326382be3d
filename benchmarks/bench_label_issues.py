"""The label-issue report against cleanlab on planted flips, over seeds.

Protocol (one seed): the distributed quickstart job (``jobs/quickstart_ray.py``: scikit-learn's
digits as shards, two Ray Train workers, the confusion actor) with pair-flip noise at
``--rate`` in four classes (9->1, 2->0, 4->7, 3->5), ``--epochs`` epochs of which
``--pretrain-epochs`` CE, a noisy validation split of ``--val-fraction``, the posterior
averaged over the last ``--report-epochs`` epochs. The report's rankings are scored against
the clean labels: LCCN's on the training split (the chain's averaged posterior), LCCN's
(Eq. 7 from the final model and the chain's phi) and cleanlab's ``find_label_issues`` (the
same final model's probabilities) on the held-out split, where both have out-of-sample
predictions (docs/label-issues.md). Reported: R-precision (precision at k = the number of
planted flips) and the precision / recall of each method's own flagged set; mean +- std
over seeds. And the cleaning, per seed: the training labels' accuracy against the clean
ones, observed and after the report's relabelling (``labels.csv``'s ``cleaned``), beside
the report's estimate of both from the noisy data and confident learning's estimate.

    python benchmarks/bench_label_issues.py --seeds 0 1 2 [--write benchmarks/results/label_issues.md]
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

from pipeline.core.options import add_options


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rate", type=float, default=0.4)
    add_options(p, ("--epochs", "--pretrain-epochs", "--val-fraction", "--report-epochs",
                    "--warmup-weights"),
                defaults={"--epochs": 8, "--pretrain-epochs": 4, "--val-fraction": 0.2,
                          "--report-epochs": 3})
    p.add_argument("--write", type=Path, default=None, help="write the table here (Markdown)")
    return p


def one_seed(args: argparse.Namespace, seed: int, run_dir: Path) -> list[dict]:
    from lccn_jobs.digits import main as quickstart_ray

    summary = quickstart_ray([
        "--rate", str(args.rate), "--epochs", str(args.epochs),
        "--pretrain-epochs", str(args.pretrain_epochs), "--milestones", "--no-baseline",
        "--val-fraction", str(args.val_fraction), "--report-epochs", str(args.report_epochs),
        "--seed", str(seed), "--run-dir", str(run_dir), "--run-name", f"issues-s{seed}",
        "--warmup-weights", args.warmup_weights, "--no-tracking"])
    rows = []
    cleaning = summary["label_issues"]["cleaning"]
    for ev in summary["label_issues"]["evaluation"]:
        flagged = next(r for r in ev["at"] if r["k"] == "flagged")
        rows.append({"seed": seed, "split": ev["split"], "method": ev["method"],
                     "issues": ev["issues"], "evaluated": ev["evaluated"],
                     "r_precision": ev["r_precision"], "flag_p": flagged["precision"],
                     "flag_r": flagged["recall"], "flagged": ev["flagged"],
                     "test_top1": summary["metrics"].get("test_top1")})
        if "accuracy_cleaned" in ev and ev["split"] == "train":
            rows[-1].update(observed=ev["accuracy_observed"], cleaned=ev["accuracy_cleaned"],
                            relabel=ev["relabel"], estimate=cleaning["accuracy_observed"],
                            estimate_cleaned=cleaning["accuracy_cleaned"],
                            estimate_se=cleaning["accuracy_observed_se"],
                            confident=cleaning["confident_joint_accuracy"])
    return rows


def cleaning_table(rows: list[dict]) -> str:
    out = ["| seed | truth: observed / cleaned | estimate: observed / cleaned (95%) | "
           "estimate − truth | confident learning: observed | relabelled |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "cleaned" not in r:
            continue
        out.append(f"| {r['seed']} | {100 * r['observed']:.2f} / {100 * r['cleaned']:.2f} | "
                   f"{100 * r['estimate']:.1f} / {100 * r['estimate_cleaned']:.1f} "
                   f"(± {196 * r['estimate_se']:.1f}) | "
                   f"{100 * (r['estimate'] - r['observed']):+.1f} | "
                   f"{100 * r['confident']:.1f} | {r['relabel']} |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = ["| split | method | planted flips / samples | R-precision | flagged: precision | "
           "flagged: recall |", "|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        if (r["split"], r["method"]) not in keys:
            keys.append((r["split"], r["method"]))

    def ms(vals: list[float]) -> str:
        v = np.asarray(vals, dtype=float)
        return f"{v.mean():.3f} ± {v.std():.3f}" if len(v) > 1 else f"{v.mean():.3f}"

    for split, method in keys:
        rs = [r for r in rows if (r["split"], r["method"]) == (split, method)]
        n = "; ".join(f"{r['issues']}/{r['evaluated']}" for r in rs)
        out.append(f"| {split} | {method} | {n} | {ms([r['r_precision'] for r in rs])} | "
                   f"{ms([r['flag_p'] for r in rs])} | {ms([r['flag_r'] for r in rs])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    args = get_args_parser().parse_args(argv)
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lccn-bench-issues-") as tmp:
        for seed in args.seeds:
            rows += one_seed(args, seed, Path(tmp) / f"seed{seed}")
    seconds = time.perf_counter() - t0
    import torch

    load = os.getloadavg()
    cmd = "python benchmarks/bench_label_issues.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    best = args.warmup_weights == "best"
    title = ", the noise phase started from the best warm-up epoch (`--warmup-weights best`)" \
        if best else ""
    start = ("\nthe noise phase starts from the CE epoch with the best noisy validation "
             "accuracy\n(`LCCNConfig.warmup_weights`);") if best else ""
    text = f"""# The label-issue report against cleanlab on planted flips{title}

Script: `benchmarks/bench_label_issues.py` (the protocol is in its docstring): the
distributed digits quickstart, pair flips at {args.rate} in four classes, {args.epochs} epochs
({args.pretrain_epochs} CE), the posterior averaged over the last {args.report_epochs},
a {args.val_fraction:.0%} noisy validation split; seeds {', '.join(map(str, args.seeds))};{start}
mean ± std over seeds. Chance precision is the share of flipped labels (about 0.15).

Command:

```
{cmd.strip()}
```

{table(rows)}

The cleaned labels (training split; `cleaned` = `suggested` where `relabel`):

{cleaning_table(rows)}

The training split is scored on LCCN alone: cleanlab needs out-of-sample probabilities,
which a run has only for its held-out split (docs/label-issues.md). Clean test accuracy
of the runs: {', '.join(f"{r['test_top1']:.3f}" for r in rows if r['split'] == 'train')}.

Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average
{load[0]:.1f} at the end), torch {torch.__version__}; {seconds:.0f} s in all.
"""
    print(text)
    if args.write is not None:
        args.write.write_text(text)
    return text


if __name__ == "__main__":
    main()
