"""Where the benchmarks find their data by default (``--data`` chooses another folder): a
``shared/data`` folder beside the checkout, holding the CIFAR-10 JPEG tarball and, under
``cifar10n/``, CIFAR-10N's human labels of its training images (Wei et al. 2022)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# CIFAR-10N's labels of the training JPEGs (columns key, aggre, random1; the key
# train/<class>/<k:04d>), under the data folder
HUMAN_LABELS = Path("cifar10n") / "cifar10n-aggre-random1.csv"
