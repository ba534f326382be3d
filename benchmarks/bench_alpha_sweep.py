"""The paper's alpha ablation run as a Ray Tune sweep of the CIFAR job, with the label-issue
report of every trial scored against cleanlab's on the same run.

Protocol: shards of a class-balanced CIFAR-10 subset (``lccn-shards imagefolder SRC --out
DIR --splits train --per-class 1000``, then ``--splits test`` in full), asymmetric noise 0.5
(seed 0), the fidelity benchmark's CPU model (``cnn_wide``, 0.37M parameters), SGD lr 0.1,
batch 128, 12 epochs with lr x0.1 after epochs 8 and 11, the first 4 cross-entropy, the
anchor warm-up for one epoch (74 steps), posterior targets, a 2-epoch ramp (a quarter of
the LCCN phase); one Ray Train worker a trial, two trials at once on a 2-CPU machine. The
sweep is ``python -m tune.sweep --job cifar --space alpha`` (the paper's grid 0.01 ... 1000,
nothing else varied, FIFO: every trial runs out), one sweep per training seed (``--seeds``;
the noise stays seed 0); a
cross-entropy run of the same job, protocol and seed is the reference. A
trial's row: its noisy-validation accuracy at the epoch it selects (what ranks it), its
noisy-validation NLL at the final epoch (``val_nll``: -log sum_k P(k|x) phi[k, observed] over
the held-out split, the noisy labels' likelihood under the model and its learnt phi), clean
test accuracy at the final epoch and at that selected epoch, the error of its learnt phi,
and the label-issue report's R-precision (precision at k = the number of flipped labels):
LCCN on the training split (the chain's posterior averaged over the last 5 epochs), LCCN and
cleanlab's ``find_label_issues`` on the held-out noisy validation split, both from the final
model's out-of-sample probabilities.

    python benchmarks/bench_alpha_sweep.py --data SHARDS --out DIR [--write benchmarks/results/alpha_sweep.md]
    python benchmarks/bench_alpha_sweep.py --data SHARDS --out DIR --report-only --write ...

``--out`` keeps the sweeps (``DIR/sweep``: Tune, trials, MLflow; named ``alpha-asym0.5``
for seed 0, ``alpha-asym0.5-seed<S>`` for another) and the CE runs (``DIR/ce``); run again
with the same ``--out``, an unfinished sweep resumes and a finished one is only reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NAME = "alpha-asym0.5"
NOISE = '{"kind": "asymmetric", "rate": 0.5, "seed": 0}'
# the job options of every run (the CE reference adds --method ce)
PROTOCOL = ["--noise", NOISE, "--model", "cnn_wide", "--epochs", "12", "--pretrain-epochs", "4",
            "--milestones", "8", "11", "--lr", "0.1", "--lr-values", "--lr-decay", "0.1",
            "--batch-size", "128", "--weight-decay", "5e-4", "--warmup", "anchor",
            "--warmup-steps", "74", "--targets", "posterior", "--ramp-epochs", "2",
            "--num-workers", "1", "--loader-workers", "1"]


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True,
                   help="CIFAR-10 shards folder (train/ and test/)")
    p.add_argument("--out", type=Path, required=True, help="working folder (absolute)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                   help="training seeds: one sweep and one CE run each")
    p.add_argument("--report-only", action="store_true",
                   help="only read the finished sweep and CE run under --out")
    p.add_argument("--write", type=Path, default=None, help="write the table here (Markdown)")
    return p


def sweep_name(seed: int) -> str:
    return NAME if seed == 0 else f"{NAME}-seed{seed}"


def sweep_argv(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--job", "cifar", "--space", "alpha", "--num-samples", "1", "--scheduler", "fifo",
            "--name", sweep_name(seed), "--sweep-dir", str(args.out / "sweep"), "--",
            "--data", str(args.data.resolve()), *PROTOCOL,
            *([] if seed == 0 else ["--seed", str(seed)])]


def ce_argv(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--data", str(args.data.resolve()), *PROTOCOL, "--method", "ce",
            "--seed", str(seed), "--run-dir", str(args.out / "ce"),
            "--run-name", f"ce-seed{seed}", "--no-tracking"]


def _rprec(summary: dict, split: str, method: str) -> float | None:
    for ev in (summary.get("label_issues") or {}).get("evaluation", []):
        if ev["split"] == split and ev["method"] == method and ev["kind"] == "mislabelled":
            return ev["r_precision"]
    return None


def final_val_nll(summary: dict) -> float | None:
    """The final epoch's ``val_nll``: from the run's history, or (a run from before the
    engine reported it) recomputed from its last checkpoint: the held-out predictions the
    label-issue report keeps and the chain's phi with alpha. None for a run without them."""
    nll = summary["history"][-1].get("val_nll")
    if nll is not None:
        return nll
    import torch

    from pipeline.core.confusion import transition
    from pipeline.core.posterior import STATE_KEY
    from pipeline.track.label_issues import _chain0
    from pipeline.train.loop import noisy_nll_of

    ckpts = sorted(Path(summary["run_dir"], "train", summary["run_name"]).glob(
        "checkpoint_*/state.pt"))
    if not ckpts:
        return None
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
    rep = state.get(STATE_KEY)  # the method's state sits at the checkpoint's top level
    if not rep or rep.get("heldout") is None or state.get("store") is None:
        return None
    chain = _chain0(state["store"])
    phi = transition(torch.as_tensor(chain["counts"]), torch.as_tensor(rep["alpha"]))
    idx = torch.as_tensor(rep["heldout"]["idx"]).long()
    observed = torch.as_tensor(chain["observed"]).long()[idx]
    return noisy_nll_of(torch.as_tensor(rep["heldout"]["probs"]), observed, phi)


def run_row(summary: dict) -> dict:
    """The figures of one run's summary JSON (``<run-dir>/results/<run>.json``)."""
    hist = summary["history"]
    sel = summary["selected"] or {}
    err = summary["metrics"].get("transition_error")
    return {"test_final": hist[-1]["test_top1"], "val_selected": sel.get("val_top1"),
            "val_nll_final": final_val_nll(summary),
            "test_selected": sel.get("test_top1"), "epoch_selected": sel.get("epoch"),
            "phi_error": err if err is not None and math.isfinite(err) else None,
            "train_lccn": _rprec(summary, "train", "lccn"),
            "val_lccn": _rprec(summary, "validation", "lccn"),
            "val_cleanlab": _rprec(summary, "validation", "cleanlab"),
            "issues": next((f"{ev['issues']}/{ev['evaluated']}"
                            for ev in (summary.get("label_issues") or {}).get("evaluation", [])
                            if ev["split"] == "train"), None),
            "seconds": summary["seconds"]}


def collect(out: Path, seed: int) -> tuple[list[dict], dict]:
    """(the seed's rows, one per alpha, sorted, with the sweep's rank), its CE row."""
    sweep = json.loads((out / "sweep" / f"{sweep_name(seed)}.json").read_text())
    rows = []
    for t in sweep["trials"]:
        res = out / "sweep" / "trials" / t["trial_id"] / "results" / f"{t['trial_id']}.json"
        rows.append({"alpha": t["lccn.alpha"], "seed": seed, "rank": t["rank"],
                     "status": t["status"], **run_row(json.loads(res.read_text()))})
    rows.sort(key=lambda r: r["alpha"])
    by_nll = sorted((r for r in rows if r["val_nll_final"] is not None),
                    key=lambda r: r["val_nll_final"])
    for i, r in enumerate(by_nll):
        r["rank_nll"] = i + 1
    ce = run_row(json.loads((out / "ce" / "results" / f"ce-seed{seed}.json").read_text()))
    return rows, {"seed": seed, **ce}


def _ms(values: list, d: int = 2, scale: float = 100.0) -> str:
    """``mean ± std`` (population std over seeds; the value alone for one seed)."""
    v = [x * scale for x in values if x is not None]
    if not v:
        return "-"
    mean = sum(v) / len(v)
    if len(v) == 1:
        return f"{mean:.{d}f}"
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))
    return f"{mean:.{d}f} ± {std:.{d}f}"


def table(rows: list[dict], ces: list[dict]) -> str:
    """Mean ± std over seeds per alpha (and CE), then the ranks of every seed's sweep."""
    lines = ["| α | ranks by noisy val acc. | noisy val acc., selected | ranks by noisy-val "
             "NLL | noisy-val NLL, final | test final | test selected | φ error | "
             "R-prec. train: LCCN | R-prec. val: LCCN | R-prec. val: cleanlab |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in sorted({r["alpha"] for r in rows}):
        g = [r for r in rows if r["alpha"] == a]
        col = lambda k: [r[k] for r in g]  # noqa: E731
        lines.append(f"| {a:g} | {', '.join(str(r['rank']) for r in g)} | "
                     f"{_ms(col('val_selected'))} | "
                     f"{', '.join(str(r.get('rank_nll', '-')) for r in g)} | "
                     f"{_ms(col('val_nll_final'), 3, 1)} | "
                     f"{_ms(col('test_final'))} | "
                     f"{_ms(col('test_selected'))} | {_ms(col('phi_error'), 4, 1)} | "
                     f"{_ms(col('train_lccn'), 3, 1)} | {_ms(col('val_lccn'), 3, 1)} | "
                     f"{_ms(col('val_cleanlab'), 3, 1)} |")
    lines.append(f"| CE (no α) | - | {_ms([c['val_selected'] for c in ces])} | - | "
                 f"{_ms([c['val_nll_final'] for c in ces], 3, 1)} | "
                 f"{_ms([c['test_final'] for c in ces])} | "
                 f"{_ms([c['test_selected'] for c in ces])} | - | - | - | - |")
    seeds = sorted({r["seed"] for r in rows})
    return (f"Seeds {', '.join(map(str, seeds))}; test top-1 and noisy-validation accuracy in "
            f"%, mean ± std over seeds; ranks: within each seed's sweep (1 = the highest "
            f"noisy-validation accuracy at the selected epoch, what the sweep ranked by; "
            f"or the lowest noisy-validation NLL at the final epoch).\n\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = get_args_parser().parse_args(argv)
    args.out = args.out.resolve()
    t0 = time.perf_counter()
    if not args.report_only:
        from lccn_jobs.datasets import CIFAR
        from tune import sweep

        for seed in args.seeds:
            done = args.out / "sweep" / f"{sweep_name(seed)}.json"
            if not (done.is_file() and json.loads(done.read_text())["complete"]):
                sweep.main(sweep_argv(args, seed))
            if not (args.out / "ce" / "results" / f"ce-seed{seed}.json").is_file():
                CIFAR.main(ce_argv(args, seed))
    rows, ces = [], []
    for seed in args.seeds:
        r, c = collect(args.out, seed)
        rows += r
        ces.append(c)
    text = table(rows, ces)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text += (f"\nMachine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} "
             f"at the end; sweep trials {min(r['seconds'] for r in rows):.0f}-"
             f"{max(r['seconds'] for r in rows):.0f} s each, CE "
             f"{min(c['seconds'] for c in ces):.0f}-{max(c['seconds'] for c in ces):.0f} s"
             + ("" if args.report_only else f"; {time.perf_counter() - t0:.0f} s in all")
             + ".\n")
    print(text)
    if args.write:
        args.write.write_text(text)


if __name__ == "__main__":
    main()
