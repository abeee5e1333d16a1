"""Shared config-file helpers: dataclasses from presets, JSON or TOML files, and ``key=value`` overrides."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Type

from nestpipe.utils.jsonio import read_json


def read_mapping(path: str, what: str) -> Dict[str, Any]:
    """Parse a JSON or TOML file into a dict; errors name the file and ``what`` it was meant to be."""
    if not path.endswith(".toml"):
        return read_json(path, f"{what} file", expect=dict)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no {what} file")
    # standard library from Python 3.11 (the package supports 3.10): only a TOML file needs it
    import tomllib

    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot parse {what} file: {e}") from e
    return d


def build(cls: Type, d: Dict[str, Any], where: str):
    """``cls(**d)`` with unknown keys and wrong types reported by name."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    for k in d:
        if k not in names:
            raise ValueError(f"{where}: unknown key {k!r} for {cls.__name__} (known: {sorted(names)})")
    obj = cls(**d)
    validate = getattr(obj, "validate", None)
    if validate:
        validate(where)
    return obj


def parse_overrides(items, where: str) -> Dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (values parsed as JSON when possible)."""
    out: Dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{where}: expected KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def resolve(cls: Type, presets: Dict[str, Any], spec: str, overrides: Dict[str, Any], what: str):
    """A preset name or a JSON/TOML file (optionally ``{"preset": NAME, ...overrides}``), then overrides."""
    if spec in presets:
        base = dataclasses.asdict(presets[spec])
        where = f"{what} preset {spec!r}"
    elif os.path.exists(spec) or spec.endswith((".json", ".toml")):
        d = read_mapping(spec, what)
        where = spec
        preset = d.pop("preset", None)
        if preset is not None:
            if preset not in presets:
                raise ValueError(f"{spec}: unknown {what} preset {preset!r} (known: {sorted(presets)})")
            base = {**dataclasses.asdict(presets[preset]), **d}
        else:
            base = d
    else:
        raise ValueError(f"unknown {what} {spec!r}: not a preset ({', '.join(sorted(presets))}) nor a file")
    return build(cls, {**base, **overrides}, where)
