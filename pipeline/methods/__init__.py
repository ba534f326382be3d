"""Training methods as plug-ins of the engine (:mod:`pipeline.engine`), one module each,
registered by the name ``RunConfig.method`` takes. See :class:`pipeline.methods.base.Method`
for the interface and ``docs/design.md`` for how to add one."""

from pipeline.methods.base import Method, get_method, register, registered

# the built-in methods register themselves on import
from pipeline.methods import ce as _ce  # noqa: E402,F401
from pipeline.methods import divide as _divide  # noqa: E402,F401
from pipeline.methods import lccn as _lccn  # noqa: E402,F401
from pipeline.methods import bootstrap as _bootstrap  # noqa: E402,F401
from pipeline.methods import forward as _forward  # noqa: E402,F401
from pipeline.methods import sadapt as _sadapt  # noqa: E402,F401
from pipeline.methods import trevision as _trevision  # noqa: E402,F401

__all__ = ["Method", "get_method", "register", "registered"]
