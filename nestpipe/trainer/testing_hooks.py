"""Test-only hooks: the negative controls that must break a correctness test, and fault and timing injection.

None of these is a training option: they are not in :class:`~nestpipe.trainer.config.TrainConfig`, never written to
``RUN/config.json`` and never read from a config file, nor from a global by the code they alter: the training loop
receives them as a parameter (:func:`nestpipe.trainer.loop.train_worker`, ``hooks=``) and hands each component
the plain values it needs at construction. Tests set them for one run through the environment of the ranks
(:func:`as_env`, read by the rank's entry point with :func:`from_env`), per run of a measure plan
(:mod:`nestpipe.measure.launcher`), or in-process with :func:`make`. A run with a hook set prints it at start and
records it in ``metrics.json`` (``testing_hooks``), so such a run cannot pass for a normal one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import typing
from typing import Any, Dict

from nestpipe.utils.options import annotation_name, value_fits

ENV_VAR = "NESTPIPE_TESTING_HOOKS"


@dataclasses.dataclass(frozen=True)
class TestingHooks:
    """Every field's default is the production behaviour."""

    __test__ = False  # not a pytest test class

    # negative controls: each one breaks an invariant that a test asserts
    requester_salt: int = 0  # requesters route with another placement salt than owners use
    skip_replica_sync: bool = False  # 2D-SP: replicas are not synchronised across groups (they diverge)
    skip_dual_buffer_sync: bool = False  # DBP: rows of keys(t) ∩ keys(t+1) are not copied into t+1's buffer
    update_per_micro_batch: bool = False  # FWP: the update runs after every micro-batch (the window is not frozen)
    replica_refresh_own_keys_only: bool = False  # 2D-SP + DBP: the sync refreshes only the group's own keys(t)
    skip_tier_write_back: bool = False  # tier=mmap: updated rows evicted from the DRAM cache are not written back
    route_ahead_repeat_record: bool = False  # pipe.route_ahead: the batch routed ahead is this step's again (stale)
    late_write_back: bool = False  # DBP write-back stream: a batch's rows reach the store one retrieval too late
    # faults and timing: raise on ``fail_rank`` at step ``fail_step``; sleep inside checkpoint writes or between
    # retrieval and forward (a batch in flight), so a test can kill the run there
    fail_step: int = -1
    fail_rank: int = 0
    checkpoint_sleep_s: float = 0.0
    step_sleep_s: float = 0.0
    # observation: the DBP stage streams run on a recording stand-in for the device's stream API (CPU too), and the
    # order of their copies, events and waits is written to ``PREFIX.rankR.json`` (pipeline/streams.py)
    record_streams: str = ""

    def pause(self) -> None:
        """``step_sleep_s``: a window, between a batch's retrieval and its forward, to kill the run with the batch
        in flight (nothing in production)."""
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)

    def changed(self) -> Dict[str, Any]:
        """The hooks that differ from production, by name (empty in a normal run)."""
        default = TestingHooks()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def parse(text: str, where: str = ENV_VAR) -> TestingHooks:
    """Hooks from a JSON object of field names to values; unknown names and wrong types are refused."""
    try:
        doc = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object of hook names to values")
    hints = typing.get_type_hints(TestingHooks)
    kwargs = {}
    for name, value in doc.items():
        if name not in hints:
            known = ", ".join(sorted(f.name for f in dataclasses.fields(TestingHooks)))
            raise ValueError(f"{where}: unknown testing hook {name!r} (known: {known})")
        if not value_fits(value, hints[name]):
            raise ValueError(f"{where}: testing hook {name} = {value!r}: expected {annotation_name(hints[name])}")
        kwargs[name] = float(value) if hints[name] is float else value
    return TestingHooks(**kwargs)


PRODUCTION = TestingHooks()


def from_env(environ=None) -> TestingHooks:
    """The hooks ``$NESTPIPE_TESTING_HOOKS`` sets (production where unset): read by a rank process's entry point
    (:mod:`nestpipe.trainer.launch`) and handed to :func:`nestpipe.trainer.loop.train_worker`."""
    return parse((os.environ if environ is None else environ).get(ENV_VAR, ""))


def make(**hooks: Any) -> TestingHooks:
    """Hooks from keyword arguments, validated as the environment's are (unknown names and wrong types refused)."""
    return parse(json.dumps(hooks), where="testing hooks")


def as_env(**hooks: Any) -> Dict[str, str]:
    """The environment entry that sets ``hooks`` in processes started with it (validated here first)."""
    text = json.dumps(hooks, sort_keys=True)
    parse(text)
    return {ENV_VAR: text}
