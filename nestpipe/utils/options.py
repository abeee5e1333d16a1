"""Configuration fields that carry their meaning: ``opt(default, help, choices=..., minimum=...)`` in a dataclass.

The metadata is what a config's one validation pass checks (allowed values, lower bound) and what its
``--help-config`` listing prints (see :mod:`nestpipe.trainer.config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
        choices: Optional[Tuple] = None, minimum: Optional[float] = None) -> Any:
    """A config field with its meaning (``help``) and, optionally, its allowed values or lower bound."""
    meta = {"help": help, "choices": choices, "minimum": minimum}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
