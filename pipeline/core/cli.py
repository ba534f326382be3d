"""Helpers shared by the project's command lines (``lccn-shards``, ``lccn-labelview``,
``lccn-label-issues``). Imports: the standard library only."""

from __future__ import annotations

import os
import sys


def prog_name(module: str, argv0: str | None = None) -> str:
    """The program name for usage lines: the console script's name (``lccn-shards``) when
    run as one, else ``python -m <module>``."""
    base = os.path.basename(argv0 if argv0 is not None else (sys.argv[0] if sys.argv else ""))
    if not base or base.endswith(".py") or base in ("-c", "-m"):
        return f"python -m {module}"
    return base
