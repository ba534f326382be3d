"""Cost of DivideMix's per-epoch co-divide (``pipeline.core.divide.co_divide``) by training-set size.

For each N in ``--ns``: N per-sample losses (70% drawn low, 30% high, as after a warm-up)
with random noisy labels over ``--classes`` classes, then ``co_divide`` (min-max
normalisation, 2-component GMM with DivideMix's settings, posterior for every sample)

    all      fitted on all N losses, predicted on all N
    subset   fitted on a class-balanced subset of ``--fit-size`` (DivideMix's Clothing1M
             route: 1000 batches x 32), predicted on all N

median (and min) seconds over ``--reps`` calls, with the clean-mask precision / recall
against the planted split. Run once per thread count; prints a markdown table, and writes
it to ``--out`` only when asked.

    python benchmarks/bench_divide.py [--ns 50000 1000000] [--threads 1] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch


from pipeline.core.divide import co_divide  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[50_000, 1_000_000])
    p.add_argument("--classes", type=int, default=14)
    p.add_argument("--fit-size", type=int, default=32_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    return p


def planted(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.rand(n, generator=g) < 0.7
    low = (0.3 + 0.15 * torch.randn(n, generator=g, dtype=torch.float64)).clamp_min(0)
    high = 2.5 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    return torch.where(clean, low, high), clean, torch.randint(0, k, (n,), generator=g)


def timed(fn, reps: int):
    out, times = None, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times), min(times)


def main(argv: list[str] | None = None) -> str:
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rows = ["| N | fit on | seconds | precision | recall |", "|---|---|---|---|---|"]
    for n in args.ns:
        losses, clean, observed = planted(n, args.classes)
        routes = {"all": dict(),
                  f"subset {args.fit_size}": dict(observed=observed, fit_size=args.fit_size,
                                                  num_classes=args.classes)}
        for name, kw in routes.items():
            d, med, lo = timed(lambda: co_divide(losses, seed=0, **kw), args.reps)
            tp = (d.clean & clean).sum().item()
            prec, rec = tp / max(d.clean.sum().item(), 1), tp / clean.sum().item()
            rows.append(f"| {n:,} | {name} | {med:.3f} ({lo:.3f}) | {prec:.4f} | {rec:.4f} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(f"\nthreads {args.threads}, load average {os.getloadavg()[0]:.1f}\n\n{table}")
    if args.out is not None:
        args.out.write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
