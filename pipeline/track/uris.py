"""URIs as the project shows them: the password of a URI's user information never appears
in what it prints, logs as an MLflow parameter or writes into a results file.

Imports: the standard library only (a Ray Train worker imports it without MLflow).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit


def redact_uri(uri: str | None) -> str | None:
    """``uri`` with the password of its user information replaced by ``***``
    (``http://user:***@host:5000``): what the project prints, logs as a parameter or writes
    into a results file. Unchanged without a password; None stays None. Credentials are
    better passed in MLflow's own variables (``MLFLOW_TRACKING_USERNAME``,
    ``MLFLOW_TRACKING_PASSWORD``), which never appear in a URI."""
    if not uri or "@" not in uri or "://" not in uri:
        return uri
    parts = urlsplit(uri)
    if "@" not in parts.netloc or parts.password is None:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def redact_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with :func:`redact_uri` applied to every argument (``--tracking-uri=...``
    too)."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        out.append(f"{flag}={redact_uri(value)}" if eq and a.startswith("--")
                   else redact_uri(a))
    return out
