"""The job library: what the entry scripts in ``jobs/`` and the sweeps in :mod:`tune` share,
installed beside :mod:`pipeline` so that both import it by name (a script under
``ray job submit --working-dir .`` finds it in the uploaded working directory, which Ray
puts first on the job's ``PYTHONPATH``).

    recipes     the training recipes as data (RunConfig points) and the presets table
    cli         the shared command line (run options, config flags, data options)
    configs     parsed arguments + a recipe -> the run's configs; the pre-Ray checks
    sources     shard sources, label views, --smoke-test's generated shards
    reporting   the end of a run: summary, results JSON, label-issue report
    driver      the Ray Train settings, run_job (fit on Ray), the Job interface
    datasets    the jobs on converted shards (CIFAR, Clothing1M, WebVision), as data
    own_images  the job on one's own images (jobs/train.py)
    digits      the distributed quickstart (jobs/quickstart_ray.py)
    catalog     the jobs by their sweep name

May import: :mod:`pipeline` (every subpackage), :mod:`shards`; Ray and MLflow.
"""
