"""Search spaces of the LCCN sweeps, as plain data keyed by config field names.

A space maps ``"<section>.<field>"`` (a field of a nested config of
:class:`pipeline.config.RunConfig`: ``lccn``, ``optim``, ``model``) or ``"<field>"`` (a
top-level RunConfig field, e.g. ``"seed"``) to a Ray Tune domain (``tune.loguniform``,
``tune.choice``, ...) or to a constant. A sampled point is a dict with the same keys and plain
values; :func:`apply_point` puts it into a RunConfig with ``dataclasses.replace``, so every
point is checked by the dataclasses' own ``__post_init__`` (e.g. ``alpha > 0``,
``0 < anneal_floor <= 1``) and an unknown key raises.

Ranges are our choices around the paper's settings (Sec. 5): alpha = 1 on every dataset,
warm-up δ = 20,000 steps (CIFAR) or 40,000 (Clothing1M, WebVision), power annealing with a
floor of 0.5 on the web datasets.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ray import tune

from pipeline.config import RunConfig

METRIC = "test_top1"  # the one metric every sweep ranks trials by
MODE = "max"

SPACES: dict[str, dict[str, Any]] = {
    # the quickstart: its smoke run has only a handful of LCCN steps, so δ stays tiny
    "digits": {
        "lccn.alpha": tune.loguniform(0.1, 10.0),
        "lccn.anneal": tune.choice([True, False]),
        "lccn.anneal_floor": tune.uniform(0.3, 1.0),
        "lccn.warmup_steps": tune.choice([0, 1, 2]),
    },
    "cifar10": {
        "lccn.alpha": tune.loguniform(0.1, 10.0),
        "lccn.warmup_steps": tune.choice([5_000, 10_000, 20_000, 40_000]),
        "lccn.warmup": tune.choice(["eq8", "identity"]),
        "optim.weight_decay": tune.loguniform(1e-4, 1e-3),
    },
    "clothing1m": {
        "lccn.alpha": tune.loguniform(0.1, 10.0),
        "lccn.anneal": True,
        "lccn.anneal_floor": tune.uniform(0.3, 0.8),
        "lccn.warmup_steps": tune.choice([10_000, 20_000, 40_000]),
        "optim.lr": tune.loguniform(3e-4, 3e-3),
    },
    "webvision": {
        "lccn.alpha": tune.loguniform(0.1, 10.0),
        "lccn.anneal": True,
        "lccn.anneal_floor": tune.uniform(0.3, 0.8),
        "lccn.warmup_steps": tune.choice([20_000, 40_000, 80_000]),
        "lccn.outlier": tune.choice([True, False]),
    },
}


def get_space(name: str) -> dict[str, Any]:
    """A copy of the named space (``digits``, ``cifar10``, ``clothing1m``, ``webvision``)."""
    if name not in SPACES:
        raise KeyError(f"no search space {name!r}; known: {sorted(SPACES)}")
    return dict(SPACES[name])


def sample_point(space: Mapping[str, Any], *, seed: int) -> dict[str, Any]:
    """One point of ``space`` drawn with a numpy ``Generator`` seeded by ``seed`` (for tests
    and dry runs; inside a sweep Tune samples). Constants are kept as they are."""
    import numpy as np

    rng = np.random.default_rng(seed)
    point = {}
    for key, dom in space.items():
        if isinstance(dom, tune.search.sample.Domain):
            value = dom.sample(random_state=rng)
            point[key] = value.item() if hasattr(value, "item") else value
        else:
            point[key] = dom
    return point


def apply_point(run: RunConfig, point: Mapping[str, Any]) -> RunConfig:
    """``run`` with the fields named in ``point`` replaced (``{"lccn.alpha": 0.5}`` sets
    ``run.lccn.alpha``). Each nested frozen config is rebuilt with ``dataclasses.replace``, so
    its ``__post_init__`` checks the new values.

    Raises ValueError naming the key for an unknown section or field, or for a value the
    config refuses.
    """
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    top_fields = {f.name for f in dataclasses.fields(run)}
    for key, value in point.items():
        section, _, name = key.rpartition(".")
        if not section:
            if key not in top_fields or dataclasses.is_dataclass(getattr(run, key)):
                raise ValueError(f"search space key {key!r}: not a plain RunConfig field "
                                 f"(fields: {sorted(top_fields)})")
            top[key] = value
            continue
        sub = getattr(run, section, None) if "." not in section else None
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ValueError(f"search space key {key!r}: RunConfig has no config section "
                             f"{section!r}")
        fields = {f.name for f in dataclasses.fields(sub)}
        if name not in fields:
            raise ValueError(f"search space key {key!r}: {type(sub).__name__} has no field "
                             f"{name!r} (fields: {sorted(fields)})")
        nested.setdefault(section, {})[name] = value
    try:
        for section, values in nested.items():
            top[section] = dataclasses.replace(getattr(run, section), **values)
        return dataclasses.replace(run, **top)
    except (TypeError, ValueError) as e:
        raise ValueError(f"sampled point {dict(point)} gives an invalid RunConfig: {e}") from e
