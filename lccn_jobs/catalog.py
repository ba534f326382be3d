"""The jobs by the name a sweep gives them (``python -m tune.sweep --job NAME``), each a
:class:`lccn_jobs.driver.Job` whose script is ``jobs/<job.name>.py``."""

from __future__ import annotations

from lccn_jobs.datasets import CIFAR, CLOTHING1M, WEBVISION
from lccn_jobs.digits import DIGITS
from lccn_jobs.driver import Job
from lccn_jobs.own_images import JOB as OWN_IMAGES

JOBS: dict[str, Job] = {"quickstart": DIGITS, "cifar": CIFAR, "clothing1m": CLOTHING1M,
                        "webvision": WEBVISION, "train": OWN_IMAGES}
