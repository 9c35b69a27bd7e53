"""Asynchronous, distributed checkpointing built on torch.distributed.checkpoint.

``Checkpointer`` is the facade; the DCP plug-ins it is built from are usable on their own with
``dcp.save`` / ``dcp.async_save`` / ``dcp.load``: ``SpreadSavePlanner``,
``CachemwStorageWriter``, ``CachemwStorageReader`` and ``BufferStager``. ``save``/``load``
are shaped like ``torch.save``/``torch.load``.
"""
from .checkpointer import Checkpointer, CheckpointerConfig
from .errors import CheckpointBusyError, ChecksumError, CheckpointNotFoundError
from .handle import SaveHandle
from .planner import SpreadSavePlanner
from .reader import CachemwStorageReader
from .stager import BufferStager
from .writer import CachemwStorageWriter

__all__ = [
    "Checkpointer", "CheckpointerConfig", "SaveHandle", "SpreadSavePlanner", "CachemwStorageWriter",
    "CachemwStorageReader", "BufferStager", "CheckpointBusyError", "ChecksumError", "CheckpointNotFoundError",
]
