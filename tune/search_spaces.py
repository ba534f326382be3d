"""Search spaces of the LCCN sweeps, as plain data keyed by config field names.

A space maps ``"<section>.<field>"`` (a field of a nested config of
:class:`pipeline.core.config.RunConfig`: ``lccn``, ``optim``, ``model``) or ``"<field>"`` (a
top-level RunConfig field) to a *spec*, JSON-able data:

    {"loguniform": [lo, hi]}   {"uniform": [lo, hi]}   {"randint": [lo, hi]}  (hi excluded)
    {"choice": [v, ...]}       {"grid": [v, ...]}      (every value, times --num-samples)
    a plain value              (a constant)

:func:`to_tune` turns a space into Ray Tune domains; :func:`load_space` reads one from a JSON
file (``python -m tune.sweep --space FILE.json``). A sampled point is a dict with the same
keys and plain values; :func:`pipeline.core.options.apply_point` puts it into a RunConfig with
``dataclasses.replace``, so every point is checked by the dataclasses' own ``__post_init__``
(e.g. ``alpha > 0``, ``0 < anneal_floor <= 1``) and an unknown key raises.

The spaces are keyed by job (``quickstart``, ``cifar``, ``clothing1m``, ``webvision``), plus
``alpha`` (any job): the paper's ablation grid of alpha and nothing else. Every job's space
draws the Dirichlet alpha log-uniformly over 0.01..1000, the range of the paper's ablation
(Sec. 5, CIFAR-10 asymmetric noise r = 0.5: about 85% at alpha 0.01, about 88% from 0.1 to
10, 72.14% at 1000); ``--alpha-grid`` replaces it by that ablation's grid,
:data:`PAPER_ALPHAS`. Around the paper's other settings (warm-up δ = 20,000 steps on CIFAR,
40,000 on the web datasets; power annealing on for the web datasets) the ranges are our
choices. ``optim.lr`` of a job with a piecewise schedule (``--lr-values``, the CIFAR recipe)
is the first phase's rate; the sweep scales the other phases with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.core.config import RunConfig, scaled_lr_values  # noqa: F401 (re-exported)

METRIC = "val_top1"  # what a sweep ranks and stops trials by by default (noisy validation)
MODE = "max"
REPORTED_BESIDE = "test_top1"  # reported next to the ranking metric, never used to choose
# the held-out negative log-likelihood of the noisy labels under the model and its noise
# model: reported beside val_top1, and the alternative ranking metric (--metric val_nll):
# unlike the accuracy it followed alpha's effect on the clean test accuracy
# (benchmarks/results/alpha_sweep.md)
VAL_NLL = "val_nll"
# the metrics a sweep may rank by, with their modes: both on the noisy validation split
RANKING = {METRIC: MODE, VAL_NLL: "min"}
TIME_ATTR = "epochs_done"  # ASHA's clock: epochs finished by the trial's Train run

PAPER_ALPHAS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 100.0, 1000.0)
ALPHA = {"loguniform": [0.01, 1000.0]}
# the warm-up estimate as phi's prior (LCCNConfig.prior_strength): what keeps the chain from
# following a classifier that memorises its labels (benchmarks/results/cifar.md)
PRIOR_STRENGTH = {"choice": [0.0, 1.0, 4.0]}

SPACES: dict[str, dict[str, Any]] = {
    # the digits quickstart: ~20 steps an epoch at the smoke sizes, so δ stays small
    "quickstart": {
        "lccn.alpha": ALPHA,
        "lccn.anneal": {"choice": [True, False]},
        "lccn.warmup_steps": {"choice": [0, 10, 40]},
        "lccn.warmup": {"choice": ["anchor", "eq8", "identity"]},
        "lccn.targets": {"choice": ["sample", "posterior"]},
        "lccn.ramp_epochs": {"choice": [0.0, 1.0, 4.0]},
        "lccn.prior_strength": PRIOR_STRENGTH,
        "optim.lr": {"loguniform": [0.02, 0.2]},
    },
    "cifar": {
        "lccn.alpha": ALPHA,
        "lccn.anneal": {"choice": [True, False]},
        "lccn.warmup_steps": {"choice": [5_000, 10_000, 20_000, 40_000]},
        "lccn.warmup": {"choice": ["anchor", "eq8"]},
        "lccn.targets": {"choice": ["sample", "posterior"]},
        "lccn.ramp_epochs": {"choice": [0.0, 1.0, 4.0]},
        "lccn.prior_strength": PRIOR_STRENGTH,
        "optim.lr": {"loguniform": [0.1, 0.5]},
    },
    "clothing1m": {
        "lccn.alpha": ALPHA,
        "lccn.anneal": {"choice": [True, False]},
        "lccn.warmup_steps": {"choice": [10_000, 20_000, 40_000]},
        "lccn.warmup": {"choice": ["anchor", "eq8"]},
        "lccn.targets": {"choice": ["sample", "posterior"]},
        "lccn.ramp_epochs": {"choice": [0.0, 1.0, 4.0]},
        "lccn.prior_strength": PRIOR_STRENGTH,
        "optim.lr": {"loguniform": [3e-4, 3e-3]},
    },
    "webvision": {
        "lccn.alpha": ALPHA,
        "lccn.anneal": {"choice": [True, False]},
        "lccn.warmup_steps": {"choice": [20_000, 40_000, 80_000]},
        "lccn.warmup": {"choice": ["anchor", "eq8"]},
        "lccn.targets": {"choice": ["sample", "posterior"]},
        "lccn.ramp_epochs": {"choice": [0.0, 1.0, 4.0]},
        "lccn.prior_strength": PRIOR_STRENGTH,
        "optim.lr": {"loguniform": [3e-3, 3e-2]},
    },
    # one's own images (jobs/train.py): the warm-up stays the job's share of the data's
    # steps; lr around the fine-tuning rate of an ImageNet backbone
    "train": {
        "lccn.alpha": ALPHA,
        "lccn.anneal": {"choice": [True, False]},
        "lccn.warmup": {"choice": ["anchor", "eq8"]},
        "lccn.targets": {"choice": ["sample", "posterior"]},
        "lccn.ramp_epochs": {"choice": [0.0, 1.0, 4.0]},
        "lccn.prior_strength": PRIOR_STRENGTH,
        "optim.lr": {"loguniform": [3e-3, 3e-2]},
    },
    # the paper's alpha ablation alone: the grid, every other setting the job's own
    "alpha": {"lccn.alpha": {"grid": list(PAPER_ALPHAS)}},
}

KINDS = ("loguniform", "uniform", "randint", "choice", "grid")


def get_space(name: str) -> dict[str, Any]:
    """A copy of the named space (``quickstart``, ``cifar``, ``clothing1m``, ``webvision``,
    ``alpha``)."""
    if name not in SPACES:
        raise KeyError(f"no search space {name!r}; known: {sorted(SPACES)}")
    return json.loads(json.dumps(SPACES[name]))


def with_alpha_grid(space: Mapping[str, Any]) -> dict[str, Any]:
    """``space`` with ``lccn.alpha`` swept over the paper's grid :data:`PAPER_ALPHAS`."""
    return {**space, "lccn.alpha": {"grid": list(PAPER_ALPHAS)}}


def load_space(path: str | Path) -> dict[str, Any]:
    """A space from a JSON file (an object of key -> spec); raises ValueError naming the
    file and the key of a spec that is not understood."""
    path = Path(path)
    try:
        space = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"search space file {path}: {e}") from None
    if not isinstance(space, dict) or not space:
        raise ValueError(f"search space file {path}: expected a non-empty JSON object of "
                         f"config key -> spec, got {type(space).__name__}")
    for key, spec in space.items():
        try:
            _domain(spec)
        except ValueError as e:
            raise ValueError(f"search space file {path}: key {key!r}: {e}") from None
    return space


def _domain(spec: Any) -> Any:
    from ray import tune

    if not isinstance(spec, dict):
        return spec  # a constant
    if len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"a spec is a constant or one of {{kind: args}} with kind in {KINDS}, "
                         f"got {spec!r}")
    kind, args = next(iter(spec.items()))
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ValueError(f"{kind} takes a non-empty list, got {args!r}")
        return tune.choice(args) if kind == "choice" else tune.grid_search(args)
    if (not isinstance(args, list) or len(args) != 2
            or not all(isinstance(v, (int, float)) for v in args) or not args[0] < args[1]):
        raise ValueError(f"{kind} takes [lo, hi] with lo < hi, got {args!r}")
    lo, hi = args
    if kind == "loguniform":
        if lo <= 0:
            raise ValueError(f"loguniform needs lo > 0, got {args!r}")
        return tune.loguniform(lo, hi)
    if kind == "randint":
        return tune.randint(int(lo), int(hi))
    return tune.uniform(lo, hi)


def to_tune(space: Mapping[str, Any]) -> dict[str, Any]:
    """The space as Ray Tune's ``param_space`` (domains and ``grid_search`` dicts)."""
    out = {}
    for key, spec in space.items():
        try:
            out[key] = _domain(spec)
        except ValueError as e:
            raise ValueError(f"search space key {key!r}: {e}") from None
    return out


def sample_point(space: Mapping[str, Any], *, seed: int) -> dict[str, Any]:
    """One point of ``space`` (specs) drawn with a numpy ``Generator`` seeded by ``seed``
    (for tests and dry runs; inside a sweep Tune samples). A grid gives one of its values,
    constants are kept as they are."""
    import numpy as np
    from ray.tune.search.sample import Domain

    rng = np.random.default_rng(seed)
    point = {}
    for key, dom in to_tune(space).items():
        if isinstance(dom, dict) and "grid_search" in dom:
            value = dom["grid_search"][int(rng.integers(len(dom["grid_search"])))]
        elif isinstance(dom, Domain):
            value = dom.sample(random_state=rng)
        else:
            value = dom
        point[key] = value.item() if hasattr(value, "item") else value
    return point
