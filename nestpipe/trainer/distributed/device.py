"""The one device layer: which accelerator and which collective backend a rank uses.

cpu -> gloo, cuda -> nccl, npu (Ascend, through an import-guarded ``torch_npu``) -> hccl, or gloo on any device
(``dist_backend``). Everything else in the trainer asks this module; nothing else imports ``torch_npu`` or picks a
backend.

Host-side state (the DRAM embedding store, its optimizer state) always lives on the CPU; only the per-batch
buffers, the dense model and the collectives' payloads live on ``Device.torch``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Device:
    kind: str  # cpu | cuda | npu
    backend: str  # gloo | nccl | hccl
    torch: torch.device

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch)
        elif self.kind == "npu":
            torch.npu.synchronize(self.torch)  # type: ignore[attr-defined]


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())  # type: ignore[attr-defined]


def resolve(kind: str = "auto", local_rank: int = 0, backend: str = "auto") -> Device:
    """The device for this rank: ``auto`` prefers cuda, then npu, then cpu. ``backend``: ``auto`` (the device's
    own: gloo, nccl, hccl) or ``gloo`` on any device (several ranks may then share one GPU)."""
    dev = _resolve(kind, local_rank)
    if backend == "auto":
        return dev
    if backend != "gloo":
        raise ValueError(f"dist_backend {backend!r}: auto or gloo")
    return dataclasses.replace(dev, backend="gloo")


def _resolve(kind: str, local_rank: int) -> Device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else ("npu" if _npu_available() else "cpu")
    if kind == "cpu":
        return Device("cpu", "gloo", torch.device("cpu"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is available")
        idx = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return Device("cuda", "nccl", torch.device("cuda", idx))
    if kind == "npu":
        if not _npu_available():
            raise RuntimeError("--device npu: torch_npu is not installed or no Ascend NPU is visible")
        idx = local_rank % torch.npu.device_count()  # type: ignore[attr-defined]
        torch.npu.set_device(idx)  # type: ignore[attr-defined]
        return Device("npu", "hccl", torch.device("npu", idx))
    raise ValueError(f"unknown device {kind!r} (auto, cpu, cuda, npu)")


def set_flush_denormal(enabled: bool) -> bool:
    """Flush subnormal floats to zero (x86 FTZ + DAZ) in this thread and in every thread it starts from now on
    (a new thread inherits its creator's floating-point environment: the pipeline's stage and communication threads,
    Numba's and torch's pools). Returns whether the setting is in effect (False where the CPU has no such mode, or
    when ``enabled`` is False).

    Why: an x86 core takes a microcode assist, about a hundred times the cost, for every arithmetic operation on a
    subnormal (below 1.2e-38 in float32), and confident predictions produce them (the sigmoid of a logit below
    about -87): once a model fits its training data closely, the gradients that reach the sparse update are full
    of them, and the update and the step slow down several-fold (``docs/trainer.md``). Values that small change no
    parameter that matters. Every schedule (``--pipeline off`` ... ``nested``) runs in the same mode, so their
    bitwise equality is unaffected. Called before the process group starts, so gloo's threads share the mode."""
    ok = bool(torch.set_flush_denormal(bool(enabled)))
    return ok and bool(enabled)


def init_distributed(device: Device, timeout_s: float) -> tuple:
    """Join the process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    The timeout bounds how long a collective waits for a dead or failed peer (gloo's default is 30 minutes).
    Returns (rank, world_size).
    """
    if not dist.is_initialized():
        dist.init_process_group(
            backend=device.backend,
            timeout=datetime.timedelta(seconds=float(timeout_s)),
            device_id=device.torch if device.kind != "cpu" and device.backend != "gloo" else None,
        )
    return dist.get_rank(), dist.get_world_size()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
