"""The Gibbs step of Eq. 7 against a slow, obvious loop oracle, and its statistics."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.core.sampler import (
    anneal_gamma,
    conditional_transition,
    gibbs_posterior,
    gibbs_step,
    sample_categorical,
)


def oracle_posterior(probs, observed, z_old, counts, alpha, *, gamma=1.0, counted=None):
    """Eq. 7 written out sample by sample, exactly as in the paper."""
    m, k_latent = probs.shape
    k = counts.shape[1]
    # one prior for every latent row (scalar or (K,)) or a prior per row (K_latent, K)
    alpha = torch.as_tensor(alpha, dtype=torch.float64).expand(k_latent, k)
    out = torch.zeros(m, k_latent, dtype=torch.float64)
    for i in range(m):
        c = counts.to(torch.float64).clone()
        j = int(observed[i])
        if counted is None or bool(counted[i]):
            c[int(z_old[i]), j] -= 1  # its own count only
        for kk in range(k_latent):
            a = alpha[kk]
            cond = (a[j] + c[kk, j]) / sum(a[jj] + c[kk, jj] for jj in range(k))
            out[i, kk] = (float(probs[i, kk]) * cond) ** gamma
        out[i] /= out[i].sum()
    return out


def random_state(gen, *, m=16, k=5, k_latent=None, n_per_cell=3):
    k_latent = k_latent or k
    probs = torch.softmax(torch.randn(m, k_latent, generator=gen, dtype=torch.float64) * 2, 1)
    observed = torch.randint(0, k, (m,), generator=gen)
    z_old = torch.randint(0, k_latent, (m,), generator=gen)
    counts = torch.randint(0, n_per_cell, (k_latent, k), generator=gen)
    # every batch sample holds its own count in C
    counts.index_put_((z_old, observed), torch.ones(m, dtype=torch.int64), accumulate=True)
    return probs, observed, z_old, counts


@pytest.mark.parametrize("alpha", [1.0, 0.05, [0.5, 1.0, 2.0, 0.1, 3.0], "per-row"])
@pytest.mark.parametrize("gamma", [1.0, 0.6])
@pytest.mark.parametrize("k_latent", [5, 6])
def test_posterior_matches_loop_oracle(alpha, gamma, k_latent):
    gen = torch.Generator().manual_seed(1)
    if alpha == "per-row":  # LCCNConfig.prior_strength: alpha_kj, a Dirichlet prior per row
        alpha = torch.rand(k_latent, 5, generator=torch.Generator().manual_seed(3),
                           dtype=torch.float64) * 20 + 0.1
    probs, observed, z_old, counts = random_state(gen, k_latent=k_latent)
    counted = torch.rand(16, generator=gen) > 0.3
    got = gibbs_posterior(probs, observed, z_old, counts, alpha, gamma=gamma,
                          counted=counted)
    want = oracle_posterior(probs, observed, z_old, counts, alpha, gamma=gamma, counted=counted)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_own_count_removal_changes_the_conditional():
    """A sample alone in its cell: removing its count must zero that cell's evidence."""
    counts = torch.tensor([[1, 0], [0, 5]])
    observed, z_old = torch.tensor([0]), torch.tensor([0])
    cond = conditional_transition(observed, z_old, counts, 1e-3)
    # C¬[0, 0] = 0 -> (α + 0) / (2α + 0) = 0.5; without removal it would be ~1
    assert cond[0, 0] == pytest.approx(0.5)
    assert cond[0, 1] == pytest.approx(1e-3 / (2e-3 + 5))


def assert_draws_follow(z, p, reps):
    """``z`` holds ``reps`` draws for each row of ``p (M, K)`` (rows repeated in order): each
    cell's frequency lies within 5 standard errors of a binomial proportion of ``p``."""
    m = p.shape[0]
    freq = torch.zeros_like(p)
    freq.index_put_((torch.arange(m).repeat(reps), z), torch.ones(z.numel(), dtype=torch.float64),
                    accumulate=True)
    freq /= reps
    se = torch.sqrt(p * (1 - p) / reps)
    assert ((freq - p).abs() <= 5 * se + 1e-4).all(), (freq, p)


def test_empirical_draws_match_the_posterior():
    gen = torch.Generator().manual_seed(2)
    probs, observed, z_old, counts = random_state(gen, m=4, k=4)
    p = oracle_posterior(probs, observed, z_old, counts, 1.0)
    reps = 40_000
    z = gibbs_step(probs.repeat(reps, 1), observed.repeat(reps), z_old.repeat(reps), counts, 1.0,
                   generator=torch.Generator().manual_seed(3))
    assert_draws_follow(z, p, reps)


def test_generator_makes_draws_reproducible():
    gen = torch.Generator().manual_seed(4)
    probs, observed, z_old, counts = random_state(gen, m=64)
    a = gibbs_step(probs, observed, z_old, counts, 1.0, generator=torch.Generator().manual_seed(9))
    b = gibbs_step(probs, observed, z_old, counts, 1.0, generator=torch.Generator().manual_seed(9))
    c = gibbs_step(probs, observed, z_old, counts, 1.0, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_warmup_phi_replaces_the_conditional():
    gen = torch.Generator().manual_seed(5)
    probs, observed, z_old, counts = random_state(gen, m=8, k=3)
    phi = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.6, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    got = gibbs_posterior(probs, observed, z_old, counts, 1.0, phi=phi)
    want = probs * phi[:, observed].T
    torch.testing.assert_close(got, want / want.sum(1, keepdim=True))


def test_sample_categorical_respects_zero_probabilities():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], dtype=torch.float64).repeat(500, 1)
    z = sample_categorical(p, generator=torch.Generator().manual_seed(0))
    assert (z[0::2] == 1).all()
    assert set(z[1::2].tolist()) == {0, 2}


def test_anneal_schedule():
    assert anneal_gamma(0, 100) == 1.0
    assert anneal_gamma(50, 100) == pytest.approx(math.exp(-0.4))
    assert anneal_gamma(100, 100) == 0.5  # floor: exp(-0.8) = 0.449 < 0.5
    with pytest.raises(ValueError, match="max_step"):
        anneal_gamma(1, 0)


@pytest.mark.parametrize("bad, match", [
    (dict(alpha=0.0), "alpha"),
    (dict(alpha=-1.0), "alpha"),
    (dict(alpha=[1.0, 1.0]), r"alpha must be a scalar or have shape \(5,\)"),
    (dict(observed=torch.tensor([0] * 15 + [7])), r"observed labels must lie in \[0, 5\)"),
    (dict(z_old=torch.tensor([0] * 15 + [9])), r"z_old must lie in \[0, 5\)"),
    (dict(probs=torch.full((16, 4), 0.25, dtype=torch.float64)), "4 latent classes"),
    (dict(observed=torch.tensor([0, 1])), r"observed and z_old must be \(16,\)"),
    (dict(gamma=0.0), "gamma"),
])
def test_bad_input_is_named(bad, match):
    gen = torch.Generator().manual_seed(6)
    probs, observed, z_old, counts = random_state(gen)
    args = dict(probs=probs, observed=observed, z_old=z_old, counts=counts, alpha=1.0, gamma=1.0)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        gibbs_step(args["probs"], args["observed"], args["z_old"], args["counts"], args["alpha"],
                   gamma=args["gamma"], generator=gen)


# -- the device core (gibbs_draw): what a GPU worker runs, compiled or not ------------------


@pytest.mark.parametrize("gamma", [1.0, 0.6])
@pytest.mark.parametrize("warm", [False, True])
def test_device_core_is_the_eager_step(gamma, warm):
    """gibbs_draw with the uniforms sample_categorical would draw gives the loop oracle's
    posterior and the eager path's labels, for the counts and the warm-up phi alike."""
    from pipeline.core.confusion import as_alpha
    from pipeline.core.sampler import gibbs_draw

    gen = torch.Generator().manual_seed(4)
    probs, observed, z_old, counts = random_state(gen, m=64, k=5)
    phi = torch.softmax(torch.randn(5, 5, generator=gen, dtype=torch.float64), 1) if warm else None
    u = torch.rand(64, 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    post, z, changed = gibbs_draw(probs, observed, z_old, counts, as_alpha(1.0, 5),
                                  torch.tensor(gamma, dtype=torch.float64), u, phi)
    ref = gibbs_posterior(probs, observed, z_old, counts, 1.0, gamma=gamma, phi=phi)
    if not warm:
        torch.testing.assert_close(post, oracle_posterior(probs, observed, z_old, counts, 1.0,
                                                          gamma=gamma), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post, ref, rtol=1e-12, atol=1e-14)
    want = sample_categorical(ref, generator=torch.Generator().manual_seed(9))
    assert torch.equal(z, want)
    assert float(changed) == pytest.approx(float((want != z_old).float().mean()))


def test_compiled_device_core_draws_from_eq7():
    """torch.compile(gibbs_draw), as a GPU worker runs it with PerfConfig.compile (here on
    the CPU): the empirical law of its draws matches the loop oracle within 5 standard
    errors per cell."""
    from pipeline.core.confusion import as_alpha
    from pipeline.core.sampler import gibbs_draw

    gen = torch.Generator().manual_seed(2)
    probs, observed, z_old, counts = random_state(gen, m=4, k=4)
    p = oracle_posterior(probs, observed, z_old, counts, 1.0)
    reps = 40_000
    u = torch.rand(4 * reps, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    draw = torch.compile(gibbs_draw)
    post, z, _ = draw(probs.repeat(reps, 1), observed.repeat(reps), z_old.repeat(reps), counts,
                      as_alpha(1.0, 4), torch.tensor(1.0, dtype=torch.float64), u)
    torch.testing.assert_close(post[:4], p, rtol=1e-9, atol=1e-12)
    assert_draws_follow(z, p, reps)


# -- the host kernel (gibbs_draw_host): what a CPU worker's labeler runs --------------------


@pytest.mark.parametrize("gamma", [1.0, 0.6])
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("k_latent", [5, 6])
@pytest.mark.parametrize("per_row", [False, True])
def test_host_kernel_is_the_eager_step(gamma, warm, k_latent, per_row):
    """gibbs_draw_host with the uniforms sample_categorical would draw gives the eager
    posterior to rounding and the same labels, with counted masks and the warm-up phi."""
    from pipeline.core.confusion import as_alpha
    from pipeline.core.sampler import gibbs_draw_host

    gen = torch.Generator().manual_seed(4)
    probs, observed, z_old, counts = random_state(gen, m=64, k=5, k_latent=k_latent)
    probs = probs.float()  # what the labeler takes from a model
    counted = torch.rand(64, generator=gen) > 0.2
    phi = (torch.softmax(torch.randn(k_latent, 5, generator=gen, dtype=torch.float64), 1)
           if warm else None)
    alpha = as_alpha([0.5, 1.0, 2.0, 0.1, 3.0], 5)
    if per_row:  # a prior per latent row (LCCNConfig.prior_strength)
        alpha = alpha + 30.0 * torch.softmax(torch.randn(k_latent, 5, generator=gen,
                                                         dtype=torch.float64), 1)
    u = torch.rand(64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    post, z, moved = gibbs_draw_host(probs.numpy(), observed.numpy(), z_old.numpy(),
                                     counts.numpy(), alpha.numpy(), u.numpy(), gamma=gamma,
                                     phi=None if phi is None else phi.numpy(),
                                     counted=counted.numpy())
    ref = gibbs_posterior(probs, observed, z_old, counts, alpha, gamma=gamma, phi=phi,
                          counted=counted)
    torch.testing.assert_close(torch.from_numpy(post), ref, rtol=1e-12, atol=1e-14)
    want = sample_categorical(ref, generator=torch.Generator().manual_seed(9))
    assert torch.equal(torch.from_numpy(z), want)
    assert moved == int((want != z_old).sum())


def test_host_kernel_draws_from_eq7_and_names_bad_labels():
    from pipeline.core.confusion import as_alpha
    from pipeline.core.sampler import gibbs_draw_host

    gen = torch.Generator().manual_seed(2)
    probs, observed, z_old, counts = random_state(gen, m=4, k=4)
    p = oracle_posterior(probs, observed, z_old, counts, 1.0)
    reps = 40_000
    u = torch.rand(4 * reps, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a = as_alpha(1.0, 4).numpy()
    post, z, _ = gibbs_draw_host(probs.repeat(reps, 1).numpy(), observed.repeat(reps).numpy(),
                                 z_old.repeat(reps).numpy(), counts.numpy(), a, u.numpy())
    torch.testing.assert_close(torch.from_numpy(post[:4]), p, rtol=1e-10, atol=1e-12)
    assert_draws_follow(torch.from_numpy(z), p, reps)
    bad = observed.clone()
    bad[2] = -1
    with pytest.raises(ValueError, match=r"observed labels must lie in \[0, 4\), got range \[-1"):
        gibbs_draw_host(probs.numpy(), bad.numpy(), z_old.numpy(), counts.numpy(), a, u[:4].numpy())
    bad = z_old.clone()
    bad[0] = 4
    with pytest.raises(ValueError, match=r"z_old must lie in \[0, 4\), got range \[\d, 4\]"):
        gibbs_draw_host(probs.numpy(), observed.numpy(), bad.numpy(), counts.numpy(), a, u[:4].numpy())


def test_host_moves_equal_the_tensor_path():
    """apply_moves_host (the CPU labeler's own moves) leaves C and z as apply_delta_ on the
    counted, moved samples does, returns those moves, and names a bad index."""
    from pipeline.core.confusion import apply_delta_, apply_moves_host, count_matrix

    gen = torch.Generator().manual_seed(7)
    n, k, k_latent = 200, 4, 5
    observed = torch.randint(0, k, (n,), generator=gen)
    z = torch.randint(0, k_latent, (n,), generator=gen)
    counted = torch.rand(n, generator=gen) > 0.1
    counts = count_matrix(z, observed, k_latent, k, counted=counted)
    idx = torch.randperm(n, generator=gen)[:64]
    z_new = torch.randint(0, k_latent, (64,), generator=gen)
    c_ref, z_ref = counts.clone(), z.clone()
    keep = counted[idx]
    i, zn = idx[keep], z_new[keep]
    moved = z_ref[i] != zn
    apply_delta_(c_ref, observed[i][moved], z_ref[i][moved], zn[moved])
    z_ref[i] = zn
    obs, old, new = apply_moves_host(counts, z, observed, counted, idx, z_new)
    assert torch.equal(counts, c_ref) and torch.equal(z, z_ref)
    assert torch.equal(counts, count_matrix(z, observed, k_latent, k, counted=counted))
    assert torch.equal(obs, observed[i][moved]) and torch.equal(new, zn[moved])
    assert apply_moves_host(counts, z, observed, counted, idx, z[idx]) is None
    with pytest.raises(ValueError, match=r"sample index 200 outside \[0, 200\)"):
        apply_moves_host(counts, z, observed, counted, torch.tensor([3, 200]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"latent label 5 outside \[0, 5\)"):
        apply_moves_host(counts, z, observed, counted, idx[keep][:1], torch.tensor([5]))
