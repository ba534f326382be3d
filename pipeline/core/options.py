"""Command-line flags of the config fields, declared once.

Every :class:`~pipeline.core.config.RunConfig` field a user sets from a command line has one
entry in :data:`FLAGS` (flag -> the field's path in the RunConfig); its type, default,
choices and help come from the dataclass: the field's annotation, its default, its
``metadata["choices"]`` and its entry in the class docstring (``name: text``). The jobs, the
quickstart, the benchmarks and the Tune sweeps add these flags with :func:`add_options` and
read them back into a RunConfig with :func:`apply_options`; a sampled Tune point (keys such
as ``"lccn.alpha"``) goes through :func:`apply_point`, the same setter. A program decides
only which flags it offers and, where its protocol differs from the library's, their
defaults.

Imports nothing above :mod:`pipeline.core`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline.core.config import RunConfig

# flag -> the field's path in RunConfig ("seed", "optim.lr", ...)
FLAGS: dict[str, str] = {
    "--seed": "seed",
    "--val-fraction": "val_fraction",
    "--model": "model.name",
    "--bn-momentum": "model.bn_momentum",
    "--weights": "model.weights",
    "--epochs": "optim.epochs",
    "--pretrain-epochs": "optim.pretrain_epochs",
    "--batch-size": "optim.batch_size",
    "--lr": "optim.lr",
    "--milestones": "optim.milestones",
    "--lr-decay": "optim.lr_decay",
    "--weight-decay": "optim.weight_decay",
    "--ema-decay": "optim.ema_decay",
    "--norm-weight-decay": "optim.norm_weight_decay",
    "--alpha": "lccn.alpha",
    "--prior-strength": "lccn.prior_strength",
    "--warmup-steps": "lccn.warmup_steps",
    "--warmup": "lccn.warmup",
    "--warmup-prior": "lccn.warmup_prior",
    "--init": "lccn.init",
    "--targets": "lccn.targets",
    "--ramp-epochs": "lccn.ramp_epochs",
    "--guard-drop": "lccn.guard_drop",
    "--guard-patience": "lccn.guard_patience",
    "--guard-targets": "lccn.guard_targets",
    "--guard-prior-strength": "lccn.guard_prior_strength",
    "--guard-floor": "lccn.guard_floor",
    "--guard-rise": "lccn.guard_rise",
    "--guard-sampler": "lccn.guard_sampler",
    "--teacher": "lccn.teacher",
    "--warmup-weights": "lccn.warmup_weights",
    "--refresh-steps": "lccn.refresh_steps",
    "--commit-every": "lccn.commit_every",
    "--report-epochs": "lccn.report_epochs",
    "--anneal": "lccn.anneal",
    "--outlier": "lccn.outlier",
    "--outlier-prior": "lccn.outlier_prior",
    "--stop-on-collapse": "monitor.stop",
    "--collapse-val-drop": "monitor.val_drop",
    "--p-threshold": "divide.p_threshold",
    "--mixmatch-alpha": "divide.mixmatch_alpha",
    "--lambda-u": "divide.lambda_u",
    "--temperature": "divide.temperature",
    "--conf-penalty": "divide.conf_penalty",
    "--division-loss": "divide.division_loss",
    "--compile": "perf.compile",
    "--amp": "perf.amp",
    "--bootstrap-beta": "baseline.bootstrap_beta",
    "--transition": "baseline.transition",
    "--transition-file": "baseline.transition_file",
    "--revision-fraction": "baseline.revision_fraction",
}

UNSET = "unset"  # add_options(defaults=...) value: the flag defaults to None (a recipe's)


def dest(flag: str) -> str:
    """The attribute a flag is parsed into (``--warmup-steps`` -> ``warmup_steps``)."""
    return flag.lstrip("-").replace("-", "_")


def _owner(path: str) -> tuple[type, str]:
    """The config class holding the field at ``path`` and the field's name."""
    cls: type = RunConfig
    *parents, name = path.split(".")
    for part in parents:
        cls = typing.get_type_hints(cls)[part]
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise KeyError(f"{cls.__name__} has no field {name!r} (path {path!r})")
    return cls, name


def field_doc(cls: type, name: str) -> str:
    """The text of ``name``'s entry in ``cls``' docstring (``name: text``, or a shared
    ``a, b: text``), its lines joined; '' without one."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        m = re.match(r"^([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (.*)$", line)
        if m:
            current = [m.group(2)]
            for key in m.group(1).split(", "):
                entries[key] = current
        elif current is not None and line.startswith("    "):
            current.append(line.strip())
        else:
            current = None
    return " ".join(entries.get(name, []))


def _plain(text: str) -> str:
    """Docstring markup made plain for ``--help``: ``x`` -> x, :func:`~a.b` -> b."""
    text = re.sub(r":[a-z]+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1]
                  if m.group(0).startswith(":class:`~") else m.group(1), text)
    return text.replace("``", "")


def _first_sentence(text: str) -> str:
    m = re.search(r"(?<=[a-z0-9)\]`'\"])\. (?=[A-Z(`\"'])", text)
    return text[:m.start() + 1] if m else text


def _base_type(hint: Any) -> tuple[Any, bool]:
    """``(scalar type, is a tuple)`` of an annotation such as ``float | None`` or
    ``tuple[int, ...]``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return args[0], True
    return hint, False


def option_spec(flag: str) -> dict[str, Any]:
    """``add_argument`` keywords of ``flag`` from its field (type, choices, help, the
    library default); see :func:`add_options`."""
    path = FLAGS[flag]
    cls, name = _owner(path)
    fld = next(f for f in dataclasses.fields(cls) if f.name == name)
    scalar, many = _base_type(typing.get_type_hints(cls)[name])
    default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
    doc = _first_sentence(_plain(field_doc(cls, name)))
    spec: dict[str, Any] = {"dest": dest(flag), "default": default,
                            "help": f"{doc} ({cls.__name__}.{name})" if doc else
                            f"{cls.__name__}.{name}"}
    if scalar is bool:
        spec["action"] = argparse.BooleanOptionalAction
    else:
        spec["type"] = fld.metadata.get("parse", scalar)
        if many:
            spec["nargs"] = "*"
            spec["default"] = list(default)
    if "choices" in fld.metadata:
        spec["choices"] = tuple(fld.metadata["choices"])
    return spec


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                flags: Iterable[str], *, defaults: Mapping[str, Any] | None = None,
                notes: Mapping[str, str] | None = None,
                choices: Mapping[str, Iterable[str]] | None = None,
                unset: str = "the recipe's") -> None:
    """Add ``flags`` (keys of :data:`FLAGS`) to ``parser``. Each defaults to its field's
    library default unless ``defaults`` names it: a value (the program's protocol), or
    :data:`UNSET` (None: the program fills it later, e.g. from a recipe; the help then says
    ``default: <unset>``). ``notes`` appends a program's own remark to a flag's help; ``choices`` overrides a
    field's choices (the method list comes from the method registry)."""
    defaults, notes, choices = defaults or {}, notes or {}, choices or {}
    unknown = (set(defaults) | set(notes) | set(choices)) - set(flags)
    if unknown:
        raise ValueError(f"add_options: {sorted(unknown)} are not among the flags added")
    for flag in flags:
        spec = option_spec(flag)
        if flag in choices:
            spec["choices"] = tuple(choices[flag])
        default = defaults.get(flag, spec["default"])
        if default is UNSET:
            spec["default"] = None
            shown = unset
        else:
            spec["default"] = list(default) if isinstance(default, tuple) else default
            shown = "%(default)s"
        note = f"; {notes[flag]}" if flag in notes else ""
        spec["help"] = f"{spec['help']}{note}".replace("%", "%%") + f" (default: {shown})"
        parser.add_argument(flag, **spec)


def section_title(path: str) -> str:
    """The title of the help group of a field: its config class and the first line of the
    class' docstring."""
    cls, _ = _owner(path)
    first = _plain(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " "))
    return f"{cls.__name__}: {_first_sentence(first).rstrip('.')}"


def add_option_groups(parser: argparse.ArgumentParser, flags: Iterable[str],
                      **kwargs: Any) -> None:
    """:func:`add_options` with one help group per config class (``RunConfig``,
    ``OptimConfig``, ``LCCNConfig``...), in the order of ``flags``; ``kwargs`` as there,
    each applied to the flags it names."""
    groups: dict[str, list[str]] = {}
    for flag in flags:
        groups.setdefault(section_title(FLAGS[flag]), []).append(flag)
    for title, members in groups.items():
        sub = {k: {f: v for f, v in d.items() if f in members} for k, d in kwargs.items()
               if d is not None}
        add_options(parser.add_argument_group(title), members, **sub)


def value_at(run: RunConfig, path: str) -> Any:
    """The value of the field ``path`` (``"lccn.targets"``, or a plain RunConfig field such
    as ``"method"``) of ``run``: what :func:`apply_point` sets."""
    section, _, name = path.rpartition(".")
    return getattr(getattr(run, section), name) if section else getattr(run, name)


def apply_point(run: RunConfig, point: Mapping[str, Any]) -> RunConfig:
    """``run`` with the fields named in ``point`` replaced (``{"lccn.alpha": 0.5}`` sets
    ``run.lccn.alpha``). Each nested frozen config is rebuilt with ``dataclasses.replace``, so
    its ``__post_init__`` checks the new values.

    Raises ValueError naming the key for an unknown section or field, or for a value the
    config refuses.
    """
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    top_fields = {f.name for f in dataclasses.fields(run)}
    for key, value in point.items():
        section, _, name = key.rpartition(".")
        if not section:
            if key not in top_fields or dataclasses.is_dataclass(getattr(run, key)):
                raise ValueError(f"config key {key!r}: not a plain RunConfig field "
                                 f"(fields: {sorted(top_fields)})")
            top[key] = value
            continue
        sub = getattr(run, section, None) if "." not in section else None
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ValueError(f"config key {key!r}: RunConfig has no config section "
                             f"{section!r}")
        fields = {f.name for f in dataclasses.fields(sub)}
        if name not in fields:
            raise ValueError(f"config key {key!r}: {type(sub).__name__} has no field "
                             f"{name!r} (fields: {sorted(fields)})")
        nested.setdefault(section, {})[name] = value
    for section, values in nested.items():  # a bad value: the config's own ValueError
        top[section] = dataclasses.replace(getattr(run, section), **values)
    return dataclasses.replace(run, **top)


def options_point(args: argparse.Namespace, flags: Iterable[str] | None = None
                  ) -> dict[str, Any]:
    """The point (field path -> value) of every flag of ``flags`` (default: every flag of
    :data:`FLAGS` that ``args`` has) that is set in ``args`` (not None); lists as tuples."""
    names = FLAGS if flags is None else flags
    point = {FLAGS[f]: getattr(args, dest(f)) for f in names
             if getattr(args, dest(f), None) is not None}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in point.items()}


def apply_options(run: RunConfig, args: argparse.Namespace,
                  flags: Iterable[str] | None = None) -> RunConfig:
    """``run`` with the value of every flag of ``flags`` (default: every flag of
    :data:`FLAGS` that ``args`` has) that is set in ``args`` (not None):
    :func:`apply_point` of :func:`options_point`."""
    return apply_point(run, options_point(args, flags))
