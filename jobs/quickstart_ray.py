"""Quickstart of the distributed stack: LCCN vs cross-entropy on the noisy digits, two Ray
Train workers, the confusion actor and MLflow.

The job itself is ``lccn_jobs.digits.DIGITS`` (the installed job library: :mod:`lccn_jobs`);
``--help`` lists its options. Runs as a plain script (a local Ray) or on a cluster::

    python jobs/quickstart_ray.py
    ray job submit --working-dir . -- python jobs/quickstart_ray.py --run-dir /abs/runs ...
"""

from lccn_jobs.digits import DIGITS as JOB

get_args_parser, prepare_run, main = JOB.get_args_parser, JOB.prepare_run, JOB.main

if __name__ == "__main__":
    main()
