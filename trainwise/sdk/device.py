"""Where a user's job runs: the device, the precision of its autocast, the CPU threads.

`choose(spec_device, precision, cpu_threads, local_rank)` gives a `Placement`:
- device "auto": CUDA (the rank's own GPU, `LOCAL_RANK`) when there is one, else the CPU;
- precision "auto": bf16 autocast on a GPU that supports it, else fp16 (with a GradScaler), and
  fp32 on the CPU (CPU bf16 autocast changes the numbers of a job that was never tuned for it:
  it is asked for explicitly, `precision="bf16"`);
- cpu_threads None: torch's own default (every core); a number: that many intra-op threads.

`to_device(batch)` moves tensors (in dicts, lists, tuples) with non_blocking copies, which the
pinned memory of `run.dataloader` makes asynchronous on a GPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


class DeviceError(ValueError):
    """A device or precision the machine cannot give; the message names the fix."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    precision: str  # fp32, bf16 or fp16
    cpu_threads: int

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Enabled for fp16 only (bf16 and fp32 have the range to need none)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    def to_device(self, batch: Any) -> Any:
        if torch.is_tensor(batch):
            return batch.to(self.device, non_blocking=self.device.type == "cuda")
        if isinstance(batch, dict):
            return {key: self.to_device(value) for key, value in batch.items()}
        if isinstance(batch, list | tuple):
            moved = [self.to_device(value) for value in batch]
            return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
        return batch

    def record(self) -> dict[str, Any]:
        return {"device": str(self.device), "precision": self.precision,
                "cpu_threads": self.cpu_threads}


def choose(device: str = "auto", precision: str = "auto", cpu_threads: int | None = None,
           local_rank: int | None = None) -> Placement:
    if device not in DEVICES:
        raise DeviceError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if precision not in PRECISIONS:
        raise DeviceError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise DeviceError("device 'cuda' was asked for, but torch sees no GPU here "
                          f"(torch {torch.__version__}); use device 'auto' or 'cpu'")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda" or (device == "auto" and has_cuda):
        index = local_rank % max(1, torch.cuda.device_count())
        chosen = torch.device("cuda", index)
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    else:
        chosen = torch.device("cpu")
        if precision == "auto":
            precision = "fp32"
        if precision == "fp16":
            raise DeviceError("precision 'fp16' needs a GPU (CPU autocast runs bf16); use "
                              "'bf16' or 'fp32' on the CPU")
    if cpu_threads is not None:
        if cpu_threads < 1:
            raise DeviceError(f"cpu_threads {cpu_threads} must be >= 1 (or None: every core)")
        torch.set_num_threads(cpu_threads)
    return Placement(chosen, precision, torch.get_num_threads())
