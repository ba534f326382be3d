"""Distribution over Ray (the cluster layer), the only package of the library that imports Ray
(inside its functions, so that it imports without Ray too): the fenced confusion-store actor
and its client, the Ray Train driver (``fit_distributed``: the actor, the ``TorchTrainer``,
resume checks, placement-group clean-up) and the per-worker function (``run_worker``: the
engine over a shard source and a shared chain).

May import: :mod:`pipeline.core`, :mod:`pipeline.data`, :mod:`pipeline.track`,
:mod:`pipeline.train`; Ray.
"""
