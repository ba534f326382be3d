"""A sweep's results: the ranking of its trials and the table and plot of them.

Trials are ranked by their *selected* epoch (``--metric val_nll``: the lowest held-out
negative log-likelihood of the noisy labels instead): the epoch with the highest
noisy-validation accuracy ``val_top1`` (accuracy on the held-out split against its observed labels, what a
user with noisy data has; the first such epoch on ties, as
:func:`pipeline.train.engine.select_epoch`). The clean test accuracy of that same epoch,
``test_top1``, is reported beside it and never used to rank. A trial stopped early by the
scheduler keeps the epochs it ran.

Pure functions of plain data (no Ray, no MLflow), so the ranking is tested on its own.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tune.search_spaces import METRIC, RANKING, REPORTED_BESIDE, TIME_ATTR, VAL_NLL


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def epoch_rows(history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per epoch, ordered by ``epochs_done``: a resumed trial may report an epoch
    again, the last report of an epoch wins."""
    by_epoch: dict[int, dict[str, Any]] = {}
    for row in history:
        if _finite(row.get(TIME_ATTR)):
            by_epoch[int(row[TIME_ATTR])] = dict(row)
    return [by_epoch[e] for e in sorted(by_epoch)]


def _sign(metric: str) -> float:
    if metric not in RANKING:
        raise ValueError(f"a sweep ranks by one of {sorted(RANKING)} (noisy validation), "
                         f"not {metric!r}")
    return 1.0 if RANKING[metric] == "max" else -1.0


def selected(history: Sequence[Mapping[str, Any]], metric: str = METRIC
             ) -> dict[str, Any] | None:
    """The epoch a user keeps: the best ``metric`` (``val_top1``: highest, ``val_nll``:
    lowest; first on ties), with its ``val_top1``, ``test_top1`` and ``val_nll`` and the
    ``config`` it was reported under; None when no epoch has a finite ``metric``."""
    sign = _sign(metric)
    rows = [r for r in epoch_rows(history) if _finite(r.get(metric))]
    if not rows:
        return None
    best = max(rows, key=lambda r: (sign * float(r[metric]), -int(r[TIME_ATTR])))
    out: dict[str, Any] = {"epoch": int(best[TIME_ATTR])}
    # the config that epoch was reported under (Tune's "config/<key>" columns): after a
    # PBT exploit a trial's early epochs ran under another config than its final one
    out["config"] = {k[len("config/"):]: v for k, v in best.items()
                     if isinstance(k, str) and k.startswith("config/") and v == v}
    for key in (METRIC, REPORTED_BESIDE, VAL_NLL):
        out[key] = float(best[key]) if _finite(best.get(key)) else None
    return out


def rank_trials(trials: Sequence[Mapping[str, Any]], metric: str = METRIC
                ) -> list[dict[str, Any]]:
    """``trials`` (dicts with ``trial_id``, ``config``, ``status``, ``history``: the per-epoch
    results) as table rows, best first by ``metric`` of the selected epoch (``val_top1`` or
    ``val_nll``, :func:`selected`): ``rank`` (None for a trial with no validation result,
    listed last), ``trial_id``, ``status``, ``epochs_done``, the config keys,
    ``val_top1``, ``test_top1`` and ``val_nll`` of the selected epoch, ``selected_epoch``,
    and the last epoch's ``last_val_top1``, ``last_test_top1`` and ``last_val_nll``."""
    rows = []
    for t in trials:
        hist = epoch_rows(t.get("history") or [])
        sel = selected(hist, metric)
        last = hist[-1] if hist else {}
        row = {"rank": None, "trial_id": t["trial_id"], "status": t.get("status", ""),
               TIME_ATTR: int(last[TIME_ATTR]) if hist else 0}
        config = dict(t.get("config") or {})
        if sel is not None:  # the selected epoch's own config, where its report has it
            config.update({k: v for k, v in sel["config"].items() if k in config})
        row.update(config)
        row.update({METRIC: None if sel is None else sel[METRIC],
                    REPORTED_BESIDE: None if sel is None else sel[REPORTED_BESIDE],
                    VAL_NLL: None if sel is None else sel[VAL_NLL],
                    "selected_epoch": None if sel is None else sel["epoch"]})
        for key in (METRIC, REPORTED_BESIDE, VAL_NLL):
            row[f"last_{key}"] = float(last[key]) if _finite(last.get(key)) else None
        rows.append(row)
    sign = _sign(metric)
    ranked = sorted((r for r in rows if r[metric] is not None),
                    key=lambda r: (-sign * r[metric], str(r["trial_id"])))
    for i, r in enumerate(ranked):
        r["rank"] = i + 1
    return ranked + sorted((r for r in rows if r[metric] is None),
                           key=lambda r: str(r["trial_id"]))


def columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Column order of the table: rank, trial, status, epochs, the config keys (sorted),
    then the accuracies."""
    head = ["rank", "trial_id", "status", TIME_ATTR]
    tail = [METRIC, REPORTED_BESIDE, VAL_NLL, "selected_epoch", f"last_{METRIC}",
            f"last_{REPORTED_BESIDE}", f"last_{VAL_NLL}"]
    keys = sorted({k for r in rows for k in r} - set(head) - set(tail))
    return head + keys + tail


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.4f}"
    return str(v)


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table as CSV (floats in full precision, missing values empty)."""
    cols = columns(rows)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for r in rows:
        w.writerow(["" if r.get(c) is None else (repr(r[c]) if isinstance(r.get(c), float)
                                                 else r[c]) for c in cols])
    return buf.getvalue()


def to_markdown(rows: Sequence[Mapping[str, Any]], *, title: str = "",
                metric: str = METRIC) -> str:
    """The table as a Markdown pipe table (floats to 4 decimals), ranked by ``metric``."""
    cols = columns(rows)
    lines = [f"# {title}", ""] if title else []
    lines.append(f"Ranked by {metric} ({RANKING[metric]}) of each trial's selected epoch (the "
                 f"epoch of its best {metric}); {REPORTED_BESIDE} is that epoch's clean test "
                 f"accuracy, reported only; {METRIC} the noisy-validation accuracy, "
                 f"{VAL_NLL} the held-out negative log-likelihood of the noisy labels under "
                 f"the model and its noise model (lower is better).")
    lines.append("")
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"
