"""The data cost of an epoch with a noisy validation split, from shards: the training pass
plus the validation pass, with the split's samples

* **filtered after decoding** (the path of shards whose manifest has no ``first_idx``: the
  training pass decodes and augments every sample, then drops the held-out ones from its
  batches; the validation pass reads and decodes the whole training split again and keeps
  the held-out ones), and
* **dropped before decoding** (the default for shards :mod:`shards` writes: the training
  pass skips their decode and keeps their raw bytes; the validation pass decodes only
  those, in the training process).

Both run :class:`pipeline.train.shard_source.ShardSource` on the same shards (real CIFAR-10
JPEGs, preset ``cifar``, one rank, the loader in the training process), alternating, and
report wall and CPU seconds per epoch and the images decoded.

    python benchmarks/bench_heldout.py [--data DIR] [--n 10000] [--val-fraction 0.05]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_loader import _cpu_now, build_shards, extract_cifar  # noqa: E402

from pipeline.core.labels import LabelView  # noqa: E402
from pipeline.core.options import add_options  # noqa: E402
from pipeline.data.split_labels import read_split_labels  # noqa: E402
from pipeline.data.stream import LoaderConfig  # noqa: E402
from pipeline.train.shard_source import ShardSource  # noqa: E402
from pipeline.train.sources import held_out_mask  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data",
                   help="folder holding cifar10-jpeg.tar.gz")
    p.add_argument("--n", type=int, default=10000, help="CIFAR-10 training JPEGs to use")
    add_options(p, ("--val-fraction",))
    p.add_argument("--repeats", type=int, default=3, help="epochs per path (the median kept)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    return p


def epoch(src: ShardSource, e: int) -> dict[str, float]:
    """One training pass and one validation pass: seconds, CPU seconds, samples."""
    t0, c0 = time.perf_counter(), _cpu_now()
    trained = sum(int(b.valid.sum()) for b in src.train_batches(e))
    t1 = time.perf_counter()
    val = sum(int(b.valid.sum()) for b in src.val_batches())
    t2, c2 = time.perf_counter(), _cpu_now()
    return {"train_s": t1 - t0, "val_s": t2 - t1, "wall_s": t2 - t0, "cpu_s": c2 - c0,
            "trained": trained, "val": val}


def main(argv: list[str] | None = None) -> str:
    args = get_args_parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lccn-heldout-") as tmp:
        tree = extract_cifar(args.data / "cifar10-jpeg.tar.gz", Path(tmp) / "tree", args.n)
        split, writer = build_shards(tree, Path(tmp) / "shards", shard_size=500)
        labels = read_split_labels(split)
        view = LabelView(labels["label"], labels["label"], 10)
        mask = held_out_mask(view, args.val_fraction, seed=0)
        cfg = LoaderConfig(batch_size=128, num_workers=0, shuffle_buffer=1000, preset="cifar",
                           seed=0)
        rows: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
        for r in range(args.repeats):
            for path in ("after", "before"):
                src = ShardSource(train_source=str(split), test_source=None, view=view,
                                  loader_cfg=cfg, rank=0, world_size=1, held_out=mask)
                if not src.drop_early:
                    raise SystemExit(f"{split}: the manifest has no first_idx ({writer})")
                src.drop_early = path == "before"
                got = epoch(src, r)
                rows[path].append(got)
                print(f"[heldout] {path:6s} repeat {r}: {got}", flush=True)
    med = {p: {k: float(np.median([x[k] for x in v])) for k in v[0]} for p, v in rows.items()}
    a, b = med["after"], med["before"]
    lines = [
        "# The noisy validation split: filtered after decoding vs dropped before it",
        "",
        f"Command: `python benchmarks/bench_heldout.py {' '.join(argv or sys.argv[1:])}`".rstrip(),
        "",
        f"Machine: {os.cpu_count()} cores ({platform.machine()}), load average "
        f"{load[0]:.1f} at the start and {os.getloadavg()[0]:.1f} at the end; torch threads 1, "
        f"the loader in the training process (`num_workers=0`). {args.n} CIFAR-10 training "
        f"JPEGs in shards of 500 ({writer}), preset `cifar`, batch 128, validation split "
        f"{args.val_fraction:g} ({int(mask.sum())} samples), one rank. Medians of "
        f"{args.repeats} epochs per path, the paths alternating.",
        "",
        "| held-out samples | trained | validated | training pass s | validation pass s | "
        "epoch wall s | epoch CPU s | images decoded per epoch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m, decoded in (("filtered after decoding", a, 2 * args.n),
                             ("dropped before decoding", b, args.n)):
        lines.append(f"| {name} | {m['trained']:.0f} | {m['val']:.0f} | {m['train_s']:.2f} | "
                     f"{m['val_s']:.2f} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | {decoded} |")
    lines += ["", f"Per epoch: {a['wall_s'] / b['wall_s']:.2f}x less wall time and "
              f"{a['cpu_s'] / b['cpu_s']:.2f}x less CPU with the split dropped before decoding "
              f"(the training split decoded once, not twice; the held-out samples decoded once, "
              f"by the validation pass)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
