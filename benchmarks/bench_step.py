"""Training-step time with and without the confusion actor (small CNN, CIFAR-sized batches).

Modes, each run through the real batch loop (``run_pass``: LCCN's ``GibbsTask``, CE's
``LabelTask``) and ``GibbsLabeler``:

  ce          plain cross-entropy step (no sampler)
  local       LCCN, ConfusionStore in this process (LCCNConfig.commit_every = n)
  push        LCCN, the real StoreActor in a Ray actor and ActorStoreClient
              (LCCNConfig.commit_every = n): the labeler applies its own moves at once and
              sends n steps' labels in one call, whose reply it takes once it has arrived
              (``--commit-every 1``: one call per step)

Reported per mode: step time, sampler time (Eq. 7 on the batch), sync time (time the step
spends on the store: the calls, and waiting for a reply), their share of
the step, and the step time over the CE step. Each measurement is one ``run_pass``
over ``--steps`` batches, which includes its epoch-boundary prefetch and flush (two
blocking round trips); modes are interleaved and, per mode, the repetition with the
shortest step time is kept (other processes on a small shared machine only ever add time).
"steady store ms/step" is the mean over steps of the labeler's time in ``commit`` (own
moves, buffering, the call every n steps) and in taking replies, away from the epoch
boundaries (the epoch-start pull of the whole z and C and the final flush left out).

With ``--ray-workers 2`` two Ray actors (one torch thread each) train side by side against
one store actor, as two Train workers would (no DDP gradient sync), each on its own half of
the samples (as in an epoch of a real run).

    python benchmarks/bench_step.py                      # K = 10 and K = 1000, in-process
    python benchmarks/bench_step.py --ray-workers 2      # adds the two-worker run
    python benchmarks/bench_step.py --commit-every 1     # one store call per step
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from pipeline.core.batch import Batch  # noqa: E402
from pipeline.core.config import LCCNConfig  # noqa: E402
from pipeline.core.confusion_store import ConfusionStore  # noqa: E402
from pipeline.core.options import add_options
from pipeline.core.warmup import smoothed_identity  # noqa: E402
from pipeline.cluster.store_actor import ActorStoreClient, StoreActor  # noqa: E402
from pipeline.train.labeler import GibbsLabeler  # noqa: E402
from pipeline.train.loop import LabelTask, run_pass
from pipeline.train.methods.lccn import GibbsTask
from pipeline.train.models import build_model  # noqa: E402

from bench_data import DEFAULT_DATA  # noqa: E402  (this folder: the script's own)

MODES = ("ce", "local", "push")
WARMUP_STEPS = 8


class TimedLabeler(GibbsLabeler):
    """GibbsLabeler recording, per step, its time on the store away from the epoch
    boundaries: ``commit`` (own moves, buffering, a push every n steps) plus taking replies
    in ``sample``. ``per_step`` has one entry per step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.per_step: list[float] = []
        self._acc, self._outside = 0.0, True

    def prefetch(self, idx) -> None:
        self._outside = False
        try:
            super().prefetch(idx)
        finally:
            self._outside = True

    def flush(self) -> float:
        self._outside = False
        try:
            return super().flush()
        finally:
            self._outside = True

    def _resolve(self, wait: bool = False) -> float:
        t0 = time.perf_counter()
        out = super()._resolve(wait)
        if self._outside:
            self._acc += time.perf_counter() - t0
        return out

    def commit(self, idx, z_new, next_idx) -> None:
        t0 = time.perf_counter()
        self._outside = False   # a reply taken inside commit is counted with it
        try:
            super().commit(idx, z_new, next_idx)
        finally:
            self._outside = True
        self.per_step.append(self._acc + time.perf_counter() - t0)
        self._acc = 0.0


@dataclass(frozen=True)
class Setup:
    num_classes: int
    num_samples: int
    batch: int
    steps: int
    seed: int
    commit_every: int = 8


def load_images(kind: str, data: Path, count: int, *, seed: int) -> torch.Tensor:
    """``(count, 3, 32, 32)`` float: standard-normal noise, or the first CIFAR-10 training
    JPEGs of ``data/cifar10-jpeg.tar.gz`` scaled to [0, 1] and normalised per channel."""
    if kind == "random":
        return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    from PIL import Image
    path = data / "cifar10-jpeg.tar.gz"
    if not path.is_file():
        raise FileNotFoundError(f"--inputs cifar needs {path}; pass --data")
    out = []
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isfile() and "/train/" in f"/{member.name}" and member.name.endswith(".jpg"):
                img = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                out.append(torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()))
                if len(out) == count:
                    break
    x = torch.stack(out).permute(0, 3, 1, 2).float() / 255
    return (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), keepdim=True)


def make_labels(setup: Setup) -> torch.Tensor:
    g = torch.Generator().manual_seed(setup.seed)
    return torch.randint(0, setup.num_classes, (setup.num_samples,), generator=g)


class Runner:
    """A model, optimizer, batches and one labeler per LCCN mode; ``run(mode)`` trains
    ``setup.steps`` batches and returns run_pass's dict."""

    def __init__(self, setup: Setup, images: torch.Tensor, *, push_actor=None,
                 worker: int = 0, share: tuple[int, int] = (0, 1),
                 threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.setup = setup
        k = setup.num_classes
        self.model = build_model("small_cnn", k, seed=setup.seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.images = images
        self.observed = make_labels(setup)
        self.gen = torch.Generator().manual_seed(setup.seed + worker)
        self.worker = worker
        self.share = share   # (i, W): this worker trains on samples i, i + W, ...
        self.labelers: dict[str, GibbsLabeler] = {}
        cfg = LCCNConfig(commit_every=setup.commit_every)
        phi = smoothed_identity(k, k)
        max_steps = 10 * setup.steps
        if push_actor is None:  # in-process: the local store only
            store = ConfusionStore(self.observed, self.observed.clone(), k, k)
            self.labelers["local"] = TimedLabeler(
                cfg, store, store.counts, store.version, phi_init=phi, max_steps=max_steps,
                generator=torch.Generator().manual_seed(1), worker=str(worker))
        if push_actor is not None:
            client = ActorStoreClient(push_actor)
            client.join()
            counts, version = client.snapshot()
            self.labelers["push"] = TimedLabeler(
                cfg, client, counts, version,
                phi_init=phi, max_steps=max_steps,
                generator=torch.Generator().manual_seed(2 + worker), worker=f"{worker}-push")

    def batches(self, steps: int | None = None):
        s = self.setup
        i0, w = self.share
        mine = torch.arange(i0, s.num_samples, w)
        idx_all = mine[torch.randperm(mine.numel(), generator=self.gen)]
        pool = self.images.shape[0] // s.batch
        for i in range(s.steps if steps is None else steps):
            idx = idx_all[i * s.batch:(i + 1) * s.batch]
            p = i % pool
            yield Batch(self.images[p * s.batch:(p + 1) * s.batch], self.observed[idx], idx,
                        self.observed[idx], torch.ones(s.batch, dtype=torch.bool))

    def run(self, mode: str, steps: int | None = None) -> dict[str, float]:
        labeler = None if mode == "ce" else self.labelers[mode]
        known = self.setup.num_classes + 1
        task = (LabelTask(self.model, self.opt, known_below=known) if labeler is None else
                GibbsTask(self.model, self.opt, labeler=labeler, known_below=known))
        out = run_pass(task, self.batches(steps))
        out["store_p50"] = float("nan")
        if labeler is not None:   # most steps make no call: the mean
            out["store_p50"] = statistics.fmean(labeler.per_step)
            labeler.per_step.clear()
        return out


@ray.remote(num_cpus=1)
class RayWorker:
    """One simulated Train worker (own process, one torch thread)."""

    def __init__(self, setup: Setup, images: torch.Tensor, push_actor, worker: int,
                 share: tuple[int, int]) -> None:
        self.runner = Runner(setup, images, push_actor=push_actor, worker=worker, share=share,
                             threads=1)

    def run(self, mode: str, steps: int | None = None) -> dict[str, float]:
        return self.runner.run(mode, steps)


def summarise(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per mode, the repetition with the shortest step time; overhead vs CE."""
    out = {mode: dict(min(reps, key=lambda r: r["step_time"])) for mode, reps in results.items()}
    ce = out.get("ce", {}).get("step_time")
    for m in out.values():
        m["overhead"] = (m["step_time"] / ce - 1) if ce else float("nan")
    return out


def fmt(title: str, summary: dict[str, dict[str, float]]) -> str:
    lines = [f"**{title}**", "",
             "| mode | step ms | sampler ms | sync ms | (sampler + sync) / step | "
             "steady store ms/step (p50) | steady share | step vs CE | staleness |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, m in summary.items():
        p50 = m["store_p50"]
        steady = "-" if p50 != p50 else f"{1e3 * p50:.2f}"
        share = ("-" if p50 != p50 else
                 f"{100 * (m['sampler_time'] + p50) / m['step_time']:.1f}%")
        lines.append(f"| {mode} | {1e3 * m['step_time']:.1f} | {1e3 * m['sampler_time']:.2f} | "
                     f"{1e3 * m['sync_time']:.2f} | {100 * m['sampler_share']:.1f}% | "
                     f"{steady} | {share} | {100 * m['overhead']:+.1f}% | "
                     f"{m['staleness']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--inputs", choices=("random", "cifar"), default="random")
    p.add_argument("--classes", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--samples", type=int, nargs="+", default=[50_000, 100_000],
                   help="N per entry of --classes")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="batches per measurement")
    p.add_argument("--reps", type=int, default=4,
                   help="measurements per mode (the fastest is kept)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in this process (1 leaves a core to Ray and the actor)")
    p.add_argument("--ray-workers", type=int, default=0,
                   help="also run the push mode with this many Ray worker actors")
    add_options(p, ("--commit-every",), notes={"--commit-every": "of the LCCN modes"})
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="modes to measure (ce is always measured: the reference)")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the markdown tables here")
    args = p.parse_args(argv)
    if len(args.samples) != len(args.classes):
        raise SystemExit(f"--samples needs one value per --classes entry, got {args.samples} "
                         f"for {args.classes}")

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    images = load_images(args.inputs, args.data, 8 * args.batch, seed=args.seed)
    from pipeline.cluster.ray_train import init_ray  # local Ray bound to 127.0.0.1

    init_ray(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    tables = []
    try:
        for k, n in zip(args.classes, args.samples):
            setup = Setup(k, n, args.batch, args.steps, args.seed, args.commit_every)
            observed = make_labels(setup)
            push_actor = ray.remote(StoreActor).options(num_cpus=0).remote(
                observed, observed.clone(), k, k)
            ray.get(push_actor.open.remote(None))
            local = Runner(setup, images)
            remote = Runner(setup, images, push_actor=push_actor)
            remote.model, remote.opt = local.model, local.opt   # one model for all modes
            run = {"ce": local.run, "local": local.run, "push": remote.run}
            modes = ["ce", *(m for m in args.modes if m != "ce")]
            results: dict[str, list[dict]] = {m: [] for m in modes}
            for rep in range(args.reps + 1):          # rep 0 warms up and is dropped
                for mode in modes:
                    r = run[mode](mode, None if rep else WARMUP_STEPS)
                    if rep:
                        results[mode].append(r)
            title = (f"K = {k}, N = {n}, batch {args.batch}, commit_every "
                     f"{args.commit_every}, {args.steps} steps x "
                     f"{args.reps} reps, in-process, torch threads {torch.get_num_threads()}")
            tables.append(fmt(title, summarise(results)))
            print(tables[-1] + "\n", flush=True)

            if args.ray_workers:
                workers = [RayWorker.remote(setup, images, push_actor, 1 + i,
                                            (i, args.ray_workers))   # 0 = this process
                           for i in range(args.ray_workers)]
                results = {m: [] for m in modes if m != "local"}
                for rep in range(args.reps + 1):
                    for mode in results:
                        outs = ray.get([w.run.remote(mode, None if rep else WARMUP_STEPS)
                                        for w in workers])
                        if rep:
                            results[mode].extend(outs)
                for w in workers:
                    ray.kill(w)
                title = (f"K = {k}, commit_every {args.commit_every}: "
                         f"{args.ray_workers} Ray worker actors (1 torch thread each) "
                         f"sharing one store actor, per-worker figures")
                tables.append(fmt(title, summarise(results)))
                print(tables[-1] + "\n", flush=True)
            ray.get(push_actor.check.remote())            # C still equals the recount of z
            dups = ray.get(push_actor.__ray_call__.remote(lambda store: store.duplicates))
            if dups:
                raise RuntimeError(f"the store dropped {dups} commits as duplicates: two "
                                   f"labelers shared a worker id")
            ray.kill(push_actor)
    finally:
        ray.shutdown()
    footer = (f"machine: {platform.machine()}, {os.cpu_count()} cores, torch "
              f"{torch.__version__}, ray {ray.__version__}; inputs {args.inputs}; load average "
              f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(footer)
    if args.out is not None:
        args.out.write_text("\n\n".join(tables) + "\n\n" + footer + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
