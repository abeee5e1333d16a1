"""JSON files: one atomic write and one read with a clear error.

:func:`write_json_atomic` writes to a temporary name beside the target and renames it over the target, so a reader
(or a resumed run) sees either the old file or the whole new one, never a partial write. :func:`read_json` names the
file and says what it was expected to be when it is missing or does not parse.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional


class JSONFileError(ValueError):
    """A JSON file that exists but cannot be parsed (or holds the wrong kind of document)."""


def write_json_atomic(path: str, obj: Any, *, indent: Optional[int] = 1, sort_keys: bool = True,
                      fsync: bool = False) -> str:
    """Write ``obj`` as JSON (``indent``, ``sort_keys``, a trailing newline) to ``path`` atomically; ``fsync``: flush
    the bytes to disk before the rename (files that must survive a power loss: manifests, checkpoints).

    The temporary name carries the process id, so ranks or workers writing the same path never share one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, sort_keys=sort_keys)
            f.write("\n")
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def read_json(path: str, what: str = "JSON file", hint: str = "", expect: Optional[type] = None) -> Any:
    """The parsed contents of ``path``. Missing: :class:`FileNotFoundError`; unparsable (or not of type ``expect``):
    :class:`JSONFileError`. Both name the path and ``what`` it should hold; ``hint`` is appended to the missing-file
    message (e.g. ``"is RUN the --out directory of `nestpipe train`?"``)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no {what}" + (f" ({hint})" if hint else ""))
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JSONFileError(f"{path}: cannot parse {what}: {e}") from e
    if expect is not None and not isinstance(doc, expect):
        raise JSONFileError(f"{path}: {what} should hold a JSON {expect.__name__}, found {type(doc).__name__}")
    return doc
