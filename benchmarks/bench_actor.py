"""How many training workers one confusion actor can serve.

The "push" protocol, the library's (``LCCNConfig.commit_every = n``), runs the real
``StoreActor``: each worker keeps z of its own samples (a disjoint share of the N, as in an
epoch) and sends the labels of n batches in one ``push_packed`` call, getting back the
other workers' moves since its version. Its rate is reported in samples/s (calls x n x
batch).

For comparison, the per-step protocol the library had before (:class:`StepStore`, defined
here): one ``ray.remote(StepStore)`` actor holds C (K x K) and z for N samples, and W
simulated Train workers call ``step`` back to back, once per batch: commit the batch just
sampled (``idx``, ``z_new``; a fraction ``--change`` of labels move), fetch ``z`` of the
next batch and every count delta since the worker's last version. The workers are
asyncio coroutines spread over a few client processes (Ray actors), so 32 workers do not
need 32 Python processes on a small machine.

Measured: commits/s the actor absorbs, client-side latency p50/p90/p99, request and reply
bytes per step, and the actor process's CPU use (a core near 100% = saturated). The
"naive" protocol (full C in every reply, ``since=-1``) shows why incremental sync matters
at K = 1000. The in-process cost of a call (no Ray) bounds what any actor could do.

    python benchmarks/bench_actor.py                 # the full table (~3 min on 2 cores)
    python benchmarks/bench_actor.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pickle
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from pipeline.core.confusion_store import ConfusionStore, Sync  # noqa: E402
from pipeline.cluster.store_actor import StoreActor  # noqa: E402


@dataclass(frozen=True)
class Load:
    num_samples: int
    num_classes: int
    batch: int
    change: float
    duration: float
    warmup: float
    naive: bool = False      # full C in every reply (since = -1) instead of deltas
    wire: str = "tensor"     # "tensor": the store as is; "numpy": numpy arrays on the wire;
                             # "echo": same payloads, canned reply, no store work (Ray's floor);
                             # "push": StoreActor.push_packed, commit_every batches per call
    commit_every: int = 1


class StepStore(ConfusionStore):
    """The per-step protocol (one call per batch), kept here to measure what ``push``
    saves: ``step`` commits a batch and returns ``z`` of the next one plus *every* count
    delta since the caller's version (its own included), or the whole C when the caller
    is out of the log (``since = -1``: the "naive" protocol)."""

    def sync(self, idx, *, since: int) -> Sync:
        idx = torch.as_tensor(idx, dtype=torch.int64)
        z, e = self.z[idx].clone(), torch.empty(0, dtype=torch.int64)
        if since == self.version:
            return Sync(z, self.version, e, e, e)
        oldest = self._log[0][0] if self._log else self.version + 1
        if since < 0 or since > self.version or since + 1 < oldest:
            return Sync(z, self.version, e, e, e, counts=self.counts.clone())
        parts = self._since(since)
        return Sync(z, self.version, *(torch.cat([p[i] for p in parts]) for i in (1, 2, 3)))

    def step(self, idx, z_new, next_idx, *, since: int, worker: str = "0", seq=None) -> Sync:
        self.commit(idx, z_new, worker=worker, seq=seq)
        return self.sync(next_idx, since=since)


class NumpyWireStore(StepStore):
    """The same store behind a numpy wire format: ``step_np`` takes and returns numpy
    arrays (Ray pickles a small torch tensor in ~100 us, a numpy array in ~4 us)."""

    def step_np(self, idx, z_new, next_idx, *, since: int, worker: str, seq: int):
        s = self.step(torch.from_numpy(idx), torch.from_numpy(z_new),
                      torch.from_numpy(next_idx), since=since, worker=worker, seq=seq)
        return (s.z.numpy(), s.version, s.delta_obs.numpy(), s.delta_old.numpy(),
                s.delta_new.numpy(), None if s.counts is None else s.counts.numpy())


class EchoStore(StepStore):
    """Ray's floor: ``step`` takes the same arguments and answers a canned reply of the same
    size (z of next_idx, ~``deltas`` moves) without touching C or z."""

    def step(self, idx, z_new, next_idx, *, since: int, worker: str = "0", seq=None) -> Sync:
        d = self._canned
        return Sync(self.z[:next_idx.numel()].clone(), self.version, d, d, d)

    def set_reply_deltas(self, n: int) -> None:
        self._canned = torch.zeros(n, dtype=torch.int64)


def make_store_args(load: Load, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """observed (N,) and z_init (N,) int64 for a store with ~60% of z = observed."""
    g = torch.Generator().manual_seed(seed)
    k = load.num_classes
    observed = torch.randint(0, k, (load.num_samples,), generator=g)
    z0 = torch.where(torch.rand(load.num_samples, generator=g) < 0.6, observed,
                     torch.randint(0, k, (load.num_samples,), generator=g))
    return observed, z0


@ray.remote(num_cpus=0)
class Clients:
    """Hosts several simulated workers as coroutines; each loops on ``store.step``."""

    async def run(self, store, worker_ids: list[int], load: Load, version: int,
                  start_at: float, tag: str) -> dict:
        torch.set_num_threads(1)
        results = await asyncio.gather(*(self._worker(store, w, load, version, start_at, tag)
                                         for w in worker_ids))
        return {"lat": np.concatenate([r[0] for r in results]),
                "done": sum(r[1] for r in results),
                "req_bytes": [b for r in results for b in r[2]],
                "reply_bytes": [b for r in results for b in r[3]],
                "deltas": [d for r in results for d in r[4]]}

    async def _pusher(self, store, wid: int, workers: int, load: Load, fence: str,
                      start_at: float, tag: str):
        """A worker of the push protocol: ``commit_every`` batches of its own samples per
        call; its own copy of their z; the other workers' moves come back."""
        rng = np.random.default_rng([1000 + wid, int(tag.lstrip("p"))])
        n, k, b, pool = load.num_samples, load.num_classes, load.batch, 64
        mine = np.arange(wid, n, workers, dtype=np.int64)        # a disjoint share of N
        per_call = b * load.commit_every
        idxs = [rng.choice(mine, min(per_call, mine.size), replace=False) for _ in range(pool)]
        worker = f"{tag}-{wid}"
        reply = await store.push_packed.remote(np.empty(0, np.int64), np.empty(0, np.int64),
                                               since=-1, worker=worker, seq=0, steps=0,
                                               full_z=True, fence=fence)
        z_local, version = reply[0].astype(np.int64), reply[1]
        while time.time() < start_at:
            await asyncio.sleep(0.001)
        t_measure = start_at + load.warmup
        t_end = t_measure + load.duration
        lat, done, req, rep, deltas = [], 0, [], [], []
        i = 0
        while True:
            now = time.time()
            if now >= t_end:
                break
            idx = idxs[i % pool]
            move = rng.random(idx.size) < load.change
            z_new = np.where(move, rng.integers(0, k, idx.size), z_local[idx])
            z_local[idx] = z_new
            t0 = time.perf_counter()
            reply = await store.push_packed.remote(idx, z_new, since=version, worker=worker,
                                                   seq=i + 1, steps=load.commit_every,
                                                   fence=fence)
            dt = time.perf_counter() - t0
            version = reply[1]
            i += 1
            if now >= t_measure and time.time() <= t_end:
                lat.append(dt)
                done += 1
                if done <= 16:
                    req.append(len(pickle.dumps((idx, z_new))))
                    rep.append(len(pickle.dumps(reply)))
                    deltas.append(reply[2].size)
        return np.asarray(lat), done, req, rep, deltas

    async def run_push(self, store, worker_ids: list[int], workers: int, load: Load,
                       fence: str, start_at: float, tag: str) -> dict:
        torch.set_num_threads(1)
        results = await asyncio.gather(*(self._pusher(store, w, workers, load, fence,
                                                      start_at, tag) for w in worker_ids))
        return {"lat": np.concatenate([r[0] for r in results]),
                "done": sum(r[1] for r in results),
                "req_bytes": [b for r in results for b in r[2]],
                "reply_bytes": [b for r in results for b in r[3]],
                "deltas": [d for r in results for d in r[4]]}

    async def _worker(self, store, wid: int, load: Load, version: int, start_at: float,
                      tag: str):
        # fresh draws per measurement: replaying a sequence the store already applied
        # would move nothing
        rng = np.random.default_rng([1000 + wid, int(tag.lstrip("p"))])
        gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
        n, k, b, pool = load.num_samples, load.num_classes, load.batch, 64
        # the batches' idx are built up front, so the client spends its CPU on the calls
        idxs = [torch.from_numpy(rng.choice(n, b, replace=False).astype(np.int64))
                for _ in range(pool)]
        numpy_wire = load.wire == "numpy"
        if numpy_wire:
            idxs = [i.numpy() for i in idxs]
        sync = await store.sync.remote(torch.as_tensor(idxs[0]), since=version)
        version, z_old = sync.version, sync.z
        if numpy_wire:
            z_old = z_old.numpy()
        while time.time() < start_at:            # all workers start together
            await asyncio.sleep(0.001)
        t_measure = start_at + load.warmup
        t_end = t_measure + load.duration
        lat, done, req, rep, deltas = [], 0, [], [], []
        i = 0
        while True:
            now = time.time()
            if now >= t_end:
                break
            idx, nxt = idxs[i % pool], idxs[(i + 1) % pool]
            move = torch.rand(b, generator=gen) < load.change
            z_new = torch.where(move, torch.randint(0, k, (b,), generator=gen),
                                torch.as_tensor(z_old))
            since = -1 if load.naive else version
            if numpy_wire:
                z_new = z_new.numpy()
                t0 = time.perf_counter()
                reply = await store.step_np.remote(idx, z_new, nxt, since=since,
                                                   worker=f"{tag}-{wid}", seq=i)
                dt = time.perf_counter() - t0
                z_next, version, n_delta = reply[0], reply[1], reply[2].size
            else:
                t0 = time.perf_counter()
                reply = await store.step.remote(idx, z_new, nxt, since=since,
                                                worker=f"{tag}-{wid}", seq=i)
                dt = time.perf_counter() - t0
                z_next, version, n_delta = reply.z, reply.version, reply.delta_obs.numel()
            i += 1
            if now >= t_measure and time.time() <= t_end:
                lat.append(dt)
                done += 1
                if done <= 16:   # a sample of payload sizes, outside the timed region
                    req.append(len(pickle.dumps((idx, z_new, nxt))))
                    rep.append(len(pickle.dumps(reply)))
                    deltas.append(n_delta)
            z_old = z_next
        return np.asarray(lat), done, req, rep, deltas


def actor_cpu_seconds(actor) -> float:
    """CPU seconds (all threads) of an actor's process so far."""
    return ray.get(actor.__ray_call__.remote(lambda self: time.process_time()))


ZERO_COPY_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}


def protocol_name(load: Load, zero_copy: bool) -> str:
    if load.naive:
        return "full C"
    if load.wire == "push":
        return f"push, commit_every {load.commit_every}"
    name = {"tensor": "deltas", "numpy": "deltas, numpy wire",
            "echo": "Ray floor (echo)"}[load.wire]
    return name + (", zero-copy" if zero_copy else "")


class Bench:
    """One store actor and its client processes, reused for every W of a (K, protocol)."""

    def __init__(self, load: Load, *, client_procs: int, seed: int, zero_copy: bool) -> None:
        self.load, self.zero_copy = load, zero_copy
        observed, z0 = make_store_args(load, seed)
        env = {"runtime_env": ZERO_COPY_ENV} if zero_copy else {}
        cls = {"tensor": StepStore, "numpy": NumpyWireStore, "echo": EchoStore,
               "push": StoreActor}[load.wire]
        self.store = ray.remote(cls).options(num_cpus=0, **env).remote(
            observed, z0, load.num_classes, load.num_classes, log_capacity=4096)
        self.fence = ray.get(self.store.open.remote(None)) if load.wire == "push" else None
        self.procs = [Clients.options(**env).remote() for _ in range(client_procs)]
        ray.get([p.__ray_ready__.remote() for p in self.procs] +
                [self.store.__ray_ready__.remote()])
        # the actor's background CPU (Ray's threads), subtracted from its busy time
        c0, t0 = actor_cpu_seconds(self.store), time.time()
        time.sleep(0.5)
        self.idle_rate = (actor_cpu_seconds(self.store) - c0) / (time.time() - t0)
        self.points = 0

    def close(self) -> None:
        ray.get(self.store.check.remote())            # invariants still hold after the load
        dups = ray.get(self.store.__ray_call__.remote(lambda store: store.duplicates))
        if dups:
            raise RuntimeError(f"the store dropped {dups} commits as duplicates")
        for p in self.procs:
            ray.kill(p)
        ray.kill(self.store)

    def measure(self, workers: int) -> dict:
        """``workers`` simulated workers for ``load.duration`` s after ``load.warmup`` s."""
        load, store = self.load, self.store
        if load.wire == "echo":   # as many moves as W workers changing `change` of a batch
            ray.get(store.set_reply_deltas.remote(round(workers * load.batch * load.change)))
        version = ray.get(store.__ray_call__.remote(lambda s: s.version))
        procs = self.procs[:workers]
        groups = [list(range(i, workers, len(procs))) for i in range(len(procs))]
        self.points += 1
        start_at = time.time() + 0.5
        if load.wire == "push":
            futs = [p.run_push.remote(store, g, workers, load, self.fence, start_at,
                                      f"p{self.points}") for p, g in zip(procs, groups)]
        else:
            futs = [p.run.remote(store, g, load, version, start_at, f"p{self.points}")
                    for p, g in zip(procs, groups)]
        time.sleep(max(0.0, start_at + load.warmup - time.time()))
        cpu0, t0 = actor_cpu_seconds(store), time.time()
        outs = ray.get(futs)
        cpu1, t1 = actor_cpu_seconds(store), time.time()
        lat = np.concatenate([o["lat"] for o in outs]) * 1e3
        done = sum(o["done"] for o in outs)
        busy = (cpu1 - cpu0) - self.idle_rate * (t1 - t0)
        return {
            "K": load.num_classes, "W": workers, "protocol": protocol_name(load, self.zero_copy),
            "commits_s": done / load.duration,
            "samples_s": done * load.batch * load.commit_every / load.duration,
            "p50": float(np.percentile(lat, 50)), "p90": float(np.percentile(lat, 90)),
            "p99": float(np.percentile(lat, 99)),
            "req_B": float(np.mean([b for o in outs for b in o["req_bytes"]])),
            "reply_B": float(np.mean([b for o in outs for b in o["reply_bytes"]])),
            "deltas": float(np.mean([d for o in outs for d in o["deltas"]])),
            # the CPU window ends when the last client returns, a little after the measured one
            "actor_cpu": (cpu1 - cpu0) / max(t1 - t0, 1e-9),
            "cpu_per_commit_us": 1e6 * busy / max(done, 1),
        }


def inprocess_step_cost(load: Load, *, steps: int, seed: int) -> float:
    """Seconds per ``StepStore.step`` (per ``push`` of ``commit_every`` batches, with
    one other worker's push in the reply) called directly (no Ray)."""
    observed, z0 = make_store_args(load, seed)
    store = StepStore(observed, z0, load.num_classes, load.num_classes)
    rng = np.random.default_rng(seed)
    b, n, k = load.batch, load.num_samples, load.num_classes
    if load.wire == "push":
        b *= load.commit_every
        idxs = [torch.from_numpy(rng.choice(n, b, replace=False).astype(np.int64))
                for _ in range(steps)]
        zs = [torch.from_numpy(rng.integers(0, k, b)) for _ in range(steps)]
        versions = [0, 0]   # two workers taking turns: each reply carries the other's push
        t0 = time.perf_counter()
        for i in range(steps):
            s = store.push(idxs[i], zs[i], since=versions[i % 2], worker=str(i % 2), seq=i,
                           steps=load.commit_every)
            versions[i % 2] = s.version
        return (time.perf_counter() - t0) / steps
    idxs = [torch.from_numpy(rng.choice(n, b, replace=False).astype(np.int64))
            for _ in range(steps + 1)]
    zs = [torch.from_numpy(rng.integers(0, k, b)) for _ in range(steps)]
    version = 0
    t0 = time.perf_counter()
    for i in range(steps):
        s = store.step(idxs[i], zs[i], idxs[i + 1], since=-1 if load.naive else version,
                       worker="0", seq=i)
        version = s.version
    return (time.perf_counter() - t0) / steps


COLUMNS = ("| K | protocol | W | calls/s | samples/s | p50 ms | p90 ms | p99 ms | request B "
           "| reply B | deltas/reply | actor CPU | actor CPU/call |")


def fmt_row(r: dict) -> str:
    return (f"| {r['K']} | {r['protocol']} | {r['W']} | {r['commits_s']:.0f} | "
            f"{r['samples_s']:.0f} | "
            f"{r['p50']:.2f} | {r['p90']:.2f} | {r['p99']:.2f} | {r['req_B']:.0f} | "
            f"{r['reply_B']:.0f} | {r['deltas']:.0f} | {100 * r['actor_cpu']:.0f}% | "
            f"{r['cpu_per_commit_us']:.0f} us |")


def fmt_table(rows: list[dict]) -> str:
    return "\n".join([COLUMNS, "|" + "---|" * 13, *(fmt_row(r) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--classes", type=int, nargs="+", default=[50, 1000])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--naive-workers", type=int, nargs="+", default=[1, 4])
    p.add_argument("--wire-workers", type=int, nargs="+", default=[1, 8],
                   help="W for the wire-format comparison (at the largest K)")
    p.add_argument("--push-workers", type=int, nargs="+", default=[8, 16, 32],
                   help="W for the push protocol (each K)")
    p.add_argument("--commit-every", type=int, nargs="+", default=[8, 32],
                   help="batches per push call (LCCNConfig.commit_every) to measure")
    p.add_argument("--only-push", action="store_true",
                   help="measure the push protocol only (skip the per-step protocols)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--change", type=float, default=0.2,
                   help="fraction of each batch whose latent label is redrawn")
    p.add_argument("--duration", type=float, default=2.0, help="measured seconds per run")
    p.add_argument("--warmup-seconds", type=float, default=0.5,
                   help="unmeasured seconds before each run")
    p.add_argument("--repeats", type=int, default=2, help="runs per point, the best is kept")
    p.add_argument("--client-procs", type=int, default=1,
                   help="processes hosting the simulated workers")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--out", type=Path, default=None, help="write the markdown tables here")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.naive_workers, args.wire_workers = [1, 4], [1], [4]
        args.push_workers, args.commit_every = [4], [8]
        args.duration, args.warmup_seconds, args.repeats = 1.0, 0.5, 1

    torch.set_num_threads(1)
    from pipeline.cluster.ray_train import init_ray  # local Ray bound to 127.0.0.1

    init_ray(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    rows, base = [], {}

    def sweep(load: Load, ws: list[int], *, zero_copy: bool = False) -> None:
        bench = Bench(load, client_procs=args.client_procs, seed=args.seed, zero_copy=zero_copy)
        try:
            for w in ws:   # best of --repeats: other processes on the machine only slow it
                row = max((bench.measure(w) for _ in range(args.repeats)),
                          key=lambda r: r["commits_s"])
                rows.append(row)
                print(fmt_row(row), flush=True)
        finally:
            bench.close()

    load_before = os.getloadavg()
    print(COLUMNS)
    try:
        for k in args.classes:
            for naive in (() if args.only_push else (False, True)):
                load = Load(args.samples, k, args.batch, args.change, args.duration,
                            args.warmup_seconds, naive=naive)
                base[(k, protocol_name(load, False))] = inprocess_step_cost(
                    load, steps=200 if naive else 2000, seed=args.seed)
                sweep(load, args.naive_workers if naive else args.workers)
            for n in args.commit_every:
                load = Load(args.samples, k, args.batch, args.change, args.duration,
                            args.warmup_seconds, wire="push", commit_every=n)
                base[(k, protocol_name(load, False))] = inprocess_step_cost(
                    load, steps=500, seed=args.seed)
                sweep(load, args.push_workers)
        if not args.only_push:
            k = max(args.classes)
            load = Load(args.samples, k, args.batch, args.change, args.duration, args.warmup_seconds)
            sweep(load, args.wire_workers, zero_copy=True)
            sweep(dataclasses.replace(load, wire="numpy"), args.wire_workers)
            sweep(dataclasses.replace(load, wire="echo"), args.wire_workers)
    finally:
        ray.shutdown()

    summary = ["| K | protocol | store call in-process | peak calls/s via the actor "
               "| peak samples/s | at W | min actor CPU/call | calls/s per actor core "
               "(1 / CPU per call) |",
               "|---|---|---|---|---|---|---|---|"]
    for k in args.classes:
        for proto in dict.fromkeys(r["protocol"] for r in rows if r["K"] == k):
            sel = [r for r in rows if r["K"] == k and r["protocol"] == proto]
            best = max(sel, key=lambda r: r["samples_s"])
            cpu = min(r["cpu_per_commit_us"] for r in sel)
            cost = base.get((k, proto))
            cost = "-" if cost is None else f"{cost * 1e6:.0f} us"
            summary.append(f"| {k} | {proto} | {cost} | {best['commits_s']:.0f} | "
                           f"{best['samples_s']:.0f} | {best['W']} | {cpu:.0f} us | "
                           f"{1e6 / cpu:.0f} |")
    text = fmt_table(rows) + "\n\n" + "\n".join(summary) + "\n"
    print()
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, ray {ray.__version__}, "
          f"torch {torch.__version__}; ray.init(num_cpus={args.num_cpus}); load average "
          f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after (other processes "
          f"on the machine inflate the latencies)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
