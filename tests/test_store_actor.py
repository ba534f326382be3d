"""The confusion actor's fences and counters: every call that reads or writes C and z is
refused after the actor restarted (in-process and on a real local Ray), a checkpoint is
never written from a reset chain, and the counters survive a restart in the checkpoint."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig
from pipeline.dist_worker import DistConfig, LocalSession, load_state, run_worker
from pipeline.ray_train import initial_assignment_placeholder
from pipeline.store_actor import FenceError, LocalStoreClient, StoreActor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "jobs"))
import quickstart_ray  # noqa: E402


def _args(n=12, k=3):
    observed = torch.arange(n) % k
    return (observed, observed.clone(), k, k)


def _restart(store: StoreActor) -> None:
    """What Ray does when the actor process dies: a new object from the constructor args."""
    store.__init__(*_args(len(store), store.num_classes))


@pytest.mark.parametrize("call", ["check_state", "snapshot", "sync", "get_meta", "set_meta",
                                  "commit"])
def test_every_chain_call_is_refused_after_a_restart(call):
    store = StoreActor(*_args())
    client = LocalStoreClient(store)
    client.open(None)
    client.commit(torch.tensor([0, 1]), torch.tensor([2, 2]), worker="w", seq=0)
    assert client.check_state()["version"] == 1
    _restart(store)
    args = {"check_state": (), "snapshot": (), "get_meta": ("k",), "set_meta": ("k", 1),
            "sync": (torch.tensor([0]),),
            "commit": (torch.tensor([0]), torch.tensor([1]))}[call]
    kwargs = {"sync": {"since": 0}, "commit": {"worker": "w", "seq": 1}}.get(call, {})
    with pytest.raises(FenceError, match=f"{call} with fence .* refused.*restarted"):
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
        store.step(torch.tensor([seq]), torch.tensor([1]), torch.tensor([0]), since=0,
                   worker="w", seq=seq, fence=fence)
    store.commit(torch.tensor([0]), torch.tensor([1]), worker="w", seq=4, fence=fence)  # retry
    saved = store.check_state()
    assert saved["counters"]["calls"] == 5 and saved["counters"]["duplicates"] == 1
    _restart(store)
    with pytest.raises(FenceError):  # the running group's next commit, refused
        store.step(torch.tensor([6]), torch.tensor([1]), torch.tensor([0]), since=0,
                   worker="w", seq=5, fence=fence)
    fence = store.open(saved)
    st = store.stats()
    assert (st["calls"], st["duplicates"], st["opened"], st["refused"], st["restored"]) == \
        (6, 1, 2, 1, 1)
    # a worker-group restart with the actor alive keeps the live (larger) counts
    store.step(torch.tensor([7]), torch.tensor([1]), torch.tensor([0]), since=0, worker="x",
               seq=0, fence=fence)
    store.open(saved)
    st = store.stats()
    assert (st["calls"], st["opened"], st["restored"]) == (7, 3, 1)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from pipeline.ray_train import init_ray

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
    from pipeline.store_actor import ActorStoreClient, create_store_actor

    obs, z0, k, _ = _args(40, 4)
    handle = create_store_actor("fence-test", obs, z0, k, k)
    client = ActorStoreClient(handle)
    client.open(None)
    for seq in range(3):
        client.resolve(client.step(torch.tensor([seq]), torch.tensor([3]), torch.tensor([0]),
                                   since=0, worker="w", seq=seq))
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
    from pipeline.ray_train import NonFiniteError, stop_on_non_finite
    from pipeline.sampler import gibbs_step

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
