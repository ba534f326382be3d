"""DivideLCCN on WebVision (mini or full), on Ray Train.

The job itself is ``lccn_jobs.datasets.WEBVISION`` (the installed job library: :mod:`lccn_jobs`);
``--help`` lists its options. Runs as a plain script (a local Ray) or on a cluster::

    python jobs/webvision_divide_lccn.py --smoke-test
    ray job submit --working-dir . -- python jobs/webvision_divide_lccn.py --run-dir /abs/runs ...
"""

from lccn_jobs.datasets import WEBVISION as JOB

get_args_parser, prepare_run, main = JOB.get_args_parser, JOB.prepare_run, JOB.main

if __name__ == "__main__":
    main()
