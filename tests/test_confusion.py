"""C, its invariants under thousands of random steps, the store protocol, planted-noise
recovery and Theorem 3."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.config import LCCNConfig
from pipeline.core.confusion import (
    apply_delta_,
    check_invariants,
    count_matrix,
    theorem3_bound,
    transition,
)
from pipeline.core.confusion_store import ConfusionStore
from pipeline.core.sampler import gibbs_step
from pipeline.core.warmup import initial_assignment, smoothed_identity, soft_confusion
from pipeline.train.labeler import GibbsLabeler


def test_counts_to_transition_round_trip():
    gen = torch.Generator().manual_seed(0)
    z = torch.randint(0, 4, (1000,), generator=gen)
    obs = torch.randint(0, 3, (1000,), generator=gen)
    c = count_matrix(z, obs, 4, 3)
    assert c.sum() == 1000 and torch.equal(c.sum(0), torch.bincount(obs, minlength=3))
    phi = transition(c)
    torch.testing.assert_close(phi.sum(1), torch.ones(4, dtype=torch.float64))
    # counts -> matrix -> expected counts
    torch.testing.assert_close(phi * c.sum(1, keepdim=True), c.to(torch.float64))
    # alpha smoothing: rows still sum to 1
    torch.testing.assert_close(transition(c, 0.5).sum(1), torch.ones(4, dtype=torch.float64))


def test_invariants_survive_thousands_of_random_steps():
    gen = torch.Generator().manual_seed(1)
    n, k, kl = 2000, 6, 7
    obs = torch.randint(0, k, (n,), generator=gen)
    counted = torch.rand(n, generator=gen) > 0.1
    store = ConfusionStore(obs, torch.randint(0, kl, (n,), generator=gen), kl, k, counted=counted)
    for step in range(3000):
        idx = torch.randperm(n, generator=gen)[:32]
        store.commit(idx, torch.randint(0, kl, (32,), generator=gen), worker=str(step % 3),
                     seq=step // 3)
        if step % 250 == 0:
            store.check()
    store.check()
    assert store.version == 3000


def test_check_invariants_catches_corruption():
    obs = torch.tensor([0, 1, 1, 2])
    z = torch.tensor([0, 1, 2, 2])
    c = count_matrix(z, obs, 3, 3)
    check_invariants(c, z, obs)
    bad = c.clone()
    bad[0, 0] -= 1
    bad[1, 0] += 1  # same totals, wrong cells
    with pytest.raises(AssertionError, match="invariant 3"):
        check_invariants(bad, z, obs)
    bad = c.clone()
    bad[0, 0] = -1
    with pytest.raises(AssertionError, match="invariant 1"):
        check_invariants(bad, z, obs)


def test_commit_is_exactly_once_under_retries_and_duplicates():
    obs = torch.tensor([0, 1, 2, 0, 1, 2])
    store = ConfusionStore(obs, obs.clone(), 3, 3)
    before = store.counts.clone()
    v = store.commit(torch.tensor([0, 1]), torch.tensor([2, 2]), worker="a", seq=0)
    after = store.counts.clone()
    # a retried call (same seq) changes nothing
    assert store.commit(torch.tensor([0, 1]), torch.tensor([2, 2]), worker="a", seq=0) == v
    assert torch.equal(store.counts, after) and store.duplicates == 1
    # an idempotent replay without seq moves nothing either: the delta comes from stored z
    store.commit(torch.tensor([0, 1]), torch.tensor([2, 2]))
    assert torch.equal(store.counts, after)
    assert int((after - before).abs().sum()) == 4
    store.check()


def test_trusted_samples_are_never_counted():
    obs = torch.tensor([0, 1, 2, 0])
    counted = torch.tensor([True, True, False, True])
    store = ConfusionStore(obs, obs.clone(), 3, 3, counted=counted)
    assert store.counts.sum() == 3
    store.commit(torch.tensor([2, 3]), torch.tensor([0, 1]))
    assert store.z[2] == 2  # the trusted sample's z is fixed
    assert store.counts.sum() == 3
    store.check()


def test_push_replies_rebuild_a_replica_exactly():
    """A pull (an empty push) brings the other workers' moves since the caller's version:
    the payload grows with their batches; too far behind the log, the whole C comes back."""
    gen = torch.Generator().manual_seed(2)
    n, k = 500, 4
    obs = torch.randint(0, k, (n,), generator=gen)
    store = ConfusionStore(obs, obs.clone(), k, k, log_capacity=8)
    replica, version = store.counts.clone(), store.version
    empty = torch.empty(0, dtype=torch.int64)

    def pull(since: int):
        before = store.version
        s = store.push(empty, empty, since=since, worker="a", seq=99, steps=0)
        assert s.z.numel() == 0 and store.version == before  # a pull commits nothing
        if s.counts is not None:
            replica.copy_(s.counts)
        else:
            apply_delta_(replica, s.delta_obs, s.delta_old, s.delta_new)
        return s

    for i in range(5):
        store.commit(torch.arange(i * 10, i * 10 + 10), torch.randint(0, k, (10,), generator=gen),
                     worker="b", seq=i)
    s = pull(version)
    assert s.counts is None and s.delta_obs.numel() <= 50 and s.others == 5
    assert torch.equal(replica, store.counts)
    # too far behind the log: a full copy comes back
    for i in range(20):
        store.commit(torch.arange(10), torch.randint(0, k, (10,), generator=gen), worker="b",
                     seq=5 + i)
    s = pull(s.version)
    assert s.counts is not None and s.others == -1
    assert torch.equal(replica, store.counts)
    # the caller's own commits are left out of its replies (it applied them itself)
    store.commit(torch.arange(20, 30), torch.full((10,), 3), worker="a", seq=1)
    s = pull(store.version - 1)
    assert s.others == 0 and s.counts is None and s.delta_obs.numel() == 0


def test_state_dict_round_trip_and_corruption_detected():
    obs = torch.tensor([0, 1, 2, 0, 1])
    store = ConfusionStore(obs, torch.tensor([1, 1, 2, 0, 0]), 3, 3)
    store.commit(torch.tensor([0]), torch.tensor([2]), worker="w", seq=5)
    state = store.state_dict()
    again = ConfusionStore.from_state_dict(state)
    assert torch.equal(again.counts, store.counts) and again.version == store.version
    assert again.commit(torch.tensor([0]), torch.tensor([0]), worker="w", seq=5) == store.version
    state["counts"][0, 0] += 1
    with pytest.raises(ValueError, match="recount"):
        ConfusionStore.from_state_dict(state)


def plant(n, t, gen):
    k = t.shape[1]
    y = torch.randint(0, t.shape[0], (n,), generator=gen)
    obs = torch.multinomial(t[y], 1, generator=gen).squeeze(1)
    return y, obs


def test_planted_noise_recovery_with_an_oracle_classifier():
    """A fixed, imperfect oracle P(y|x) (0.6 on the truth); the chain must find T."""
    gen = torch.Generator().manual_seed(3)
    k, n = 5, 6000
    t = torch.eye(k, dtype=torch.float64) * 0.6
    for a, b in [(0, 1), (1, 2), (2, 0), (3, 4), (4, 3)]:
        t[a, b] = 0.4
    y, obs = plant(n, t, gen)
    probs = torch.full((n, k), 0.1, dtype=torch.float64)
    probs[torch.arange(n), y] = 0.6
    store = ConfusionStore(obs, initial_assignment(obs, mode="observed"), k, k)
    labeler = GibbsLabeler(LCCNConfig(alpha=1.0), store, store.counts, store.version,
                           phi_init=smoothed_identity(k, k), max_steps=1, generator=gen)
    for sweep in range(15):
        order = torch.randperm(n, generator=gen)
        batches = list(order.split(128))
        labeler.prefetch(batches[0])
        for b, nxt in zip(batches, batches[1:] + [None]):
            z, _ = labeler.sample(probs[b], obs[b], b)
            labeler.commit(b, z, nxt)
    store.check()
    realised = count_matrix(y, obs, k, k).to(torch.float64)
    realised /= realised.sum(1, keepdim=True)
    err = (store.transition() - realised).abs().mean()
    assert err < 0.03, (store.transition(), realised)
    assert (store.z == y).float().mean() > 0.8


def test_soft_confusion_is_eq8_and_identity_is_smoothed():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]], dtype=torch.float64)
    obs = torch.tensor([0, 1, 1])
    phi = soft_confusion(probs, obs, 2)
    torch.testing.assert_close(phi, torch.tensor([[1 / 1.5, 0.5 / 1.5], [0.0, 1.0]],
                                                 dtype=torch.float64))
    ident = smoothed_identity(3, 2, smoothing=0.2)
    torch.testing.assert_close(ident.sum(1), torch.ones(3, dtype=torch.float64))
    assert ident[0, 0] == pytest.approx(0.9) and ident[2, 0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k_latent"):
        smoothed_identity(5, 2)
    with pytest.raises(ValueError, match="argmax"):
        initial_assignment(obs, mode="argmax")


@pytest.mark.parametrize("seed", range(20))
def test_theorem3_bounds_the_change_of_phi_per_batch(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    k, n, m = 6, 400, int(torch.randint(1, 100, (1,), generator=gen))
    alpha = float(torch.rand(1, generator=gen)) * 2 + 0.01
    obs = torch.randint(0, k, (n,), generator=gen)
    store = ConfusionStore(obs, torch.randint(0, k, (n,), generator=gen), k, k)
    old = store.counts.clone()
    store.commit(torch.randperm(n, generator=gen)[:m], torch.randint(0, k, (m,), generator=gen))
    change = (transition(store.counts, alpha) - transition(old, alpha)).abs().sum(1)
    bound = theorem3_bound(old, store.counts, alpha)
    assert (change <= bound + 1e-12).all(), (change, bound)


def test_apply_delta_matches_recount():
    gen = torch.Generator().manual_seed(7)
    z = torch.randint(0, 4, (300,), generator=gen)
    obs = torch.randint(0, 4, (300,), generator=gen)
    c = count_matrix(z, obs, 4, 4)
    idx = torch.randperm(300, generator=gen)[:50]
    z_new = torch.randint(0, 4, (50,), generator=gen)
    apply_delta_(c, obs[idx], z[idx], z_new)
    z[idx] = z_new
    assert torch.equal(c, count_matrix(z, obs, 4, 4))


def test_labels_out_of_range_are_named():
    with pytest.raises(ValueError, match="latent contains 9"):
        count_matrix(torch.tensor([0, 9]), torch.tensor([0, 1]), 3, 3)
    store = ConfusionStore(torch.tensor([0, 1]), torch.tensor([0, 1]), 2, 2)
    with pytest.raises(ValueError, match="z_new out of range"):
        store.commit(torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError, match="idx out of range"):
        store.commit(torch.tensor([7]), torch.tensor([0]))


@pytest.mark.parametrize("path", ["host", "tensor", "device_core"])
def test_refresh_steps_samples_against_the_counts_of_the_last_refresh(path):
    """LCCNConfig.refresh_steps = n: after the warm-up Eq. 7 reads
    phi = (C + alpha) / rowsum of the counts at the last refresh, taken at the first step
    after the warm-up and every n steps after it (the paper's code's freq_trans), not the
    current counts; conditional() reads the same phi. The three paths: the compiled host
    kernel, the tensor one and the device core (what torch.compile captures, run eagerly
    here). A labeler made again mid-run (a resume) refreshes at its first step."""
    from pipeline.core.sampler import gibbs_draw

    gen = torch.Generator().manual_seed(5)
    k, n, warm, every, alpha = 4, 600, 2, 3, 0.5
    y = torch.randint(0, k, (n,), generator=gen)
    obs = torch.where(torch.rand(n, generator=gen) < 0.3, torch.randint(0, k, (n,),
                                                                        generator=gen), y)
    probs = torch.softmax(torch.randn(n, k, generator=gen, dtype=torch.float64) * 2, 1)
    store = ConfusionStore(obs, initial_assignment(obs, mode="observed"), k, k)
    cfg = LCCNConfig(alpha=alpha, warmup_steps=warm, refresh_steps=every, commit_every=1)

    def make(step_count=0):
        lab = GibbsLabeler(cfg, store, store.counts, store.version,
                           phi_init=smoothed_identity(k, k), max_steps=1, generator=gen)
        lab._host = lab._host and path == "host"
        if path == "device_core":
            lab._draw = gibbs_draw
        lab.step_count = step_count
        lab.seq = store.last_seq.get(lab.worker, -1) + 1  # as LocalChain resumes it
        return lab

    labeler = make()
    batches = list(torch.randperm(n, generator=gen).split(50))
    labeler.prefetch(batches[0])
    phi, taken = None, []
    for s, (b, nxt) in enumerate(zip(batches, batches[1:] + [None])):
        if s == 7:  # a resume: a new labeler continues the step count
            labeler = make(step_count=s)
            labeler.prefetch(b)
        now = store.counts.to(torch.float64)
        current = (now + alpha) / (now + alpha).sum(1, keepdim=True)
        if s >= warm and (s - (warm if s < 7 else 7)) % every == 0:  # 7: the resume
            phi = current
        cond = labeler.conditional(obs[b], b)
        z, stats = labeler.sample(probs[b], obs[b], b)
        if s < warm:
            expect_cond = smoothed_identity(k, k).T[obs[b]]
        else:
            expect_cond = phi.T[obs[b]]
            taken.append(labeler._phi_snap_step)
        torch.testing.assert_close(cond, expect_cond, msg=lambda m: f"step {s}: {m}")
        expect = probs[b] * expect_cond
        torch.testing.assert_close(stats.posterior.cpu(), expect / expect.sum(1, keepdim=True))
        labeler.commit(b, z, nxt)
    # refreshed at 2, 5 and (the resume) 7, 10; the counts moved in between
    assert sorted(set(taken)) == [2, 5, 7, 10]
    assert store.duplicates == 0 and store.steps == len(batches)
    store.check()
    with pytest.raises(ValueError, match="refresh_steps must be an integer >= 1"):
        LCCNConfig(refresh_steps=0)
