"""Are the cleaned labels cleaner? The label-issue report of LCCN runs scored against the
clean labels it never saw.

Input: the report states ``bench_cifar.py --report-state FILE`` writes for its LCCN run (the
averaged Eq. 7 posteriors of the training rows, the held-out predictions of the selected
epoch's classifier and of the last epoch's on the noisy validation split, the chain and the
clean labels). ``--heldout last`` scores with the last epoch's predictions (the report's
reading before it took the selected classifier's). For each, the report is built as a
run builds it (:func:`pipeline.track.label_issues.build_report`) and scored:

- the accuracy of the observed labels and of the cleaned ones (``suggested`` where
  ``relabel``), on the training rows, against the clean labels;
- the report's estimate of both (noisy data only) and its 95% interval, and confident
  learning's estimate of the observed labels' accuracy from the held-out predictions,
  beside the truth;
- precision and recall of the flags on the noisy validation split, beside cleanlab's
  ``find_label_issues`` given the same out-of-sample probabilities.

``--true-transition``: the estimate's bound with the run's own classifier. The held-out
estimate (the mean posterior of the observed label on the noisy validation split, Eq. 7
with the selected classifier's out-of-sample probabilities) is read once with the run's φ
as the report reads it and once with the training rows' true transition (counted from the
clean labels) in its place, the classifier's temperature refitted to it on the split; both
beside the split's own share of right labels and the training rows'.

The bound (``--clean-model FILE``, a ``bench_cifar.py --save-model`` of CE trained on the
clean labels of other images, ``--train-offset``): the same rule with that classifier's
probabilities on the run's training and validation images and the label view's true
transition. Usage::

    python benchmarks/bench_cleaning.py OUT/*-report.pt --json OUT/cleaning.json
    python benchmarks/bench_cleaning.py OUT/*-report.pt --true-transition \\
        --json OUT/estimate-bound.json
    python benchmarks/bench_cleaning.py OUT/fid/random1-seed0-lccn-report.pt \\
        --clean-model MODELS/clean25k.pt --setting random1 --train-size 20000
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from pipeline.core.confusion import transition
from pipeline.core.posterior import STATE_KEY
from pipeline.track.label_issues import (
    _chain0,
    _heldout_nll,
    _tempered,
    build_report,
    heldout_of,
    heldout_posterior,
)


def score(state: dict) -> dict:
    """The report of one run's state, scored against its clean labels."""
    clean = np.asarray(state["clean"])
    rep = build_report(state, clean=clean)
    c = rep.cleaning
    out = {"estimate": {k: v for k, v in c.items() if k != "calibration"},
           "calibration": c.get("calibration")}
    for ev in rep.evaluation:
        flag = next(r for r in ev["at"] if r["k"] == "flagged")
        key = f"{ev['split']}_{ev['method']}"
        out[key] = {"flagged": flag["n"], "precision": flag["precision"],
                    "recall": flag["recall"], "r_precision": ev["r_precision"],
                    "issues": ev["issues"], "evaluated": ev["evaluated"]}
        if "accuracy_cleaned" in ev:
            out[key].update(accuracy_observed=ev["accuracy_observed"],
                            accuracy_cleaned=ev["accuracy_cleaned"], relabel=ev["relabel"])
    return out


def estimate_bound(state: dict) -> dict:
    """The held-out estimate of the observed labels' accuracy with the run's φ (calibrated
    as the report calibrates it) and with the training rows' true transition (the
    classifier's temperature refitted to it), beside the truth on the split and on the
    training rows (percent)."""
    from scipy.optimize import minimize_scalar

    acc, chain = state[STATE_KEY], _chain0(state["store"])
    obs = np.asarray(chain["observed"], dtype=np.int64)
    clean = np.asarray(state["clean"], dtype=np.int64)
    k = int(acc["num_classes"])
    phi = transition(torch.as_tensor(chain["counts"]),
                     torch.as_tensor(acc["alpha"], dtype=torch.float64)).numpy()
    held, _ = heldout_of(acc)
    hidx = np.asarray(held["idx"], dtype=np.int64)
    probs = np.asarray(held["probs"], dtype=np.float64)[:, :phi.shape[0]]
    ho = obs[hidx]
    train = np.ones(len(obs), dtype=bool)
    train[hidx] = False
    true = np.full((k, k), 1e-9)
    np.add.at(true, (clean[train], obs[train]), 1.0)
    true = np.vstack([true / true.sum(1, keepdims=True), phi[k:]])  # LCCN*: its outlier row
    run_est = build_report(state).cleaning["heldout_accuracy_observed"]  # as the report reads it
    t = minimize_scalar(lambda v: _heldout_nll(_tempered(probs, v), ho, true),
                        bounds=(0.25, 4.0), method="bounded").x
    true_est = heldout_posterior(_tempered(probs, t), ho, true)[np.arange(len(ho)), ho]
    return {"split": int(len(ho)), "truth_split": 100 * float((ho == clean[hidx]).mean()),
            "truth_train": 100 * float((obs[train] == clean[train]).mean()),
            "estimate_run_phi": 100 * float(run_est),
            "estimate_true_transition": 100 * float(true_est.mean()),
            "temperature_true_transition": float(t),
            "phi_diagonal": float(np.diag(phi[:k]).mean()),
            "true_diagonal": float(np.diag(true[:k]).mean())}


def bound(state: dict, model_path: Path, setting: str, train_size: int) -> dict:
    """The same rule read from a classifier trained on the clean labels of other images:
    its probabilities on the run's training rows and validation rows (all out of its
    sample) and the view's true transition stand in for the chain's posteriors and the
    held-out predictions."""
    import argparse as _a

    import bench_cifar
    from pipeline.core.confusion import transition  # noqa: F401 (documents the convention)
    from pipeline.train.models import build_model

    args = _a.Namespace(data=bench_cifar.DEFAULT_DATA, cache=Path("/tmp/lccn-cifar10-cache"),
                        train_size=train_size, train_offset=0, normalise="channel",
                        settings=[setting], augment="none")
    data = bench_cifar.load_data(args)
    view = bench_cifar.noisy_view(setting, data.train_y, data.features, 0, rows=data.rows,
                                  human_labels=data.human_labels)
    net = build_model("cnn_wide", 10)
    net.load_state_dict(torch.load(model_path, map_location="cpu"))
    net.eval()
    with torch.no_grad():
        probs = torch.cat([torch.softmax(net(data.train_x[i:i + 500]), 1)
                           for i in range(0, len(data.train_x), 500)]).double()
    acc = state[STATE_KEY]
    chain = state["store"]
    n, k = probs.shape
    phi = torch.as_tensor(view.realised_transition(k_latent=k), dtype=torch.float64)
    observed = torch.as_tensor(view.observed)
    post = probs * phi[:, observed].T
    post = post / post.sum(1, keepdim=True)
    counted = torch.as_tensor(chain["counted"])
    fake = {"store": chain, "clean": state["clean"],
            STATE_KEY: {**acc, "sum": torch.where(counted[:, None], post, 0).float(),
                        "count": counted.long(), "top_cls": None,
                        "heldout_selected": None,
                        "heldout": {"idx": torch.nonzero(~counted)[:, 0],
                                    "probs": probs[~counted].float()}}}
    fake["store"] = {**chain, "counts": torch.as_tensor(
        view.realised_transition(k_latent=k) * 1e6)}  # the true transition as phi
    return score(fake)


def _load(path: Path, heldout: str) -> dict:
    """A report state; ``heldout="last"``: without the selected epoch's held-out
    predictions, so that the report reads the last epoch's."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if heldout == "last":
        state[STATE_KEY] = {**state[STATE_KEY], "heldout_selected": None}
    return state


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("states", nargs="+", type=Path)
    p.add_argument("--json", type=Path, default=None, help="write every score here")
    p.add_argument("--clean-model", type=Path, default=None)
    p.add_argument("--setting", default=None)
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--heldout", choices=["selected", "last"], default="selected",
                   help="whose held-out predictions the report reads: the selected epoch's "
                        "classifier (the report's default) or the last epoch's")
    p.add_argument("--true-transition", action="store_true",
                   help="the held-out estimate with the true transition in the run's φ's place")
    args = p.parse_args(argv)
    rows = {}
    if args.true_transition:
        print("| run | truth: split / training | held-out estimate: run's φ / true "
              "transition | φ diagonal: run / true |")
        print("|---|---|---|---|")
        for f in args.states:
            b = estimate_bound(_load(f, args.heldout))
            rows[f.name] = b
            print(f"| {f.name} | {b['truth_split']:.1f} / {b['truth_train']:.1f} | "
                  f"{b['estimate_run_phi']:.1f} / {b['estimate_true_transition']:.1f} | "
                  f"{b['phi_diagonal']:.3f} / {b['true_diagonal']:.3f} |")
        if args.json is not None:
            args.json.write_text(json.dumps(rows, indent=1, default=float))
        return
    print("| run | truth: observed / cleaned | estimate: observed / cleaned (95%) | "
          "confident learning: observed | relabelled | flags on validation P / R (LCCN) | "
          "cleanlab P / R |")
    print("|---|---|---|---|---|---|---|")
    for f in args.states:
        state = _load(f, args.heldout)
        got = score(state)
        if args.clean_model is not None:
            got["bound"] = bound(state, args.clean_model, args.setting, args.train_size)
        rows[f.name] = got
        for name, g in [(f.name, got)] + ([("bound (clean classifier)", got["bound"])]
                                          if "bound" in got else []):
            e, tr = g["estimate"], g.get("train_lccn", {})
            va, cl = g.get("validation_lccn", {}), g.get("validation_cleanlab", {})
            ci = e["accuracy_observed_se"] * 196 if math.isfinite(
                e["accuracy_observed_se"]) else float("nan")
            print(f"| {name} | {100 * tr.get('accuracy_observed', math.nan):.2f} / "
                  f"{100 * tr.get('accuracy_cleaned', math.nan):.2f} | "
                  f"{100 * e['accuracy_observed']:.1f} / {100 * e['accuracy_cleaned']:.1f} "
                  f"(± {ci:.1f}) | {100 * e.get('confident_joint_accuracy', math.nan):.1f} | "
                  f"{tr.get('relabel', 0)} of {e['samples']} | "
                  f"{va.get('precision', math.nan):.3f} / {va.get('recall', math.nan):.3f} | "
                  f"{cl.get('precision', math.nan):.3f} / {cl.get('recall', math.nan):.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, default=float))


if __name__ == "__main__":
    main()
