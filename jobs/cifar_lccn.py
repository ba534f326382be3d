"""LCCN on CIFAR-10 / CIFAR-100 with synthetic label noise, on Ray Train.

The job itself is ``lccn_jobs.datasets.CIFAR`` (the installed job library: :mod:`lccn_jobs`);
``--help`` lists its options. Runs as a plain script (a local Ray) or on a cluster::

    python jobs/cifar_lccn.py --smoke-test
    ray job submit --working-dir . -- python jobs/cifar_lccn.py --run-dir /abs/runs ...
"""

from lccn_jobs.datasets import CIFAR as JOB

get_args_parser, prepare_run, main = JOB.get_args_parser, JOB.prepare_run, JOB.main

if __name__ == "__main__":
    main()
