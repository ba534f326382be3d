"""Replay the memorisation guard's trigger (``LCCNConfig.guard_rise``,
:func:`pipeline.core.monitor.overfit_epoch`: the held-out loss of the observed labels no
longer at its lowest while its gap to the training loss widens) over recorded CE runs: the
epoch it would fire at, beside the run's noisy-validation peak, its test peak and its drop.

A CE run's epoch rows carry what the trigger reads: ``val_nll`` (CE has no noise model, so
it is the held-out loss of the observed labels, the rows' ``val_observed_loss`` today),
``loss`` (the training pass's loss of the observed labels, ``observed_loss``) and ``lr``.
The scale ``H(observed)`` is the entropy of the observed labels' class shares: from the
result's realised transition where it records one (``bench_cifar.py``: the training
subset is class-balanced, so the shares are the transition's mean row), else ``log K``.
The noise phase starts at the run's ``--pretrain-epochs`` (8 when its command line does
not say). Usage::

    python benchmarks/replay_guard.py benchmarks/results/cifar-real/*-ce.json \\
        benchmarks/results/cifar-mem-methods/*-ce.json --rise 0.01 0.02 0.05

With ``--switch LCCN.json ...`` it reads instead where the LCCN runs' switch fired (their
rows' ``guarded``), beside the CE run of the same setting and seed among the files: CE's
noisy-validation peak, the epochs within one standard error of it (the split's size from
the command line: ``--val-fraction`` of ``--train-size``), and CE's test peak::

    python benchmarks/replay_guard.py benchmarks/results/cifar-real/mem/*-ce.json \\
        --switch benchmarks/results/cifar-real/mem/*-live.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np

from pipeline.core.monitor import overfit_epoch


def ce_history(result: dict) -> list[dict] | None:
    """The CE run's epoch rows of a ``bench_cifar.py`` or ``bench_cifar_methods.py`` result
    (None when it holds no CE run)."""
    if isinstance(result.get("methods"), dict):
        entry = result["methods"].get("ce")
        return None if entry is None else entry["history"]
    return result["history"] if result.get("method") == "ce" else None


def label_entropy(result: dict, num_classes: int = 10) -> float:
    """H(observed) in nats: from the realised transition (class-balanced subset), else
    ``log K``."""
    t = result.get("true_transition")
    if t is None:
        return math.log(num_classes)
    shares = np.asarray(t, dtype=np.float64).mean(0)
    shares = shares[shares > 0]
    return float(-(shares * np.log(shares)).sum())


def replay(result: dict, rise: float) -> dict:
    """Where the trigger fires (1-based epoch at whose end, None: never), the largest
    widening of the gap between the held-out and the training loss since the lowest
    held-out loss, in units of H(observed), over the watched epochs whose held-out loss is
    above that lowest, and the run's peaks."""
    hist = ce_history(result)
    argv = " ".join(result.get("argv") or [])
    m = re.search(r"--pretrain-epochs[ =](\d+)", argv)
    first = int(m.group(1)) if m else 8
    h = label_entropy(result)
    rows = [dict(r, val_observed_loss=r.get("val_observed_loss", r.get("val_nll", math.nan)),
                 observed_loss=r.get("observed_loss", r["loss"]), label_entropy=h)
            for r in hist]
    at = overfit_epoch(rows, first_epoch=first, rise=rise)
    lr0, low, largest = None, None, 0.0
    for r in rows[first:]:
        if lr0 is None:
            lr0 = r["lr"]
        held, fit = r["val_observed_loss"], r["observed_loss"]
        if not r["lr"] < lr0 * (1 - 1e-6) or held != held:
            continue
        if low is not None and held > low[0]:
            largest = max(largest, ((held - fit) - (low[0] - low[1])) / h)
        if low is None or held < low[0]:
            low = (held, fit)
    val = [r["val_top1"] for r in hist]
    test = [r["test_top1"] for r in hist]
    pv = max(range(len(val)), key=lambda e: (val[e], -e))
    pt = max(range(len(test)), key=lambda e: (test[e], -e))
    return {"fires": None if at is None else at + 1, "max_rise": largest, "entropy": h,
            "val_peak": pv + 1, "test_peak": pt + 1, "drop": test[pt] - test[-1],
            "epochs": len(hist), "first": first}


def _flag(argv: str, flag: str, default: float) -> float:
    m = re.search(rf"{flag}[ =]([0-9.]+)", argv)
    return float(m.group(1)) if m else default


def switch_rows(ce_results: list[dict], lccn_files: list[Path]) -> list[str]:
    """One Markdown row per LCCN run: the epoch (1-based) at whose end its switch fired
    (the first ``guarded`` row is the epoch after it), against its CE run's peaks."""
    ce = {(r["setting"], r["seed"]): ce_history(r) for r in ce_results}
    out = []
    for f in lccn_files:
        result = json.loads(f.read_text())
        entry = (result.get("methods") or {}).get("lccn")
        hist_ce = ce.get((result.get("setting"), result.get("seed")))
        if entry is None or hist_ce is None:
            continue
        argv = " ".join(result.get("argv") or [])
        n_val = round(_flag(argv, "--val-fraction", 0.05) * _flag(argv, "--train-size", 20000))
        guarded = [int(r["epoch"]) for r in entry["history"] if r.get("guarded")]
        fired = guarded[0] if guarded else None
        val = [r["val_top1"] for r in hist_ce]
        test = [r["test_top1"] for r in hist_ce]
        pv = max(range(len(val)), key=lambda e: (val[e], -e))
        pt = max(range(len(test)), key=lambda e: (test[e], -e))
        se = math.sqrt(val[pv] * (1 - val[pv]) / n_val)
        near = [e + 1 for e, v in enumerate(val) if v >= val[pv] - se]
        span = f"{near[0]}-{near[-1]} ({len(near)} epochs)"
        gap = "" if fired is None else f"{fired - (pt + 1):+d}"
        out.append(f"| {f.name} | {result['setting']} | {result['seed']} | "
                   f"{fired or 'never'} | {pv + 1} | {span} | {pt + 1} | {gap} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--rise", type=float, nargs="+", default=[0.05],
                   help="guard_rise values to replay (the library's default: 0.05)")
    p.add_argument("--switch", type=Path, nargs="+", default=None,
                   help="LCCN runs whose recorded switch to read against the CE runs given")
    args = p.parse_args(argv)
    if args.switch:
        print("| LCCN run | setting | seed | switch fired after epoch | CE noisy-val peak | "
              "CE epochs within 1 se of it | CE test peak | switch − test peak |")
        print("|---|---|---|---|---|---|---|---|")
        ce_results = [r for r in (json.loads(f.read_text()) for f in args.files)
                      if ce_history(r) is not None]
        print("\n".join(switch_rows(ce_results, args.switch)))
        return
    head = " | ".join(f"fires at {r:g}" for r in args.rise)
    print(f"| run | setting | seed | epochs (CE first) | noisy-val peak | test peak (drop) | "
          f"max gap widening / H(ỹ) | {head} |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(args.rise))
    for f in args.files:
        result = json.loads(f.read_text())
        if ce_history(result) is None:
            continue
        g = [replay(result, r) for r in args.rise]
        if g[0]["epochs"] <= g[0]["first"] or math.isnan(
                ce_history(result)[-1].get("val_nll", math.nan)):
            continue  # no validation loss recorded: nothing to replay
        fires = " | ".join(str(x["fires"] or "never") for x in g)
        print(f"| {f.name} | {result['setting']} | {result['seed']} | {g[0]['epochs']} "
              f"({g[0]['first']}) | {g[0]['val_peak']} | {g[0]['test_peak']} "
              f"({100 * g[0]['drop']:.2f}) | {g[0]['max_rise']:.4f} | {fires} |")


if __name__ == "__main__":
    main()
