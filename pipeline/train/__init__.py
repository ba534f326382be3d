"""Training: the engine that runs a method over a data source with a session, the same code
in one process and in a Ray Train worker. Sessions (rank, collectives, checkpoints),
sources (in-memory tensors, shards), the Gibbs chain's backends and labeler, checkpoints,
members (networks, optimisers, schedules, weight averages), the epoch loop and evaluation,
the local trainer, the feed of the label-issue report, and the methods
(:mod:`pipeline.train.methods`: CE, the baselines, LCCN and its variants, DivideMix and
DivideLCCN), registered by name.

May import: :mod:`pipeline.core`, :mod:`pipeline.data`, :mod:`pipeline.track` (MLflow
only inside the engine's tracking, so that a GPU node without MLflow imports it); never
Ray.
"""
