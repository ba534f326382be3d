"""Replay the collapse monitor's validation check over recorded benchmark runs.

The check (``pipeline.core.monitor.CollapseMonitor``) is a pure function of each epoch's noisy
validation accuracy and learning rate, given the accuracy and the rate of the network LCCN
started from; ``bench_cifar.py`` records all of them. This script counts, per LCCN run of
the given result files, the epochs in which the check fires

- ``every rate``: comparing at every learning rate (the monitor before it took the rate
  into account);
- ``start's rate or below``: comparing only in epochs whose rate is at most the start's
  (the monitor now),

and the epochs in which the run's own monitor warned (``collapse_epochs``, which also
counts the latent-class checks). Usage::

    python benchmarks/replay_monitor.py benchmarks/results/gpu-paper-120-restart/*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from pipeline.core.config import MonitorConfig  # noqa: E402
from pipeline.core.monitor import CollapseMonitor  # noqa: E402


def replay(lccn: dict, *, val_drop: float) -> dict:
    """Fired epochs of one LCCN run under both rules; its history holds the CE epochs it
    started after (its own pre-training, or the finished CE run it restarted from)."""
    hist = lccn["history"]
    start = sum(1 for r in hist if r.get("phase", 1.0) == 0.0)
    if start == 0 or start == len(hist):
        raise ValueError("the LCCN history has no CE epochs before its LCCN epochs")
    ref = hist[start - 1]  # the CE epoch (its own, or the finished run's last) LCCN started from
    out = {"lccn_epochs": len(hist) - start, "val_start": ref["val_top1"], "lr_start": ref["lr"],
           "recorded": len(lccn.get("collapse_epochs", []))}
    for name, lr_start in (("every_rate", None), ("start_rate", ref["lr"])):
        mon = CollapseMonitor(MonitorConfig(val_drop=val_drop))
        mon.start(ref["val_top1"], lr=lr_start)
        out[name] = sum(bool(mon.reasons({}, r["val_top1"], lr=r["lr"])) for r in hist[start:])
    out["armed_epochs"] = sum(mon.compares(r["lr"]) for r in hist[start:])
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="bench_cifar.py result JSONs")
    p.add_argument("--val-drop", type=float, default=MonitorConfig.val_drop)
    args = p.parse_args(argv)
    rows = []
    runs = {f: json.loads(f.read_text()) for f in args.results}
    for f, r in runs.items():
        lccn = r["methods"].get("lccn")
        if lccn is None:
            continue
        row = {"file": f.name, "setting": r["setting"], "seed": r["seed"],
               **replay(lccn, val_drop=args.val_drop)}
        rows.append(row)
    print("| run | LCCN epochs | start: noisy val / lr | warned (recorded) | validation check, "
          "every rate | validation check, start's rate or below (epochs compared) |")
    print("|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['file']} | {x['lccn_epochs']} | {x['val_start']:.4f} / {x['lr_start']:g} | "
              f"{x['recorded']} | {x['every_rate']} | {x['start_rate']} ({x['armed_epochs']}) |")
    return rows


if __name__ == "__main__":
    main()
