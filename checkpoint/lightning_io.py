"""A Lightning ``CheckpointIO`` plugin over ``torch_like.save``/``load``.

Optional: Lightning is imported if installed (``lightning`` or ``pytorch_lightning``);
without it the class still exists, with ``object`` as base, so importing this module never
requires Lightning. Usage: ``Trainer(plugins=[CachemwCheckpointIO(compression="lz4")])``.
"""
from __future__ import annotations

import os
from typing import Any

from . import torch_like
from .storage_io import as_location
from .writer import MANIFEST_NAME

try:  # pragma: no cover - depends on what is installed
    from lightning.pytorch.plugins.io import CheckpointIO as _CheckpointIOBase
except ImportError:  # pragma: no cover
    try:
        from pytorch_lightning.plugins.io import CheckpointIO as _CheckpointIOBase
    except ImportError:
        _CheckpointIOBase = object

LIGHTNING_AVAILABLE = _CheckpointIOBase is not object


class CachemwCheckpointIO(_CheckpointIOBase):
    """Each Lightning checkpoint file path becomes a cachemw checkpoint directory."""

    def __init__(self, *, compression: str | None = None, thread_count: int = 2) -> None:
        if compression not in (None, "lz4"):
            raise ValueError(f"compression must be None or 'lz4', got {compression!r}")
        self.compression = compression
        self.thread_count = thread_count

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CachemwCheckpointIO.save_checkpoint takes no storage_options")
        torch_like.save(checkpoint, path, compression=self.compression, thread_count=self.thread_count)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return torch_like.load(path, map_location=map_location, thread_count=self.thread_count)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        location = as_location(path)
        location.remove_file(MANIFEST_NAME)  # uncommit first
        if location.exists():
            location.fs.rm(location.path, recursive=True)

    def teardown(self) -> None:
        pass
