"""Asynchronous, distributed checkpointing built on torch.distributed.checkpoint.

``Checkpointer`` is the facade; the DCP plug-ins it is built from are usable on their own with
``dcp.save`` / ``dcp.async_save`` / ``dcp.load``: ``SpreadSavePlanner``,
``CachemwStorageWriter``, ``CachemwStorageReader`` and ``BufferStager``. ``save``/``load``
are shaped like ``torch.save``/``torch.load``. ``CachemwCheckpointIO`` is Lightning's plug-in;
it is imported on first use only (a module ``__getattr__``), since Lightning is heavy and
optional.
"""
from __future__ import annotations

import importlib
from typing import Any

from .checkpointer import Checkpointer
from .config import CheckpointerConfig
from .errors import CheckpointBusyError, ChecksumError, CheckpointNotFoundError
from .handle import SaveHandle
from .planner import SpreadSavePlanner
from .reader import CachemwStorageReader
from .stager import BufferStager
from .torch_like import load, save
from .writer import CachemwStorageWriter

# Names served by a submodule imported only when one of them is first asked for.
_LAZY = {"CachemwCheckpointIO": ".lightning_io", "LIGHTNING_AVAILABLE": ".lightning_io"}

__all__ = [
    "Checkpointer", "CheckpointerConfig", "SaveHandle", "save", "load", "CachemwCheckpointIO",
    "SpreadSavePlanner", "CachemwStorageWriter", "CachemwStorageReader", "BufferStager",
    "CheckpointBusyError", "ChecksumError", "CheckpointNotFoundError",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
