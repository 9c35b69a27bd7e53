"""An AsyncStager that snapshots a state dict into reusable buffers under a memory budget.

The training loop pays only for this copy. Buffers are kept between saves, keyed by the
tensor's path, shape and dtype, so after the first save a snapshot is a plain ``copy_`` into
memory that is already mapped (no allocation, no page faults: cheaper than ``clone``). On CUDA
the buffers are pinned so the device-to-host copy is asynchronous; ``device`` says where the
snapshot lands (``"cpu"`` on this machine). The budget bounds the bytes of buffers held: a
state that does not fit raises ``ValueError`` instead of silently growing host memory.

Used on its own with ``dcp.async_save(..., async_stager=BufferStager())``. A buffer is
reused only once the snapshot staged into it is no longer held (by a save still writing
it, or by the caller): each snapshot is a tensor of its own over the buffer, and the stager
keeps a weak reference to the last one. A save started before the previous one is done
gets fresh buffers (which the stager keeps from then on) instead of overwriting what that
save is still writing: the memory budget bounds one snapshot's buffers, and saves that
overlap each hold their own until they are written.
"""
from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager


@dataclasses.dataclass(frozen=True)
class StagerConfig:
    """``memory_budget``: max bytes of staging buffers (None: unbounded)."""

    device: str = "cpu"
    memory_budget: int | None = None
    pin_memory: bool | None = None  # None: pin when CUDA is available

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes, got {self.memory_budget}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device: not a torch device: {self.device!r}") from exc


def tensor_bytes(state: Any) -> int:
    """Total bytes of the tensors in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


class BufferStager(AsyncStager):
    """Snapshot into cached (pinned on CUDA) buffers; ``close`` releases them."""

    _synchronize_after_execute = False

    def __init__(self, *, device: str = "cpu", memory_budget: int | None = None,
                 pin_memory: bool | None = None) -> None:
        self.config = StagerConfig(device, memory_budget, pin_memory)
        self._buffers: dict[tuple, torch.Tensor] = {}
        # the snapshot last handed out over each buffer: while alive, the buffer is in use
        self._handed: dict[tuple, weakref.ref] = {}
        self._pending_cuda = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state_dict: dict) -> dict:
        needed = tensor_bytes(state_dict)
        budget = self.config.memory_budget
        if budget is not None and needed > budget:
            raise ValueError(f"memory_budget={budget} bytes is smaller than the state to snapshot ({needed} bytes)")
        used: set[tuple] = set()
        out = self._stage(state_dict, (), used)
        for key in [k for k in self._buffers if k not in used]:
            del self._buffers[key]  # tensors that left the state: free their buffers
            self._handed.pop(key, None)
        return out

    def synchronize_staging(self) -> None:
        if self._pending_cuda:
            torch.cuda.synchronize()
            self._pending_cuda = False

    def close(self) -> None:
        self.synchronize_staging()
        self._buffers.clear()
        self._handed.clear()

    def _pin(self) -> bool:
        if self.config.pin_memory is not None:
            return self.config.pin_memory
        return torch.cuda.is_available() and torch.device(self.config.device).type == "cpu"

    def _stage(self, obj: Any, path: tuple, used: set) -> Any:
        if isinstance(obj, dict):
            return {k: self._stage(v, path + (k,), used) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._stage(v, path + (i,), used) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._stage(v, path + (i,), used) for i, v in enumerate(obj))
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                return obj.detach().to(self.config.device, copy=True)  # DTensor & co: no reuse
            key = (path, tuple(obj.shape), obj.dtype)
            buf = self._buffers.get(key)
            handed = self._handed.get(key)
            if buf is None or (handed is not None and handed() is not None):
                # none yet, or the last snapshot in it is still held (a save still writing it)
                buf = torch.empty(obj.shape, dtype=obj.dtype, device=self.config.device,
                                  pin_memory=self._pin())
                self._buffers[key] = buf
            used.add(key)
            non_blocking = obj.device.type == "cuda"
            buf.copy_(obj.detach(), non_blocking=non_blocking)
            self._pending_cuda |= non_blocking
            snapshot = buf.view(buf.shape)  # its own tensor over the buffer: its life is the save's
            self._handed[key] = weakref.ref(snapshot)
            return snapshot
        return copy.deepcopy(obj)
