"""The reliability table: inject each fault into a real run and record what happened.

Training faults run the distributed quickstart (scikit-learn digits as shards, label view
with pair-flip noise, 2 Ray Train workers on a local Ray, the confusion actor, checkpoints
every 8 steps, ``max_failures=2``) and are compared with one clean run of the same seed:

- worker SIGKILL: a ``ray::RayTrainWorker`` process is sent SIGKILL once a checkpoint at
  step >= 30 exists;
- actor SIGKILL: the ``ray::StoreActor`` process, the same way;
- both in one run: a worker at step >= 30, then the actor at step >= 60;
- worker killed during a checkpoint: rank 1 exits at its 5th report (rank 0 has written and
  reported that checkpoint; the group never completes it);
- NaN loss: a learning rate of 1e6 makes the model diverge.

Data faults use shards of real CIFAR-10 JPEGs (a subset of the tarball) and the same code
paths as the jobs (``jobs/cifar_lccn.py`` up to the start of training, the shard loader and
the in-process worker loop for a run that survives), Clothing1M-format annotation files, and
the shard converter.

Per fault: whether the run survived or stopped with a clear error (the error's first line),
whether C equals the recount of z afterwards, whether commits were lost or doubled (the
steps the store applied, its ``steps`` counter, against one per LCCN step and rank plus the
initial assignment, and its ``refused``/``duplicates`` counters), and the time lost to recovery (wall time minus the
clean run's). Prints the table; ``--results FILE`` also writes it.

    python benchmarks/bench_faults.py [--data DIR] [--results benchmarks/results/faults.md]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lccn_jobs import digits as quickstart_ray
from lccn_jobs import driver
from lccn_jobs.configs import prepare
from lccn_jobs.sources import manifest_classes

REPO = Path(__file__).resolve().parents[1]

EPOCHS, PRETRAIN, CKPT_EVERY, WORKERS = 4, 1, 8, 2
TRAIN_ARGS = ["--epochs", str(EPOCHS), "--pretrain-epochs", str(PRETRAIN), "--batch-size",
              "64", "--lr", "0.05", "--milestones", "--lr-values", "--warmup-steps", "5",
              "--loader-workers", "0", "--shuffle-buffer", "100", "--checkpoint-every",
              str(CKPT_EVERY), "--num-workers", str(WORKERS), "--no-tracking",
              "--max-failures", "2"]


@dataclass
class Row:
    fault: str
    injected: str
    outcome: str = ""
    error: str = ""
    chain: str = "-"
    commits: str = "-"
    lost_s: str = "-"
    notes: list[str] = field(default_factory=list)


def first_line(e: BaseException) -> str:
    """The most specific message of an exception chain, on one line."""
    text = str(e)
    for line in text.splitlines():
        for marker in ("NonFiniteError:", "FenceError:", "ManifestError:", "ShardError:",
                       "RuntimeError:", "ValueError:"):
            if marker in line:
                return line.strip()[:220]
    return (text.strip().splitlines() or [type(e).__name__])[0][:220]


# -- processes on this machine ----------------------------------------------------------------


def ray_pids(title: str, *, under: int | None = None) -> list[int]:
    """The pids of the processes whose title starts with ``title``; with ``under`` only
    those descended from that pid (this session's raylet: another Ray on the machine, a
    test suite's, is not touched)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(title) and (under is None or _descends(int(d.name), under)):
                out.append(int(d.name))
    return sorted(out)


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
        if pid == ancestor:
            return True
    return False


def raylet_pid() -> int | None:
    """The pid of the raylet of the Ray this process started (None when it did not start
    one)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    procs = (node.all_processes.get("raylet") or []) if node is not None else []
    return procs[0].process.pid if procs else None


def newest_step(root: Path) -> int:
    best = -1
    for meta in root.glob("checkpoint_*/meta.json"):
        try:
            best = max(best, int(json.loads(meta.read_text())["global_step"]))
        except (OSError, ValueError, KeyError):
            pass
    return best


class Killer(threading.Thread):
    """SIGKILL the processes titled ``title`` once a checkpoint at step >= ``step`` exists
    under ``root`` (one kill per (title, step) in ``plan``)."""

    def __init__(self, root: Path, plan: list[tuple[int, str]]) -> None:
        super().__init__(daemon=True)
        self.root, self.plan, self.done = root, list(plan), []
        self.stop = threading.Event()
        self.raylet = raylet_pid()  # only this Ray's processes are victims

    def run(self) -> None:
        for step, title in self.plan:
            while not self.stop.is_set() and newest_step(self.root) < step:
                time.sleep(0.1)
            if self.stop.is_set():
                return
            pids = ray_pids(title, under=self.raylet)
            if title == "ray::RayTrainWorker":
                pids = pids[-1:]  # one worker
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.done.append(f"SIGKILL {title} pid {pid} after checkpoint step "
                                     f"{newest_step(self.root)}")
                except ProcessLookupError:
                    pass


# -- the training faults -----------------------------------------------------------------------


def train_run(root: Path, name: str, *, extra: list[str] | None = None,
              fault: dict | None = None, kill: list[tuple[int, str]] | None = None) -> dict:
    """One quickstart run under ``root``; returns what the table needs."""
    from pipeline.core.confusion_store import ConfusionStore
    from pipeline.cluster.ray_train import fit_distributed
    from pipeline.train.checkpoints import load_state

    args = quickstart_ray.get_args_parser().parse_args(
        ["--run-dir", str(root), "--run-name", name, *TRAIN_ARGS, *(extra or [])])
    cfg, _ = prepare(args, job=quickstart_ray.JOB, dataset=quickstart_ray.DATASET)
    data = root / "data"
    train, test = quickstart_ray.write_digits_shards(data, seed=args.seed)
    view = quickstart_ray.digits_view(train, rate=args.rate, seed=args.seed)
    run = cfg.run
    dist = driver.dist_config(args, cfg, run_name=name, train=str(train), test=str(test),
                              class_names=manifest_classes(str(train)),
                              transform=cfg.recipe.transform)
    killer = Killer(root / "train" / name, kill or [])
    killer.start()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"kills": killer.done}
    try:
        res = fit_distributed(run, dist, view, max_failures=args.max_failures, fault=fault)
        out.update(ok=True, seconds=time.perf_counter() - t0, result=res)
    except Exception as e:  # noqa: BLE001 - recorded in the table
        out.update(ok=False, seconds=time.perf_counter() - t0, error=first_line(e))
        return out
    finally:
        killer.stop.set()
    state = load_state(res["checkpoint"])
    store = ConfusionStore.from_state_dict(state["store"])  # raises if C != recount(z)
    store.check()
    lccn_steps = int(state["lccn_step"])
    out["chain_ok"] = True
    out["version"] = int(state["store"]["steps"])   # steps applied (a push carries several)
    out["expected_version"] = WORKERS * (lccn_steps + 1)
    out["stats"] = res["store"]
    out["resumed"] = (res["metrics"].get("resumed_epoch"), res["metrics"].get("resumed_batch"))
    return out


def training_rows(tmp: Path) -> list[Row]:
    import ray

    from pipeline.cluster.ray_train import init_ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        clean = train_run(tmp / "clean", "clean")
        base = clean["seconds"]
        cases = [
            ("worker SIGKILL", "SIGKILL of one Train worker after the checkpoint at step >= 30",
             dict(kill=[(30, "ray::RayTrainWorker")])),
            ("actor SIGKILL", "SIGKILL of the confusion actor after the checkpoint at step >= 30",
             dict(kill=[(30, "ray::StoreActor")])),
            ("worker and actor SIGKILL in one run", "a worker at step >= 30, the actor at >= 60",
             dict(kill=[(30, "ray::RayTrainWorker"), (60, "ray::StoreActor")])),
            ("worker killed during a checkpoint", "rank 1 exits at its 5th report (rank 0 has "
             "written the checkpoint, the group never completes it)",
             dict(fault={"rank": 1, "report": 5, "marker": str(tmp / "ckpt-fault.marker")})),
            ("NaN loss", "learning rate 1e6 (the model diverges)",
             dict(extra=["--lr", "1e6"])),
        ]
        rows = [summarise("none (reference run)", "-", clean, base)]
        for i, (fault, how, kw) in enumerate(cases):
            print(f"[faults] {fault} ...", flush=True)
            rows.append(summarise(fault, how, train_run(tmp / f"t{i}", f"t{i}", **kw), base))
        return rows
    finally:
        ray.shutdown()


def commit_line(out: dict, stats: dict) -> str:
    """The store's steps applied against one commit per LCCN step and rank (plus the
    initial assignments), and its refused and duplicate commits and actor take-overs."""
    exact = out["version"] == out["expected_version"]
    return (f"{'none lost or doubled' if exact else 'MISMATCH'}: steps applied "
            f"{out['version']} = {out['expected_version']} expected; refused "
            f"{stats.get('refused', 0):.0f}, duplicates {stats.get('duplicates', 0):.0f}, "
            f"actor take-overs {stats.get('restored', 0):.0f}")


def summarise(fault: str, how: str, out: dict, base: float) -> Row:
    row = Row(fault, how)
    row.notes += out.get("kills", [])
    if not out["ok"]:
        row.outcome = f"stopped with an error after {out['seconds']:.0f} s"
        row.error = out["error"]
        return row
    st = out["stats"] or {}
    row.outcome = "survived" + (f", resumed at epoch {out['resumed'][0]:.0f} batch "
                                f"{out['resumed'][1]:.0f}" if out["resumed"][0] >= 0 else "")
    row.chain = "C == recount(z)" if out["chain_ok"] else "BROKEN"
    row.commits = commit_line(out, st)
    row.lost_s = "0 (reference)" if fault.startswith("none") else f"{out['seconds'] - base:+.0f}"
    return row


# -- the data faults ---------------------------------------------------------------------------


def cifar_subset(tarball: Path, out: Path, per_class: int) -> Path:
    """``out/train|test/<class>/*.jpg``: the first ``per_class`` JPEGs of every class."""
    counts: dict[tuple[str, str], int] = {}
    with tarfile.open(tarball, "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if len(parts) < 3 or not m.isfile() or parts[-3] not in ("train", "test"):
                continue
            key = (parts[-3], parts[-2])
            limit = per_class if parts[-3] == "train" else per_class // 4
            if counts.get(key, 0) >= limit:
                continue
            dest = out / parts[-3] / parts[-2] / parts[-1]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(m).read())
            counts[key] = counts.get(key, 0) + 1
    return out


def convert(src: Path, out: Path) -> None:
    from shards import imagefolder

    imagefolder.convert(src, out, shard_size=100, workers=1, progress=False)


def job_start(shards: Path, run_dir: Path) -> tuple[bool, str, float]:
    """Run ``jobs/cifar_lccn.py`` up to the start of training (the driver's checks and
    label view); returns (reached training, error line, seconds)."""
    from lccn_jobs.datasets import CIFAR

    reached = {"yes": False}

    def stop_before_ray(*a: Any, **k: Any) -> dict:
        reached["yes"] = True
        raise SystemExit("reached training")

    real = driver.run_job
    driver.run_job = stop_before_ray
    t0 = time.perf_counter()
    try:
        CIFAR.main(["--data", str(shards), "--run-dir", str(run_dir), "--no-tracking"])
        msg = ""
    except SystemExit as e:
        msg = "" if reached["yes"] else str(e.code)
    finally:
        driver.run_job = real
    return reached["yes"], msg, time.perf_counter() - t0


def local_run(shards: Path, run_dir: Path) -> tuple[list[dict], Any]:
    """The worker loop in this process (same code as a Ray worker) on the CIFAR shards."""
    import torch

    from pipeline.core.config import LCCNConfig, ModelConfig, OptimConfig, RunConfig
    from pipeline.cluster.ray_train import initial_assignment_placeholder
    from pipeline.cluster.store_actor import LocalStoreClient, StoreActor
    from pipeline.cluster.worker import DistConfig, LocalSession, run_worker
    from shards.labelview import build_view

    view = build_view(shards / "train", {"kind": "asymmetric", "rate": 0.4, "seed": 0})
    run = RunConfig(method="lccn", seed=0, model=ModelConfig("small_cnn"),
                    optim=OptimConfig(epochs=2, pretrain_epochs=1, batch_size=100, lr=0.05),
                    lccn=LCCNConfig(warmup_steps=2))
    dist = DistConfig(run_name="local", run_dir=str(run_dir), train_source=str(shards / "train"),
                      num_workers=1, loader_workers=0, shuffle_buffer=100, preset="cifar",
                      tracking_uri=None)
    z0, counted = initial_assignment_placeholder(view, run)
    store = StoreActor(torch.from_numpy(view.observed), z0, 10, 10, counted=counted)
    rows = run_worker(run, dist, view, LocalStoreClient(store), LocalSession(run_dir / "ckpt"))
    return rows, store


def data_rows(tmp: Path, tarball: Path) -> list[Row]:
    from pipeline.core.confusion import count_matrix
    from pipeline.data.manifest import Manifest, sha256_file

    src = cifar_subset(tarball, tmp / "jpeg", per_class=100)
    pristine = tmp / "pristine"
    convert(src, pristine)
    rows = []

    def fresh(name: str) -> Path:
        d = tmp / name
        shutil.copytree(pristine, d)
        return d

    # corrupt JPEG inside a shard whose manifest describes it (as written by a converter)
    d = fresh("corrupt-jpeg")
    shard = d / "train" / "train-000000.tar"
    with tarfile.open(shard) as t:
        members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as t:
        for m, payload in members:
            if m.name.endswith(".jpg") and m.name.startswith("00000003"):
                payload = payload[: len(payload) // 2]
                m.size = len(payload)
            t.addfile(m, io.BytesIO(payload))
    man = Manifest.load(d / "train")
    man.shards[0] = replace(man.shards[0], sha256=sha256_file(shard),
                            bytes=shard.stat().st_size)
    man.save(d / "train")
    print("[faults] corrupt JPEG ...", flush=True)
    t0 = time.perf_counter()
    r = Row("corrupt JPEG", "one JPEG member cut to half its bytes; the manifest matches the "
            "shard (as if the converter had written it)")
    try:
        epochs, store = local_run(d, tmp / "run-corrupt")
        # the noisy validation split's samples are not counted (store.counted)
        ok = torch_equal(store.counts, count_matrix(store.z, store.observed, 10, 10,
                                                    counted=store.counted))
        r.outcome = "survived (worker loop in one process)"
        r.chain = "C == recount(z)" if ok else "BROKEN"
        r.commits = (f"steps applied {store.steps} = "
                     f"{1 + sum(int(e['steps']) for e in epochs[1:])} "
                     f"expected (initial + one per LCCN step)")
        r.notes.append("per epoch: " + "; ".join(
            f"skipped {e['data_skipped_samples']:.0f} sample(s), padded {e['data_padded']:.0f}"
            for e in epochs))
        r.lost_s = "0 (the sample is skipped, its slot padded)"
    except Exception as e:  # noqa: BLE001
        r.outcome, r.error = "stopped with an error", first_line(e)
    r.notes.append(f"{time.perf_counter() - t0:.0f} s for 2 epochs")
    rows.append(r)

    # file-level faults: refused by the job before training
    def truncate(d: Path) -> None:
        p = d / "train" / "train-000002.tar"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    def same_size(d: Path) -> None:
        p = d / "train" / "train-000002.tar"
        with tarfile.open(p) as t:
            m = next(m for m in t.getmembers() if m.name.endswith(".jpg"))
        raw = bytearray(p.read_bytes())
        raw[m.offset_data + m.size // 2: m.offset_data + m.size // 2 + 32] = bytes(32)
        p.write_bytes(bytes(raw))

    def missing(d: Path) -> None:
        (d / "train" / "train-000002.tar").unlink()

    for name, how, damage in (
            ("truncated tar", "train-000002.tar cut to half its size", truncate),
            ("same-size corruption", "32 bytes of a JPEG inside train-000002.tar zeroed "
             "(size unchanged)", same_size),
            ("missing shard", "train-000002.tar deleted", missing)):
        print(f"[faults] {name} ...", flush=True)
        d = fresh(name.replace(" ", "-"))
        damage(d)
        reached, msg, secs = job_start(d, tmp / f"run-{name.replace(' ', '-')}")
        r = Row(name, how)
        r.outcome = ("reached training (NOT caught)" if reached
                     else f"stopped with a clear error after {secs:.1f} s, before training")
        r.error = msg.replace(str(tmp), "<tmp>")
        rows.append(r)

    rows.append(annotation_row(tmp, src))
    rows.append(conversion_row(tmp, src))
    return rows


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def annotation_row(tmp: Path, src: Path) -> Row:
    """A Clothing1M-format tree with one malformed line in clean_label_kv.txt."""
    from shards import cli

    print("[faults] bad annotation line ...", flush=True)
    root = tmp / "c1m"
    ann = root / "annotations"
    ann.mkdir(parents=True)
    names = [f"class{k}" for k in range(14)]
    (ann / "category_names_eng.txt").write_text("\n".join(names) + "\n")
    jpgs = sorted(src.glob("train/*/*.jpg"))[:20]
    keys = []
    for i, j in enumerate(jpgs):
        key = f"images/{i % 3}/{i:02d}/{i}.jpg"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(j, root / key)
        keys.append(key)
    lines = [f"{k} {i % 14}" for i, k in enumerate(keys)]
    lines[7] = f"{keys[7]} seven"  # the bad line: line 8
    (ann / "clean_label_kv.txt").write_text("\n".join(lines) + "\n")
    (ann / "clean_test_key_list.txt").write_text("\n".join(keys) + "\n")
    err = io.StringIO()
    real = sys.stderr
    sys.stderr = err
    try:
        code = cli.main(["clothing1m", str(root), "--out", str(tmp / "c1m-out"), "--splits",
                         "test", "--no-progress"])
    finally:
        sys.stderr = real
    r = Row("bad annotation line", "line 8 of clean_label_kv.txt reads '<key> seven'")
    r.outcome = (f"conversion stopped with a clear error (exit code {code})" if code
                 else "converted (NOT caught)")
    r.error = err.getvalue().strip().replace(str(tmp), "<tmp>")
    return r


def conversion_row(tmp: Path, src: Path) -> Row:
    """SIGKILL of ``python -m shards imagefolder`` after some shards, then the same command
    again; compared with an uninterrupted conversion."""
    from pipeline.data.manifest import Manifest

    print("[faults] interrupted conversion ...", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def cmd(out: Path) -> list[str]:
        return [sys.executable, "-m", "shards", "imagefolder", str(src), "--out", str(out),
                "--shard-size", "20", "--workers", "1", "--validate", "decode", "--no-progress"]

    t0 = time.perf_counter()
    subprocess.run(cmd(tmp / "conv-ref"), env=env, check=True, capture_output=True)
    ref_s = time.perf_counter() - t0
    out = tmp / "conv-hit"
    proc = subprocess.Popen(cmd(out), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while len(list((out / "train").glob("train-*.tar"))) < 10 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(list((out / "train").glob("train-*.tar")))
    had_manifest = (out / "train" / "manifest.json").exists()
    t0 = time.perf_counter()
    rerun = subprocess.run(cmd(out), env=env, capture_output=True, text=True)
    rerun_s = time.perf_counter() - t0
    same = all(Manifest.load(out / s).to_json() == Manifest.load(tmp / "conv-ref" / s).to_json()
               for s in ("train", "test"))
    r = Row("interrupted conversion", f"SIGKILL of the converter once {done_before} training "
            "shards were on disk; then the same command again")
    r.outcome = (f"rerun finished (exit {rerun.returncode}); no manifest existed after the "
                 f"kill: {not had_manifest}")
    r.chain = "-"
    r.commits = ("shards and manifests identical to an uninterrupted conversion" if same
                 else "OUTPUT DIFFERS")
    r.lost_s = f"{rerun_s - ref_s:+.1f} (rerun {rerun_s:.1f} s vs {ref_s:.1f} s uninterrupted)"
    return r


# -- report ------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    out = ["| fault | injected | outcome | error (first line) | C after | commits | time lost (s) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join(cell(x) for x in (
            r.fault, r.injected, r.outcome, f"`{r.error}`" if r.error else "-", r.chain,
            r.commits, r.lost_s)) + " |")
    notes = [f"- {r.fault}: {n}" for r in rows for n in r.notes]
    return "\n".join(out) + ("\n\nNotes:\n\n" + "\n".join(notes) if notes else "") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path(os.environ.get(
        "LCCN_SHARED_DATA", REPO.parent / "shared" / "data")),
        help="folder holding cifar10-jpeg.tar.gz (default $LCCN_SHARED_DATA)")
    p.add_argument("--only", choices=("training", "data"), default=None)
    p.add_argument("--results", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in
                               ["benchmarks/bench_faults.py", *(argv or sys.argv[1:])])
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        tmp = Path(tmp)
        if args.only in (None, "training"):
            rows += training_rows(tmp / "training")
        if args.only in (None, "data"):
            rows += data_rows(tmp / "data", args.data / "cifar10-jpeg.tar.gz")
    md = (f"# Reliability: faults injected into real runs\n\n"
          f"Command: `{cmd}` ({time.perf_counter() - t0:.0f} s)\n\n"
          f"Machine: {os.cpu_count()} CPUs, {platform.platform()}, Python "
          f"{platform.python_version()}; 1-minute load average {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after (a shared VM: time lost is wall time against one "
          f"clean run, noisy by several seconds).\n\n"
          f"Training runs: the distributed quickstart (digits, {WORKERS} Ray Train workers, "
          f"{EPOCHS} epochs of which {PRETRAIN} CE, checkpoints every {CKPT_EVERY} steps and at "
          f"every epoch end, `max_failures=2`). 'commits' compares the steps the store applied with "
          f"one commit per LCCN step and rank plus one initial assignment per rank: equal "
          f"means no commit was lost or applied twice relative to the checkpoint the run "
          f"resumed from. Data runs: 1,250 real CIFAR-10 JPEGs as shards of 100.\n\n"
          + table(rows))
    print(md)
    if args.results is not None:
        args.results.write_text(md)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
