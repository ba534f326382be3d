"""Data: shard manifests and their checks, the per-rank WebDataset stream (split by node,
then worker; shuffle; decode; augment; equal batches per rank), transforms and presets,
object storage (``s3://``), the per-sample labels of a split, and the in-memory data sets
of the benchmarks and the embedded default (CIFAR in memory, scikit-learn's digits).

May import: :mod:`pipeline.core`; WebDataset, PIL, torchvision, boto3 (lazily).
"""
