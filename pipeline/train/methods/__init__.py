"""Training methods as plug-ins of the engine (:mod:`pipeline.train.engine`), one module each,
registered by the name ``RunConfig.method`` takes. See :class:`pipeline.train.methods.base.Method`
for the interface and ``docs/design.md`` for how to add one."""

from pipeline.train.methods import bootstrap as _bootstrap  # noqa: E402,F401

# the built-in methods register themselves on import
from pipeline.train.methods import ce as _ce  # noqa: E402,F401
from pipeline.train.methods import divide as _divide  # noqa: E402,F401
from pipeline.train.methods import forward as _forward  # noqa: E402,F401
from pipeline.train.methods import lccn as _lccn  # noqa: E402,F401
from pipeline.train.methods import sadapt as _sadapt  # noqa: E402,F401
from pipeline.train.methods import trevision as _trevision  # noqa: E402,F401
from pipeline.train.methods.base import Method, get_method, register, registered

__all__ = ["Method", "get_method", "register", "registered"]
