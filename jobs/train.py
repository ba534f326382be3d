"""Train on your own images (a class-folder tree or a CSV of path,label), on Ray Train.

The job itself is ``lccn_jobs.own_images.JOB`` (the installed job library: :mod:`lccn_jobs`);
``--help`` lists its options. Runs as a plain script (a local Ray) or on a cluster::

    python jobs/train.py --smoke-test
    ray job submit --working-dir . -- python jobs/train.py --run-dir /abs/runs ...
"""

from lccn_jobs.own_images import JOB as JOB

get_args_parser, prepare_run, main = JOB.get_args_parser, JOB.prepare_run, JOB.main

if __name__ == "__main__":
    main()
