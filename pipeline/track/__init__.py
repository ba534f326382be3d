"""Tracking and reporting: the MLflow client of a run (batched metrics, params, artifacts),
the plots logged as artifacts (transition heat maps, accuracy curves), and the label-issue
report built from a run's checkpoint.

May import: :mod:`pipeline.core`, :mod:`pipeline.data`; MLflow, matplotlib, cleanlab
(lazily).
"""
