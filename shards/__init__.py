"""Datasets to WebDataset tar shards: one small converter per source (CIFAR, Clothing1M,
WebVision, an image tree, a CSV) sharing one writer, the label views over a converted split
(``lccn-labelview``), and the ``lccn-shards`` command.

May import: :mod:`pipeline.core`, :mod:`pipeline.data`.
"""
