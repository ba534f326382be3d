"""The label-issue report: rankings and precision/recall at k computed by hand, the
held-out posterior against the sampler's Eq. 7, the accumulator's mean over epochs and ranks
and its checkpoint round trip, the command line on a checkpoint (files, an MLflow store,
clear errors), and a real two-worker run on digits with planted flips that ranks the flips
first, with cleanlab's numbers beside it and the files as MLflow artifacts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.confusion import count_matrix, transition
from pipeline.core.confusion_store import ConfusionStore
from pipeline.core.posterior import STATE_KEY, ReportAccumulator
from pipeline.core.sampler import gibbs_posterior
from pipeline.track import label_issues as li

REPO = Path(__file__).resolve().parents[1]


def test_rankings_and_precision_at_k_by_hand():
    # 5 samples, K = 3; observed 0 everywhere; samples 1 and 3 really are class 2
    post = np.array([[0.9, 0.05, 0.05], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1],
                     [0.2, 0.0, 0.8], [0.5, 0.45, 0.05]])
    obs = np.zeros(5, dtype=np.int64)
    r = li.rank_mislabelled(post, obs, np.arange(5), num_classes=3)
    assert r.score == pytest.approx([0.1, 0.9, 0.4, 0.8, 0.5])
    assert r.order().tolist() == [1, 3, 4, 2, 0]
    assert r.flagged.tolist() == [False, True, False, True, False]
    assert r.suggested.tolist() == [0, 2, 0, 2, 0]
    truth = np.array([False, True, False, True, False])
    known = np.ones(5, bool)
    ev = li.at_k(r, truth, known, ks=[1, 3])
    rows = {row["k"]: row for row in ev["at"]}
    assert rows["1"]["precision"] == 1.0 and rows["1"]["recall"] == 0.5
    assert rows["3"]["precision"] == pytest.approx(2 / 3) and rows["3"]["recall"] == 1.0
    assert ev["r_precision"] == 1.0 and rows["flagged"]["precision"] == 1.0
    # an unknown clean label leaves the sample out of the evaluation
    known[1] = False
    ev = li.at_k(r, truth, known)
    assert (ev["evaluated"], ev["issues"], ev["r_precision"]) == (4, 1, 1.0)


def test_outlier_mass_is_not_a_mislabel():
    # LCCN*: K = 2 plus the outlier class
    post = np.array([[0.1, 0.1, 0.8], [0.1, 0.8, 0.1]])
    obs = np.array([0, 0])
    mis = li.rank_mislabelled(post, obs, np.arange(2), num_classes=2)
    assert mis.score == pytest.approx([0.1, 0.8])
    assert mis.flagged.tolist() == [False, True]
    out = li.rank_outliers(post, np.arange(2), num_classes=2)
    assert out.flagged.tolist() == [True, False] and out.score == pytest.approx([0.8, 0.1])
    with pytest.raises(ValueError, match="K \\+ 1 = 3"):
        li.rank_outliers(post[:, :2], np.arange(2), num_classes=2)
    with pytest.raises(ValueError, match="row 1"):
        li.rank_mislabelled(np.array([[1.0, 0.0], [0.0, 0.0]]), obs, np.arange(2),
                            num_classes=2)


def test_heldout_posterior_is_eq7_without_an_own_count():
    g = torch.Generator().manual_seed(0)
    k, n = 4, 50
    obs_all = torch.randint(0, k, (200,), generator=g)
    z_all = torch.randint(0, k, (200,), generator=g)
    counts = count_matrix(z_all, obs_all, k, k)
    probs = torch.softmax(torch.randn(n, k, generator=g, dtype=torch.float64), 1)
    obs = torch.randint(0, k, (n,), generator=g)
    want = gibbs_posterior(probs, obs, torch.zeros(n, dtype=torch.int64), counts, 0.5,
                           counted=torch.zeros(n, dtype=torch.bool))
    got = li.heldout_posterior(probs.numpy(), obs.numpy(), transition(counts, 0.5).numpy())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-9, atol=1e-12)


def _acc(**kw):
    args = dict(num_samples=6, k_latent=3, num_classes=3, epochs=2, total_epochs=5,
                first_noise_epoch=1, alpha=1.0)
    args.update(kw)
    return ReportAccumulator(**args)


def _two_ranks(accs, batches, epoch):
    """Every rank's accumulator fed its batches of ``epoch`` and merged with a reduce that
    sums the ranks' parts, as the all-reduce does."""
    sinks = [a.sink(epoch) for a in accs]
    for r, (idx, post) in batches:
        sinks[r](torch.tensor(idx), torch.tensor(post, dtype=torch.float32))
    names = ("top_cls", "top_sum", "obs_sum", "out_sum", "count")
    parts = []
    for a in accs:  # collect each rank's packed part first, then hand every rank the sum
        before = {n: getattr(a, n) for n in names}
        kept = a._part
        a.merge(lambda t: parts.append(t.clone()) or torch.zeros_like(t))
        for n, v in before.items():
            setattr(a, n, v)
        a._part = kept
    total = sum(parts)
    for a in accs:
        a.end_epoch(epoch, lambda t: total)


def test_accumulator_means_over_the_last_epochs_and_ranks_and_round_trips():
    """Below the size limit every class is kept: the dense sums over the window's epochs
    and the ranks (the all-reduce adds the other rank's part)."""
    acc = _acc()
    assert [e for e in range(5) if acc.covers(e)] == [3, 4]
    assert acc.sink(2) is None and acc.exact
    other_rank = {}

    def reduce(part):  # a second rank that saw samples 4 and 5 with a one-hot posterior
        other = torch.zeros_like(part)
        other[4:, 2] = 1.0
        other[4:, 3] = 1.0
        other_rank["seen"] = True
        return part + other

    for epoch in (3, 4):
        sink = acc.sink(epoch)
        post = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]) if epoch == 3 else \
            torch.tensor([[0, 0, 1.0], [0, 1.0, 0]])
        sink(torch.tensor([0, 1]), post)
        acc.end_epoch(epoch, reduce)
    assert other_rank and acc.epochs == [3, 4]
    assert acc.count.tolist() == [2, 2, 0, 0, 2, 2]
    mean = acc.sum / acc.count.clamp_min(1).unsqueeze(1)
    np.testing.assert_allclose(mean[0].numpy(), [0.5, 0, 0.5])
    np.testing.assert_allclose(mean[4].numpy(), [0, 0, 1.0])
    fresh = _acc()
    fresh.load_state_dict(acc.state_dict())
    assert torch.equal(fresh.sum, acc.sum) and fresh.epochs == [3, 4]
    assert not _acc(epochs=0).covers(4)


def test_top_k_sums_merge_over_ranks_and_round_trip(monkeypatch):
    """Above the size limit, two ranks, two epochs: the kept classes' sums are the
    posteriors' sums (here every posterior has mass on two classes only, so nothing falls
    out), the observed label's sum is exact, and a state round-trips."""
    from pipeline.core import posterior

    monkeypatch.setattr(posterior, "MAX_ENTRIES", 1)
    observed = torch.tensor([0, 1, 2, 0, 1, 2])
    accs = [_acc(observed=observed, topk=2), _acc(observed=observed, topk=2)]
    assert not accs[0].exact and accs[0].k == 2
    rng = np.random.default_rng(0)
    dense = np.zeros((6, 3))
    for epoch in (3, 4):
        post = rng.dirichlet(np.ones(3), 6)
        post[:, 1] = 0.0  # class 1 never has mass: the two kept classes hold all of it
        post /= post.sum(1, keepdims=True)
        dense += post
        order = rng.permutation(6)  # each sample once an epoch, on one of the ranks
        _two_ranks(accs, [(0, (order[:4].tolist(), post[order[:4]])),
                          (1, (order[4:].tolist(), post[order[4:]]))], epoch)
    a = accs[0]
    assert a.epochs == [3, 4] and a.count.tolist() == [2] * 6 and a.sum is None
    got = np.zeros((6, 3))
    np.put_along_axis(got, a.top_cls.long().numpy(), a.top_sum.numpy(), 1)
    np.testing.assert_allclose(got, dense, rtol=1e-6)
    np.testing.assert_allclose(a.obs_sum.numpy(), dense[np.arange(6), observed], rtol=1e-6)
    assert (np.diff(a.top_sum.numpy(), axis=1) <= 0).all()  # largest first
    fresh = _acc(observed=observed, topk=2)
    fresh.load_state_dict(a.state_dict())
    assert torch.equal(fresh.top_sum, a.top_sum) and fresh.epochs == [3, 4]
    # the same samples from two ranks between two merges breaks an invariant: an error
    with pytest.raises(RuntimeError, match="sample 1 came from two ranks"):
        _two_ranks(accs, [(0, ([0, 1], [[1.0, 0, 0], [0, 1.0, 0]])),
                          (1, ([1], [[0, 0, 1.0]]))], 4)


def test_above_the_size_limit_each_sample_keeps_its_top_classes(monkeypatch):
    """Above MAX_ENTRIES the accumulator keeps the k largest classes of each sample (its
    memory O(N x k)) and the exact sums of the observed label and the outlier class; the
    report built from it flags and suggests what the dense sums give."""
    from pipeline.core import posterior

    monkeypatch.setattr(posterior, "MAX_ENTRIES", 10)
    n, k_cls, k_lat = 40, 9, 10
    rng = np.random.default_rng(1)
    observed = torch.from_numpy(rng.integers(0, k_cls, n))
    acc = ReportAccumulator(num_samples=n, k_latent=k_lat, num_classes=k_cls, epochs=3,
                            total_epochs=3, first_noise_epoch=0, alpha=1.0,
                            observed=observed, topk=3)
    assert not acc.exact and acc.k == 3
    truth = rng.integers(0, k_lat, n)
    dense = np.zeros((n, k_lat))
    for epoch in range(3):
        post = rng.dirichlet(np.full(k_lat, 0.3), n)
        post[np.arange(n), truth] += 2.0
        post /= post.sum(1, keepdims=True)
        dense += post
        sink = acc.sink(epoch)
        for chunk in np.array_split(rng.permutation(n), 4):
            sink(torch.from_numpy(chunk), torch.from_numpy(post[chunk]).float())
        acc.end_epoch(epoch, lambda t: t)
    assert acc.top_cls.shape == (n, 3) and acc.count.tolist() == [3] * n
    np.testing.assert_allclose(acc.obs_sum.numpy(), dense[np.arange(n), observed], rtol=1e-5)
    np.testing.assert_allclose(acc.out_sum.numpy(), dense[:, k_cls], rtol=1e-5)
    assert (acc.top_cls[:, 0].numpy() == dense.argmax(1)).all()
    np.testing.assert_allclose(acc.top_sum[:, 0].numpy(), dense.max(1), rtol=1e-5)
    # the report from the top-k state agrees with the dense posterior's ranking
    store = ConfusionStore(observed, observed.clamp(max=k_cls - 1), k_lat, k_cls)
    state = {"store": store.state_dict(), STATE_KEY: acc.state_dict()}
    rep = li.build_report(state)
    want = li.rank_mislabelled(dense / 3, observed.numpy(), np.arange(n), num_classes=k_cls)
    np.testing.assert_allclose(rep.mislabelled.score, want.score, atol=1e-5)
    # the decisions from the dense posterior (no held-out split: no calibration, no shift):
    # flagged where P(wrong) is above its mean, relabelled where the most probable other
    # in-distribution class beats the observed label
    mean = dense / 3
    obs = observed.numpy()
    p_obs = mean[np.arange(n), obs]
    other = mean[:, :k_cls].copy()
    other[np.arange(n), obs] = -1
    wrong = 1 - p_obs - mean[:, k_cls]
    assert (rep.mislabelled.flagged == (wrong > wrong.mean())).all()
    indist = truth < k_cls  # an outlier's runner-up class may fall out of the 3 kept
    assert (rep.mislabelled.relabel == (other.max(1) > p_obs))[indist].all()
    assert (rep.mislabelled.suggested == other.argmax(1))[indist].all() and indist.sum() > 30
    assert any("kept each sample's 3 largest of 10 classes" in n for n in rep.notes)


def _state(tmp_path: Path, *, k: int, outlier: bool, rng: np.random.Generator):
    """A checkpoint state as an LCCN run leaves it: the chain, the averaged posteriors of
    the training samples, the held-out predictions."""
    n = 60
    k_lat = k + 1 if outlier else k
    clean = rng.integers(0, k, n)
    flips = rng.random(n) < 0.25
    observed = np.where(flips, (clean + 1) % k, clean)
    held = np.zeros(n, bool)
    held[::5] = True
    post = np.full((n, k_lat), 0.02)
    post[np.arange(n), clean] = 1.0
    if outlier:
        clean[7] = k  # one out-of-distribution sample
        post[7] = 0.02
        post[7, k] = 1.0
    post /= post.sum(1, keepdims=True)
    state = _chain_state(observed, clean.clip(0, k - 1), post, held, k_lat, k)
    return state, clean, observed


def _chain_state(observed: np.ndarray, z: np.ndarray, post: np.ndarray, held: np.ndarray,
                 k_lat: int, k: int) -> dict:
    """The chain (latent labels ``z``; ``held`` samples not counted) and the accumulator:
    the posteriors ``post`` averaged over three epochs, the held-out rows' predictions."""
    store = ConfusionStore(torch.from_numpy(observed), torch.from_numpy(z), k_lat, k,
                           counted=torch.from_numpy(~held))
    count = np.where(held, 0, 3)
    acc = {"sum": torch.from_numpy(post * count[:, None]).float(),
           "count": torch.from_numpy(count), "epochs": [3, 4, 5], "alpha": 1.0,
           "k_latent": k_lat, "num_classes": k,
           "heldout": {"idx": torch.from_numpy(np.flatnonzero(held)),
                       "probs": torch.from_numpy(post[held]).float()}}
    return {"store": store.state_dict(), STATE_KEY: acc, "mlflow_run_id": None}


def test_report_files_and_cli_log_into_a_real_mlflow_store(tmp_path, capsys):
    from mlflow import MlflowClient

    rng = np.random.default_rng(0)
    state, clean, observed = _state(tmp_path, k=3, outlier=True, rng=rng)
    ckpt = tmp_path / "checkpoint_000003"
    ckpt.mkdir()
    torch.save(state, ckpt / "state.pt")
    from pipeline.core.labels import LabelView

    view = LabelView(observed=observed, clean=clean, num_classes=3)
    view.save(tmp_path / "view.npz")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    assert li.main([str(ckpt), "--label-view", str(tmp_path / "view.npz"), "--k", "5",
                    "--out", str(tmp_path / "rep"), "--tracking-uri", uri,
                    "--mlflow-run-id", run_id]) == 0
    printed = capsys.readouterr().out
    assert "| train | mislabelled" in printed and "cleanlab" in printed
    rows = list(csv.DictReader(open(tmp_path / "rep" / "mislabelled.csv")))
    counted = np.flatnonzero(~np.isin(np.arange(60), np.arange(0, 60, 5)))
    planted = {int(i) for i in counted if 0 <= clean[i] < 3 and clean[i] != observed[i]}
    assert {int(r["idx"]) for r in rows} == planted  # a posterior at the truth finds all
    assert all(r["suggested"] == str(clean[int(r["idx"])]) for r in rows)
    assert [float(r["confidence"]) for r in rows] == sorted(
        (float(r["confidence"]) for r in rows), reverse=True)
    out_rows = list(csv.DictReader(open(tmp_path / "rep" / "outliers.csv")))
    assert [int(r["idx"]) for r in out_rows] == [7]
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    methods = {(e["split"], e["kind"], e["method"]) for e in summary["evaluation"]}
    assert methods == {("train", "mislabelled", "lccn"), ("train", "outlier", "lccn"),
                       ("validation", "mislabelled", "lccn"),
                       ("validation", "mislabelled", "cleanlab")}
    arts = {a.path for a in client.list_artifacts(run_id, "label_issues")}
    assert arts == {f"label_issues/{f}" for f in ("mislabelled.csv", "outliers.csv",
                                                  "labels.csv", "summary.json", "summary.md")}
    # the cleaned labels of every counted training sample, in idx order
    labels = list(csv.DictReader(open(tmp_path / "rep" / "labels.csv")))
    assert [int(r["idx"]) for r in labels] == counted.tolist()
    assert list(labels[0]) == ["idx", "key", "observed", "suggested", "p_suggested",
                               "p_observed", "p_outlier", "flagged", "relabel", "cleaned"]
    assert {int(r["idx"]) for r in labels if r["flagged"] == "1"} == planted
    assert {int(r["idx"]) for r in labels if r["relabel"] == "1"} == planted
    for r in labels:
        i = int(r["idx"])
        if clean[i] < 3:  # the posterior peaks at the truth: the cleaned label is clean
            assert r["cleaned"] == str(clean[i])
            if observed[i] != clean[i]:
                assert r["suggested"] == str(clean[i]) and float(r["p_suggested"]) > 0.9
                assert float(r["p_observed"]) < 0.1
            else:
                assert float(r["p_observed"]) > 0.9 and float(r["p_suggested"]) < 0.1
        else:
            assert float(r["p_outlier"]) > 0.9 and r["relabel"] == "0"
    # the estimate is the held-out one (out of sample: 1 wrong label of 12 there); the
    # training posteriors (truth-peaked: 12 wrong of 48 here) are moved for the decisions
    # only as far as its 95% interval requires, to its lower edge
    c = summary["cleaning"]
    truth_acc = float(np.mean([observed[i] == clean[i] for i in counted]))
    held = c["heldout_accuracy_observed"]
    assert c["accuracy_observed"] == held and held > truth_acc + 0.1
    shifted = float(np.mean([float(r["p_observed"]) for r in labels]))
    assert shifted == pytest.approx(held - 1.96 * c["accuracy_observed_se"], abs=1e-3)
    assert shifted == pytest.approx(truth_acc, abs=0.05)
    assert c["relabel"] == len(planted) and 0 < c["expected_gain"] <= 1 - truth_acc + 0.05
    assert c["calibration"]["temperature"] == 1.0  # 12 samples do not support a fit
    assert "Estimated accuracy of the observed labels" in printed
    assert client.get_run(run_id).data.metrics["label_issues_rprec_train_mislabelled_lccn"] == 1.0


def test_a_latent_class_the_chain_emptied_is_not_relabelled_into_another(tmp_path):
    """A collapse under pair flips: the chain has merged class 2 into class 0 (every image
    of a 2 sits in latent class 0 and its posterior says 0). Relabelling the samples
    labelled 2 would turn right labels wrong, so they are kept; the other flips are still
    relabelled to their clean class."""
    rng = np.random.default_rng(1)
    n, k = 300, 3
    clean = rng.integers(0, k, n)
    observed = np.where(rng.random(n) < 0.25, (clean + 1) % k, clean)
    merged = np.where(clean == 2, 0, clean)  # the chain's z: no sample in latent class 2
    held = np.zeros(n, bool)
    held[::5] = True
    post = np.full((n, k), 0.02)
    post[np.arange(n), merged] = 1.0
    post /= post.sum(1, keepdims=True)
    rep = li.build_report(_chain_state(observed, merged, post, held, k, k), clean=clean)
    rows, rel = rep.mislabelled.idx, rep.mislabelled.relabel
    assert rep.cleaning["vanished_classes"] == [2] and rep.cleaning["kept_back"] > 20
    assert not rel[observed[rows] == 2].any()
    # the flips labelled 0 or 1 whose clean class the chain kept are relabelled to it
    fixable = (observed[rows] != 2) & (observed[rows] != clean[rows]) & (clean[rows] != 2)
    assert fixable.sum() > 10 and rel[fixable].all()
    assert (rep.mislabelled.suggested[fixable] == clean[rows][fixable]).all()
    ev = next(e for e in rep.evaluation if e["split"] == "train" and "accuracy_cleaned" in e)
    assert ev["accuracy_cleaned"] > ev["accuracy_observed"]
    assert any("emptied latent class 2" in note for note in rep.notes)


def test_the_report_reads_the_selected_epochs_heldout_predictions(tmp_path):
    """A run records the held-out predictions of its last epoch and of its selected one;
    the report reads the selected classifier's (the one the run exports), and an older
    state without them the last epoch's. Here the last classifier has memorised: on the
    held-out images it predicts each observed label, wrong ones included, so read from it
    the split's labels look right; the selected classifier predicts the clean class."""
    rng = np.random.default_rng(2)
    n, k = 400, 3
    clean = rng.integers(0, k, n)
    observed = np.where(rng.random(n) < 0.3, (clean + 1) % k, clean)
    held = np.zeros(n, bool)
    held[::4] = True
    post = np.full((n, k), 0.05)
    post[np.arange(n), clean] = 1.0
    post /= post.sum(1, keepdims=True)
    state = _chain_state(observed, clean, post, held, k, k)
    parrot = np.full((n, k), 0.05)
    parrot[np.arange(n), observed] = 1.0
    parrot /= parrot.sum(1, keepdims=True)
    idx = torch.from_numpy(np.flatnonzero(held))
    acc = state[STATE_KEY]
    acc["heldout"] = {"idx": idx, "probs": torch.from_numpy(parrot[held]).float()}
    truth = float((observed[held] == clean[held]).mean())
    last = li.build_report(state, clean=clean).cleaning["heldout_accuracy_observed"]
    assert last > truth + 0.15  # the memorised classifier vouches for the wrong labels
    acc["heldout_selected"] = {"idx": idx, "probs": torch.from_numpy(post[held]).float(),
                               "epoch": 5, "val_top1": 0.9}
    rep = li.build_report(state, clean=clean)
    assert rep.cleaning["heldout_accuracy_observed"] == pytest.approx(truth, abs=0.06)
    assert "selected epoch's classifier (noisy validation accuracy 0.9000)" in \
        rep.cleaning["estimated_from"]
    ev = {e["method"]: e for e in rep.evaluation if e["split"] == "validation"}
    assert ev["lccn"]["r_precision"] == 1.0 and ev["cleanlab"]["r_precision"] == 1.0


def test_cli_errors_name_the_file(tmp_path):
    with pytest.raises(SystemExit, match="state.pt: no such file"):
        li.main([str(tmp_path)])
    from pipeline.core.labels import LabelView

    state, clean, observed = _state(tmp_path, k=3, outlier=True, rng=np.random.default_rng(0))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save(state, ckpt / "state.pt")
    LabelView(observed=observed[:20], clean=clean[:20], num_classes=3).save(tmp_path / "v.npz")
    with pytest.raises(SystemExit, match="clean labels given cover 20 samples, the run's "
                                         "training chain 60: give the training split"):
        li.main([str(ckpt), "--label-view", str(tmp_path / "v.npz")])
    torch.save({"store": None}, tmp_path / "state.pt")
    with pytest.raises(SystemExit, match=f"{tmp_path}: the checkpoint holds no averaged"):
        li.main([str(tmp_path)])


@pytest.mark.ray
def test_a_real_run_ranks_planted_flips_first_beside_cleanlab(tmp_path):
    """Two Ray Train workers, digits with 40% pair flips in four classes (the quickstart's
    planted noise), 4 CE + 4 LCCN epochs, the posterior averaged over the last 3."""
    from mlflow import MlflowClient

    from lccn_jobs import digits as quickstart_ray

    summary = quickstart_ray.main(["--epochs", "8", "--pretrain-epochs", "4", "--milestones",
                                   "--no-baseline", "--run-dir", str(tmp_path),
                                   "--run-name", "flips", "--val-fraction", "0.2",
                                   "--report-epochs", "3"])
    rep = summary["label_issues"]
    assert rep["posterior_epochs"] == [5, 6, 7]
    ev = {(e["split"], e["method"]): e for e in rep["evaluation"]}
    train = ev[("train", "lccn")]
    assert train["issues"] > 100  # the planted flips among the ~1000 counted samples
    # measured with seeds 0, 1, 2: 0.95, 0.94, 0.59 (this run, seed 0: 0.95; flagged
    # precision 0.87 +- 0.17, recall 0.83 +- 0.11 over the seeds,
    # benchmarks/results/label_issues.md); chance is the flip rate, ~0.15
    assert train["r_precision"] >= 0.5
    flagged = next(r for r in train["at"] if r["k"] == "flagged")
    assert flagged["precision"] >= 0.5 and flagged["recall"] >= 0.5
    # cleanlab beside LCCN on the held-out split, from the same final model
    held, cl = ev[("validation", "lccn")], ev[("validation", "cleanlab")]
    assert held["evaluated"] == cl["evaluated"] > 200 and held["issues"] == cl["issues"]
    assert 0.0 <= cl["r_precision"] <= 1.0 and cl["r_precision"] > 0.3
    files = {Path(f).name for f in rep["files"]}
    assert files == {"mislabelled.csv", "labels.csv", "summary.json", "summary.md"}
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    arts = {a.path for a in client.list_artifacts(summary["mlflow_run_id"], "label_issues")}
    assert "label_issues/mislabelled.csv" in arts and "label_issues/summary.md" in arts


def test_confident_joint_accuracy_reads_a_sure_classifiers_disagreements_as_noise():
    from pipeline.track.label_issues import confident_joint_accuracy

    rng = np.random.default_rng(0)
    truth = rng.integers(0, 4, 2000)
    observed = np.where(rng.random(2000) < 0.2, rng.integers(0, 4, 2000), truth)
    right = float((observed == truth).mean())
    probs = np.full((2000, 4), 0.02)
    probs[np.arange(2000), truth] = 0.94  # sure and right: every disagreement is noise
    assert confident_joint_accuracy(probs, observed) == pytest.approx(right, abs=0.01)
    # the same classifier wrong on a third of the images: its errors count as noise too
    wrong = rng.random(2000) < 0.33
    shifted = np.roll(probs, 1, axis=1)
    worse = np.where(wrong[:, None], shifted, probs)
    assert confident_joint_accuracy(worse, observed) < right - 0.2
    # a class without a held-out label: no estimate
    assert np.isnan(confident_joint_accuracy(probs[observed != 3], observed[observed != 3]))


def test_calibration_moves_the_transition_only_away_from_the_identity():
    """``calibrate`` on held-out labels (20% flipped): with a classifier right about the
    true classes and a transition holding too little noise, it moves the transition away
    from the identity and the held-out estimate toward the truth; with a classifier that
    predicts the noisy labels themselves (it has learnt them), where the held-out
    likelihood would rise as the transition nears the identity, it does not move it
    there."""
    rng = np.random.default_rng(0)
    n, k = 3000, 4
    truth = rng.integers(0, k, n)
    flip = rng.random(n) < 0.2
    observed = np.where(flip, (truth + rng.integers(1, k, n)) % k, truth)
    right = float((observed == truth).mean())

    def peaked(at: np.ndarray) -> np.ndarray:
        p = np.full((n, k), 0.15 / (k - 1))
        p[np.arange(n), at] = 0.85
        return p

    def estimate(probs: np.ndarray, phi: np.ndarray, cal: li.Calibration) -> float:
        post = li.heldout_posterior(cal.probs(probs), observed, cal.phi(phi))
        return float(post[np.arange(n), observed].mean())

    def noisy(diag: float) -> np.ndarray:
        return np.full((k, k), (1 - diag) / (k - 1)) + (diag - (1 - diag) / (k - 1)) * np.eye(k)

    tight = noisy(0.95)
    cal = li.calibrate(peaked(truth), observed, tight)
    assert cal.shrink < 0
    before = estimate(peaked(truth), tight, li.Calibration())
    after = estimate(peaked(truth), tight, cal)
    # (the temperature and the shrink trade along a ridge of equal likelihood here, both
    # symmetric: the fit moves the estimate toward the truth, not necessarily onto it)
    assert before > right + 0.1 and after < before - 0.05
    # the classifier predicts the observed labels: the likelihood favours the identity
    learnt, phi = peaked(observed), noisy(0.8)
    toward = li._heldout_nll(learnt, observed, li._shrunk(phi, 0.9))
    assert toward < li._heldout_nll(learnt, observed, phi)
    cal = li.calibrate(learnt, observed, phi)
    assert cal.shrink <= 0


def test_the_heldout_shift_can_veto_a_relabel_but_not_make_one():
    """``decide``: the shifted posteriors (their mean matched to the held-out estimate)
    flag and estimate; a label is relabelled only where the chain's own posterior favours
    the other class too, and a positive shift can still hold one back."""
    p_obs = np.array([0.20, 0.40, 0.45, 0.60, 0.90])
    p_best = np.array([0.70, 0.50, 0.35, 0.30, 0.05])
    none = np.zeros(5)
    _, _, _, raw = li.decide(p_obs, p_best, none, shift=0.0, noise_rate=0.5)
    assert raw.tolist() == [True, True, False, False, False]
    # a strong negative shift makes the other class the more probable in rows 3-4 of the
    # shifted posteriors, and it lowers their estimated accuracy, but relabels nothing more
    po, pb, flagged, rel = li.decide(p_obs, p_best, none, shift=-2.0, noise_rate=0.5)
    assert (pb > po).tolist() == [True, True, True, True, False]
    assert rel.tolist() == raw.tolist() and flagged[:4].all()
    assert po.mean() < p_obs.mean()
    # a positive shift (the chain implies more noise than the held-out split allows) vetoes
    # row 1, where the observed label was a close second
    po, pb, _, rel = li.decide(p_obs, p_best, none, shift=0.5, noise_rate=0.5)
    assert rel.tolist() == [True, False, False, False, False] == (pb > po).tolist()
