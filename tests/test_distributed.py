"""The distributed run: the fenced confusion actor, the per-worker loop with checkpoint and
exact resume (in one process, no Ray), and the real thing on a local Ray cluster (2 CPU
workers, digits shards): invariants after training with a killed worker, a failed run, a
re-submission and a killed actor; MLflow contents; 1 vs 2 workers.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.config import (
    LCCNConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    PerfConfig,
    RunConfig,
)
from pipeline.core.confusion import count_matrix
from pipeline.core.confusion_store import ConfusionStore
from pipeline.core.monitor import CollapseWarning
from lccn_jobs import digits as quickstart_ray
from pipeline.cluster.ray_train import initial_assignment_placeholder
from pipeline.cluster.store_actor import FenceError, LocalStoreClient, StoreActor
from pipeline.cluster.worker import DistConfig, LocalSession, parse_failures, run_worker
from pipeline.train.labeler import GibbsLabeler
from pipeline.train.sources import held_out_mask

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Digits shards (train 1258 / test 539, 100 per shard) and a 40% pair-flip view."""
    root = tmp_path_factory.mktemp("digits")
    train, test = quickstart_ray.write_digits_shards(root, seed=0)
    return train, test, quickstart_ray.digits_view(train, rate=0.4, seed=0)


def _store(n=12, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    observed = torch.randint(0, k, (n,), generator=g)
    return StoreActor(observed, observed.clone(), k, k), observed


# -- the fenced store (no Ray) ----------------------------------------------------------------


def test_open_restores_state_and_discards_later_commits():
    store, observed = _store()
    fence = store.open(None)
    store.commit(torch.tensor([0, 1]), torch.tensor([2, 2]), worker="a", seq=0, fence=fence)
    saved = store.check_state()
    store.commit(torch.tensor([2, 3, 4]), torch.tensor([0, 0, 0]), worker="a", seq=1, fence=fence)
    assert store.version == 2
    fence2 = store.open(saved)
    assert fence2 != fence
    assert store.version == 1 and store.last_seq == {"a": 0}
    assert torch.equal(store.z, saved["z"]) and torch.equal(store.counts, saved["counts"])
    store.check()
    # back to the constructor state
    store.open(None)
    assert torch.equal(store.z, observed) and store.version == 0 and store.last_seq == {}


def test_commit_with_old_fence_is_refused_and_changes_nothing():
    store, _ = _store()
    old = store.open(None)
    new = store.open(None)
    before = store.state_dict()
    with pytest.raises(FenceError):
        store.push(torch.tensor([0]), torch.tensor([1]), since=0, worker="w", seq=0,
                   fence=old)
    assert torch.equal(store.counts, before["counts"]) and store.version == 0
    assert store.refused == 1
    store.commit(torch.tensor([0]), torch.tensor([1]), worker="w", seq=0, fence=new)
    assert store.version == 1


def test_restarted_actor_refuses_the_running_group():
    """A restarted actor has no fence until rank 0 reopens it from the checkpoint."""
    _, observed = _store()
    fresh = StoreActor(observed, observed.clone(), 3, 3)  # what Ray's restart builds
    with pytest.raises(FenceError, match="restarted"):
        fresh.commit(torch.tensor([0]), torch.tensor([1]), worker="w", seq=5, fence="f" * 32)
    client = LocalStoreClient(fresh)
    with pytest.raises(FenceError):
        client.join()


def test_retried_commit_applied_once_through_client():
    store, _ = _store()
    client = LocalStoreClient(store)
    client.open(None)
    idx, z = torch.tensor([0, 1, 2]), torch.tensor([1, 1, 1])
    client.commit(idx, z, worker="w", seq=0)
    client.commit(idx, torch.tensor([2, 2, 2]), worker="w", seq=0)  # a retry: same seq
    assert store.version == 1 and store.duplicates == 1
    assert torch.equal(store.z[idx], z)
    store.check()


def test_load_state_dict_rejects_other_split_and_corrupt_counts():
    store, _ = _store()
    other, _ = _store(seed=1)
    with pytest.raises(ValueError, match="another split"):
        store.load_state_dict(other.state_dict())
    bad = store.state_dict()
    bad["counts"] = bad["counts"].clone()
    bad["counts"][0, 0] += 1
    with pytest.raises(ValueError, match="recount"):
        store.load_state_dict(bad)


def test_labeler_over_client_matches_direct_store():
    """GibbsLabeler through LocalStoreClient (fenced, one call per step) keeps the replica
    equal to C, and the store commits once per step."""
    k, n = 4, 64
    g = torch.Generator().manual_seed(0)
    observed = torch.randint(0, k, (n,), generator=g)
    store = StoreActor(observed, observed.clone(), k, k)
    client = LocalStoreClient(store)
    client.open(None)
    counts, version = client.snapshot()
    lab = GibbsLabeler(LCCNConfig(commit_every=1), client, counts, version, phi_init=torch.eye(k),
                       max_steps=10, generator=torch.Generator().manual_seed(1))
    batches = [torch.arange(s, s + 16) for s in range(0, n, 16)]
    lab.prefetch(batches[0])
    for i, idx in enumerate(batches):
        probs = torch.softmax(torch.randn(16, k, generator=g), 1)
        z, _ = lab.sample(probs, observed[idx], idx)
        lab.commit(idx, z, batches[i + 1] if i + 1 < len(batches) else None)
    lab.flush()
    assert torch.equal(lab.counts, store.counts)
    assert torch.equal(store.counts, count_matrix(store.z, observed, k, k))
    assert store.version == len(batches)


def test_parse_failures_and_dist_config_checks(tmp_path):
    assert parse_failures("1:5:exit, 0:9:kill_store") == [(1, 5, "exit"), (0, 9, "kill_store")]
    with pytest.raises(ValueError, match="mode"):
        parse_failures("0:1:explode")
    with pytest.raises(ValueError, match="rank:step:mode"):
        parse_failures("0:1")
    with pytest.raises(ValueError, match="absolute"):
        DistConfig(run_name="r", run_dir="relative/dir", train_source=str(tmp_path))
    with pytest.raises(ValueError, match="absolute"):
        DistConfig(run_name="r", run_dir=str(tmp_path), train_source="rel/train")


# -- the worker loop in one process: checkpoint and exact resume -------------------------------


def _local_run(digits, root: Path, *, inject: str = "", epochs: int = 3, commit_every: int = 1):
    train, test, view = digits
    run = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", in_channels=1),
                    optim=OptimConfig(epochs=epochs, pretrain_epochs=1, batch_size=64, lr=0.05),
                    lccn=LCCNConfig(warmup_steps=5, commit_every=commit_every))
    dist = DistConfig(run_name="local", run_dir=str(root), train_source=str(train),
                      test_source=str(test), num_workers=1, loader_workers=0,
                      shuffle_buffer=100, preset="digits", checkpoint_every=7,
                      tracking_uri=None, inject_failure=inject)
    z0, counted = initial_assignment_placeholder(view, run)
    return run, dist, view, z0, counted


@pytest.mark.parametrize("commit_every, amp", [(1, "off"), (4, "fp16")])
def test_resume_after_failure_is_exact(digits, tmp_path, one_thread, commit_every, amp):
    """Failing mid-epoch (after a mid-epoch checkpoint) and resuming gives the same model,
    C, z and commit count as the uninterrupted run: nothing lost, nothing counted twice.
    With commit_every 4 the worker dies holding 3 steps it has not sent (43-45). With
    float16 autocast the checkpoint carries the GradScaler's state and the resumed run goes
    on with it (a fresh scaler would restart its growth count at the resume)."""
    run, dist, view, z0, counted = _local_run(digits, tmp_path / "a", commit_every=commit_every)
    run = replace(run, perf=PerfConfig(amp=amp))
    obs = torch.from_numpy(view.observed)
    ref_store = StoreActor(obs, z0, 10, 10, counted=counted)
    ref_session = LocalSession(tmp_path / "a" / "ckpt")
    ref_rows = run_worker(run, dist, view, LocalStoreClient(ref_store), ref_session)
    # 1,258 digits less the 63 of the validation split (dropped before the plan): 19 steps
    spe = int(ref_rows[0]["steps"])
    assert spe == 19

    # fail after step 45 of 57: the last checkpoint is the one at step 42 (every 7 steps)
    dist_b = replace(dist, run_dir=str(tmp_path / "b"), inject_failure="0:45:raise")
    (tmp_path / "b").mkdir()
    store = StoreActor(obs, z0, 10, 10, counted=counted)
    session = LocalSession(tmp_path / "b" / "ckpt")
    with pytest.raises(RuntimeError, match="injected failure at step 45"):
        run_worker(run, dist_b, view, LocalStoreClient(store), session)
    assert store.version > 0
    rows = run_worker(run, dist_b, view, LocalStoreClient(store), session)  # resume
    assert rows[0]["resumed_epoch"] == 2 and rows[0]["resumed_batch"] == 42 - 2 * spe
    assert len(rows) == 1 and len(ref_rows) == 3

    assert torch.equal(store.z, ref_store.z)
    assert torch.equal(store.counts, ref_store.counts)
    if commit_every == 1:
        assert store.version == ref_store.version == 2 * spe + 1  # 2 LCCN epochs + initial
    else:  # one call per 4 steps, plus the flushes at the checkpoints (every 7 steps)
        assert ref_store.version < 2 * spe * 0.5 and store.duplicates == 0
    store.check()
    a = LocalSession(tmp_path / "a" / "ckpt").load_checkpoint()
    b = session.load_checkpoint()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["global_step"] == b["global_step"] == 3 * spe
    if amp == "fp16":
        sa, sb = a["scalers"][0], b["scalers"][0]
        assert sa["scale"] > 0 and sa["_growth_tracker"] > 3 * spe - 42
        assert (sa["scale"], sa["_growth_tracker"]) == (sb["scale"], sb["_growth_tracker"])
    else:
        assert a["scalers"] == [None]
    # epochs before the failure have the same rows; the resumed epoch's row covers only
    # the batches after the checkpoint
    assert [r["loss"] for r in a["history"][:2]] == [r["loss"] for r in b["history"][:2]]
    assert b["history"][2]["steps"] == spe - (42 - 2 * spe) and a["history"][2]["steps"] == spe
    # the collapse monitor's statistics land in the LCCN epochs' rows (rank 0, from the
    # store state at the epoch's checkpoint), not in the CE epoch's
    assert "latent_entropy" not in a["history"][0]
    for r in a["history"][1:]:
        assert 0.5 < r["latent_entropy"] <= 1.1 and 0 < r["z_agreement"] <= 1
        assert r["collapse"] in (0.0, 1.0) and r["phi_drift"] >= 0
    # the checkpointed store state equals the live store at the end
    assert torch.equal(b["store"]["z"], store.z) and b["store"]["version"] == store.version


def test_a_run_resumed_after_the_memorisation_switch_continues_identically(
        digits, tmp_path, one_thread, monkeypatch):
    """The guard's switch and the teacher are decided from the checkpointed epoch rows and
    the best epoch's weights the method checkpoints: a run that fails mid-epoch after the
    switch (with Eq. 7 reading the best epoch's copy) and resumes ends with the same model,
    C, z and rows as the uninterrupted run. Scripted noisy validation figures (the epoch
    being scored); the lr falls after epoch 2."""
    from pipeline.train.engine import Engine

    top1 = [0.50, 0.60, 0.62, 0.60, 0.58, 0.57]
    held = [2.0, 1.5, 1.2, 1.35, 1.45, 1.5]
    monkeypatch.setattr(Engine, "val_scores", lambda self: {
        "top1": top1[len(self.history)], "nll": 1.0, "nll_plain": held[len(self.history)]})
    run, dist, view, z0, counted = _local_run(digits, tmp_path / "a", epochs=6)
    run = replace(run, optim=replace(run.optim, milestones=(2,)))
    obs = torch.from_numpy(view.observed)
    ref_store = StoreActor(obs, z0, 10, 10, counted=counted)
    ref_rows = run_worker(run, dist, view, LocalStoreClient(ref_store),
                          LocalSession(tmp_path / "a" / "ckpt"))
    spe = int(ref_rows[0]["steps"])
    switched = [e for e, r in enumerate(ref_rows) if r["guarded"]]
    assert switched and switched[0] <= 4, [r["observed_loss"] for r in ref_rows]
    assert ref_rows[switched[0]]["teacher_epoch"] == 2  # the best noisy validation epoch
    # fail 5 steps into the last epoch (after the switch); the checkpoint is 2 steps in
    fail = 5 * spe + 5
    dist_b = replace(dist, run_dir=str(tmp_path / "b"), inject_failure=f"0:{fail}:raise")
    (tmp_path / "b").mkdir()
    store = StoreActor(obs, z0, 10, 10, counted=counted)
    session = LocalSession(tmp_path / "b" / "ckpt")
    with pytest.raises(RuntimeError, match=f"injected failure at step {fail}"):
        run_worker(run, dist_b, view, LocalStoreClient(store), session)
    rows = run_worker(run, dist_b, view, LocalStoreClient(store), session)
    assert rows[0]["resumed_epoch"] == 5 and 0 < rows[0]["resumed_batch"] < 5
    a, b = LocalSession(tmp_path / "a" / "ckpt").load_checkpoint(), session.load_checkpoint()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert torch.equal(store.z, ref_store.z) and torch.equal(store.counts, ref_store.counts)
    for key in ("guarded", "teacher_epoch", "guard_ranks"):
        assert [r[key] for r in a["history"]] == [r[key] for r in b["history"]], key
    assert b["guard_best"]["epoch"] == 2


def test_a_mid_epoch_checkpoint_is_not_resumed_under_another_batch_order(digits, tmp_path,
                                                                         one_thread):
    """The order of an epoch's batches depends on the workers (ranks, loader processes,
    per-rank batch, shuffle buffer): a checkpoint taken mid-epoch refuses a resume under
    other values, naming them, instead of training some samples twice and skipping others."""
    from pipeline.train.checkpoints import resume_problem

    run, dist, view, z0, counted = _local_run(digits, tmp_path, inject="0:45:raise")
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    session = LocalSession(tmp_path / "train" / dist.run_name)  # where a Ray run keeps them
    with pytest.raises(RuntimeError, match="injected failure at step 45"):
        run_worker(run, dist, view, LocalStoreClient(store), session)
    other = replace(dist, shuffle_buffer=50, inject_failure="")
    with pytest.raises(ValueError, match="batch 4 of epoch 2, .*shuffle_buffer 100 -> 50"):
        run_worker(run, other, view, LocalStoreClient(store), session)
    # the job driver reads the same from meta.json before it starts Ray Train
    assert "shuffle_buffer 100 -> 50" in resume_problem(run, other)
    assert resume_problem(run, replace(dist, inject_failure="")) is None
    rows = run_worker(run, replace(dist, inject_failure=""), view, LocalStoreClient(store),
                      session)  # the checkpoint's values resume
    assert rows[0]["resumed_batch"] == 4  # step 42 of 19-step epochs


def test_a_ce_run_tracks_each_epoch_once_with_its_lr_and_the_final_checkpoint(digits, tmp_path,
                                                                            one_thread):
    """MLflow gets one value per epoch (step = epoch) with the rate the epoch trained at,
    and every method's final checkpoint under checkpoint/, not only those with a
    transition."""
    from mlflow import MlflowClient

    run, dist, view, _, _ = _local_run(digits, tmp_path, epochs=3)
    run = replace(run, method="ce", optim=replace(run.optim, milestones=(1,), lr_decay=0.1))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    dist = replace(dist, tracking_uri=uri, experiment="ce-tracked")
    rows = run_worker(run, dist, view, None, LocalSession(tmp_path / "ckpt"))
    assert [r["lr"] for r in rows] == pytest.approx([0.05, 0.005, 0.005])
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("ce-tracked").experiment_id])
    lr = client.get_metric_history(mlrun.info.run_id, "lr")
    assert sorted((m.step, round(m.value, 6)) for m in lr) == [(0, 0.05), (1, 0.005),
                                                                 (2, 0.005)]
    assert sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "val_top1")) \
        == [0, 1, 2]
    files = {f.path for f in client.list_artifacts(mlrun.info.run_id)}
    # the checkpoint stays in the run dir only (docs/operations.md); the model is logged
    assert "checkpoint" not in files and "transition.csv" not in files
    models = client.search_logged_models(experiment_ids=[mlrun.info.experiment_id])
    assert [m.source_run_id for m in models] == [mlrun.info.run_id]


def test_outlier_export_survives_a_failure_in_its_window(digits, tmp_path, one_thread):
    """LCCN*'s p(outlier) average rides in the checkpoints: a worker that fails in the
    last epoch (the averaging window, after a mid-epoch checkpoint) and resumes writes the
    same outliers.csv into its final checkpoint as the uninterrupted run."""
    run, dist, view, _, _ = _local_run(digits, tmp_path / "a", epochs=3)
    run = replace(run, lccn=replace(run.lccn, outlier=True, outlier_prior=0.5))
    z0, counted = initial_assignment_placeholder(view, run)
    obs = torch.from_numpy(view.observed)
    files = []
    for name, inject in (("a", ""), ("b", "0:52:raise")):  # step 52 of 60: last epoch
        d = replace(dist, run_dir=str(tmp_path / name), inject_failure=inject)
        (tmp_path / name).mkdir(exist_ok=True)
        store = StoreActor(obs, z0, 11, 10, counted=counted)
        session = LocalSession(tmp_path / name / "ckpt")
        if inject:
            with pytest.raises(RuntimeError, match="injected failure at step 52"):
                run_worker(run, d, view, LocalStoreClient(store), session)
        run_worker(run, d, view, LocalStoreClient(store), session)
        files.append((session.checkpoints()[-1] / "outliers.csv").read_text())
    assert files[0] == files[1]
    lines = files[0].splitlines()
    assert lines[0] == "idx,key,observed,p_outlier,flag"
    held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
    assert len(lines) - 1 == int((~held_out).sum())
    assert all(line.split(",")[3] != "" for line in lines[1:])  # every sample drawn


def test_collapse_monitor_can_stop_a_distributed_run(digits, tmp_path, one_thread, monkeypatch):
    """With MonitorConfig(stop=True) the worker loop stops after the first LCCN epoch whose
    chain the monitor flags (forced here: its criteria are tested in test_fidelity), on
    every rank together, and warns instead of raising on rank 0 alone."""
    from pipeline.core.monitor import CollapseMonitor

    monkeypatch.setattr(CollapseMonitor, "reasons",
                        lambda self, health, val=0.0, **kw: ["forced"])
    run, dist, view, z0, counted = _local_run(digits, tmp_path, epochs=3)
    run = replace(run, monitor=MonitorConfig(stop=True))
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    with pytest.warns(CollapseWarning):
        rows = run_worker(run, dist, view, LocalStoreClient(store), LocalSession(tmp_path / "c"))
    assert len(rows) == 2  # the CE epoch and the first LCCN epoch, not the third
    assert rows[1]["collapse"] == 1.0 and "collapse" not in rows[0]


@pytest.mark.parametrize("commit_every", [1, 4])
def test_lccn_plus_in_the_distributed_engine_trains_trusted_on_clean_never_counts_them(
        digits, tmp_path, one_thread, monkeypatch, commit_every):
    """The distributed path (ShardSource, SharedChain over the store actor's class, the
    DistLabeler) honours LCCN+ as the local one: every draw of a trusted sample is its
    clean label (its posterior one-hot there), including those whose observed label is
    wrong, and C never counts one (the store's invariants hold)."""
    from pipeline.core.noise import trusted_subset

    run, dist, view, _, _ = _local_run(digits, tmp_path, epochs=2, commit_every=commit_every)
    view = trusted_subset(view, count=120, seed=0)
    run = replace(run, lccn=replace(run.lccn, use_trusted=True))
    dist = replace(dist, checkpoint_every=0)
    z0, counted = initial_assignment_placeholder(view, run)
    trusted, clean = torch.from_numpy(view.trusted), torch.from_numpy(view.clean)
    seen = {"trusted": 0, "wrong": 0}
    real = GibbsLabeler.sample

    def recording(self, probs, observed, idx):
        z, stats = real(self, probs, observed, idx)
        t = trusted[idx]
        assert torch.equal(z[t], clean[idx][t]), "a trusted sample got a sampled label"
        assert torch.equal(stats.posterior[t].argmax(1), clean[idx][t])
        assert bool((stats.posterior[t].max(1).values == 1.0).all())
        seen["trusted"] += int(t.sum())
        seen["wrong"] += int((t & (observed != clean[idx])).sum())
        return z, stats

    monkeypatch.setattr(GibbsLabeler, "sample", recording)
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    run_worker(run, dist, view, LocalStoreClient(store), LocalSession(tmp_path / "ckpt"))
    held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
    trained = view.trusted & ~held_out
    assert seen["trusted"] == int(trained.sum()) and seen["wrong"] > 0
    assert not store.counted[trusted].any()
    assert torch.equal(store.z[trusted], clean[trusted])
    assert int(store.counts.sum()) == int((~view.trusted & ~held_out).sum())
    store.check()


def test_store_state_from_checkpoint_recounts(digits, tmp_path, one_thread):
    """Every checkpoint carries a store state whose C is the recount of its z."""
    run, dist, view, z0, counted = _local_run(digits, tmp_path, epochs=2)
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    session = LocalSession(tmp_path / "ckpt")
    run_worker(run, dist, view, LocalStoreClient(store), session)
    ckpts = session.checkpoints()
    assert len(ckpts) == 5 + 2  # at global steps 7, 14, 21, 28, 35 and at both epoch ends
    from pipeline.train.checkpoints import load_state
    for c in ckpts:
        st = load_state(c)["store"]
        again = ConfusionStore.from_state_dict(st)  # raises if C != recount(z)
        again.check()
        # C counts the training samples only: the noisy validation split is not counted
        held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
        assert held_out.sum() > 0 and not st["counted"].numpy()[held_out].any()
        observed = st["observed"].numpy()
        assert np.bincount(observed[~held_out], minlength=10).tolist() == \
            st["counts"].sum(0).tolist()
        assert torch.equal(st["z"][held_out], st["observed"][held_out])  # never moved


def test_noisy_validation_split_of_a_distributed_run(digits, tmp_path, one_thread, monkeypatch):
    """The held-out split of a distributed run: the local trainer's split for the same view
    and seed (stratified, deterministic), never in a training batch nor in C (skipped and
    counted in val_held_out), and scored every epoch against the observed labels."""
    from pipeline.core.labels import LabelView
    from pipeline.data.stream import LoaderConfig, make_eval_loader
    from pipeline.train import engine
    from pipeline.train.checkpoints import load_state
    from pipeline.train.models import build_model
    from pipeline.train.trainer import LocalTrainer, TensorData

    run, dist, view, z0, counted = _local_run(digits, tmp_path, epochs=2)
    dist = replace(dist, checkpoint_every=0)
    n = len(view)
    mask = held_out_mask(view, run.val_fraction, seed=run.seed)
    # deterministic, stratified by observed label, another seed another split
    assert np.array_equal(mask, held_out_mask(view, run.val_fraction, seed=run.seed))
    assert not np.array_equal(mask, held_out_mask(view, run.val_fraction, seed=run.seed + 1))
    for j in range(10):
        n_j = int((view.observed == j).sum())
        assert int(mask[view.observed == j].sum()) == round(run.val_fraction * n_j)
    # the local trainer holds out the same samples
    tiny = LabelView(np.arange(10) % 10, np.arange(10) % 10, 10)
    local = LocalTrainer(run, TensorData(torch.zeros(n, 1, 8, 8), view),
                         TensorData(torch.zeros(10, 1, 8, 8), tiny))
    assert np.array_equal(np.setdiff1d(np.arange(n), local.train_rows), np.flatnonzero(mask))
    # ... in the same index space: every sample keeps its row, the held-out ones marked
    assert np.array_equal(local.held_out, mask) and local.engine.data.num_samples == n
    assert counted is not None and torch.equal(counted, torch.from_numpy(~mask))

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (idx, valid) of every training batch
    real = engine.run_pass

    def recording(task, batches, **kwargs):
        def each():
            for b in batches:
                seen.append((b.idx.clone(), b.valid.clone()))
                yield b
        return real(task, each(), **kwargs)

    monkeypatch.setattr(engine, "run_pass", recording)
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    session = LocalSession(tmp_path / "ckpt")
    rows = run_worker(run, dist, view, LocalStoreClient(store), session)
    assert len(rows) == 2 and seen
    trained = torch.cat([idx[valid] for idx, valid in seen]).numpy()
    assert not mask[np.concatenate([idx.numpy() for idx, _ in seen])].any()
    # both epochs together saw every training sample twice, no held-out one
    assert np.array_equal(np.bincount(trained, minlength=n), 2 * (~mask).astype(np.int64))
    store.check()
    assert torch.equal(store.z[torch.from_numpy(mask)], torch.from_numpy(view.observed)[mask])
    for row in rows:
        assert row["val_held_out"] == mask.sum()
        assert 0 < row["val_top1"] <= 1
    # val_top1 is the accuracy of the model against the held-out samples' observed labels
    state = load_state(session.checkpoints()[-1])
    model = build_model("small_cnn", 10, in_channels=1)
    model.load_state_dict(state["model"])
    model.eval()
    loader = make_eval_loader(dist.train_source, view, LoaderConfig(
        batch_size=64, num_workers=0, preset="digits", seed=0))
    hit = total = 0
    with torch.no_grad():
        for b in loader:
            keep = torch.from_numpy(mask)[b.idx] & b.valid
            pred = model(b.images[keep]).argmax(1)
            hit += int((pred == b.observed[keep]).sum())
            total += int(keep.sum())
    assert total == mask.sum()
    assert rows[-1]["val_top1"] == pytest.approx(hit / total)
    assert [r["val_top1"] for r in state["history"]] == [r["val_top1"] for r in rows]


def test_a_test_split_with_fewer_shards_than_ranks_is_scored_once_by_the_first_ranks(digits):
    """Digits: 13 training shards, 6 test shards, 8 ranks. Every rank trains; ranks 0-5
    score whole test shards, each test sample exactly once, ranks 6 and 7 score nothing
    (Engine.score sums the counts of all ranks)."""
    from pipeline.data.stream import LoaderConfig, load_manifest
    from pipeline.train.shard_source import ShardSource

    train, test, view = digits
    cfg = LoaderConfig(batch_size=16, num_workers=0, preset="digits", seed=0)
    assert len(load_manifest(test, cfg=cfg).shards) == 6
    seen = []
    for rank in range(8):
        src = ShardSource(train_source=str(train), test_source=str(test), view=view,
                          loader_cfg=cfg, rank=rank, world_size=8, held_out=None)
        idx = [b.idx[b.valid] for b in src.test_batches()]
        assert bool(idx) == (rank < 6), rank
        seen += idx
        assert next(iter(src.train_batches(0)), None) is not None  # every rank trains
    seen = torch.cat(seen)
    assert len(seen) == 539 and torch.equal(seen.sort().values, torch.arange(539))


def test_the_validation_split_is_decoded_from_the_bytes_the_training_pass_kept(digits):
    """Two ranks: the training pass leaves the held-out samples out before decoding (the
    shards record their idx ranges) and counts them; afterwards each rank's validation
    batches come from the raw bytes its pass kept, the same samples and tensors (observed
    labels) as reading them from the shards, which is what a rank does before its first
    pass (each rank then scores the held-out samples of the shards it reads: others than in
    its training pass); over both ranks, every held-out sample once either way."""
    from pipeline.data.stream import LoaderConfig
    from pipeline.train.session import ProcessSession
    from pipeline.train.shard_source import ShardSource

    train, _, view = digits
    cfg = LoaderConfig(batch_size=32, num_workers=0, preset="digits", seed=0)
    mask = held_out_mask(view, 0.1, seed=0)
    before, after, kept = {}, {}, []
    for rank in range(2):
        src = ShardSource(train_source=str(train), test_source=None, view=view, loader_cfg=cfg,
                          rank=rank, world_size=2, held_out=mask)
        assert src.drop_early
        before.update({int(i): (x, int(y)) for b in src.val_batches()
                       for i, x, y, v in zip(b.idx, b.images, b.clean, b.valid) if v})
        assert src._val_raw is None
        pass_ = src.train_batches(0)
        idx = torch.cat([b.idx[b.valid] for b in pass_])
        assert not mask[idx.numpy()].any()
        mine = [int(i) for b in src.val_batches() for i in b.idx]
        after.update({int(i): (x, int(y)) for b in src.val_batches()
                      for i, x, y in zip(b.idx, b.images, b.clean)})
        assert src._val_raw is not None
        assert pass_.counters(ProcessSession("cpu"))["val_held_out"] == len(mine)
        kept += mine
    assert sorted(kept) == sorted(before) == np.flatnonzero(mask).tolist()
    for i, (x, y) in after.items():
        assert torch.equal(x, before[i][0]) and y == before[i][1] == view.observed[i]


def test_a_store_counting_the_validation_split_is_refused(digits, tmp_path, one_thread):
    """Rank 0 refuses the chain state at the first checkpoint (step 7, still in CE) and
    nothing is saved."""
    run, dist, view, _, _ = _local_run(digits, tmp_path, epochs=2)
    obs = torch.from_numpy(view.observed)
    store = StoreActor(obs, obs.clone(), 10, 10)  # counts every sample
    with pytest.raises(ValueError, match="the store counts .* noisy validation split"):
        run_worker(run, dist, view, LocalStoreClient(store), LocalSession(tmp_path / "c"))
    assert store.version == 0 and not LocalSession(tmp_path / "c").checkpoints()


def test_skipped_and_padded_samples_reach_each_epoch_row_and_mlflow(digits, tmp_path, one_thread):
    """A truncated shard: every epoch's row (history, checkpoint) and MLflow carry the
    loader's counters, summed over ranks."""
    from mlflow import MlflowClient

    from pipeline.data.manifest import Manifest, ShardInfo, sha256_file

    train, test, view = digits
    split = tmp_path / "train"
    shutil.copytree(train, split)
    shard = split / "train-000003.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    m = Manifest.load(split)  # describe the damaged file, as if it had been written so
    m.shards[3] = ShardInfo(shard.name, m.shards[3].num_samples, sha256_file(shard),
                            shard.stat().st_size)
    m.save(split)
    run = RunConfig(method="ce", seed=0, model=ModelConfig("small_cnn", in_channels=1),
                    optim=OptimConfig(epochs=2, pretrain_epochs=2, batch_size=128, lr=0.05))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    dist = DistConfig(run_name="counters", run_dir=str(tmp_path), train_source=str(split),
                      num_workers=1, loader_workers=0, shuffle_buffer=50, preset="digits",
                      tracking_uri=uri, experiment="counters")
    session = LocalSession(tmp_path / "ckpt")
    rows = run_worker(run, dist, view, None, session)
    assert len(rows) == 2
    for row in rows:
        assert row["data_skipped_shards"] == 1.0
        assert 0 < row["data_missing"] == row["data_padded"] < 100
    client = MlflowClient(tracking_uri=uri)
    run_id = session.load_checkpoint()["mlflow_run_id"]
    padded = client.get_metric_history(run_id, "data_padded")
    assert sorted((m.step, m.value) for m in padded) == [(0, rows[0]["data_padded"]),
                                                          (1, rows[1]["data_padded"])]
    assert [r["data_skipped_shards"] for r in session.load_checkpoint()["history"]] == [1.0, 1.0]


# -- on a real local Ray cluster (2 CPUs, 2 Train workers) -------------------------------------

# 1258 training digits in 13 shards, global batch 64 -> about 20 steps per epoch; 6 epochs,
# LCCN from epoch 2, the lr x0.1 from epoch 3 (the memorisation guard watches epochs 3-5,
# with a hair trigger: 0.001 x H(observed)); checkpoints every 8 global steps and at each
# epoch end.
EPOCHS, PRETRAIN, CKPT_EVERY = 6, 2, 8
COMMIT_EVERY = LCCNConfig().commit_every  # the default protocol runs under the failures
RAY_ARGS = ["--epochs", str(EPOCHS), "--pretrain-epochs", str(PRETRAIN), "--batch-size", "64",
            "--lr", "0.05", "--milestones", "3", "--lr-values", "--guard-rise", "0.001",
            "--warmup-steps", "5",
            "--loader-workers", "0", "--shuffle-buffer", "100",
            "--checkpoint-every", str(CKPT_EVERY), "--no-baseline"]


def _epoch_steps(train_dir: Path, world_size: int) -> list[int]:
    """Steps of each epoch as the loader plans them (every rank takes as many): over the
    samples each shard keeps once the noisy validation split (5%, seed 0) is dropped."""
    from pipeline.data.manifest import Manifest
    from pipeline.data.stream import plan_epoch

    held = held_out_mask(quickstart_ray.digits_view(train_dir, rate=0.4, seed=0), 0.05, seed=0)
    ranges = Manifest.load(train_dir).idx_ranges()
    counts = [n - int(held[f:f + n].sum()) for f, n in ranges]
    return [plan_epoch(counts, world_size=world_size, num_workers=1,
                       batch_size=64 // world_size, seed=0, epoch=e, shuffle=True).steps
            for e in range(EPOCHS)]


def _resume_position(steps: list[int], failed_after: int) -> tuple[int, int]:
    """(epoch, batch) of the last checkpoint at or before global step ``failed_after``: a
    mid-epoch checkpoint at that step is written before the failure fires, an epoch-end one
    is not (the failure fires in the step's hook, before the epoch's end)."""
    best, start = (0, 0), 0
    for e, n in enumerate(steps):
        for s in range(start + 1, start + n + 1):
            if s > failed_after:
                return best
            if s == start + n:
                if s == failed_after:
                    return best
                best = (e + 1, 0)
            elif s % CKPT_EVERY == 0:
                best = (e, s - start)
        start += n
    return best


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    import os

    key = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # read by the Train controller: detect failures fast
    old = os.environ.get(key)
    os.environ[key] = "0.5"
    from pipeline.cluster.ray_train import init_ray

    started = init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
    if old is None:
        os.environ.pop(key)
    else:
        os.environ[key] = old


@pytest.fixture(scope="module")
def chaos_run(ray_cluster, tmp_path_factory):
    """One 2-worker run, submitted twice under the same name:

    1st submission (max 1 restart): rank 1 dies (os._exit) after step 50 (LCCN epoch 2,
      last checkpoint at step 48) and the group restarts from the checkpoint; then rank 0
      raises after step 75 (last checkpoint: step 72) -> a 2nd failure -> the run fails.
    2nd submission: resumes from step 72; rank 0 kills the confusion actor after step 100
      (last checkpoint: step 96, mid-epoch); Ray restarts the actor empty, the group fails
      and restarts, rank 0 restores C and z from the checkpoint; the run completes.
    """
    import ray.train

    run_dir = tmp_path_factory.mktemp("chaos")
    base = ["--run-dir", str(run_dir), "--run-name", "chaos", *RAY_ARGS]
    with pytest.raises(ray.train.TrainingFailedError):
        quickstart_ray.main([*base, "--max-failures", "1", "--inject-failure", "1:50:exit,0:75:raise"])
    first = sorted(p.name for p in (run_dir / "train" / "chaos").glob("checkpoint_*"))
    summary = quickstart_ray.main([*base, "--max-failures", "1", "--inject-failure", "0:100:kill_store"])
    return {"run_dir": run_dir, "summary": summary, "first_checkpoints": first,
            "steps": _epoch_steps(run_dir / "data" / "digits-seed0" / "train", 2)}


@pytest.mark.ray
def test_injected_failures_all_fired(chaos_run):
    markers = sorted(p.name for p in chaos_run["run_dir"].glob(".injected-failure-*"))
    assert markers == [".injected-failure-r0-s100-kill_store", ".injected-failure-r0-s75-raise",
                       ".injected-failure-r1-s50-exit"]
    assert chaos_run["first_checkpoints"], "the failed submission left no checkpoint"


@pytest.mark.ray
def test_resubmission_resumes_from_last_checkpoint(chaos_run):
    s, steps = chaos_run["summary"], chaos_run["steps"]
    assert 50 > sum(steps[:PRETRAIN]) and 100 <= sum(steps[:-1])  # failures in LCCN epochs
    # the final row comes from the last (re)start: from the checkpoint before step 100
    resumed = (s["metrics"]["resumed_epoch"], s["metrics"]["resumed_batch"])
    assert resumed == _resume_position(steps, 100) and resumed[1] > 0  # mid-epoch
    assert s["epoch"] == EPOCHS and s["global_step"] == sum(steps)
    assert s["metrics"]["epoch"] == EPOCHS - 1


@pytest.mark.ray
def test_noisy_validation_reported_every_epoch_by_two_workers(chaos_run):
    """Both ranks skip their held-out samples (summed: the whole split, in every epoch run
    from its start) and score their share of them; val_top1 is in every epoch's row, in the
    Ray Train report and selects the epoch of the result file."""
    s = chaos_run["summary"]
    train = chaos_run["run_dir"] / "data" / "digits-seed0" / "train"
    view = quickstart_ray.digits_view(train, rate=0.4, seed=0)
    n_val = int(held_out_mask(view, 0.05, seed=0).sum())
    assert n_val > 0
    hist = s["history"]
    assert len(hist) == EPOCHS
    for e, row in enumerate(hist):
        assert 0 < row["val_top1"] <= 1, (e, row)
        partial = row["resumed_epoch"] == e and row["resumed_batch"] > 0
        assert row["val_held_out"] == n_val or (partial and row["val_held_out"] < n_val), row
    assert 0 < s["metrics"]["val_top1"] <= 1  # rank 0's last Ray Train report
    best = max(range(EPOCHS), key=lambda e: (hist[e]["val_top1"], -e))
    assert s["selected"] == {"epoch": best, "epoch_number": best + 1,
                             "val_top1": hist[best]["val_top1"],
                             "test_top1": hist[best]["test_top1"], "by": "val_top1"}
    saved = json.loads((chaos_run["run_dir"] / "results" / "chaos.json").read_text())
    assert saved["selected"]["epoch"] == best


@pytest.mark.ray
def test_both_workers_switch_and_choose_the_teacher_together(chaos_run):
    """Two Train workers decide the memorisation switch and the teacher from the same
    all-reduced epoch rows (each rank checks it with an all-reduce every epoch, and a
    disagreement stops the run): every LCCN epoch row counts 0 or 2 ranks switched, and
    the resubmitted run, restarted twice on the way, ends with the decisions of its rows."""
    hist = chaos_run["summary"]["history"]
    assert len(hist) == EPOCHS
    for r in hist[PRETRAIN:]:
        assert r["guard_ranks"] == 2.0 * r["guarded"], r
        assert r["teacher_epoch"] == -1 or 0 <= r["teacher_epoch"] < r["epoch"], r
    print("guard:", [(r["guarded"], r["teacher_epoch"], round(r["val_observed_loss"], 4),
                      round(r["observed_loss"], 4), r["lr"]) for r in hist])


@pytest.mark.ray
def test_invariants_and_exact_commit_count_after_failures(chaos_run):
    """C equals the recount of z, column sums are the observed histogram, and the store
    applied exactly one commit per LCCN step per rank (+ one initial commit per rank): every
    commit made after a checkpoint that a failure rolled back was discarded, none twice."""
    from pipeline.train.checkpoints import load_state

    s = chaos_run["summary"]
    state = load_state(s["checkpoint"])["store"]
    store = ConfusionStore.from_state_dict(state)  # raises if C != recount(z)
    store.check()
    assert torch.equal(store.counts, count_matrix(store.z, store.observed, 10, 10,
                                                  counted=store.counted))
    counted = store.counted.numpy()
    assert 0 < (~counted).sum() < 0.1 * counted.size  # the noisy validation split (5%)
    assert store.counts.sum(0).tolist() == \
        np.bincount(store.observed.numpy()[counted], minlength=10).tolist()
    lccn_steps = sum(chaos_run["steps"][PRETRAIN:])
    assert load_state(s["checkpoint"])["lccn_step"] == lccn_steps
    # every step's labels applied once (a push carries several: fewer versions than steps)
    assert state["steps"] == 2 * (lccn_steps + 1)
    if COMMIT_EVERY > 1:
        assert state["version"] < state["steps"] / 2
    else:
        assert state["version"] == state["steps"]
    # one labeler id per (rank, worker-group start); the last ones sent seq 0..n-1
    assert sum(1 for w in state["last_seq"] if w.startswith("init.")) >= 2
    # the actor kill: the running group's next calls (Ray retries the in-flight ones on the
    # restarted actor) were refused and counted, and the counters survived the restart
    # through the checkpoint; a retry that reached the same actor would be a duplicate
    st = s["store"]
    assert st["refused"] >= 1 and st["refused"] + st["duplicates"] >= 1, st
    assert st["restored"] == 2, st  # the re-submission and the restarted actor took over
    # one call per LCCN step (or per commit_every steps) and rank, less at most one
    # checkpoint interval that died with the actor (calls re-done after a restart count again)
    assert st["calls"] >= 2 * (lccn_steps - CKPT_EVERY) // COMMIT_EVERY, st
    assert s["metrics"]["store_duplicates"] == 0


@pytest.mark.ray
def test_mlflow_run_holds_metrics_figures_and_checkpoint(chaos_run, tmp_path):
    import mlflow.artifacts
    import mlflow.pytorch
    from mlflow import MlflowClient

    s = chaos_run["summary"]
    client = MlflowClient(tracking_uri=s["tracking_uri"])
    exp = client.get_experiment_by_name("lccn-quickstart_ray")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, "both submissions and all restarts log into one MLflow run"
    run = runs[0]
    assert run.info.run_id == s["mlflow_run_id"] and run.info.status == "FINISHED"
    top1 = client.get_metric_history(run.info.run_id, "test_top1")
    assert sorted({m.step for m in top1}) == list(range(EPOCHS))
    val = client.get_metric_history(run.info.run_id, "val_top1")
    assert sorted({m.step for m in val}) == list(range(EPOCHS))
    assert {"staleness", "sync_time", "transition_error", "steps_per_s", "latent_entropy",
            "z_agreement", "phi_drift", "collapse", "observed_loss",
            "noise_floor"} <= set(run.data.metrics)
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"transitions", "transition.csv", "curves.png"} <= files and "checkpoint" not in files
    figs = {f.path for f in client.list_artifacts(run.info.run_id, "transitions")}
    assert {f"transitions/phi_epoch_{e:03d}.png" for e in range(PRETRAIN, EPOCHS)} <= figs
    # the checkpoint is referenced (the driver's tag), not copied into MLflow
    assert run.data.tags["lccn.checkpoint"] == str(s["checkpoint"])
    # the classifier records what lccn-predict needs: the run's transform and class names
    from pipeline.track.tracking import _use_tracking_uri

    with _use_tracking_uri(s["tracking_uri"]):  # a LoggedModel's runs:/ reads the global URI
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=f"runs:/{run.info.run_id}/model", tracking_uri=s["tracking_uri"],
            dst_path=str(tmp_path))
    model = mlflow.pytorch.load_model(local)
    assert model.preset == "digits" and model.class_names == tuple(str(d) for d in range(10))


@pytest.mark.ray
def test_one_and_two_workers_estimate_the_same_transition(chaos_run, tmp_path):
    """A 1-worker run and the (failed, resumed, restarted) 2-worker run land on transition
    estimates that agree with each other and with the realised noise, and on latent labels
    that correct the noise about equally well.

    Tolerances from repeated runs of this setting: 1 worker (3 seeds) mean |phi - T| 0.007
    to 0.011, latent accuracy 0.95; 2 workers (4 runs, clean and with failures) 0.008 to
    0.017 and 0.91 to 0.94; mean |phi_1 - phi_2| 0.004 to 0.011. Observed labels: 0.851."""
    from pipeline.train.checkpoints import load_state

    one = quickstart_ray.main(["--run-dir", str(tmp_path), "--run-name", "one", "--num-workers",
                               "1", "--no-tracking", *RAY_ARGS])
    two = chaos_run["summary"]
    train = chaos_run["run_dir"] / "data" / "digits-seed0" / "train"
    view = quickstart_ray.digits_view(train, rate=0.4, seed=0)
    realised = view.realised_transition()
    accuracy = {}
    for name, s in (("one", one), ("two", two)):
        phi = np.array(s["transition"])
        assert np.allclose(phi.sum(1), 1)
        assert np.abs(phi - realised).mean() < 0.025, name
        st = load_state(s["checkpoint"])["store"]
        z, counted = st["z"].numpy(), st["counted"].numpy()  # the training samples
        accuracy[name] = float((z == view.clean)[counted].mean())
    observed_accuracy = float((view.observed == view.clean)[counted].mean())
    assert min(accuracy.values()) > observed_accuracy + 0.04, (accuracy, observed_accuracy)
    assert abs(accuracy["one"] - accuracy["two"]) < 0.05, accuracy
    phi1, phi2 = np.array(one["transition"]), np.array(two["transition"])
    assert np.abs(phi1 - phi2).mean() < 0.03
    assert one["metrics"]["staleness"] == 0.0  # one worker: never stale
    assert two["metrics"]["staleness_max"] >= 1  # two workers: the other's commits


@pytest.mark.ray
def test_lccn_star_plus_on_ray_exports_outliers_and_keeps_the_trusted_set_out_of_c(
        ray_cluster, digits, tmp_path):
    """LCCN*+ through the job driver on 2 Ray Train workers: 20% of the digits
    pixel-shuffled at read time, 100 clean samples and 20 labelled outliers trusted. Rank 0
    gathers every rank's p(outlier) by idx into outliers.csv (one row per training sample,
    with its key), which lands next to the run's results and in its MLflow run and ranks the
    planted outliers first; the trusted samples hold their clean label (the outlier class
    for the labelled outliers) and are never counted in C.

    Measured (two runs): the 222 planted outliers not trusted ranked with precision 0.92,
    142 of them flagged and nothing else."""
    import argparse
    import csv

    from mlflow import MlflowClient

    from lccn_jobs.driver import run_job

    from pipeline.core.noise import open_set, trusted_subset
    from pipeline.data.split_labels import read_split_labels
    from pipeline.train.checkpoints import load_state

    train, test, _ = digits
    labels = read_split_labels(train)
    view = trusted_subset(open_set(labels["label"], 10, 0.2, seed=0), count=100, seed=0,
                          outliers=20)
    run = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", in_channels=1),
                    optim=OptimConfig(epochs=EPOCHS, pretrain_epochs=PRETRAIN, batch_size=64,
                                      lr=0.05),
                    lccn=LCCNConfig(outlier=True, use_trusted=True, outlier_prior=0.5))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    dist = DistConfig(run_name="star-plus", run_dir=str(tmp_path), train_source=str(train),
                      test_source=str(test), num_workers=2, loader_workers=0,
                      shuffle_buffer=100, preset="digits", tracking_uri=uri,
                      experiment="lccn-star-plus")
    summary = run_job(argparse.Namespace(max_failures=0, cpus_per_worker=1.0),
                      job="test", run=run, dist=dist, view=view)
    path = Path(summary["files"]["outliers.csv"])
    assert path == tmp_path / "results" / "star-plus-outliers.csv"
    with open(path) as f:
        rows = list(csv.DictReader(f))
    held_out = held_out_mask(view, run.val_fraction, seed=run.seed)
    idx = np.array([int(r["idx"]) for r in rows])
    assert sorted(idx.tolist()) == np.flatnonzero(~held_out).tolist()  # each once
    assert [r["key"] for r in rows] == [labels["key"][i] for i in idx]
    assert [int(r["observed"]) for r in rows] == view.observed[idx].tolist()
    p = np.array([float(r["p_outlier"]) for r in rows])
    trusted, ood = view.trusted[idx], view.ood[idx]
    assert (p[trusted & ood] == 1.0).all() and (p[trusted & ~ood] == 0.0).all()
    free = ~trusted  # ranked among the samples whose status the run was not told
    order = np.argsort(-p[free])[:int(ood[free].sum())]
    precision = ood[free][order].mean()
    flagged = free & (p > 0.5)
    assert precision >= 0.8 and flagged.sum() >= 60 and ood[flagged].mean() >= 0.95

    client = MlflowClient(tracking_uri=uri)
    artifacts = {f.path for f in client.list_artifacts(summary["mlflow_run_id"])}
    assert "outliers.csv" in artifacts

    st = load_state(summary["checkpoint"])["store"]
    t = torch.from_numpy(view.trusted)
    assert not st["counted"][t].any()
    assert torch.equal(st["z"][t], torch.from_numpy(view.clean)[t])
    assert (st["z"][torch.from_numpy(view.trusted & view.ood)] == 10).all()
    ConfusionStore.from_state_dict(st).check()


@pytest.mark.ray
def test_a_run_in_object_storage_killed_mid_epoch_resumes_bit_identical(ray_cluster, moto_url,
                                                                        tmp_path, monkeypatch):
    """On real Ray, with the run dir in S3-compatible object storage (a moto server): the
    single worker dies (os._exit, as after SIGKILL) mid-epoch in LCCN epoch 2 (19 steps an
    epoch: 1,195 training digits, batch 64) and the run fails (--max-failures 0); the same
    command again finds its checkpoints in the bucket (Ray Train's registry and the newest
    complete one, step 48), resumes there and ends with the same model, z, C and store
    version as an uninterrupted run on a local disk with the same seed. Results, the
    exported model and the injected-failure marker are in the bucket; the bucket keeps
    the checkpoints Ray Train manages and no others. The endpoint is in the driver's
    environment only (the Ray workers started without it): the job hands it to them."""
    import ray.train

    from pipeline.core import storage
    from pipeline.data import s3
    from pipeline.train.checkpoints import checkpoint_dirs, load_state

    s3.client(endpoint_url=moto_url).create_bucket(Bucket="runs")
    args = ["--epochs", "4", "--pretrain-epochs", "1", "--batch-size", "64", "--lr", "0.05",
            "--milestones", "--lr-values", "--warmup-steps", "5", "--loader-workers", "0",
            "--shuffle-buffer", "100", "--checkpoint-every", "8", "--num-workers", "1",
            "--no-tracking", "--no-baseline"]
    ref = quickstart_ray.main(["--run-dir", str(tmp_path / "a"), "--run-name", "ref", *args])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_url)
    monkeypatch.setenv("LCCN_RUNS", str(tmp_path / "local"))  # where the digits are written
    remote = ["--run-dir", "s3://runs/team/b/", "--run-name", "hit", *args,
              "--max-failures", "0"]
    with pytest.raises(ray.train.TrainingFailedError):
        quickstart_ray.main([*remote, "--inject-failure", "0:50:exit"])
    root = "s3://runs/team/b"
    assert storage.is_file(f"{root}/.injected-failure-r0-s50-exit", endpoint_url=moto_url)
    assert checkpoint_dirs(f"{root}/train/hit", endpoint_url=moto_url), "nothing saved"
    hit = quickstart_ray.main([*remote, "--inject-failure", "0:50:exit"])  # fired already
    assert (hit["metrics"]["resumed_epoch"], hit["metrics"]["resumed_batch"]) == (2, 10)
    assert hit["checkpoint"].startswith(f"{root}/train/hit/checkpoint_")
    a, b = load_state(ref["checkpoint"]), load_state(hit["checkpoint"], endpoint_url=moto_url)
    assert a["global_step"] == b["global_step"] == 4 * 19
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key in ("z", "counts"):
        assert torch.equal(a["store"][key], b["store"][key]), key
    assert a["store"]["steps"] == b["store"]["steps"] == 3 * 19 + 1
    assert ref["store"]["refused"] == 0
    # the run's files are in the bucket, nothing of it on this machine's disk
    assert json.loads(storage.read_text(f"{root}/results/hit.json", endpoint_url=moto_url)
                      )["global_step"] == 4 * 19
    assert hit["files"]["model"] == f"{root}/models/hit.pt2"
    assert storage.is_file(f"{root}/models/hit.pt2", endpoint_url=moto_url)
    assert storage.is_file(f"{root}/models/hit.json", endpoint_url=moto_url)
    kept = [storage.name(d) for d in checkpoint_dirs(f"{root}/train/hit", endpoint_url=moto_url)]
    snap = json.loads(storage.read_text(f"{root}/train/hit/checkpoint_manager_snapshot.json",
                                        endpoint_url=moto_url))
    assert sorted(kept) == sorted(r["checkpoint_dir_name"] for r in snap["checkpoint_results"])
    assert len(kept) <= 2  # CheckpointConfig.num_to_keep


def test_packed_wire_format_round_trips_a_push():
    """The Ray client sends numpy arrays (push_packed) and rebuilds a Sync from the reply:
    the other worker's moves, and the whole z on request."""
    from pipeline.cluster.store_actor import StoreActor, unpack_sync

    obs = torch.tensor([0, 1, 2, 0, 1, 2])
    a, b = StoreActor(obs, obs.clone(), 3, 3), StoreActor(obs, obs.clone(), 3, 3)
    fa, fb = a.open(None), b.open(None)
    for store, fence in ((a, fa), (b, fb)):   # another worker's commit, to be sent back
        store.commit(torch.tensor([5]), torch.tensor([0]), worker="x", seq=0, fence=fence)
    for seq, full_z in enumerate((False, True)):
        want = a.push(torch.tensor([0, 1]), torch.tensor([2, 0]), since=0, worker="w",
                      seq=seq, full_z=full_z, fence=fa)
        got = unpack_sync(b.push_packed(np.array([0, 1], dtype=np.int32),
                                        np.array([2, 0], dtype=np.int16), since=0,
                                        worker="w", seq=seq, full_z=full_z, fence=fb))
        assert got.version == want.version and got.others == want.others == 1
        assert got.counts is None and want.counts is None
        for name in ("z", "delta_obs", "delta_old", "delta_new"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.z.dtype == torch.int64 and got.z.numel() == (6 if full_z else 0)
        assert torch.equal(a.counts, b.counts) and torch.equal(a.z, b.z)


def test_each_worker_reserves_its_cpus_with_a_gpu_too():
    """--cpus-per-worker reaches Ray's reservation with --gpu as without (it was dropped
    with a GPU: 1 CPU per worker for 8 decode processes)."""
    ray_train = pytest.importorskip("ray.train")
    from pipeline.cluster.ray_train import worker_resources

    assert worker_resources(True, 10) == {"CPU": 10.0, "GPU": 1.0}
    assert worker_resources(False, 2) == {"CPU": 2.0}
    scaling = ray_train.ScalingConfig(num_workers=8, use_gpu=True,
                                      resources_per_worker=worker_resources(True, 10))
    assert scaling._resources_per_worker_not_none == {"CPU": 10.0, "GPU": 1.0}
    with pytest.raises(ValueError, match="cpus_per_worker must be > 0"):
        worker_resources(True, 0)


def test_a_worker_dead_at_its_groups_start_resubmits_the_run_within_max_failures(capfd):
    """Ray Train 2.60 ends a run with a non-retryable ControllerError when a worker dies
    while the controller launches the training function on a (re)started group (the soak
    hit it); fit_resubmitting submits the run again (which resumes from its checkpoint)
    up to max_failures times, and raises every other failure at once."""
    import ray.exceptions
    import ray.train

    from pipeline.cluster.ray_train import died_while_starting, fit_resubmitting

    dead = ray.train.ControllerError(ray.exceptions.ActorDiedError())
    other = ray.train.ControllerError(ValueError("a bad scaling config"))
    assert died_while_starting(dead) and not died_while_starting(other)
    assert not died_while_starting(ray.exceptions.ActorDiedError())

    class Trainer:
        def __init__(self, outcomes: list) -> None:
            self.outcomes = outcomes

        def fit(self):
            out = self.outcomes.pop(0)
            if isinstance(out, BaseException):
                raise out
            return out

    outcomes = [dead, dead, "result"]
    assert fit_resubmitting(lambda: Trainer(outcomes), max_failures=2) == "result"
    assert "submitting it again (2 of 2)" in capfd.readouterr().out
    outcomes = [dead, dead, "result"]
    with pytest.raises(ray.train.ControllerError):
        fit_resubmitting(lambda: Trainer(outcomes), max_failures=1)
    assert outcomes == ["result"]  # two submissions: the first and one more
    outcomes = [other, "result"]
    with pytest.raises(ray.train.ControllerError, match="a bad scaling config"):
        fit_resubmitting(lambda: Trainer(outcomes), max_failures=5)
    outcomes = [dead] * 4 + ["result"]
    assert fit_resubmitting(lambda: Trainer(outcomes), max_failures=-1) == "result"


def test_the_fault_benchmarks_kill_only_the_processes_of_their_own_ray():
    """bench_faults / bench_soak pick victims by process title; with ``under`` (their
    raylet) a process of the same title elsewhere on the machine (another Ray, a test
    suite's) is not one. Here: a child of this process against an orphaned one."""
    import os
    import runpy
    import signal
    import subprocess
    import time

    ray_pids = runpy.run_path(str(REPO / "benchmarks" / "bench_faults.py"))["ray_pids"]

    title = "lccn-victim-test"  # argv[0] of both sleepers
    sleep = "import time; time.sleep(60)"
    mine = subprocess.Popen([title, "-c", sleep], executable=sys.executable)
    subprocess.run(["bash", "-c", f"(exec -a {title} {sys.executable} -c '{sleep}' "
                                  f">/dev/null 2>&1 &)"], check=True)
    try:
        deadline = time.monotonic() + 10
        while len(ray_pids(title)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        every = ray_pids(title)
        assert mine.pid in every and len(every) == 2
        assert ray_pids(title, under=os.getpid()) == [mine.pid]
    finally:
        for pid in ray_pids(title):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        mine.wait()
