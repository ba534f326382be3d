"""Configs and maths: the typed run configs, the transition matrix and its counts, the
exact Gibbs step (Eq. 7), the warm-up transition (Eq. 8), the noise generators and label
views, the baselines' losses, DivideMix's division, the collapse monitor, the in-process
count store, posterior windows and the batch type every source yields; ``storage``, where
a run keeps its files (a shared folder or an ``s3://`` prefix, through one pyarrow file
system), and ``options``, the command-line flags of the config fields.

Tensors in, tensors out: nothing here knows about ranks, what a run writes where, Ray,
MLflow or WebDataset. ``numba`` (the CPU kernels) is optional and imported where it is used.

May import: torch, numpy, scikit-learn, pyarrow and the standard library; nothing else of
the project.
"""
