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
overlap each hold their own until they are written. Stagings may run at once in several
threads (one stager shared by their ``async_save`` calls): a buffer is claimed, found free
and handed to one snapshot, under a lock, so two stagings never copy into one buffer; the
copy itself runs outside it, in parallel.

Tuples are rebuilt as what they were (a namedtuple stays one): DCP pickles a tuple whole,
and a load gives back the type saved, as ``dcp.save`` of the state itself would.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
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


def same_sequence(like: list | tuple, items: list) -> Any:
    """``items`` in a sequence of ``like``'s kind: a list, a tuple, a namedtuple of the same class."""
    if isinstance(like, list):
        return items
    if isinstance(like, tuple) and hasattr(like, "_fields") and hasattr(like, "_make"):
        return like._make(items)  # a namedtuple
    return tuple(items)


def is_plain_tuple(obj: Any) -> bool:
    """A tuple or a namedtuple: rebuilt item by item; other tuple subclasses are copied whole."""
    return type(obj) is tuple or (isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_make"))


@dataclasses.dataclass
class _Slot:
    """A buffer kept for one tensor key and the snapshot last handed out over it (weakly):
    while that snapshot lives, the buffer is in use."""

    buffer: torch.Tensor
    snapshot: weakref.ref

    def free(self) -> bool:
        return self.snapshot() is None


class BufferStager(AsyncStager):
    """Snapshot into cached (pinned on CUDA) buffers; ``close`` releases them."""

    _synchronize_after_execute = False

    def __init__(self, *, device: str = "cpu", memory_budget: int | None = None,
                 pin_memory: bool | None = None) -> None:
        self.config = StagerConfig(device, memory_budget, pin_memory)
        self._slots: dict[tuple, _Slot] = {}
        self._lock = threading.Lock()  # held to claim a slot, never during a copy
        self._pending_cuda = False

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.buffer.numel() * s.buffer.element_size() for s in self._slots.values())

    def stage(self, state_dict: dict) -> dict:
        needed = tensor_bytes(state_dict)
        budget = self.config.memory_budget
        if budget is not None and needed > budget:
            raise ValueError(f"memory_budget={budget} bytes is smaller than the state to snapshot ({needed} bytes)")
        used: set[tuple] = set()
        out = self._stage(state_dict, (), used)
        with self._lock:  # tensors that left the state: free their buffers (not one a snapshot holds)
            for key in [k for k, s in self._slots.items() if k not in used and s.free()]:
                del self._slots[key]
        return out

    def synchronize_staging(self) -> None:
        if self._pending_cuda:
            torch.cuda.synchronize()
            self._pending_cuda = False

    def close(self) -> None:
        self.synchronize_staging()
        with self._lock:
            self._slots.clear()

    def _pin(self) -> bool:
        if self.config.pin_memory is not None:
            return self.config.pin_memory
        return torch.cuda.is_available() and torch.device(self.config.device).type == "cpu"

    def _claim(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """A snapshot tensor over a buffer no other live snapshot holds: the kept one if free,
        else a fresh one, which is kept from then on (the one it replaces lives as long as
        the snapshot over it). Found free and handed out in one step under the lock."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.free():
                snapshot = slot.buffer.view(slot.buffer.shape)  # its own tensor: its life is the save's
                slot.snapshot = weakref.ref(snapshot)
                return snapshot
        # none yet, or the last snapshot in it is still held (a save still writing it);
        # allocated outside the lock: pinning memory is slow and claims nothing
        buf = torch.empty(like.shape, dtype=like.dtype, device=self.config.device, pin_memory=self._pin())
        snapshot = buf.view(buf.shape)
        with self._lock:
            self._slots[key] = _Slot(buf, weakref.ref(snapshot))
        return snapshot

    def _stage(self, obj: Any, path: tuple, used: set) -> Any:
        if isinstance(obj, dict):
            return {k: self._stage(v, path + (k,), used) for k, v in obj.items()}
        if isinstance(obj, list) or is_plain_tuple(obj):
            return same_sequence(obj, [self._stage(v, path + (i,), used) for i, v in enumerate(obj)])
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                return obj.detach().to(self.config.device, copy=True)  # DTensor & co: no reuse
            key = (path, tuple(obj.shape), obj.dtype)
            snapshot = self._claim(key, obj)
            used.add(key)
            non_blocking = obj.device.type == "cuda"
            snapshot.copy_(obj.detach(), non_blocking=non_blocking)
            self._pending_cuda |= non_blocking
            return snapshot
        return copy.deepcopy(obj)
