"""Replay the memorisation signal over recorded CE runs: the first epoch whose training loss
falls below the label-noise floor H(observed | clean), beside the run's peak test epoch.

A CE run's ``loss`` is its cross-entropy on the observed labels (what the epoch rows now
carry for every method as ``observed_loss``). The floor is the one of the run's realised
noise: ``noise_floor`` in a ``bench_cifar.py`` result (its per-setting JSON), or, for a
``bench_cifar_methods.py`` result without one, ``--floor SETTING=NATS``. Usage::

    python benchmarks/replay_floor.py benchmarks/results/cifar-mem/{sym0.5,asym0.5,idn0.4}-seed0.json
    python benchmarks/replay_floor.py benchmarks/results/cifar-methods/*-seed0-ce.json \\
        --floor sym0.5=1.660 asym0.5=0.277 idn0.4=1.478
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cifar import regime  # noqa: E402


def replay(history: list[dict], floor: float) -> dict:
    """First epoch (1-based) with loss below ``floor`` (None: never), the peak test epoch
    (:func:`bench_cifar.regime`'s), the final loss."""
    below = next((e + 1 for e, r in enumerate(history) if r["loss"] < floor), None)
    g = regime({"history": history}, floor)
    return {"below_floor": below, "peak_epoch": g["peak_epoch"], "final_loss": g["final_loss"],
            "floor": floor}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--floor", nargs="*", default=[], metavar="SETTING=NATS",
                   help="the floor of a setting, for results that do not record one")
    args = p.parse_args(argv)
    given = {k: float(v) for k, v in (f.split("=", 1) for f in args.floor)}
    print("| file | setting | CE loss below the floor at epoch | peak test epoch | "
          "final loss / floor |\n|---|---|---|---|---|")
    for f in args.files:
        r = json.loads(f.read_text())
        hist = r["methods"]["ce"]["history"] if "methods" in r else r["history"]
        floor = r.get("noise_floor", given.get(r["setting"]))
        if floor is None:
            raise SystemExit(f"{f}: no noise_floor recorded; give --floor {r['setting']}=NATS")
        g = replay(hist, floor)
        print(f"| {f.name} | {r['setting']} | {g['below_floor'] or 'never'} | "
              f"{g['peak_epoch']} | {g['final_loss']:.3f} / {floor:.3f} |")


if __name__ == "__main__":
    main()
