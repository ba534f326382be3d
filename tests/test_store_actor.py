"""The confusion actor's fences and counters: every call that reads or writes C and z is
refused after the actor restarted (in-process and on a real local Ray), a checkpoint is
never written from a reset chain, and the counters survive a restart in the checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig
from lccn_jobs import digits as quickstart_ray
from pipeline.cluster.ray_train import initial_assignment_placeholder
from pipeline.cluster.store_actor import FenceError, LocalStoreClient, StoreActor
from pipeline.cluster.worker import DistConfig, LocalSession, run_worker
from pipeline.train.checkpoints import load_state

REPO = Path(__file__).resolve().parents[1]


def _args(n=12, k=3):
    observed = torch.arange(n) % k
    return (observed, observed.clone(), k, k)


def _restart(store: StoreActor) -> None:
    """What Ray does when the actor process dies: a new object from the constructor args."""
    store.__init__(*_args(len(store), store.num_classes))


@pytest.mark.parametrize("call", ["check_state", "snapshot", "push", "get_meta", "set_meta",
                                  "commit"])
def test_every_chain_call_is_refused_after_a_restart(call):
    store = StoreActor(*_args())
    client = LocalStoreClient(store)
    client.open(None)
    client.commit(torch.tensor([0, 1]), torch.tensor([2, 2]), worker="w", seq=0)
    assert client.check_state()["version"] == 1
    _restart(store)
    args = {"check_state": (), "snapshot": (), "get_meta": ("k",), "set_meta": ("k", 1),
            "push": (torch.tensor([0]), torch.tensor([1])),
            "commit": (torch.tensor([0]), torch.tensor([1]))}[call]
    kwargs = {"push": {"since": 0, "worker": "w", "seq": 1},
              "commit": {"worker": "w", "seq": 1}}.get(call, {})
    what = "commit" if call == "push" else call  # a push is a commit
    with pytest.raises(FenceError, match=f"{what} with fence .* refused.*restarted"):
        getattr(client, call)(*args, **kwargs)
    assert store.refused == 1 and store.version == 0


def test_unfenced_in_process_calls_still_work():
    store = StoreActor(*_args())
    assert store.check_state()["version"] == 0
    assert store.snapshot()[1] == 0


class _DiesBeforeCheckpoint(LocalStoreClient):
    """A client whose actor 'dies and is restarted by Ray' right before the ``n``-th
    ``check_state``: between the checkpoint barrier and rank 0 reading the state."""

    def __init__(self, store: StoreActor, n: int) -> None:
        super().__init__(store)
        self.n, self.seen = n, 0

    def check_state(self) -> dict:
        self.seen += 1
        if self.seen == self.n:
            _restart_like(self.store)
        return super().check_state()


def _restart_like(store: StoreActor) -> None:
    store.__init__(store.observed.clone(), store.observed.clone(), store.k_latent,
                   store.num_classes, counted=store.counted.clone())


def test_checkpoint_after_actor_death_is_refused_not_reset(tmp_path):
    """Without the fence the 4th checkpoint would hold version 0 and z = observed (a reset
    chain that passes every invariant); with it the worker fails and nothing is saved."""
    train, test = quickstart_ray.write_digits_shards(tmp_path / "data", seed=0)
    view = quickstart_ray.digits_view(train, rate=0.4, seed=0)
    run = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn", in_channels=1),
                    optim=OptimConfig(epochs=2, pretrain_epochs=1, batch_size=128, lr=0.05),
                    lccn=LCCNConfig(warmup_steps=2))
    dist = DistConfig(run_name="fence", run_dir=str(tmp_path), train_source=str(train),
                      num_workers=1, loader_workers=0, shuffle_buffer=50, preset="digits",
                      checkpoint_every=4, tracking_uri=None)
    z0, counted = initial_assignment_placeholder(view, run)
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    session = LocalSession(tmp_path / "ckpt")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # epoch 0 (CE, 10 steps): checkpoints at steps 4, 8 and the epoch end; the 4th
        # check_state is the first one in LCCN epoch 1 (step 12)
        with pytest.raises(FenceError, match="check_state"):
            run_worker(run, dist, view, _DiesBeforeCheckpoint(store, 4), session)
    finally:
        torch.set_num_threads(old)
    saved = [load_state(c) for c in session.checkpoints()]
    assert [s["global_step"] for s in saved] == [4, 8, 10]
    assert all(s["store"]["version"] == 0 for s in saved)  # CE epochs commit nothing
    assert store.version == 0  # the restarted store: it must not have been checkpointed


def test_counters_survive_a_restart_through_the_checkpoint():
    store = StoreActor(*_args())
    fence = store.open(None)
    for seq in range(5):
        store.push(torch.tensor([seq]), torch.tensor([1]), since=0, worker="w", seq=seq,
                   fence=fence)
    store.commit(torch.tensor([0]), torch.tensor([1]), worker="w", seq=4, fence=fence)  # retry
    saved = store.check_state()
    assert saved["counters"]["calls"] == 5 and saved["counters"]["duplicates"] == 1
    _restart(store)
    with pytest.raises(FenceError):  # the running group's next commit, refused
        store.push(torch.tensor([6]), torch.tensor([1]), since=0, worker="w", seq=5,
                   fence=fence)
    fence = store.open(saved)
    st = store.stats()
    assert (st["calls"], st["duplicates"], st["opened"], st["refused"], st["restored"]) == \
        (6, 1, 2, 1, 1)
    # a worker-group restart with the actor alive keeps the live (larger) counts
    store.push(torch.tensor([7]), torch.tensor([1]), since=0, worker="x", seq=0, fence=fence)
    store.open(saved)
    st = store.stats()
    assert (st["calls"], st["opened"], st["restored"]) == (7, 3, 1)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from pipeline.cluster.ray_train import init_ray

    started = init_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.ray
def test_local_ray_listens_on_loopback_only(ray_local):
    """The local Ray a job starts (init_ray) binds no port on another interface."""
    import ipaddress

    import psutil

    if not ray_local.get_runtime_context().gcs_address.startswith("127.0.0.1:"):
        pytest.skip("connected to an existing Ray, not the local one this module started")
    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    listening = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(proc.name(), c.laddr.ip, c.laddr.port) for c in conns
                      if c.status == psutil.CONN_LISTEN]
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    open_ = [(n, ip, port) for n, ip, port in listening
             if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback]
    assert not open_, f"listening beyond loopback: {open_}"


@pytest.mark.ray
def test_real_actor_kill_fences_control_calls_and_keeps_counters(ray_local):
    """SIGKILL of the real actor (Ray restarts it empty): check_state and snapshot are
    refused, not answered with the fresh state; reopening from the checkpointed state
    brings back C, z, version and the counters."""
    from pipeline.cluster.store_actor import ActorStoreClient, create_store_actor

    obs, z0, k, _ = _args(40, 4)
    handle = create_store_actor("fence-test", obs, z0, k, k)
    client = ActorStoreClient(handle)
    client.open(None)
    for seq in range(3):
        client.resolve(client.push(torch.tensor([seq]), torch.tensor([3]), since=0,
                                   worker="w", seq=seq))
    saved = client.check_state()
    assert saved["version"] == 3 and saved["counters"]["calls"] == 3
    client.kill()
    deadline = time.monotonic() + 60  # ray.kill is asynchronous: wait for the new process
    fence = "old"
    while fence is not None:
        assert time.monotonic() < deadline, "the actor did not come back within 60 s"
        try:
            fence = ray_local.get(handle.get_fence.remote())
        except ray_local.exceptions.RayActorError:
            time.sleep(0.2)
    for call in (client.check_state, client.snapshot):
        with pytest.raises(FenceError, match="restarted"):
            call()
    client.open(saved)
    st = client.stats()
    assert st["version"] == 3 and st["calls"] == 3 and st["refused"] == 2
    assert st["restored"] == 1 and st["opened"] == 2
    assert torch.equal(client.check_state()["z"], saved["z"])
    ray_local.kill(handle, no_restart=True)


def test_non_finite_logits_stop_training_at_the_forward_pass():
    """A diverged model would otherwise hand NaN probabilities to the Gibbs step, which
    turns them into valid-looking labels and commits them."""
    from pipeline.core.sampler import gibbs_step
    from pipeline.cluster.ray_train import NonFiniteError, stop_on_non_finite

    nan = torch.full((4, 3), float("nan"))
    z = gibbs_step(nan, torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 2, 0]),
                   torch.full((3, 3), 5, dtype=torch.int64), 1.0,
                   generator=torch.Generator().manual_seed(0))
    assert z.dtype == torch.int64 and ((z >= 0) & (z < 3)).all()  # silent without the guard
    model = torch.nn.Linear(3, 3)
    stop_on_non_finite(model, rank=1)
    model(torch.ones(2, 3))  # finite: passes
    with pytest.raises(NonFiniteError, match="rank 1: 6 non-finite logits in forward pass 2"):
        model(torch.tensor([[float("nan"), 0.0, 0.0], [0.0, float("inf"), 0.0]]))


# -- the push protocol (LCCNConfig.commit_every > 1) ------------------------------------------


def _push_store(n=600, k=4, seed=0, trusted_every=0):
    g = torch.Generator().manual_seed(seed)
    observed = torch.randint(0, k, (n,), generator=g)
    counted = None
    if trusted_every:
        counted = torch.arange(n) % trusted_every != 0
    return StoreActor(observed, observed.clone(), k, k, counted=counted, log_capacity=64)


def _labelers(clients, n: int, *, seed: int = 0, trusted=None, clean=None):
    from pipeline.core.warmup import smoothed_identity
    from pipeline.train.labeler import GibbsLabeler

    clients[0].open(None)
    for c in clients[1:]:
        c.join()
    counts, version = clients[0].snapshot()
    k = counts.shape[0]
    cfg = LCCNConfig(commit_every=n, use_trusted=trusted is not None)
    return [GibbsLabeler(cfg, c, counts, version, phi_init=smoothed_identity(k, k),
                         max_steps=100, generator=torch.Generator().manual_seed(seed + r),
                         trusted=trusted, clean=clean, worker=f"r{r}.{c.fence[:8]}")
            for r, c in enumerate(clients)]


def _epoch(labelers, observed, epoch, *, batch=16, stop_after=None, drawn=None):
    """One epoch, each worker its own share of the samples, steps interleaved round-robin;
    every worker flushes at the end (the checkpoint barrier). Returns the steps taken."""
    n, w = observed.numel(), len(labelers)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(100 + epoch))
    batches = [[s[i:i + batch] for i in range(0, s.numel(), batch)]
               for s in (perm[r::w] for r in range(w))]
    for lab, b in zip(labelers, batches):
        lab.prefetch(b[0])
    steps = 0
    for i in range(max(len(b) for b in batches)):
        for r, lab in enumerate(labelers):
            if i >= len(batches[r]):
                continue
            idx = batches[r][i]
            g = torch.Generator().manual_seed(10_000 * epoch + 100 * i + r)
            probs = torch.softmax(3 * torch.randn(idx.numel(), lab.k_latent, generator=g), 1)
            z, _ = lab.sample(probs, observed[idx], idx)
            if drawn is not None:
                drawn[idx] = z
            lab.commit(idx, z, batches[r][i + 1] if i + 1 < len(batches[r]) else None)
            steps += 1
            if stop_after is not None and steps == stop_after:
                return steps
    for lab in labelers:
        lab.flush()
    return steps


@pytest.mark.parametrize("trusted_every", [0, 5])
def test_push_keeps_c_equal_to_recount_and_every_label_once(trusted_every):
    """Three workers, commit_every 4: after every epoch C equals the recount of z, z holds
    exactly the labels the workers drew (nothing lost, nothing from an older draw), each
    push is one version, and after the next epoch's prefetch every replica equals C."""
    store = _push_store(trusted_every=trusted_every)
    observed = store.observed
    trusted = clean = None
    if trusted_every:
        trusted, clean = ~store.counted, observed.clone()
    labelers = _labelers([LocalStoreClient(store) for _ in range(3)], 4, trusted=trusted,
                         clean=clean)
    drawn = store.z.clone()
    staleness = []
    for epoch in range(3):
        _epoch(labelers, observed, epoch, drawn=drawn)
        store.check()
        want = drawn if trusted is None else torch.where(trusted, store.z, drawn)
        assert torch.equal(store.z, want)
        staleness += [lab._staleness for lab in labelers]
    pushes = sum(lab.seq for lab in labelers) - 3 * 3  # less one empty pull per epoch
    assert store.version == pushes and store.duplicates == 0
    for lab in labelers:
        # own moves applied locally + the other workers' deltas = C, without a full copy
        lab._send()  # an empty push: a pull of the deltas since the replica's version
        lab._resolve(wait=True)
        assert torch.equal(lab.counts, store.counts)
        lab.prefetch(torch.arange(3))  # the next epoch starts from the store's exact z
        assert torch.equal(lab._z, store.z)
    assert max(staleness) > 0  # the other workers' steps arrive late, and are counted


def test_one_worker_samples_the_same_chain_for_any_commit_every():
    """Own moves reach the replica at once: one worker draws the same labels whether it
    calls the store every step or every 5 steps."""
    out = {}
    for n in (1, 5):
        store = _push_store()
        labelers = _labelers([LocalStoreClient(store)], n)
        drawn = store.z.clone()
        for epoch in range(3):
            _epoch(labelers, store.observed, epoch, drawn=drawn)
        store.check()
        out[n] = (drawn, store.z.clone(), store.counts.clone(), labelers[0].seq)
    assert torch.equal(out[1][0], out[5][0]) and torch.equal(out[1][1], out[5][1])
    assert torch.equal(out[1][2], out[5][2])
    assert out[5][3] < out[1][3] / 4  # ~5x fewer calls (plus one pull per epoch)


def test_host_kernels_and_the_tensor_path_sample_the_same_chain():
    """The CPU labeler's compiled host path (Eq. 7 and its own moves in one call each) and
    the tensor path an accelerator runs draw the same labels and leave the same C, trusted
    samples included, over three workers and two epochs."""
    out = {}
    for host in (True, False):
        store = _push_store(trusted_every=5)
        trusted, clean = ~store.counted, store.observed.clone()
        labelers = _labelers([LocalStoreClient(store) for _ in range(3)], 4, trusted=trusted,
                             clean=clean)
        for lab in labelers:
            assert lab._host  # K = 4 on the CPU with numba installed
            lab._host = host
        drawn = store.z.clone()
        for epoch in range(2):
            _epoch(labelers, store.observed, epoch, drawn=drawn)
        store.check()
        out[host] = (drawn, store.z.clone(), store.counts.clone())
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


class _ReplayingClient(LocalStoreClient):
    """Every push is delivered twice (a retry after a lost reply): the caller gets the
    retry's reply, as from a task Ray re-executed."""

    def push(self, *args, **kwargs):
        super().push(*args, **kwargs)
        return super().push(*args, **kwargs)


def test_replayed_pushes_are_applied_once():
    ref = _push_store()
    labelers = _labelers([LocalStoreClient(ref) for _ in range(2)], 3)
    for epoch in range(2):
        _epoch(labelers, ref.observed, epoch)
    store = _push_store()
    labelers = _labelers([_ReplayingClient(store) for _ in range(2)], 3)
    for epoch in range(2):
        _epoch(labelers, store.observed, epoch)
    store.check()
    pushes = sum(lab.seq for lab in labelers)
    assert store.duplicates == pushes - 2 * 2  # the empty pulls at each prefetch commit nothing
    assert store.version == ref.version
    assert torch.equal(store.z, ref.z) and torch.equal(store.counts, ref.counts)


def test_killed_worker_with_unsent_steps_and_a_late_push_from_its_group():
    """Checkpoint mid-epoch (all flushed), worker 1 dies with steps buffered but unsent,
    worker 0's next push (old fence) is refused; the group restarts from the checkpoint,
    redoes the epoch and the store holds exactly the restarted group's labels."""
    store = _push_store()
    observed = store.observed
    labelers = _labelers([LocalStoreClient(store) for _ in range(2)], 4)
    _epoch(labelers, observed, 0)
    saved = store.check_state()
    _epoch(labelers, observed, 1, stop_after=11)  # mid-epoch: both hold unsent steps
    assert all(lab._buf for lab in labelers) and store.version > saved["version"]
    dead = labelers[0]
    labelers = _labelers([LocalStoreClient(store) for _ in range(2)], 4, seed=7)  # restart
    store.open(saved)  # rank 0 restores the checkpoint (the helper opened once already)
    for lab in labelers:
        lab.store.join()
        lab.counts, lab.version = lab.store.snapshot()
        lab.worker = f"{lab.worker.split('.')[0]}.{lab.store.fence[:8]}"
    with pytest.raises(FenceError, match="commit with fence"):
        dead.flush()
    assert store.version == saved["version"]
    drawn = store.z.clone()
    _epoch(labelers, observed, 1, drawn=drawn)
    store.check()
    assert torch.equal(store.z, drawn)
    assert store.version == saved["version"] + sum(lab.seq for lab in labelers) - 2


@pytest.mark.parametrize("commit_every", [1, 4])
def test_push_is_refused_after_a_restart(commit_every):
    store = _push_store()
    client = LocalStoreClient(store)
    fence = client.open(None)
    client.push(torch.tensor([0, 1]), torch.tensor([2, 2]), since=0, worker="w", seq=0,
                steps=commit_every)
    _restart_like(store)
    with pytest.raises(FenceError, match="commit with fence .* refused.*restarted"):
        client.push(torch.tensor([2]), torch.tensor([1]), since=1, worker="w", seq=1)
    store.open(None)
    with pytest.raises(FenceError, match=f"commit with fence {fence[:8]} refused"):
        client.push(torch.tensor([2]), torch.tensor([1]), since=1, worker="w", seq=1)
    assert store.version == 0 and store.refused == 2


def test_push_packed_round_trips_and_packs_small():
    """The Ray client's wire format: int16 labels and moves, int32 counts, back to int64."""
    import numpy as np

    from pipeline.cluster.store_actor import unpack_sync

    a, b = _push_store(), _push_store()
    fa, fb = a.open(None), b.open(None)
    for store, fence in ((a, fa), (b, fb)):
        store.push(torch.tensor([0, 1, 2]), torch.tensor([3, 3, 3]), since=0, worker="x",
                   seq=0, fence=fence)
    want = a.push(torch.tensor([5, 6]), torch.tensor([1, 2]), since=0, worker="w", seq=0,
                  steps=2, full_z=True, fence=fa)
    packed = b.push_packed(np.array([5, 6]), np.array([1, 2]), since=0, worker="w", seq=0,
                           steps=2, full_z=True, fence=fb)
    assert packed[0].dtype == np.int16 and packed[2].dtype == np.int16
    got = unpack_sync(packed)
    assert got.version == want.version == 2 and got.others == want.others == 1
    for name in ("z", "delta_obs", "delta_old", "delta_new"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == torch.int64
    assert got.delta_obs.numel() == int((a.observed[:3] != 3).sum())  # only x's moves
    full = unpack_sync(b.push_packed(np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                                     since=-1, worker="w", seq=1, steps=0, fence=fb))
    assert full.counts.dtype == torch.int64 and torch.equal(full.counts, b.counts)
    assert b.version == 2  # an empty pull commits nothing


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_commit_every_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=f"commit_every must be an integer >= 1, got {bad!r}"):
        LCCNConfig(commit_every=bad)


@pytest.mark.ray
def test_push_over_a_real_actor_keeps_the_chain_and_is_fenced(ray_local):
    """Two labelers push through ActorStoreClient (packed int16/int32 arrays, replies taken
    when they have arrived): C == recount(z), z holds every drawn label, the replicas
    catch up exactly; after the actor is killed and reopened, a push is refused."""
    from pipeline.cluster.store_actor import ActorStoreClient, create_store_actor

    local = _push_store()
    handle = create_store_actor("push-test", local.observed, local.z, local.k_latent,
                                local.num_classes)
    labelers = _labelers([ActorStoreClient(handle) for _ in range(2)], 3)
    drawn = local.z.clone()
    for epoch in range(2):
        _epoch(labelers, local.observed, epoch, drawn=drawn)
    state = labelers[0].store.check_state()
    assert torch.equal(state["z"], drawn)
    assert state["steps"] == sum(len(range(0, 300, 16)) for _ in range(2)) * 2
    for lab in labelers:
        lab._send()
        lab._resolve(wait=True)
        assert torch.equal(lab.counts, state["counts"])
    labelers[0].store.kill()
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the actor did not come back within 60 s"
        try:
            if ray_local.get(handle.get_fence.remote()) is None:
                break
        except ray_local.exceptions.RayActorError:
            time.sleep(0.2)
    lab = labelers[1]
    lab._buf.append((torch.tensor([1]), torch.tensor([2])))
    with pytest.raises(FenceError, match="refused"):
        lab.flush()
    ray_local.kill(handle, no_restart=True)
