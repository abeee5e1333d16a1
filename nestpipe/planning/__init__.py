"""Planning tools: the sharding planner (``nestpipe plan``) and the step-timeline simulator (``nestpipe simulate``).

Modules: :mod:`.hardware` and :mod:`.workload` (inputs and presets), :mod:`.keys` (unique-key arithmetic of a
Zipf key stream), :mod:`.network` (All2All / AllReduce cost), :mod:`.cost_model` (per-task durations),
:mod:`.timeline` (event-based schedule of the five DBP stages and FWP micro-batches), :mod:`.calibration`,
:mod:`.simulate` (sweeps and figures), :mod:`.planner` (cost-driven greedy sharding), :mod:`.cli` (``nestpipe
plan``).

The package is pure (no trainer, no measured run) and sits below the trainer, which plans its sharding with it.
What measures this trainer's runs (``simulate --calibrate RUN``, the dense probe, held-out validation) is in
:mod:`nestpipe.measure`, above the trainer.
"""

from .hardware import HardwareConfig, load_hardware, HARDWARE_PRESETS  # noqa: F401
from .workload import WorkloadConfig, load_workload, WORKLOAD_PRESETS  # noqa: F401
