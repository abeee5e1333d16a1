"""Planning tools: the sharding planner (``nestpipe plan``) and the step-timeline simulator (``nestpipe simulate``).

Modules: :mod:`.hardware` and :mod:`.workload` (inputs and presets), :mod:`.keys` (unique-key arithmetic of a
Zipf key stream), :mod:`.network` (All2All / AllReduce cost), :mod:`.cost_model` (per-task durations),
:mod:`.timeline` (event-based schedule of the five DBP stages and FWP micro-batches), :mod:`.calibration`,
:mod:`.simulate` (sweeps and figures), :mod:`.measured` (calibration from a measured run of this trainer and
predictions for this machine), :mod:`.validate_local` (held-out validation on trained runs), :mod:`.planner`
(cost-driven greedy sharding), :mod:`.cli`.
"""

from .hardware import HardwareConfig, load_hardware, HARDWARE_PRESETS  # noqa: F401
from .workload import WorkloadConfig, load_workload, WORKLOAD_PRESETS  # noqa: F401
