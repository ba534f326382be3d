"""Population-based training: the space PBT needs, perturbed values kept in range, a seeded
Train run that forgets the cloned trial's MLflow run, and one real PBT sweep of two digits
trials in which the weaker trial is exploited and its new Train run continues from the other
trial's checkpoint with mutated alpha and annealing floor."""

from __future__ import annotations

import json

import pytest
import torch

from tune import pbt


def test_pbt_space_has_the_mutated_keys_and_annealing_on():
    space = pbt.pbt_space({"lccn.alpha": {"grid": [1.0, 10.0]}, "lccn.anneal": False})
    assert space["lccn.alpha"] == {"grid": [1.0, 10.0]}  # the user's spec is kept
    assert space["lccn.anneal_floor"] == pbt.MUTATIONS["lccn.anneal_floor"]
    assert space["lccn.anneal"] is True


def test_perturbed_values_are_clipped_into_the_configs_ranges():
    cfg = pbt.clip_config({"lccn.alpha": 1200.0, "lccn.anneal_floor": 1.2, "optim.lr": 9.0})
    assert cfg == {"lccn.alpha": 1000.0, "lccn.anneal_floor": 1.0, "optim.lr": 9.0}
    from pipeline.core.config import RunConfig
    from pipeline.core.options import apply_point

    apply_point(RunConfig(), {k: v for k, v in cfg.items() if k != "optim.lr"})  # valid


def test_seed_run_drops_the_mlflow_run_and_keeps_an_existing_seed(tmp_path):
    from pipeline.train.checkpoints import META_FILE, STATE_FILE, newest_complete_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    torch.save({"global_step": 80, "mlflow_run_id": "abc", "epoch": 2}, src / STATE_FILE)
    (src / META_FILE).write_text(json.dumps({"epoch": 2, "global_step": 80,
                                             "mlflow_run_id": "abc", "run_name": "t0"}))
    root = tmp_path / "train" / "t1-e2"
    meta = pbt.seed_run(src, root)
    assert meta["run_name"] == "t0"
    found = newest_complete_checkpoint(root)  # what the job resumes from
    assert found == root / "checkpoint_pbt_seed"
    state = torch.load(found / STATE_FILE, weights_only=False)
    assert state["mlflow_run_id"] is None and state["global_step"] == 80
    assert json.loads((found / META_FILE).read_text())["mlflow_run_id"] is None
    torch.save({"global_step": 80, "mlflow_run_id": "xyz"}, src / STATE_FILE)
    pbt.seed_run(src, root)  # a second start of the same run keeps its seed
    assert torch.load(found / STATE_FILE, weights_only=False)["mlflow_run_id"] is None


def test_each_epoch_of_a_pbt_trial_carries_the_config_it_ran_under():
    """A trial started at alpha 1 and cloned at epoch 2 (alpha 5), then again from a
    lagging donor at epoch 1 (alpha 9): epoch 1 ran at 1, epoch 3 as reported between the
    clones at 5, epochs 2-4 as re-reported after the second at 9."""
    from tune.search_spaces import TIME_ATTR
    from tune.sweep import with_epoch_configs

    records = [{"time": 0, "epoch": 0, "config": {"lccn.alpha": 1.0}},
               {"time": 10, "epoch": 2, "config": {"lccn.alpha": 5.0}},
               {"time": 20, "epoch": 1, "config": {"lccn.alpha": 9.0}}]
    hist = [{TIME_ATTR: 1, "timestamp": 5}, {TIME_ATTR: 2, "timestamp": 25},
            {TIME_ATTR: 3, "timestamp": 26}, {TIME_ATTR: 4, "timestamp": 27}]
    got = [r["config/lccn.alpha"] for r in with_epoch_configs(hist, records)]
    assert got == [1.0, 9.0, 9.0, 9.0]
    early = [{TIME_ATTR: 3, "timestamp": 15}]  # epoch 3 as reported between the clones
    assert with_epoch_configs(early, records)[0]["config/lccn.alpha"] == 5.0


def test_each_cloned_checkpoint_starts_its_own_run():
    """Two clones at the same epoch from different donors (or checkpoints) get two Train
    runs, never one resumed under the other's name; the same checkpoint (a restored sweep
    restarting the trial) gets the same run back."""
    a = pbt.clone_run_name("t_00000", {"run_name": "t_00001", "epoch": 3, "global_step": 60})
    assert a.startswith("t_00000-e3_") and a.rsplit("-e", 1)[0] == "t_00000"
    assert a == pbt.clone_run_name("t_00000", {"run_name": "t_00001", "epoch": 3,
                                               "global_step": 60})
    assert a != pbt.clone_run_name("t_00000", {"run_name": "t_00002", "epoch": 3,
                                               "global_step": 60})
    assert a != pbt.clone_run_name("t_00000", {"run_name": "t_00001-e1-0a1b2c3d",
                                               "epoch": 3, "global_step": 60})


@pytest.mark.ray
def test_pbt_sweep_exploits_and_resumes_from_the_other_trials_checkpoint(tmp_path):
    """Two trials at once (one Train worker each), one with a learning rate too small to
    learn, so it stays in the lower half. PBT compares a trial with the others' latest
    scores; a trial is cloned at its first report after the other has saved a checkpoint
    (the other's first report after this one's first). The Train runs start a few seconds
    apart, a few 1-2 s epochs: 8 epochs leave room for a start-up lead of up to 5."""
    epochs = 8
    from mlflow import MlflowClient

    from tune import sweep

    space = tmp_path / "space.json"
    space.write_text(json.dumps({"optim.lr": {"grid": [0.05, 0.0002]},
                                 "lccn.alpha": {"loguniform": [0.1, 10.0]}}))
    out = sweep.main(["--job", "quickstart", "--scheduler", "pbt", "--num-samples", "1",
                      "--space", str(space), "--name", "pbt", "--sweep-dir", str(tmp_path),
                      "--", "--epochs", str(epochs), "--pretrain-epochs", "1",
                      "--num-workers", "1",
                      "--milestones"])
    assert out["complete"] and out["errors"] == 0
    trials = {r["trial_id"]: r for r in out["trials"]}
    assert len(trials) == 2 and all(r["status"] == "finished" for r in trials.values())
    records = [json.loads(line) for f in (tmp_path / "trials").glob(f"*/{pbt.LOG_FILE}")
               for line in f.read_text().splitlines()]
    assert sum(r["restored_from"] is None for r in records) == 2  # each trial's fresh start
    exploits = [r for r in records if r["restored_from"]
                and not r["run_name"].startswith(r["restored_from"].split("-e")[0] + "-")]
    assert exploits, records
    ex = exploits[0]
    trial = ex["run_name"].rsplit("-e", 1)[0]
    source = ex["restored_from"].split("-e")[0]
    assert trial != source and {trial, source} == set(trials)
    # the new Train run loaded the other trial's checkpoint: its first epochs are the
    # other trial's, and it went on from there to the last epoch
    res = json.loads((tmp_path / "trials" / trial / "results" / f"{ex['run_name']}.json")
                     .read_text())
    src_runs = sorted((tmp_path / "trials" / source / "results").glob("*.json"))
    src_hist = json.loads(src_runs[0].read_text())["history"]
    n = ex["epoch"]
    assert [h["val_top1"] for h in res["history"][:n]] == \
        [h["val_top1"] for h in src_hist[:n]]
    assert res["metrics"]["resumed_epoch"] == n and res["epoch"] == epochs
    assert res["global_step"] == epochs * res["history"][0]["global_step"]
    # with the source's config, alpha and the annealing floor perturbed
    assert ex["config"]["optim.lr"] == 0.05
    # the table shows the config its selected epoch ran under: the trial's latest start
    # (fresh or cloned) at an epoch before it
    starts = sorted((r for r in records if r["run_name"].rsplit("-e", 1)[0] == trial),
                    key=lambda r: r["time"])
    ran_under = [r for r in starts if r["epoch"] < trials[trial]["selected_epoch"]][-1]
    assert trials[trial]["lccn.alpha"] == ran_under["config"]["lccn.alpha"]
    assert ex["config"]["lccn.alpha"] in [r["config"]["lccn.alpha"] for r in starts]
    # Tune's own record of the exploit: [our tag, the clone's tag, ..., old, new config]
    policy = (tmp_path / "tune" / "pbt" / f"pbt_policy_{trial}.txt").read_text()
    step = json.loads(policy.splitlines()[0])
    assert step[-1]["lccn.alpha"] == ex["config"]["lccn.alpha"] != step[-2]["lccn.alpha"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lccn-sweep-pbt")
    tagged = client.search_runs([exp.experiment_id],
                                filter_string=f"tags.`pbt.restored_from` = '{ex['restored_from']}'")
    assert [r.data.tags["tune.trial_id"] for r in tagged] == [trial]
