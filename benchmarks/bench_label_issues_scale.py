"""The label-issue report at full-WebVision scale: memory and time of the accumulator and
the report on a synthetic stream of Eq. 7 posteriors, N = 2.4M samples x K = 1000 classes.

Protocol: one rank (the merge's all-reduce is the identity), ``--passes`` report epochs;
each epoch visits every sample once in a random order, in batches of ``--batch`` rows of
peaked posteriors (softmax of N(0, 1) logits plus 8 at a "true" class, which 20% of the
observed labels differ from). Measured: the accumulator's tensors (the top-k sums) against
the dense N x K float32 the report used to need, the process's peak resident memory, the
seconds of the additions and the merges per epoch, of ``build_report`` and of writing its
files (labels.csv: a row per sample). Counted: the samples whose suggested label is not the
true class, and whose flag is not the planted flip (a few, where N(0, 1) noise beats the
lead).

    python benchmarks/bench_label_issues_scale.py --write benchmarks/results/label_issues_scale.md
    python benchmarks/bench_label_issues_scale.py --samples 200000 --passes 1   # a quick look
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch


from pipeline.core.confusion_store import ConfusionStore  # noqa: E402
from pipeline.core.posterior import MAX_ENTRIES, STATE_KEY, ReportAccumulator  # noqa: E402
from pipeline.track.label_issues import build_report  # noqa: E402

BOOST = 8.0  # the true class's logit lead: its posterior ~0.75 against 1000 N(0, 1) logits


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def tensor_gb(*ts: torch.Tensor | None) -> float:
    return sum(t.numel() * t.element_size() for t in ts if t is not None) / 2**30


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2_400_000)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--passes", type=int, default=2,
                   help="passes over the samples: the report's epochs (its window)")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stream-seed", type=int, default=0,
                   help="seed of the labels and posteriors")
    p.add_argument("--out", type=Path, default=None, help="folder for the report's files "
                   "(default: a temporary one, removed)")
    p.add_argument("--write", type=Path, default=None, help="write the results as Markdown")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = args.samples, args.classes
    g = torch.Generator().manual_seed(args.stream_seed)
    truth = torch.randint(0, k, (n,), generator=g)
    flip = torch.rand(n, generator=g) < 0.2
    observed = torch.where(flip, (truth + 1 + torch.randint(0, k - 1, (n,), generator=g)) % k,
                           truth)
    load0 = os.getloadavg()[0]
    rss0 = peak_rss_gb()
    acc = ReportAccumulator(num_samples=n, k_latent=k, num_classes=k, epochs=args.passes,
                            total_epochs=args.passes, first_noise_epoch=0, alpha=1.0,
                            observed=observed)
    rows = []
    t_all = time.perf_counter()
    for epoch in range(args.passes):
        sink = acc.sink(epoch)
        order = torch.randperm(n, generator=g)
        t0, t_gen = time.perf_counter(), 0.0
        for i, idx in enumerate(order.split(args.batch)):
            s = time.perf_counter()
            logits = torch.randn(len(idx), k, generator=g)
            logits[torch.arange(len(idx)), truth[idx]] += BOOST
            post = torch.softmax(logits, 1)
            t_gen += time.perf_counter() - s
            sink(idx, post)
            if i % 200 == 0:
                print(f"epoch {epoch + 1}/{args.passes}: {i * args.batch:,}/{n:,} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        t_add = time.perf_counter() - t0 - t_gen
        t1 = time.perf_counter()
        acc.end_epoch(epoch, lambda t: t)
        rows.append({"epoch": epoch + 1, "add_s": t_add, "gen_s": t_gen,
                     "merge_s": time.perf_counter() - t1})
        print(f"epoch {epoch + 1}: additions {t_add:.1f} s (posteriors made in {t_gen:.1f} s), "
              f"merge {rows[-1]['merge_s']:.1f} s, peak RSS {peak_rss_gb():.2f} GiB", flush=True)
    acc_gb = tensor_gb(acc.top_cls, acc.top_sum, acc.obs_sum, acc.out_sum, acc.count, acc.sum)
    store = ConfusionStore(observed, truth, k, k)
    state = {"store": store.state_dict(), STATE_KEY: acc.state_dict()}
    t0 = time.perf_counter()
    report = build_report(state, clean=truth.numpy(), ks=(1000, 10000))
    t_build = time.perf_counter() - t0
    out = args.out or Path(tempfile.mkdtemp(prefix="lccn-report-"))
    t0 = time.perf_counter()
    paths = report.write(out)
    t_write = time.perf_counter() - t0
    sizes = {p.name: p.stat().st_size for p in paths}
    m = report.mislabelled
    suggested_off = int((m.suggested != truth.numpy()[m.idx]).sum())
    flags_off = int((m.flagged != flip.numpy()[m.idx]).sum())
    res = {"samples": n, "classes": k, "epochs": args.passes, "batch": args.batch,
           "topk": acc.k, "exact": acc.exact, "accumulator_gb": acc_gb,
           "dense_gb": n * k * 4 / 2**30, "peak_rss_gb": peak_rss_gb(), "rss_start_gb": rss0,
           "epochs_rows": rows, "build_s": t_build, "write_s": t_write,
           "labels_csv_mb": sizes.get("labels.csv", 0) / 2**20,
           "flagged": int(m.flagged.sum()), "planted": int(flip.sum()),
           "suggested_not_truth": suggested_off, "flag_not_flip": flags_off,
           "total_s": time.perf_counter() - t_all, "load_start": load0,
           "load_end": os.getloadavg()[0], "threads": args.threads}
    print(res, flush=True)
    if args.out is None:
        for p in paths:
            p.unlink()
        out.rmdir()
    if args.write:
        args.write.write_text(markdown(res, argv))
    return res


def markdown(r: dict, argv: list[str] | None) -> str:
    cmd = "python benchmarks/bench_label_issues_scale.py " + " ".join(argv or sys.argv[1:])
    lines = [
        "# The label-issue report at full-WebVision scale", "",
        "Script: `benchmarks/bench_label_issues_scale.py` (the protocol is in its docstring): "
        f"a synthetic stream of Eq. 7 posteriors, N = {r['samples']:,} samples x K = "
        f"{r['classes']:,} classes, {r['epochs']} report epochs, batches of {r['batch']:,}, one "
        "rank.", "", "Command:", "", "```", cmd.strip(), "```", "",
        "| measure | value |", "|---|---|",
        f"| classes kept per sample (k) | {r['topk']} of {r['classes']} "
        f"({'every class' if r['exact'] else f'N x K above {MAX_ENTRIES:,}'}) |",
        f"| accumulator (top-k sums, exact observed-label sums, counts) | "
        f"{r['accumulator_gb']:.2f} GiB |",
        f"| the dense N x K float32 the report needed before (it was off here) | "
        f"{r['dense_gb']:.1f} GiB |",
        f"| peak resident memory of the process (the stream, the report included) | "
        f"{r['peak_rss_gb']:.2f} GiB |",
    ]
    for e in r["epochs_rows"]:
        lines.append(f"| epoch {e['epoch']}: additions / merge | {e['add_s']:.1f} s / "
                     f"{e['merge_s']:.1f} s (making the posteriors: {e['gen_s']:.1f} s) |")
    lines += [
        f"| build_report (rankings, precision/recall at k) | {r['build_s']:.1f} s |",
        f"| writing the files (labels.csv: {r['labels_csv_mb']:.0f} MB, a row per sample) | "
        f"{r['write_s']:.1f} s |",
        f"| flagged / planted flips | {r['flagged']:,} / {r['planted']:,} |",
        f"| samples whose suggested label is not the planted class | "
        f"{r['suggested_not_truth']:,} |",
        f"| samples whose flag is not the planted flip | {r['flag_not_flip']:,} |",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{r['threads']} thread(s); load average {r['load_start']:.1f} at the start, "
        f"{r['load_end']:.1f} at the end; {r['total_s']:.0f} s in all. In a run the "
        "additions happen inside the training steps (on the GPU for GPU workers) and each "
        "merge is one all-reduce of N x (2k + 4) float32 per epoch end and checkpoint.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
