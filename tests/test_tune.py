"""Sweeps: every search space samples into a valid RunConfig, bad keys and values are
refused with their name, and a real 2-trial Ray Tune sweep of the digits smoke runs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.config import RunConfig
from tune.search_spaces import METRIC, SPACES, apply_point, get_space, sample_point


@pytest.mark.parametrize("name", ["digits", "cifar10", "clothing1m", "webvision"])
def test_every_space_samples_a_valid_run_config(name):
    space = get_space(name)
    assert "lccn.alpha" in space
    base = RunConfig()
    seen_alphas = set()
    for seed in range(20):
        point = sample_point(space, seed=seed)
        run = apply_point(base, point)
        assert isinstance(run, RunConfig)
        for key, value in point.items():
            section, field = key.split(".")
            assert getattr(getattr(run, section), field) == value, key
        # untouched fields keep the base's values
        assert run.optim.epochs == base.optim.epochs and run.method == base.method
        seen_alphas.add(run.lccn.alpha)
        assert 0.1 <= run.lccn.alpha <= 10.0
    assert len(seen_alphas) > 10  # really sampled, not a constant


def test_sampling_is_seeded():
    space = get_space("digits")
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


def test_sweep_smoke_two_trials(tmp_path):
    """A real local Ray sweep: 2 trials of the digits quickstart smoke (2 Train workers each,
    one trial at a time on the CPU), each with its own run dir and MLflow run."""
    import mlflow

    from tune import sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = sweep.main(["--smoke-test", "--sweep-dir", str(tmp_path), "--name", "t", "--seed", "1",
                      "--tracking-uri", uri])
    assert out["errors"] == 0, [t["error"] for t in out["trials"]]
    trials = out["trials"]
    assert len(trials) == 2
    ids = [t["trial_id"] for t in trials]
    assert len(set(ids)) == 2 and all(ids)
    for t in trials:
        # the metric Tune ranked is the run's own final test accuracy, and a trained one
        # (10 classes: chance is 0.1; the smoke runs reach 0.6-0.9)
        result = tmp_path / "trials" / t["trial_id"] / "results" / f"{t['trial_id']}.json"
        assert t[METRIC] == json.loads(result.read_text())["metrics"][METRIC]
        assert t[METRIC] > 0.3, t
        assert (tmp_path / "tune" / "t" / t["trial_id"]).is_dir()
    alphas = [t["config"]["lccn.alpha"] for t in trials]
    assert alphas[0] != alphas[1]
    assert out["best_config"]["lccn.alpha"] in alphas
    assert out["best_metric"] == max(t[METRIC] for t in trials)

    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name("lccn-sweep-t")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(ids)
    by_name = {r.info.run_name: r.data.metrics[METRIC] for r in runs}
    assert all(by_name[t["trial_id"]] == pytest.approx(t[METRIC]) for t in trials)
