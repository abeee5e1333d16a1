"""Configuration fields that carry their meaning: ``opt(default, help, choices=..., minimum=...)`` in a dataclass.

The metadata is what a config's one validation pass checks (allowed values, lower bound) and what its
``--help-config`` listing prints (see :mod:`nestpipe.trainer.config`); :func:`value_fits` checks a value against
its field's annotation.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Optional, Tuple


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
        choices: Optional[Tuple] = None, minimum: Optional[float] = None) -> Any:
    """A config field with its meaning (``help``) and, optionally, its allowed values or lower bound."""
    meta = {"help": help, "choices": choices, "minimum": minimum}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def value_fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` (as parsed from JSON/TOML, lists already tuples) fits the annotation ``kind``: bool, int
    (not bool), float (int accepted), str, Optional/Union, Tuple[X, ...], Dict[K, V]."""
    origin = typing.get_origin(kind)
    if origin is typing.Union:
        return any(value_fits(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        return isinstance(value, tuple) and all(value_fits(v, item) for v in value)
    if origin is dict:
        key, val = typing.get_args(kind)
        return isinstance(value, dict) and all(value_fits(k, key) and value_fits(v, val) for k, v in value.items())
    return isinstance(value, kind)


def annotation_name(kind: Any) -> str:
    """``kind`` in the words of a config file: ``int or null``, ``list of int``, ``table of str -> str``."""
    origin = typing.get_origin(kind)
    if origin is typing.Union:
        return " or ".join(annotation_name(k) for k in typing.get_args(kind))
    if kind is type(None):
        return "null"
    if origin is tuple:
        return f"list of {annotation_name(typing.get_args(kind)[0])}"
    if origin is dict:
        return "table of " + " -> ".join(annotation_name(a) for a in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows an option's default, except where there is none to show (required options, None)."""

    def _get_help_string(self, action):
        if action.required or action.default is None or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)
