"""The LCCN training library, one subpackage per concern, each importing only those below
it (``tests/test_layers.py`` enforces it; ``docs/design.md`` draws the map)::

    pipeline.core    configs, the noise model's maths, the Gibbs step, the count store
    pipeline.data    manifests, shard streams, transforms, object storage, in-memory sets
    pipeline.track   MLflow, plots, the label-issue report
    pipeline.train   sessions, sources, chains, checkpoints, the engine, the methods
    pipeline.cluster Ray: the store actor, the Ray Train driver and worker

``shards`` (dataset converters) and ``tune`` (sweeps) sit on top; the jobs on top of those.
"""
