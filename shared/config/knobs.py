"""Knobs: a config field that is also a command-line flag, declared once with its default, help, choices and
bounds (`flag`), re-declared by the configs that take it too (`same_as`), turned into argparse flags and back."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, field, fields
from typing import Any

REQUIRED: Any = MISSING  # flag(REQUIRED, ...): a flag without default


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
         bounds: tuple[float, float | None] | None = None) -> Any:
    """A config field that is also a command-line flag: its default, help, choices and inclusive
    `bounds` (lo, hi or None) are written once, here; `add_flags` turns the dataclass into argparse
    flags (`--kebab-case` of the field name), `check_bounds` holds a value to its bounds, and other
    configs that take the same knob re-declare it with `same_as` (the deployment description and the
    chart's values.yaml are checked against these declarations by tests/test_config_source.py)."""
    meta = {"help": help, "choices": choices, "bounds": bounds, "required": default is MISSING}
    if default is MISSING:
        return field(metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def same_as(cls: type, name: str) -> Any:
    """Field `name` of config `cls` declared again, same default, help, choices and bounds: a knob
    several configs take (engine, service, deployment) is declared once, on the lowest of them."""
    f = cls.__dataclass_fields__[name]
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def knob_default(cls: type, name: str) -> Any:
    """The declared default of field `name` of config `cls`."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def knob_choices(cls: type, name: str) -> tuple[str, ...]:
    """The declared choices of field `name` of config `cls`."""
    return cls.__dataclass_fields__[name].metadata["choices"]


def check_bounds(obj: Any, label: Callable[[str], str] = str) -> None:
    """Raise ValueError, naming the field as `label(name)` does, for a value outside its flag's bounds
    or choices."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        bounds, choices = f.metadata.get("bounds"), f.metadata.get("choices")
        if bounds and value is not None:
            lo, hi = bounds
            if value != value:  # NaN compares false with every bound
                raise ValueError(f"{label(f.name)}: expected a number, got {value}")
            if value < lo or (hi is not None and value > hi):
                raise ValueError(f"{label(f.name)}: expected " + (f"at least {lo}" if hi is None else f"{lo}..{hi}")
                                 + f", got {value}")
        if choices and value is not None and value not in choices:
            raise ValueError(f"{label(f.name)}: expected one of {', '.join(choices)}, got {value!r}")


def add_flags(p: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None) -> None:
    """One flag per `flag()` field of dataclass `cls` (or the fields named in `only`):
    bool → store_true, tuple/list → comma-separated."""
    for f in fields(cls):
        if "help" not in f.metadata or (only is not None and f.name not in only):
            continue
        name = flag_name(f.name)
        kind = str(f.type)
        default = f.default if f.default_factory is MISSING else f.default_factory()  # type: ignore[misc]
        default = None if default is MISSING else default
        help_ = f.metadata["help"] + ("" if f.metadata["required"] or "%(default)" in f.metadata["help"]
                                      or default in (None, False, (), []) else " (default: %(default)s)")
        if kind == "bool":
            p.add_argument(name, action="store_true", help=help_)
        elif kind.startswith(("tuple", "list")):
            p.add_argument(name, default=",".join(default or ()), required=f.metadata["required"], help=help_)
        else:
            conv = int if kind.startswith("int") else float if kind.startswith("float") else str
            p.add_argument(name, type=conv, default=None if f.metadata["required"] else default,
                           choices=f.metadata["choices"], required=f.metadata["required"], help=help_)


def from_flags(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass from parsed flags (comma-separated values become tuples / lists)."""
    values = {}
    for f in fields(cls):
        if not hasattr(args, f.name):
            continue
        value, kind = getattr(args, f.name), str(f.type)
        if kind.startswith(("tuple", "list")) and isinstance(value, str):
            items = [x for x in value.split(",") if x]
            value = tuple(items) if kind.startswith("tuple") else items
        values[f.name] = value
    return cls(**values)



def flag_name(field_name: str) -> str:
    """--kebab-case: how a config field is spelled on the command line."""
    return "--" + field_name.replace("_", "-")


def parse_flags(cls: type, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> Any:
    """Config `cls` from the command line: its flags added to `parser`, parsed, built; a value outside a
    flag's bounds exits like any bad flag (usage, the flag named, status 2), not with a traceback."""
    add_flags(parser, cls)
    args = parser.parse_args(argv)
    try:
        return from_flags(cls, args)
    except ValueError as exc:
        parser.error(str(exc))
