"""What a job tells its user at the end of a run: the summary (metrics, the selected
epoch, the learned transition beside the true one, the files written) printed and written
as ``results/<run>.json`` under the run dir, the method's end-of-run files beside it, and
the label-issue report.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from pipeline.cluster.worker import DistConfig
from pipeline.core import storage
from pipeline.core.config import json_safe
from pipeline.core.labels import LabelView
from pipeline.core.noise import format_transition
from pipeline.data.stream import LoaderConfig, load_manifest
from pipeline.track.label_issues import job_report
from pipeline.track.tracking import _use_tracking_uri, log_dataset, ui_links
from pipeline.track.uris import redact_uri
from pipeline.train.export import EXPORT_META
from pipeline.train.engine import final_export_path, select_epoch


def summarise(out: dict[str, Any], *, job: str, dist: DistConfig, view: LabelView,
              seconds: float, register_model: str | None = None) -> dict[str, Any]:
    """The summary of a finished run (``out``: the result of
    :func:`pipeline.cluster.ray_train.fit_distributed`), printed, and written with the
    method's files under ``<run-dir>/results``. Returns it."""
    metrics = dict(out["metrics"] or {})
    state = out["state"] or {}
    summary = {
        "job": job, "run_name": dist.run_name, "run_dir": dist.run_dir, "seconds": seconds,
        "metrics": metrics, "checkpoint": out["checkpoint"], "store": out["store"],
        "mlflow_run_id": state.get("mlflow_run_id"),
        "tracking_uri": redact_uri(dist.tracking_uri),
        "epoch": state.get("epoch"), "global_step": state.get("global_step"),
        "history": state.get("history"),  # one row per epoch, data counters included
        "selected": selected_epoch(state.get("history") or []),
        "transition": None if out["phi"] is None else out["phi"].tolist(),
        "true_transition": None if view.transition is None else view.transition.tolist(),
    }
    if out["phi"] is not None:
        print("learned transition phi[k, j] = P(observed=j | latent=k):")
        print(format_transition(out["phi"].numpy(), rows="latent"))
        if view.transition is not None:
            print("true transition:")
            print(format_transition(view.transition))
    print(f"[{job}] done in {seconds:.0f} s: " + summary_line(metrics), flush=True)
    sel = summary["selected"]
    if sel is not None and sel["by"] == "val_top1":
        test = sel["test_top1"]
        test = f"{test:.4f}" if isinstance(test, float) else "not measured"
        print(f"[{job}] selected epoch {sel['epoch'] + 1} (best noisy-validation accuracy "
              f"{sel['val_top1']:.4f}): clean test accuracy {test}", flush=True)
    summary["metrics"] = measured(metrics)
    summary["mlflow"] = mlflow_after_run(summary, dist=dist, view=view, job=job,
                                         register=register_model)
    summary["label_issues"] = label_issue_report(state, view=view, dist=dist,
                                                 run_id=summary["mlflow_run_id"])
    results = storage.join(dist.run_dir, "results")
    summary["files"] = {}
    with storage.staged(results, endpoint_url=dist.s3_endpoint_url) as out_dir:
        for name, text in (out.get("files") or {}).items():  # LCCN*: outliers.csv
            (out_dir / f"{dist.run_name}-{name}").write_text(text)
            path = storage.join(results, f"{dist.run_name}-{name}")
            summary["files"][name] = str(path)
            print(f"[{job}] {name}: {path}" + (f" ({_flagged(text)})"
                                               if name.startswith("outliers") else ""),
                  flush=True)
        exported = dist.export_path
        ends = (("model", exported), ("model_final", _final_path(exported))) \
            if dist.export_model and exported else ()
        for key, path in ends:  # the selected epoch's classifier, then the final one's
            if not storage.is_file(path, endpoint_url=dist.s3_endpoint_url):
                continue
            summary["files"][key] = str(path)
            said = _exported_weights(path, dist.s3_endpoint_url)
            print(f"[{job}] {'model' if key == 'model' else 'final model'}: {path} "
                  f"({said}; torch.export; `lccn-predict {path} IMAGES --out "
                  f"predictions.csv`" + (", once downloaded" if storage.is_remote(path)
                                         else "") + ")", flush=True)
        (out_dir / f"{dist.run_name}.json").write_text(
            json.dumps(json_safe(summary), indent=1, default=str, allow_nan=False))
    return summary


def view_name(view: LabelView) -> str:
    """A label view's short name: its file's stem, else its spec's kind (and rate)."""
    spec = view.spec or {}
    if spec.get("path"):
        return Path(str(spec["path"])).stem
    name = str(spec.get("kind", "labels"))
    return name + (f"-{spec['rate']:g}" if isinstance(spec.get("rate"), (int, float)) else "")


def mlflow_after_run(summary: dict[str, Any], *, dist: DistConfig, view: LabelView, job: str,
                     register: str | None = None) -> dict[str, Any] | None:
    """On the driver once the run is over: the training data as the run's dataset input
    (the shards' URI, their manifest's digest, the label view's name), the tag
    ``lccn.checkpoint`` (the final checkpoint's path: checkpoints stay in the run dir, see
    docs/operations.md), the LoggedModel the run logged registered as ``register`` (Model
    Registry), and the UI links printed. Returns what it did; None without tracking."""
    run_id = summary.get("mlflow_run_id")
    if not dist.tracking_uri or not run_id:
        return None
    import hashlib

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=dist.tracking_uri)
    run = client.get_run(run_id)
    exp = run.info.experiment_id
    done: dict[str, Any] = {"run_id": run_id, "experiment_id": exp}
    manifest = load_manifest(dist.train_source,
                             cfg=LoaderConfig(s3_endpoint_url=dist.s3_endpoint_url))
    digest = hashlib.sha256(manifest.to_json().encode()).hexdigest()[:12]
    name = f"{manifest.dataset}/{manifest.split}:{view_name(view)}"
    if not any(d.dataset.name == name and d.dataset.digest == digest
               for d in (run.inputs.dataset_inputs if run.inputs else [])):
        log_dataset(client, run_id, source=str(dist.train_source), digest=digest, name=name,
                    num_samples=manifest.num_samples)
    done["dataset"] = {"name": name, "digest": digest, "source": str(dist.train_source)}
    if summary.get("checkpoint"):
        client.set_tag(run_id, "lccn.checkpoint", str(summary["checkpoint"]))
    models = [m for m in client.search_logged_models(
        experiment_ids=[exp], filter_string="name = 'model'")
        if m.source_run_id == run_id]
    model_id = models[0].model_id if models else None
    done["model_id"] = model_id
    if register:
        if model_id is None:
            print(f"[{job}] warning: --register-model {register}: the run logged no model "
                  f"(no test or validation images to sign it with)", flush=True)
        else:
            import mlflow

            with _use_tracking_uri(dist.tracking_uri):
                mv = mlflow.register_model(f"models:/{model_id}", register)
            done["registered"] = {"name": register, "version": mv.version}
            print(f"[{job}] registered model {register!r} version {mv.version} "
                  f"(models:/{register}/{mv.version})", flush=True)
    links = ui_links(dist.tracking_uri, exp, run_id, model_id)
    done["links"] = links
    lines = [f"[{job}] MLflow" + (f" (start the UI with `{links['command']}`)"
                                  if "command" in links else "") + ":",
             f"  runs  {links['experiment']}", f"  run   {links['run']}"]
    if model_id:
        lines.append(f"  model {links['model']}  (load: runs:/{run_id}/model or "
                     f"models:/{model_id})")
    print("\n".join(lines), flush=True)
    return done


def label_issue_report(state: dict[str, Any], *, view: LabelView, dist: DistConfig,
                       run_id: str | None) -> dict[str, Any] | None:
    """The run's label-issue report (an LCCN method's run with ``--report-epochs`` > 0):
    files under ``<run-dir>/label_issues/<run>/``, the same as MLflow artifacts
    ``label_issues/`` of the run; None for other methods."""
    out = storage.join(dist.run_dir, "label_issues", dist.run_name)
    with storage.staged(out, endpoint_url=dist.s3_endpoint_url) as local:
        rep = job_report(state, clean=view.clean, train_source=dist.train_source,
                         class_names=dist.class_names, out_dir=local,
                         tracking_uri=dist.tracking_uri, run_id=run_id)
    if rep is not None and local != out:
        rep["files"] = [str(storage.join(out, Path(f).name)) for f in rep["files"]]
    if rep is not None:
        flagged = rep["flagged_mislabelled"]
        lines = [f"label-issue report: {flagged} suspected mislabelled samples"
                 + ("" if rep["flagged_outliers"] is None else
                    f", {rep['flagged_outliers']} suspected out of distribution")
                 + f" in {out}"]
        for ev in rep["evaluation"]:
            lines.append(f"  {ev['split']} {ev['kind']} ({ev['issues']} of the "
                         f"{ev['evaluated']} with a clean label): {ev['method']} precision "
                         f"at {ev['issues']} {ev['r_precision']:.3f}, flagged {ev['flagged']} "
                         f"of those {ev['evaluated']}")
        print("\n".join(lines), flush=True)
    return rep


def _final_path(selected: str) -> str:
    """The final epoch's export beside the selected one's (local or an object-store URI):
    ``.../<run>.pt2`` -> ``.../<run>-final.pt2``."""
    name = storage.name(selected)
    return selected[:len(selected) - len(name)] + final_export_path(name).name


def _exported_weights(path: Any, endpoint_url: str | None) -> str:
    """Which weights an exported program holds, from its sidecar (``<name>.json``'s
    ``weights``: "selected epoch 14 of 40 (best noisy validation accuracy 0.6120)" or
    "final epoch 40"); "weights not recorded" for a sidecar without it."""
    text = str(path)
    meta = text[:-len(Path(text).suffix)] + EXPORT_META if Path(text).suffix else text + EXPORT_META
    try:
        said = json.loads(storage.read_text(meta, endpoint_url=endpoint_url)).get("weights")
    except (OSError, ValueError):
        said = None
    return said or "weights not recorded"


def _flagged(outliers_csv: str) -> str:
    """``"F of N samples flagged"`` for an ``outliers.csv`` text."""
    rows = list(csv.DictReader(io.StringIO(outliers_csv)))
    flagged = sum(r["flag"] == "1" for r in rows)
    return f"{flagged} of {len(rows)} training samples flagged as outliers"


def selected_epoch(history: list[dict[str, float]]) -> dict[str, Any] | None:
    """The epoch a practitioner keeps: the highest noisy-validation accuracy ``val_top1``
    (:func:`pipeline.train.engine.select_epoch`; the last epoch without a validation split), with
    its clean test accuracy. ``epoch`` is the history row's 0-based index (as every
    ``epoch`` in the results JSON and the MLflow steps); ``epoch_number`` counts from 1, as
    the printed lines do."""
    if not history:
        return None
    i = select_epoch(history)
    row = history[i]
    e = int(row.get("epoch", i))
    return {"epoch": e, "epoch_number": e + 1, "val_top1": row.get("val_top1"),
            "test_top1": row.get("test_top1"),
            "by": "val_top1" if any(math.isfinite(r.get("val_top1", math.nan)) for r in history)
            else "last"}


SUMMARY_KEYS = ("test_top1", "val_top1", "label_recovery", "transition_error", "staleness",
                "staleness_max", "sync_time", "sampler_share", "steps_per_s", "images_per_s")


def measured(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without the values that could not be measured (NaN or infinite: e.g. the
    transition error of a run on the dataset's own labels, which has no true transition)."""
    return {k: v for k, v in metrics.items()
            if not (isinstance(v, float) and not math.isfinite(v))}


def summary_line(metrics: dict[str, Any], keys: tuple[str, ...] = SUMMARY_KEYS) -> str:
    """``key value`` pairs of the measured ``keys`` (what cannot be measured is left out)."""
    m = measured(metrics)
    return "  ".join(f"{key} {m[key]:.4g}" for key in keys if isinstance(m.get(key), float))

