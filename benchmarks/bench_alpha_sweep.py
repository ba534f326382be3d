"""The paper's alpha ablation run as a Ray Tune sweep of the CIFAR job, with the label-issue
report of every trial scored against cleanlab's on the same run.

Protocol: shards of a class-balanced CIFAR-10 subset (``lccn-shards imagefolder SRC --out
DIR --splits train --per-class 1000``, then ``--splits test`` in full), asymmetric noise 0.5
(seed 0), the fidelity benchmark's CPU model (``cnn_wide``, 0.37M parameters), SGD lr 0.1,
batch 128, 12 epochs with lr x0.1 after epochs 8 and 11, the first 4 cross-entropy, the
anchor warm-up for one epoch (74 steps), posterior targets, ramp 0.25; one Ray Train worker
a trial, two trials at once on a 2-CPU machine. The sweep is ``python -m tune.sweep --job
cifar --space alpha`` (the paper's grid 0.01 ... 1000, nothing else varied, FIFO: every
trial runs out); a cross-entropy run of the same job and protocol is the reference. A
trial's row: its noisy-validation accuracy at the epoch it selects (what ranks it), clean
test accuracy at the final epoch and at that selected epoch, the error of its learnt phi,
and the label-issue report's R-precision (precision at k = the number of flipped labels):
LCCN on the training split (the chain's posterior averaged over the last 5 epochs), LCCN and
cleanlab's ``find_label_issues`` on the held-out noisy validation split, both from the final
model's out-of-sample probabilities.

    python benchmarks/bench_alpha_sweep.py --data SHARDS --out DIR [--write benchmarks/results/alpha_sweep.md]
    python benchmarks/bench_alpha_sweep.py --data SHARDS --out DIR --report-only --write ...

``--out`` keeps the sweep (``DIR/sweep``: Tune, trials, MLflow) and the CE run (``DIR/ce``);
run again with the same ``--out``, the sweep resumes and a finished one is only reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "jobs"))

NAME = "alpha-asym0.5"
NOISE = '{"kind": "asymmetric", "rate": 0.5, "seed": 0}'
# the job options of every run (the CE reference adds --method ce)
PROTOCOL = ["--noise", NOISE, "--model", "cnn_wide", "--epochs", "12", "--pretrain-epochs", "4",
            "--milestones", "8", "11", "--lr", "0.1", "--lr-values", "--lr-decay", "0.1",
            "--batch-size", "128", "--weight-decay", "5e-4", "--warmup", "anchor",
            "--warmup-steps", "74", "--targets", "posterior", "--ramp", "0.25",
            "--num-workers", "1", "--loader-workers", "1"]


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True,
                   help="CIFAR-10 shards folder (train/ and test/)")
    p.add_argument("--out", type=Path, required=True, help="working folder (absolute)")
    p.add_argument("--report-only", action="store_true",
                   help="only read the finished sweep and CE run under --out")
    p.add_argument("--write", type=Path, default=None, help="write the table here (Markdown)")
    return p


def sweep_argv(args: argparse.Namespace) -> list[str]:
    return ["--job", "cifar", "--space", "alpha", "--num-samples", "1", "--scheduler", "fifo",
            "--name", NAME, "--sweep-dir", str(args.out.resolve() / "sweep"), "--",
            "--data", str(args.data.resolve()), *PROTOCOL]


def ce_argv(args: argparse.Namespace) -> list[str]:
    return ["--data", str(args.data.resolve()), *PROTOCOL, "--method", "ce",
            "--run-dir", str(args.out.resolve() / "ce"), "--run-name", "ce", "--no-tracking"]


def _rprec(summary: dict, split: str, method: str) -> float | None:
    for ev in (summary.get("label_issues") or {}).get("evaluation", []):
        if ev["split"] == split and ev["method"] == method and ev["kind"] == "mislabelled":
            return ev["r_precision"]
    return None


def run_row(summary: dict) -> dict:
    """The figures of one run's summary JSON (``<run-dir>/results/<run>.json``)."""
    hist = summary["history"]
    sel = summary["selected"] or {}
    err = summary["metrics"].get("transition_error")
    return {"test_final": hist[-1]["test_top1"], "val_selected": sel.get("val_top1"),
            "test_selected": sel.get("test_top1"), "epoch_selected": sel.get("epoch"),
            "phi_error": err if err is not None and math.isfinite(err) else None,
            "train_lccn": _rprec(summary, "train", "lccn"),
            "val_lccn": _rprec(summary, "validation", "lccn"),
            "val_cleanlab": _rprec(summary, "validation", "cleanlab"),
            "issues": next((f"{ev['issues']}/{ev['evaluated']}"
                            for ev in (summary.get("label_issues") or {}).get("evaluation", [])
                            if ev["split"] == "train"), None),
            "seconds": summary["seconds"]}


def collect(out: Path) -> tuple[list[dict], dict]:
    """(one row per alpha, sorted, with the sweep's rank), the CE row."""
    sweep = json.loads((out / "sweep" / f"{NAME}.json").read_text())
    rows = []
    for t in sweep["trials"]:
        res = out / "sweep" / "trials" / t["trial_id"] / "results" / f"{t['trial_id']}.json"
        rows.append({"alpha": t["lccn.alpha"], "rank": t["rank"], "status": t["status"],
                     **run_row(json.loads(res.read_text()))})
    rows.sort(key=lambda r: r["alpha"])
    ce = run_row(json.loads((out / "ce" / "results" / "ce.json").read_text()))
    return rows, ce


def _f(v, d: int = 2, scale: float = 100.0) -> str:
    return "-" if v is None else f"{v * scale:.{d}f}"


def table(rows: list[dict], ce: dict) -> str:
    lines = ["| α | rank (noisy val) | noisy val, selected epoch | test final / selected | "
             "φ error | R-prec. train: LCCN | R-prec. val: LCCN / cleanlab |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['alpha']:g} | {r['rank']} | {_f(r['val_selected'])} (epoch "
                     f"{r['epoch_selected'] + 1}) | {_f(r['test_final'])} / "
                     f"{_f(r['test_selected'])} | {_f(r['phi_error'], 4, 1)} | "
                     f"{_f(r['train_lccn'], 3, 1)} | {_f(r['val_lccn'], 3, 1)} / "
                     f"{_f(r['val_cleanlab'], 3, 1)} |")
    lines.append(f"| CE (no α) | - | {_f(ce['val_selected'])} (epoch "
                 f"{ce['epoch_selected'] + 1}) | {_f(ce['test_final'])} / "
                 f"{_f(ce['test_selected'])} | - | - | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = get_args_parser().parse_args(argv)
    args.out = args.out.resolve()
    t0 = time.perf_counter()
    if not args.report_only:
        import cifar_lccn

        from tune import sweep

        done = args.out / "sweep" / f"{NAME}.json"
        if not (done.is_file() and json.loads(done.read_text())["complete"]):
            sweep.main(sweep_argv(args))
        if not (args.out / "ce" / "results" / "ce.json").is_file():
            cifar_lccn.main(ce_argv(args))
    rows, ce = collect(args.out)
    text = table(rows, ce)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text += (f"\nMachine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} "
             f"at the end; sweep trials {min(r['seconds'] for r in rows):.0f}-"
             f"{max(r['seconds'] for r in rows):.0f} s each, CE {ce['seconds']:.0f} s"
             + ("" if args.report_only else f"; {time.perf_counter() - t0:.0f} s in all")
             + ".\n")
    print(text)
    if args.write:
        args.write.write_text(text)


if __name__ == "__main__":
    main()
