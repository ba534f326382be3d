"""Helpers shared by the project's command lines (``lccn-shards``, ``lccn-labelview``,
``lccn-label-issues``, the jobs). Imports: the standard library and
:mod:`pipeline.core.storage`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.core import storage


def prog_name(module: str, argv0: str | None = None) -> str:
    """The program name for usage lines: the console script's name (``lccn-shards``) when
    run as one, else ``python -m <module>``."""
    base = os.path.basename(argv0 if argv0 is not None else (sys.argv[0] if sys.argv else ""))
    if not base or base.endswith(".py") or base in ("-c", "-m"):
        return f"python -m {module}"
    return base


def run_location(value: str) -> Path | str:
    """An ``argparse`` type for a run directory: a path (a ``Path``), or an
    ``s3://bucket/prefix`` (a ``str``, :mod:`pipeline.core.storage`); another scheme is
    refused with one line."""
    try:
        loc = storage.check_location(value, what="a run directory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return loc if storage.is_remote(loc) else Path(loc)
