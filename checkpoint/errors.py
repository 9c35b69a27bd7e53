"""The few exceptions of the checkpointer; each subclasses the built-in it refines."""
from __future__ import annotations


class ChecksumError(OSError):
    """A stored chunk does not match the checksum recorded when it was written."""


class CheckpointBusyError(RuntimeError):
    """A save was refused because the previous one is still writing (``if_busy="refuse"``)."""


class CheckpointNotFoundError(FileNotFoundError):
    """No committed checkpoint matches the request."""
