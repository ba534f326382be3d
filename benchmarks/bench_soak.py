"""The soak: one long distributed run under repeated random kills, against uninterrupted runs.

The distributed quickstart (scikit-learn digits as shards, pair-flip noise 0.4, 2 Ray Train
workers on a local Ray, the confusion actor, checkpoints every 8 steps and at every epoch
end) as in ``bench_faults.py``, but long (``--run-epochs``) and with ``max_failures`` high
enough for every kill. While it trains, a killer thread waits a random 45-90 s
(``--every``), then SIGKILLs one Train worker or the confusion actor (an even draw), and
again, until the run ends. Recorded per kill: the time, the victim, the newest checkpoint
step on disk.

After it: C equals the recount of z (the final checkpoint's store, rebuilt and checked),
no commit lost or doubled (the steps the store applied against one per LCCN step and rank
plus the initial assignment, across every resume), and the final clean test accuracy
against uninterrupted runs of the same configuration with seeds ``--seeds`` (the first is
the soak's own seed): "within noise" means within the spread (max - min) of those runs of
the same-seed run.

    python benchmarks/bench_soak.py [--run-epochs 330] [--seeds 0 1 2]
        [--results benchmarks/results/soak.md]

``--smoke`` runs a short check of the machinery (8 epochs, kills every 15-25 s, one
uninterrupted run): not a soak.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_faults as faults  # noqa: E402

VICTIMS = {"worker": "ray::RayTrainWorker", "actor": "ray::StoreActor"}


class RandomKiller(threading.Thread):
    """Every ``uniform(*every)`` seconds, SIGKILL one Train worker or the store actor (an
    even draw from ``rng``) while the run trains; ``done`` lists what happened."""

    def __init__(self, root: Path, every: tuple[float, float], rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.root, self.every, self.rng = root, every, rng
        self.stop = threading.Event()
        self.done: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.raylet = faults.raylet_pid()  # only this Ray's processes are victims

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every)):
            victim = self.rng.choice(sorted(VICTIMS))
            pids = faults.ray_pids(VICTIMS[victim], under=self.raylet)
            if victim == "worker":
                pids = pids[-1:]
            at = time.perf_counter() - self.t0
            step = faults.newest_step(self.root)
            if not pids:  # between restarts: nothing of that kind alive now
                self.done.append({"t": at, "victim": victim, "pid": None, "step": step})
                continue
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.done.append({"t": at, "victim": victim, "pid": pid, "step": step})
                except ProcessLookupError:
                    self.done.append({"t": at, "victim": victim, "pid": None, "step": step})


def one_run(root: Path, name: str, *, seed: int, epochs: int, max_failures: int,
            killer_every: tuple[float, float] | None, rng: random.Random) -> dict[str, Any]:
    """One quickstart run (``bench_faults.train_run``) with a random killer when
    ``killer_every`` is given; adds the final clean test accuracy and the kills."""
    extra = ["--epochs", str(epochs), "--seed", str(seed), "--max-failures", str(max_failures)]
    killer = None
    if killer_every is not None:
        killer = RandomKiller(root / "train" / name, killer_every, rng)
        killer.start()
    try:
        out = faults.train_run(root, name, extra=extra)
    finally:
        if killer is not None:
            killer.stop.set()
            killer.join(timeout=5)
    out["kills"] = killer.done if killer is not None else []
    if out.get("ok"):
        from pipeline.train.checkpoints import load_state

        hist = load_state(out["result"]["checkpoint"])["history"]
        out["test_top1"] = float(hist[-1]["test_top1"])
        out["epochs_run"] = len(hist)
    return out


def describe(out: dict[str, Any]) -> dict[str, str]:
    if not out.get("ok"):
        return {"outcome": f"stopped with an error after {out['seconds']:.0f} s: {out['error']}"}
    return {
        "outcome": f"finished after {out['seconds']:.0f} s",
        "chain": "C == recount(z)" if out.get("chain_ok") else "BROKEN",
        "commits": faults.commit_line(out, out.get("stats") or {}),
        "test": f"{100 * out['test_top1']:.2f}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-epochs", type=int, default=330,
                   help="epochs of every run (1 of them CE): long enough that the soak "
                        "trains for 10 minutes or more on the machine")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="the uninterrupted runs; the first is also the soak's seed")
    p.add_argument("--every", type=float, nargs=2, default=(45.0, 90.0),
                   metavar=("MIN_S", "MAX_S"), help="seconds between kills, drawn uniformly")
    p.add_argument("--kill-seed", type=int, default=0, help="seed of the killer's draws")
    p.add_argument("--smoke", action="store_true",
                   help="8 epochs, kills every 15-25 s, one uninterrupted run")
    p.add_argument("--results", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.smoke:
        args.run_epochs, args.seeds, args.every = 8, args.seeds[:1], (15.0, 25.0)
    cmd = "python " + " ".join(shlex.quote(a) for a in
                               ["benchmarks/bench_soak.py", *(argv or sys.argv[1:])])
    import ray

    from pipeline.cluster.ray_train import init_ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    load0 = os.getloadavg()[0]
    t_all = time.perf_counter()
    max_failures = 1000
    # the dashboard on, as on a cluster: Ray Train's placement-group cleaner reads the
    # state API to see that a failed run's controller has gone
    init_ray(num_cpus=2, include_dashboard=True, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
            tmp = Path(tmp)
            print(f"[soak] the soak: seed {args.seeds[0]}, {args.run_epochs} epochs, a kill "
                  f"every {args.every[0]:g}-{args.every[1]:g} s", flush=True)
            soak = one_run(tmp / "soak", "soak", seed=args.seeds[0], epochs=args.run_epochs,
                           max_failures=max_failures, killer_every=tuple(args.every),
                           rng=random.Random(args.kill_seed))
            print(f"[soak] {describe(soak)}", flush=True)
            plain = {}
            for s in args.seeds:
                print(f"[soak] uninterrupted run, seed {s} ...", flush=True)
                plain[s] = one_run(tmp / f"plain{s}", f"plain{s}", seed=s,
                                   epochs=args.run_epochs, max_failures=2, killer_every=None,
                                   rng=random.Random(0))
                print(f"[soak] seed {s}: {describe(plain[s])}", flush=True)
    finally:
        ray.shutdown()
    md, ok = report(args, cmd, soak, plain, load0, time.perf_counter() - t_all)
    print(md)
    if args.results is not None:
        args.results.write_text(md)
        print(f"wrote {args.results}")
    return 0 if ok else 1


def report(args: argparse.Namespace, cmd: str, soak: dict, plain: dict[int, dict],
           load0: float, wall: float) -> tuple[str, bool]:
    kills = [k for k in soak.get("kills", []) if k["pid"] is not None]
    missed = len(soak.get("kills", [])) - len(kills)
    by = {v: sum(k["victim"] == v for k in kills) for v in VICTIMS}
    accs = {s: o.get("test_top1") for s, o in plain.items()}
    good = [a for a in accs.values() if a is not None]
    spread = (max(good) - min(good)) if len(good) > 1 else float("nan")
    ref = accs.get(args.seeds[0])
    diff = (soak["test_top1"] - ref) if soak.get("ok") and ref is not None else float("nan")
    within = abs(diff) <= spread if spread == spread else None
    sd = describe(soak)
    rows = ["| run | kills | outcome | C after | commits | final clean test top-1 % |",
            "|---|---|---|---|---|---|"]
    rows.append(f"| soak, seed {args.seeds[0]} | {len(kills)} ({by['worker']} worker, "
                f"{by['actor']} actor) | {sd['outcome']} | {sd.get('chain', '-')} | "
                f"{sd.get('commits', '-')} | {sd.get('test', '-')} |")
    for s, o in plain.items():
        d = describe(o)
        rows.append(f"| uninterrupted, seed {s} | 0 | {d['outcome']} | {d.get('chain', '-')} "
                    f"| {d.get('commits', '-')} | {d.get('test', '-')} |")
    kill_lines = [f"- {k['t']:.0f} s: SIGKILL {k['victim']} (pid {k['pid']}), newest "
                  f"checkpoint on disk at step {k['step']}" for k in kills]
    if missed:
        kill_lines.append(f"- {missed} draw(s) found no process of the drawn kind alive "
                          f"(the group was restarting): nothing killed")
    gaps = [b["t"] - a["t"] for a, b in zip(soak.get("kills", []), soak.get("kills", [])[1:])]
    verdict = ("within noise" if within else "OUTSIDE the noise" if within is False
               else "not judged (one uninterrupted run)")
    ok = bool(soak.get("ok") and soak.get("chain_ok")
              and soak["version"] == soak["expected_version"] and within is not False)
    md = (f"# Soak: a long run under repeated random kills\n\n"
          f"Command: `{cmd}` ({wall:.0f} s in all)\n\n"
          f"Machine: {os.cpu_count()} CPUs, {platform.platform()}, Python "
          f"{platform.python_version()}; 1-minute load average {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after.\n\n"
          f"Runs: the distributed quickstart (digits, pair-flip 0.4, {faults.WORKERS} Ray "
          f"Train workers, {args.run_epochs} epochs of which {faults.PRETRAIN} CE, "
          f"checkpoints every {faults.CKPT_EVERY} steps and at every epoch end). The soak "
          f"trained for {soak['seconds'] / 60:.1f} min with a SIGKILL every "
          f"{args.every[0]:g}-{args.every[1]:g} s (drawn; gaps {min(gaps, default=0):.0f}-"
          f"{max(gaps, default=0):.0f} s) of one Train worker or the confusion actor.\n\n"
          + "\n".join(rows) + "\n\n"
          f"Final accuracy: soak {sd.get('test', '-')}, the uninterrupted run of the same seed "
          f"{'-' if ref is None else f'{100 * ref:.2f}'}: a difference of {100 * diff:+.2f} "
          f"points; noise (max - min of the {len(good)} uninterrupted seeds) "
          f"{100 * spread:.2f} points: **{verdict}**.\n\n"
          f"Kills:\n\n" + "\n".join(kill_lines) + "\n")
    return md, ok


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
