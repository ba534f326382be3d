"""Data: shard manifests and their checks, the per-rank WebDataset stream (split by node,
then worker; shuffle; decode; augment; equal batches per rank), the decode paths (JPEG bytes
to PIL's pixels on the CPU, ``jpeg``; the presets' transforms without v2's dispatch,
``sample_transform``; whole batches decoded and augmented on a device, ``device_decode``;
tar members, ``tario``), transforms and presets, object storage (``s3://``), the per-sample
labels of a split, and the in-memory data sets of the benchmarks and the embedded default
(CIFAR in memory, scikit-learn's digits).

May import: :mod:`pipeline.core`; WebDataset, PIL, torchvision, boto3 (lazily). ``jpeg``,
``sample_transform``, ``device_decode`` and ``pil_build`` import neither WebDataset nor Ray
(a GPU node without them decodes with them).
"""
