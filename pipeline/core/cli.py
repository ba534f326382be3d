"""Helpers shared by the project's command lines (``lccn-shards``, ``lccn-labelview``,
``lccn-label-issues``). Imports: the standard library only."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path


def prog_name(module: str, argv0: str | None = None) -> str:
    """The program name for usage lines: the console script's name (``lccn-shards``) when
    run as one, else ``python -m <module>``."""
    base = os.path.basename(argv0 if argv0 is not None else (sys.argv[0] if sys.argv else ""))
    if not base or base.endswith(".py") or base in ("-c", "-m"):
        return f"python -m {module}"
    return base


def local_dir(value: str) -> Path:
    """An ``argparse`` type for a run or sweep directory: a path; a URI
    (``s3://bucket/runs``) is refused with one line instead of becoming the local folder
    ``s3:/bucket/runs``."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", value)
    if m:
        raise argparse.ArgumentTypeError(
            f"{value}: the directory must be a path on a file system every node shares "
            f"(NFS, EFS, Filestore, or a bucket mounted with s3fs or gcsfuse); "
            f"{m.group(1)}:// object-store directories are not supported")
    return Path(value)
