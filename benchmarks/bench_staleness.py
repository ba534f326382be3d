"""What committing every n steps costs in accuracy: the distributed digits quickstart with
``--commit-every n``.

Each configuration (workers W, commit_every n) trains the quickstart (digits with 40%
pair-flip noise in four classes, small CNN, 30 epochs of which 8 CE, global batch 32) on a
local Ray, once per seed, each run in its own process. W = 1 is the staleness-free chain
(one worker sees every commit); W = 2 with n = 1 is the per-step protocol (staleness ~1).
Reported per configuration, mean and spread over seeds: clean test top-1, the accuracy of
the final latent labels z against the clean labels, mean |phi - T| of the learned transition,
the mean and largest staleness (other workers' steps a replica had not seen), calls to the
actor and run time.

    python benchmarks/bench_staleness.py                        # ~20 min on 2 cores
    python benchmarks/bench_staleness.py --seeds 0 --configs 2:1 2:8    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lccn_jobs import digits as quickstart_ray
from pipeline.core.options import UNSET, add_options
from pipeline.train.checkpoints import load_state

ROOT = Path(__file__).resolve().parents[1]


def parse_config(text: str) -> tuple[int, int]:
    try:
        w, n = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"config {text!r} is not WORKERS:COMMIT_EVERY") from None
    if w < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"config {text!r}: need WORKERS >= 1, COMMIT_EVERY >= 1")
    return w, n


def run_one(root: Path, workers: int, n: int, seed: int, extra: list[str]) -> dict:
    name = f"w{workers}-n{n}-s{seed}"
    cmd = [sys.executable, str(ROOT / "jobs" / "quickstart_ray.py"), "--run-dir",
           str(root / name), "--run-name", name, "--num-workers", str(workers),
           "--commit-every", str(n), "--seed", str(seed), "--no-baseline", "--no-tracking",
           *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((root / name / "results" / f"{name}.json").read_text())
    train = root / name / "data" / f"digits-seed{seed}" / "train"
    view = quickstart_ray.digits_view(train, rate=0.4, seed=seed)
    state = load_state(summary["checkpoint"])["store"]
    z = state["z"].numpy()
    m = summary["metrics"]
    return {"workers": workers, "n": n, "seed": seed, "seconds": seconds,
            "test_top1": m["test_top1"], "z_accuracy": float((z == view.clean).mean()),
            "observed_accuracy": float((view.observed == view.clean).mean()),
            "transition_error": float(np.abs(np.array(summary["transition"])
                                             - view.realised_transition()).mean()),
            "staleness": statistics.fmean(r["staleness"] for r in summary["history"]
                                          if r.get("phase") == 1.0),
            "staleness_max": max(r["staleness_max"] for r in summary["history"]),
            "calls": int(state["counters"]["calls"]), "version": int(state["version"])}


def spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def table(rows: list[dict]) -> str:
    lines = ["| workers | commit_every | seeds | test top-1 | z accuracy | mean abs(phi - T) | "
             "staleness mean | staleness max | actor calls | run s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["workers"], r["n"]) for r in rows):
        sel = [r for r in rows if (r["workers"], r["n"]) == key]
        lines.append(
            f"| {key[0]} | {key[1]} | {len(sel)} | "
            f"{spread([r['test_top1'] for r in sel], '.4f')} | "
            f"{spread([r['z_accuracy'] for r in sel], '.4f')} | "
            f"{spread([r['transition_error'] for r in sel], '.4f')} | "
            f"{spread([r['staleness'] for r in sel], '.1f')} | "
            f"{max(r['staleness_max'] for r in sel):.0f} | "
            f"{statistics.fmean(r['calls'] for r in sel):.0f} | "
            f"{statistics.fmean(r['seconds'] for r in sel):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=parse_config, nargs="+",
                   default=[(1, 1), (2, 1), (2, 8), (2, 32)],
                   help="WORKERS:COMMIT_EVERY pairs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_options(p, ("--epochs",), defaults={"--epochs": UNSET}, unset="the preset's 30")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    extra = [] if args.epochs is None else ["--epochs", str(args.epochs)]
    load_before = os.getloadavg()
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lccn-staleness-") as tmp:
        for seed in args.seeds:             # seeds outermost: a partial run covers every config
            for workers, n in args.configs:
                rows.append(run_one(Path(tmp), workers, n, seed, extra))
                r = rows[-1]
                print(f"W={workers} n={n} seed={seed}: top-1 {r['test_top1']:.4f}, z accuracy "
                      f"{r['z_accuracy']:.4f} (observed {r['observed_accuracy']:.4f}), |phi-T| "
                      f"{r['transition_error']:.4f}, staleness {r['staleness']:.1f} (max "
                      f"{r['staleness_max']:.0f}), {r['calls']} actor calls, "
                      f"{r['seconds']:.0f} s", flush=True)
    text = table(rows)
    footer = (f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
              f"{time.perf_counter() - t0:.0f} s in all; load average {load_before[0]:.1f} "
              f"before, {os.getloadavg()[0]:.1f} after")
    print()
    print(text)
    print(footer)
    if args.out is not None:
        args.out.write_text(text + "\n\n" + footer + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
