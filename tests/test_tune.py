"""Sweeps: every search space samples into a valid RunConfig, bad keys and values are
refused with their name, trials are ranked on the noisy validation accuracy and never on the
test accuracy, and one real Ray Tune sweep of the digits smoke (3 trials, per-epoch reports,
ASHA) is interrupted and restored, with its parent and child runs in MLflow."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
from ray import tune as ray_tune

from pipeline.core import storage
from pipeline.core.config import RunConfig
from pipeline.core.options import apply_point
from tune import results, trial
from tune.search_spaces import (
    METRIC,
    PAPER_ALPHAS,
    REPORTED_BESIDE,
    TIME_ATTR,
    get_space,
    load_space,
    sample_point,
    scaled_lr_values,
    to_tune,
    with_alpha_grid,
)

KNOBS = {"lccn.alpha", "lccn.anneal", "lccn.warmup_steps", "lccn.warmup", "lccn.targets",
         "lccn.ramp_epochs", "lccn.prior_strength", "optim.lr"}


@pytest.mark.parametrize("name", ["quickstart", "cifar", "clothing1m", "webvision"])
def test_every_space_samples_a_valid_run_config(name):
    space = get_space(name)
    assert set(space) >= KNOBS
    assert space["lccn.alpha"] == {"loguniform": [0.01, 1000.0]}
    base = RunConfig()
    seen_alphas = set()
    for seed in range(30):
        point = sample_point(space, seed=seed)
        run = apply_point(base, point)
        for key, value in point.items():
            section, field = key.split(".")
            assert getattr(getattr(run, section), field) == value, key
        # untouched fields keep the base's values
        assert run.optim.epochs == base.optim.epochs and run.method == base.method
        seen_alphas.add(run.lccn.alpha)
        assert 0.01 <= run.lccn.alpha <= 1000.0
    assert len(seen_alphas) > 20  # really sampled, not a constant
    assert min(seen_alphas) < 0.3 and max(seen_alphas) > 30  # log-uniform: both decades


def test_alpha_grid_is_the_papers_and_a_grid_for_tune():
    space = with_alpha_grid(get_space("quickstart"))
    assert to_tune(space)["lccn.alpha"] == {"grid_search": list(PAPER_ALPHAS)}
    assert PAPER_ALPHAS == (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 100.0, 1000.0)
    from tune.sweep import expected_trials

    assert expected_trials(space, 2) == 16


def test_the_alpha_space_is_the_papers_grid_alone_for_any_job():
    """``--space alpha``: the ablation's 8 values and nothing else, so every other setting
    is the job's own (its recipe and command line)."""
    from tune import sweep

    args = sweep.get_args_parser().parse_args(["--job", "cifar", "--space", "alpha"])
    space = sweep.resolve_space(args)
    assert space == {"lccn.alpha": {"grid": list(PAPER_ALPHAS)}}
    assert sweep.expected_trials(space, 1) == 8
    run = apply_point(RunConfig(), {"lccn.alpha": 1000.0})
    assert run.lccn.alpha == 1000.0 and run.lccn.warmup == RunConfig().lccn.warmup


def test_sampling_is_seeded():
    space = get_space("quickstart")
    assert sample_point(space, seed=3) == sample_point(space, seed=3)
    assert sample_point(space, seed=3) != sample_point(space, seed=4)


def test_apply_point_replaces_nested_frozen_configs():
    base = RunConfig()
    run = apply_point(base, {"lccn.alpha": 0.5, "optim.lr": 0.01, "seed": 7})
    assert (run.lccn.alpha, run.optim.lr, run.seed) == (0.5, 0.01, 7)
    assert base.lccn.alpha == 1.0  # the base is not changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.lccn.alpha = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("key", ["lccn.alpah", "lccnn.alpha", "optim.lccn.alpha", "lccn",
                                 "nonsense"])
def test_bad_field_name_raises_naming_it(key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        apply_point(RunConfig(), {key: 1.0})


def test_bad_value_is_refused_by_the_dataclass():
    with pytest.raises(ValueError, match="anneal_floor"):
        apply_point(RunConfig(), {"lccn.anneal_floor": 1.5})
    with pytest.raises(ValueError, match="alpha"):
        apply_point(RunConfig(), {"lccn.alpha": -1.0})


def test_unknown_space_name_raises():
    with pytest.raises(KeyError, match="imagenet"):
        get_space("imagenet")


def test_space_file_is_checked_naming_file_and_key(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"lccn.alpha": {"grid": [1, 10]}, "optim.lr": 0.1}))
    assert load_space(good) == {"lccn.alpha": {"grid": [1, 10]}, "optim.lr": 0.1}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lccn.alpha": {"loguniform": [0, 10]}}))
    with pytest.raises(ValueError, match=r"bad\.json.*lccn\.alpha.*lo > 0"):
        load_space(bad)
    bad.write_text(json.dumps({"optim.lr": {"normal": [0, 1]}}))
    with pytest.raises(ValueError, match=r"optim\.lr.*kind"):
        load_space(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_space(bad)


def test_piecewise_lr_schedule_is_scaled():
    assert scaled_lr_values((0.5, 0.1, 0.01), 0.25) == pytest.approx((0.25, 0.05, 0.005))
    assert scaled_lr_values((), 0.25) == ()


# -- ranking: noisy validation, never the test set ------------------------------------------


def _trial(tid, epochs, status="finished"):
    return {"trial_id": tid, "config": {"lccn.alpha": float(len(tid))}, "status": status,
            "history": [{TIME_ATTR: e + 1, METRIC: v, REPORTED_BESIDE: t}
                        for e, (v, t) in enumerate(epochs)]}


def test_ranking_uses_validation_not_test_accuracy():
    """Trial a has the better noisy validation accuracy, trial b the better test accuracy
    at every epoch: a ranking on the test accuracy (or leaking it) puts b first."""
    trials = [_trial("b", [(0.50, 0.95), (0.55, 0.97)]),
              _trial("a", [(0.60, 0.70), (0.80, 0.75), (0.70, 0.90)]),
              _trial("ccc", [(0.30, 0.99)], status="stopped early")]
    rows = results.rank_trials(trials)
    assert [r["trial_id"] for r in rows] == ["a", "b", "ccc"]
    a = rows[0]
    # the selected epoch is a's best validation epoch (2), with the test accuracy of that
    # epoch (0.75) -- not a's best test epoch (3, 0.90)
    assert (a["rank"], a[METRIC], a[REPORTED_BESIDE], a["selected_epoch"]) == (1, 0.80, 0.75, 2)
    assert (a[f"last_{METRIC}"], a[f"last_{REPORTED_BESIDE}"]) == (0.70, 0.90)
    assert rows[2]["status"] == "stopped early" and rows[2][TIME_ATTR] == 1


def test_ranking_by_val_nll_takes_the_lowest_and_never_the_test_accuracy():
    """``--metric val_nll``: each trial's epoch of lowest val_nll, trials ranked by it
    ascending; the test accuracy is refused as a ranking metric."""
    from tune import sweep

    a = _trial("a", [(0.60, 0.50), (0.70, 0.52)])  # the better noisy accuracy ...
    b = _trial("b", [(0.55, 0.58), (0.50, 0.60)])  # ... the better likelihood and test
    for t, nlls in ((a, (1.4, 1.3)), (b, (1.1, 1.2))):
        for row, nll in zip(t["history"], nlls):
            row["val_nll"] = nll
    assert [r["trial_id"] for r in results.rank_trials([a, b])] == ["a", "b"]
    rows = results.rank_trials([a, b], "val_nll")
    assert [(r["trial_id"], r["rank"], r["val_nll"], r["selected_epoch"]) for r in rows] == [
        ("b", 1, 1.1, 1), ("a", 2, 1.3, 2)]
    assert rows[0][REPORTED_BESIDE] == 0.58  # the selected epoch's, not the best test epoch's
    assert "Ranked by val_nll (min)" in results.to_markdown(rows, metric="val_nll")
    with pytest.raises(ValueError, match="not 'test_top1'"):
        results.rank_trials([a, b], "test_top1")
    assert sweep.get_args_parser().parse_args(["--metric", "val_nll"]).metric == "val_nll"
    with pytest.raises(SystemExit):
        sweep.get_args_parser().parse_args(["--metric", "test_top1"])


def test_the_table_carries_val_nll_of_the_selected_and_the_last_epoch():
    t = _trial("a", [(0.6, 0.7), (0.8, 0.75), (0.7, 0.9)])
    for row, nll in zip(t["history"], (1.3, 1.1, 1.2)):
        row["val_nll"] = nll
    row = results.rank_trials([t, _trial("b", [(0.5, 0.9)])])[0]
    assert (row["val_nll"], row["last_val_nll"]) == (1.1, 1.2)
    md = results.to_markdown([row])
    header = next(line for line in md.splitlines() if line.startswith("| rank"))
    assert "| val_nll |" in header and "| last_val_nll |" in header
    assert "lower is better" in md and "| 1.1000 |" in md


def test_ranking_keeps_trials_without_validation_last_and_dedups_resumed_epochs():
    trials = [_trial("x", [(float("nan"), 0.9)]),
              {"trial_id": "y", "config": {}, "status": "finished",
               "history": [{TIME_ATTR: 1, METRIC: 0.2, REPORTED_BESIDE: 0.3},
                           {TIME_ATTR: 1, METRIC: 0.4, REPORTED_BESIDE: 0.5}]}]
    rows = results.rank_trials(trials)
    assert [(r["trial_id"], r["rank"]) for r in rows] == [("y", 1), ("x", None)]
    assert rows[0][METRIC] == 0.4  # the resumed trial's last report of epoch 1 wins
    md = results.to_markdown(rows)
    assert "| 1 | y |" in md and "Ranked by val_top1" in md
    csv_text = results.to_csv(rows)
    assert csv_text.splitlines()[0].startswith("rank,trial_id,status,epochs_done")


def test_a_row_shows_the_config_its_selected_epoch_ran_under():
    """After a PBT exploit a trial's history holds epochs reported under another config
    (Tune's ``config/<key>`` columns); the row's config is the selected epoch's."""
    t = {"trial_id": "p", "config": {"lccn.alpha": 2.0}, "status": "finished",
         "history": [{TIME_ATTR: 1, METRIC: 0.7, REPORTED_BESIDE: 0.6, "config/lccn.alpha": 0.5},
                     {TIME_ATTR: 2, METRIC: 0.6, REPORTED_BESIDE: 0.5, "config/lccn.alpha": 2.0}]}
    row = results.rank_trials([t])[0]
    assert (row["selected_epoch"], row["lccn.alpha"]) == (1, 0.5)


def test_epoch_report_forwards_epoch_ends_only():
    from tune.reporting import epoch_result

    assert epoch_result({"epoch": 0.0, "global_step": 10.0}) is None  # mid-epoch checkpoint
    out = epoch_result({"epoch": 2.0, METRIC: 0.5, REPORTED_BESIDE: 0.6, "loss": 1.0,
                        "flag": True, "name": "x"})
    assert out == {"epoch": 2.0, METRIC: 0.5, REPORTED_BESIDE: 0.6, "loss": 1.0,
                   TIME_ATTR: 3}


def test_sweep_refuses_bad_input(tmp_path):
    from tune import sweep

    with pytest.raises(SystemExit, match="val-fraction"):
        sweep.main(["--smoke-test", "--sweep-dir", str(tmp_path), "--", "--val-fraction", "0"])
    with pytest.raises(SystemExit, match="nope"):
        sweep.main(["--smoke-test", "--sweep-dir", str(tmp_path), "--space", "nope"])
    space = tmp_path / "s.json"
    space.write_text(json.dumps({"lccn.alpah": 1.0}))
    with pytest.raises(SystemExit, match="alpah"):
        sweep.main(["--smoke-test", "--sweep-dir", str(tmp_path), "--space", str(space)])
    # every value a trial may draw is checked, not a few samples of them
    for bad, match in (({"lccn.warmup": {"choice": ["anchor", "identity", "eq8", "eq9"]}},
                        "eq9"),
                       ({"lccn.warmup_steps": {"randint": [-3, 50]}}, "warmup_steps"),
                       ({"lccn.alpha": {"uniform": [0.0, 2.0]}}, "alpha")):
        space.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=match):
            sweep.main(["--smoke-test", "--sweep-dir", str(tmp_path), "--space", str(space)])


def test_a_grid_is_swept_once_and_keys_a_method_ignores_are_left_out():
    from tune import sweep

    grid = {"lccn.alpha": {"grid": [0.1, 1.0]}, "optim.lr": 0.05}
    assert sweep.default_num_samples(grid, smoke=False) == 1
    assert sweep.default_num_samples({**grid, "lccn.warmup_steps": {"randint": [0, 9]}},
                                     smoke=False) == 8
    space = get_space("webvision")
    assert sweep.inert_keys(space, "divide_lccn") == ["lccn.targets", "lccn.ramp_epochs"]
    assert sweep.inert_keys(space, "lccn") == []
    assert sweep.inert_keys(space, "dividemix") == [k for k in space if k.startswith("lccn.")]
    xi = {"lccn.xi": {"loguniform": [1e-12, 1e-3]}, "lccn.alpha": 1.0}
    assert sweep.inert_keys(xi, "ce") == ["lccn.alpha"]  # CE's loss is clipped at xi
    assert sweep.inert_keys(xi, "dividemix") == ["lccn.xi", "lccn.alpha"]
    # a range is drawn in [lo, hi): a field open at hi is not refused for it
    sweep.resolve_space(sweep.get_args_parser().parse_args(["--space", "quickstart"]))
    points = sweep.edge_points({"lccn.outlier_threshold": {"uniform": [0.5, 1.0]}})
    assert max(p["lccn.outlier_threshold"] for p in points) < 1.0


@pytest.mark.parametrize("job", ["quickstart", "cifar", "clothing1m", "webvision"])
def test_every_job_builds_a_trial_run_from_its_space(job, tmp_path):
    """The trainable's run for each job (smoke data, nothing trained): the sampled point is
    in the RunConfig, the run dir and name are the trial's, the MLflow run will be a child of
    the parent run."""

    point = sample_point(get_space(job), seed=5)
    job_args = trial.parse_job_args(job, ["--smoke-test"])
    mod, args, jr = trial.trial_run(point, job=job, job_args=job_args,
                                    sweep_dir=str(tmp_path), trial_id="abc_00001",
                                    tracking_uri=f"sqlite:///{tmp_path}/m.db",
                                    experiment="lccn-sweep-x", parent_run_id="p123")
    assert mod.name and args.run_name == "abc_00001"
    assert jr.dist.run_dir == str(tmp_path / "trials" / "abc_00001")
    assert jr.dist.run_name == "abc_00001" and jr.dist.experiment == "lccn-sweep-x"
    assert dict(jr.dist.mlflow_tags) == {"mlflow.parentRunId": "p123",
                                         "tune.trial_id": "abc_00001"}
    for key, value in point.items():
        section, field = key.split(".")
        assert getattr(getattr(jr.run, section), field) == value, key
    assert jr.run.val_fraction > 0 and len(jr.view) > 0


def test_a_trial_is_warned_about_its_own_warm_up(tmp_path):
    """The warm-up warning speaks of the trial's δ (a swept field), not the job's."""

    def trial_log(point, *job_argv):
        job_args = trial.parse_job_args("cifar", ["--smoke-test", *job_argv])
        _, _, jr = trial.trial_run(point, job="cifar", job_args=job_args,
                                   sweep_dir=str(tmp_path), trial_id="w_00001",
                                   tracking_uri=None, experiment="x", parent_run_id=None)
        return [line for line in jr.lines() if "warning: --warmup-steps" in line]

    (line,) = trial_log({"lccn.warmup_steps": 100_000})
    assert line.startswith("[sweep] trial w_00001: warning: --warmup-steps 100,000 covers")
    assert trial_log({"lccn.warmup_steps": 1}) == []
    # the job's own warning (its δ covers the phase) is replaced by the trial's, not kept
    assert trial_log({"lccn.warmup_steps": 1}, "--warmup-steps", "100000") == []
    (line,) = trial_log({"lccn.warmup_steps": 200_000}, "--warmup-steps", "100000")
    assert "200,000" in line


def test_orphaned_placement_groups_are_released_and_others_kept():
    """A placement group whose creating actor died (a Train controller killed with its
    trial) is removed; one created by the driver (Tune's trials) or by a live actor is not."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from pipeline.cluster.ray_train import init_ray, release_orphaned_placement_groups

    @ray.remote(num_cpus=0)
    class Maker:
        def make(self):
            pg = placement_group([{"CPU": 0.01}])
            ray.get(pg.ready(), timeout=60)
            return pg.id.hex()

    started = init_ray(num_cpus=1)
    try:
        mine = placement_group([{"CPU": 0.01}])
        ray.get(mine.ready(), timeout=60)
        dying, living = Maker.remote(), Maker.remote()
        orphan = ray.get(dying.make.remote())
        kept = ray.get(living.make.remote())
        ray.kill(dying)
        removed = []
        for _ in range(50):  # the GCS marks the creator dead shortly after the kill
            removed += release_orphaned_placement_groups()
            if orphan in removed:
                break
            time.sleep(0.2)
        assert orphan in removed and kept not in removed and mine.id.hex() not in removed
        table = placement_group_table()
        assert table[orphan]["state"] == "REMOVED"
        assert table[kept]["state"] == table[mine.id.hex()]["state"] == "CREATED"
    finally:
        if started:
            ray.shutdown()


# -- a real sweep ------------------------------------------------------------------------------


class InterruptAfter(ray_tune.Callback):
    """Tune callback of the test: logs every trial start to ``log`` and, once ``n`` trials
    have completed, interrupts the sweep as Ctrl+C would (SIGUSR1, which Tune handles like
    SIGINT). Fires once per ``marker`` file, so the restored sweep (which keeps its
    callbacks) runs to the end."""

    def __init__(self, n, log, marker):
        self.n, self.log, self.marker, self.done = n, str(log), str(marker), 0

    def on_trial_start(self, iteration, trials, trial, **info):
        with open(self.log, "a") as f:
            f.write("start:" + trial.trial_id + "\n")

    def on_trial_complete(self, iteration, trials, trial, **info):
        with open(self.log, "a") as f:
            f.write("complete:" + trial.trial_id + "\n")
        self.done += 1
        if self.done >= self.n and not os.path.exists(self.marker):
            open(self.marker, "w").write(f"interrupted after {trial.trial_id}\n")
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.fixture(scope="module")
def interrupted_sweep(tmp_path_factory, moto_url):
    """3 trials of the digits smoke (3 epochs, 1 CE) under ASHA (grace 1 epoch, factor 2):
    the second has a learning rate too small to learn anything in an epoch, so ASHA stops it
    at the first rung. The sweep is interrupted after two trials complete and then run
    again with the same command. Its sweep dir is in S3-compatible object storage (a moto
    server): Tune's state, every trial's checkpoints and results, the table."""
    from pipeline.data import s3
    from tune import sweep

    d = tmp_path_factory.mktemp("sweep")
    s3.client(endpoint_url=moto_url).create_bucket(Bucket="sweeps")
    root = "s3://sweeps/team/sw"
    space = d / "space.json"
    space.write_text(json.dumps({"lccn.alpha": {"loguniform": [0.01, 1000.0]},
                                 "optim.lr": {"grid": [0.05, 1e-6, 0.05]}}))
    uri = f"sqlite:///{d}/mlflow.db"
    argv = ["--smoke-test", "--num-samples", "1", "--space", str(space), "--sweep-dir", root,
            "--name", "t", "--seed", "1", "--tracking-uri", uri,
            "--", "--s3-endpoint-url", moto_url]
    old = os.environ.get("LCCN_RUNS")
    os.environ["LCCN_RUNS"] = str(d / "local")  # the smoke shards the trials generate
    try:
        first = sweep.main(argv, callbacks=[InterruptAfter(2, d / "starts.log", d / "marker")])
        events_first = (d / "starts.log").read_text().split()
        second = sweep.main(argv)
    finally:
        if old is None:
            os.environ.pop("LCCN_RUNS")
        else:
            os.environ["LCCN_RUNS"] = old
    return {"dir": d, "root": root, "endpoint": moto_url, "uri": uri, "first": first,
            "second": second, "events_first": events_first,
            "events": (d / "starts.log").read_text().split()}


def test_sweep_reports_every_epoch_and_asha_stops_the_weak_trial(interrupted_sweep):
    out = interrupted_sweep["second"]
    assert out["complete"] and out["errors"] == 0, out["trials"]
    rows = out["trials"]
    assert len(rows) == 3 and len({r["trial_id"] for r in rows}) == 3
    by_lr = sorted(rows, key=lambda r: r["optim.lr"])
    weak = by_lr[0]
    assert weak["optim.lr"] == 1e-6
    assert weak["status"] == "stopped early" and weak[TIME_ATTR] == 1, weak
    finished = [r for r in rows if r["status"] == "finished"]
    assert finished and all(r[TIME_ATTR] == 3 for r in finished)
    # per-epoch results reached Tune: the finished trial's progress has epochs 1, 2, 3
    from ray.tune import ExperimentAnalysis

    fs, path = storage.filesystem(f"{interrupted_sweep['root']}/tune/t",
                                  endpoint_url=interrupted_sweep["endpoint"])
    ana = ExperimentAnalysis(path, storage_filesystem=fs)
    df = ana.trial_dataframes
    first = next(r for r in finished)
    trial_df = next(v for k, v in df.items() if k.endswith(first["trial_id"]))
    assert sorted(set(trial_df[TIME_ATTR].dropna().astype(int))) == [1, 2, 3]
    assert trial_df[METRIC].notna().all() and trial_df[REPORTED_BESIDE].notna().all()
    assert trial_df["val_nll"].notna().all() and (trial_df["val_nll"] > 0).all()
    assert all(r["val_nll"] is not None for r in finished)  # in the table too


def test_sweep_ranks_by_noisy_validation(interrupted_sweep):
    out = interrupted_sweep["second"]
    rows = out["trials"]
    assert out["metric"] == METRIC == "val_top1"
    ranked = [r for r in rows if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    assert [r[METRIC] for r in ranked] == sorted((r[METRIC] for r in ranked), reverse=True)
    assert out["best_metric"] == ranked[0][METRIC] and out["best_metric"] > 0.3
    assert out["best_test_top1"] == ranked[0][REPORTED_BESIDE]
    # the value ranked is the trial's own best noisy-validation epoch from its Train run
    best = ranked[0]
    summary = json.loads(storage.read_text(
        f"{interrupted_sweep['root']}/trials/{best['trial_id']}/results/{best['trial_id']}.json",
        endpoint_url=interrupted_sweep["endpoint"]))
    assert summary["selected"]["val_top1"] == pytest.approx(best[METRIC])
    assert summary["selected"]["test_top1"] == pytest.approx(best[REPORTED_BESIDE])


def test_restored_sweep_runs_only_the_missing_trials(interrupted_sweep):
    first, second = interrupted_sweep["first"], interrupted_sweep["second"]
    assert not first["complete"] and not first["restored"]
    assert second["complete"] and second["restored"]
    root, endpoint = interrupted_sweep["root"], interrupted_sweep["endpoint"]
    assert second["table"] == f"{root}/t/results.md"  # the table and the summary: in the bucket
    assert "| 1 |" in storage.read_text(second["table"], endpoint_url=endpoint)
    assert json.loads(storage.read_text(f"{root}/t.json", endpoint_url=endpoint)
                      )["best_metric"] == second["best_metric"]
    events, n_first = interrupted_sweep["events"], len(interrupted_sweep["events_first"])
    done_before = {e.split(":")[1] for e in events[:n_first] if e.startswith("complete:")}
    started_again = {e.split(":")[1] for e in events[n_first:] if e.startswith("start:")}
    # the two trials that had completed before the interruption are not started again
    assert len(done_before) == 2
    assert started_again and not done_before & started_again, (done_before, started_again)
    started = {e.split(":")[1] for e in events if e.startswith("start:")}
    assert {r["trial_id"] for r in second["trials"]} == started and len(started) == 3
    for r in first["trials"]:
        if r["trial_id"] in done_before:  # their results are the ones kept
            after = next(a for a in second["trials"] if a["trial_id"] == r["trial_id"])
            assert (after[METRIC], after[TIME_ATTR]) == (r[METRIC], r[TIME_ATTR])
            assert r["status"] in ("finished", "stopped early")


def test_mlflow_holds_parent_children_table_and_plot(interrupted_sweep):
    from mlflow import MlflowClient

    out = interrupted_sweep["second"]
    client = MlflowClient(interrupted_sweep["uri"])
    exp = client.get_experiment_by_name("lccn-sweep-t")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("sweep_role") == "parent"]
    assert len(parents) == 1  # the restored sweep reused its parent
    parent = parents[0]
    assert parent.info.run_id == out["parent_run_id"] == interrupted_sweep["first"]["parent_run_id"]
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics[f"best_{METRIC}"] == pytest.approx(out["best_metric"])
    assert parent.data.metrics["stopped_early"] >= 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.data.tags.get("tune.superseded") != "true"]
    by_trial = {r["trial_id"]: r for r in out["trials"]}
    assert sorted(c.info.run_name for c in children) == sorted(by_trial)
    for c in children:
        row = by_trial[c.info.run_name]
        assert float(c.data.params["run.lccn.alpha"]) == pytest.approx(row["lccn.alpha"])
        assert float(c.data.params["run.optim.lr"]) == pytest.approx(row["optim.lr"])
        hist = client.get_metric_history(c.info.run_id, METRIC)
        steps = {m.step for m in hist}  # one value per epoch run (a stopped trial may log
        assert steps >= set(range(row[TIME_ATTR]))  # the epoch it was running when stopped)
        assert len(steps) == row[TIME_ATTR] or row["status"] == "stopped early"
        assert c.data.tags["tune.status"] == row["status"]
        assert c.info.status == ("FINISHED" if row["status"] == "finished" else "KILLED")
    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.csv", "results.md", "accuracy_vs_alpha.png"} <= names
    local = client.download_artifacts(parent.info.run_id, "results.csv",
                                      str(interrupted_sweep["dir"] / "dl"))
    lines = open(local).read().splitlines()
    assert len(lines) == 4 and "val_top1" in lines[0] and "test_top1" in lines[0]
    png = client.download_artifacts(parent.info.run_id, "accuracy_vs_alpha.png",
                                    str(interrupted_sweep["dir"] / "dl"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
