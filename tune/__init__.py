"""Hyper-parameter sweeps with Ray Tune over the jobs' Ray Train runs.

:mod:`tune.search_spaces` holds the search spaces as plain data keyed by config field names
(``"lccn.alpha"``) and :func:`pipeline.core.options.apply_point`, which checks a sampled point by
building the frozen :class:`pipeline.core.config.RunConfig` from it. :mod:`tune.sweep` is the
driver (``python -m tune.sweep --job quickstart --smoke-test``), :mod:`tune.reporting` takes
each epoch of a trial's Train run to Tune, :mod:`tune.results` ranks the trials on the noisy
validation accuracy and writes the table.

Note: this package shadows nothing in Ray (Ray's is ``ray.tune``), but a script run from
``tune/`` itself must not ``import tune`` expecting Ray.

May import: :mod:`pipeline` (every subpackage), :mod:`lccn_jobs` (the jobs a trial runs);
Ray and MLflow.
"""
