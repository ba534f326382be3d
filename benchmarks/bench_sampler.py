"""Cost of the LCCN sampler per batch, against the training step it rides on.

Per batch of ``--batch`` samples and for each K, median (and min) over ``--reps`` calls:

    posterior   gibbs_posterior: Eq. 7 conditional with own-count removal, log, softmax
    draw        sample_categorical: one inverse-CDF draw per row
    commit      ConfusionStore.commit: z update + count move (apply_delta_), dedupe, checks
    apply_delta apply_delta_ alone (the count move inside commit)
    labeler     what the trainer pays per step (pipeline/train/loop.py): softmax of the logits,
                GibbsLabeler.sample (checks + posterior + draw) and GibbsLabeler.commit
                against an in-process ConfusionStore (commit + sync of the next batch's z)

Then, for ``small_cnn`` and ``preact_resnet32`` with a K-way head on (batch, 3, 32, 32): the
training step (forward + cross-entropy + backward + SGD step, train mode) and the labeler
step timed right after each training step ("in situ": the training step evicts the
sampler's code and data from the caches, which makes it 2-3x slower than back to back),
``--model-reps`` times (a third of that for preact_resnet32). The share is in-situ labeler
/ step, median / median (and min / min: the min is the least disturbed by other processes
on a shared machine). Run with 1 and 2 torch threads.

    python benchmarks/bench_sampler.py [--ks 10 100 1000] [--threads 1 2] [--json out.json]
    python benchmarks/bench_sampler.py --sampler-module old_sampler.py   # before/after

Prints markdown tables. The state is a steady one: N = ``--n`` samples with random observed
labels, 70% of z equal to the observed label (diagonal-heavy counts), classifier
probabilities a softmax of random logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn


from pipeline.core import sampler  # noqa: E402
from pipeline.core.config import LCCNConfig  # noqa: E402
from pipeline.core.confusion import apply_delta_  # noqa: E402
from pipeline.core.confusion_store import ConfusionStore  # noqa: E402
from pipeline.train import labeler as lccn
from pipeline.train.labeler import GibbsLabeler  # noqa: E402
from pipeline.train.models import build_model  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--n", type=int, default=50_000, help="training-set size held by the store")
    p.add_argument("--reps", type=int, default=1000)
    p.add_argument("--models", nargs="+", default=["small_cnn", "preact_resnet32"])
    p.add_argument("--model-reps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write all figures here")
    p.add_argument("--sampler-module", type=Path, default=None,
                   help="time another sampler.py (e.g. `git show HEAD:pipeline/core/sampler.py > "
                        "old.py`) in place of pipeline/core/sampler.py, for before/after figures")
    return p


def timed_us(fn, reps: int, *, warmup: int = 20) -> tuple[float, float]:
    """(median, min) wall µs of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times), 1e6 * min(times)


def load_sampler(path: Path | None):
    """The sampler module to time: pipeline.core.sampler, or the file at ``path``."""
    if path is None:
        return sampler
    spec = importlib.util.spec_from_file_location("sampler_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class State:
    """A steady Gibbs state for K classes: store, replica, probs and batches."""

    def __init__(self, k: int, n: int, batch: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k, self.batch = k, batch
        observed = torch.randint(0, k, (n,), generator=g)
        keep = torch.rand(n, generator=g) < 0.7           # 70% latent = observed, rest random
        z0 = torch.where(keep, observed, torch.randint(0, k, (n,), generator=g))
        self.store = ConfusionStore(observed, z0, k, k)
        self.observed = observed
        self.gen = g
        # a pool of batches and classifier probabilities (peaked on the observed label)
        self.order = torch.randperm(n, generator=g)
        self.pos = 0
        self.logits_pool = 3.0 * torch.randn(batch * 64, k, generator=g)
        self.probs_pool = torch.softmax(self.logits_pool, dim=1)

    def next_idx(self) -> torch.Tensor:
        if self.pos + self.batch > self.order.numel():
            self.pos = 0
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return idx

    def probs(self) -> torch.Tensor:
        s = int(torch.randint(0, 64, (1,), generator=self.gen)) * self.batch
        return self.probs_pool[s:s + self.batch]

    def logits(self) -> torch.Tensor:
        s = int(torch.randint(0, 64, (1,), generator=self.gen)) * self.batch
        return self.logits_pool[s:s + self.batch]


def bench_parts(k: int, args: argparse.Namespace, smp) -> dict[str, float]:
    gibbs_posterior, sample_categorical = smp.gibbs_posterior, smp.sample_categorical
    st = State(k, args.n, args.batch, args.seed)
    alpha = 1.0
    counts = st.store.counts
    idx = st.next_idx()
    obs, z_old, probs = st.observed[idx], st.store.z[idx].clone(), st.probs()
    out: dict[str, float] = {}
    out["posterior"], out["posterior_min"] = timed_us(
        lambda: gibbs_posterior(probs, obs, z_old, counts, alpha), args.reps)
    p = gibbs_posterior(probs, obs, z_old, counts, alpha)
    out["draw"], out["draw_min"] = timed_us(lambda: sample_categorical(p, generator=st.gen),
                                            args.reps)
    z_new = sample_categorical(p, generator=st.gen)
    moved = z_new != z_old
    out["moved_fraction"] = float(moved.float().mean())

    # commit: alternate between two assignments so every call moves the same counts
    state = {"flip": False}

    def commit() -> None:
        st.store.commit(idx, z_old if state["flip"] else z_new)
        state["flip"] = not state["flip"]

    out["commit"], out["commit_min"] = timed_us(commit, args.reps)
    c = counts.clone()
    o, a_, b_ = obs[moved], z_old[moved], z_new[moved]
    med, low = timed_us(lambda: (apply_delta_(c, o, a_, b_), apply_delta_(c, o, b_, a_)),
                        args.reps)
    out["apply_delta"], out["apply_delta_min"] = med / 2, low / 2

    # the trainer's path, back to back (caches warm)
    out["labeler"], out["labeler_min"] = timed_us(make_labeler_step(k, args), args.reps)
    return out


def make_labeler_step(k: int, args: argparse.Namespace):
    """One trainer step's sampler work (pipeline/train/loop.py): softmax of the logits,
    GibbsLabeler.sample, GibbsLabeler.commit (store commit + sync of the next batch)."""
    st = State(k, args.n, args.batch, args.seed)
    labeler = GibbsLabeler(LCCNConfig(alpha=1.0, commit_every=1), st.store, st.store.counts, st.store.version,
                           phi_init=torch.full((k, k), 1.0 / k, dtype=torch.float64),
                           max_steps=10 ** 9, generator=st.gen)
    cur = st.next_idx()
    labeler.prefetch(cur)
    holder = {"cur": cur}

    def labeler_step() -> None:
        cur = holder["cur"]
        nxt = st.next_idx()
        probs = torch.softmax(st.logits().float(), dim=1)
        z, _ = labeler.sample(probs, st.observed[cur], cur)
        labeler.commit(cur, z, nxt)
        holder["cur"] = nxt

    return labeler_step


def bench_model(name: str, k: int, args: argparse.Namespace) -> dict[str, float]:
    """The training step of ``name`` (K-way head) on (batch, 3, 32, 32): forward + CE +
    backward + SGD step, and the labeler step timed right after each training step (in
    situ: the step has evicted the sampler's code and data from the caches, as in the
    trainer). Returns median and min µs of both."""
    model = build_model(name, k, seed=args.seed)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, k, (args.batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    labeler_step = make_labeler_step(k, args)

    def step() -> None:
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
        labeler_step()
    reps = args.model_reps if name == "small_cnn" else max(3, args.model_reps // 3)
    steps, after = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        labeler_step()
        t2 = time.perf_counter()
        steps.append(t1 - t0)
        after.append(t2 - t1)
    us = lambda v, f: 1e6 * f(v)  # noqa: E731
    return {"step": us(steps, statistics.median), "step_min": us(steps, min),
            "in_situ": us(after, statistics.median), "in_situ_min": us(after, min)}


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    smp = load_sampler(args.sampler_module)
    lccn.gibbs_step = smp.gibbs_step  # the labeler path times the same implementation
    results: dict = {"batch": args.batch, "n": args.n, "reps": args.reps,
                     "model_reps": args.model_reps,
                     "sampler": str(args.sampler_module or "pipeline/core/sampler.py"),
                     "load_avg_start": os.getloadavg(), "rows": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for k in args.ks:
            row = {"threads": threads, "k": k, **bench_parts(k, args, smp)}
            for m in args.models:
                t = bench_model(m, k, args)
                row[m] = {**t, "share": t["in_situ"] / t["step"],
                          "share_min": t["in_situ_min"] / t["step_min"],
                          "share_isolated": row["labeler"] / t["step"]}
            results["rows"].append(row)
            print(f"threads {threads} K {k:5d}: posterior {row['posterior']:8.1f} µs  draw "
                  f"{row['draw']:7.1f}  commit {row['commit']:7.1f}  (apply_delta "
                  f"{row['apply_delta']:5.1f})  labeler {row['labeler']:8.1f} µs  "
                  + "  ".join(f"{m}: step {row[m]['step'] / 1e3:.1f} ms, labeler after it "
                              f"{row[m]['in_situ']:.0f} µs -> {100 * row[m]['share']:.2f}%"
                              for m in args.models), flush=True)
    results["load_avg_end"] = os.getloadavg()
    print()
    print(markdown(results, args.models))
    print(f"\nload average start {results['load_avg_start']}, end {results['load_avg_end']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


def markdown(results: dict, models: list[str]) -> str:
    """Two tables: the sampler's parts (isolated), and its share of each model's step."""
    parts = ["posterior", "draw", "commit", "apply_delta", "labeler"]
    head = ["threads", "K", "posterior µs", "draw µs", "commit µs", "(apply_delta µs)",
            "labeler step µs"]
    lines = ["median (min) per batch, back to back:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        cells = [str(r["threads"]), str(r["k"])]
        cells += [f"{r[x]:.1f} ({r[x + '_min']:.1f})" for x in parts]
        lines.append("| " + " | ".join(cells) + " |")
    head = ["threads", "K", "model", "step ms (min)", "labeler after step µs (min)",
            "share % (min/min)", "share % isolated"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        for m in models:
            t = r[m]
            lines.append("| " + " | ".join([
                str(r["threads"]), str(r["k"]), m,
                f"{t['step'] / 1e3:.1f} ({t['step_min'] / 1e3:.1f})",
                f"{t['in_situ']:.0f} ({t['in_situ_min']:.0f})",
                f"{100 * t['share']:.2f} ({100 * t['share_min']:.2f})",
                f"{100 * t['share_isolated']:.2f}"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
