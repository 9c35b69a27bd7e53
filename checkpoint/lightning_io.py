"""A Lightning ``CheckpointIO`` plug-in: each ``.ckpt`` is one torch.save file written by cachemw.

``Trainer(plugins=[CachemwCheckpointIO()])``. The ``.ckpt`` is a plain torch checkpoint file,
so Lightning's usual calls read it as any other: ``Model.load_from_checkpoint(path)``,
``trainer.fit(model, ckpt_path=path)``, ``torch.load(path)``. What the plug-in adds
(``torch_file``): the file appears only once whole and durable (temp, fsync, rename; a failed
save leaves the previous file), it may live behind any fsspec URL (``cachemw::s3://...``), and
the plug-in's own load (resume, ``trainer.test(ckpt_path=...)``) checks every record's CRC32
first, so a damaged file is a ``ChecksumError`` naming the record, never a run resumed on
wrong bytes.

Why not a DCP directory: Lightning hands one whole checkpoint to rank 0, so there is nothing
to spread over ranks, and a directory breaks every tool that opens the ``.ckpt`` as a file.
Directories written by earlier versions of this plug-in (a cachemw manifest inside) are still
loaded and removed.

Lightning is imported here; ``cachemw.checkpoint`` imports this module only when
``CachemwCheckpointIO`` is asked for. Either distribution works: the class derives from the
``CheckpointIO`` of ``lightning`` or ``pytorch_lightning`` and, when both are installed, is
registered with the other's too, so either Trainer accepts it. Without Lightning it still
works on its own (``object`` as base).
"""
from __future__ import annotations

import os
import shutil
from typing import Any

from cachemw.files import exchange

from . import torch_file, torch_like
from .storage_io import Location, split_file
from .writer import MANIFEST_NAME

try:  # pragma: no cover - depends on what is installed
    from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO
except ImportError:  # pragma: no cover
    _LightningCheckpointIO = None
try:  # pragma: no cover
    from pytorch_lightning.plugins.io import CheckpointIO as _PytorchLightningCheckpointIO
except ImportError:  # pragma: no cover
    _PytorchLightningCheckpointIO = None

_BASES = [b for b in (_LightningCheckpointIO, _PytorchLightningCheckpointIO) if b is not None]
LIGHTNING_AVAILABLE = bool(_BASES)


class CachemwCheckpointIO(_BASES[0] if _BASES else object):  # type: ignore[misc]
    """Lightning checkpoints as torch.save files, committed atomically, CRC-checked on load."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CachemwCheckpointIO.save_checkpoint takes no storage_options, got "
                            f"{storage_options!r}")
        legacy = Location(path)
        if legacy.exists(MANIFEST_NAME):  # an earlier version's directory under this name
            _replace_directory(checkpoint, path, legacy)
            return
        torch_file.save_file(checkpoint, path)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = "cpu",
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning calls this without ``map_location``: tensors come to CPU (as with its own
        ``TorchCheckpointIO``), not each onto the device it was saved from."""
        legacy = Location(path)
        if legacy.exists(MANIFEST_NAME):  # a directory written by an earlier version of this plug-in
            return torch_like.load(path, map_location=map_location, weights_only=weights_only)
        return torch_file.load_file(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        legacy = Location(path)
        if legacy.exists(MANIFEST_NAME):
            legacy.remove_file(MANIFEST_NAME)  # uncommit first
            legacy.fs.rm(legacy.path, recursive=True)
            return
        location, name = split_file(path)
        location.remove_file(name)

    def teardown(self) -> None:
        pass


def _replace_directory(checkpoint: dict[str, Any], path, legacy: Location) -> None:
    """Save ``checkpoint`` as the file ``path`` where an earlier version of the plug-in left
    a checkpoint directory of that name: the old one or the new one is there at any time.
    Locally the new file is written beside it and the two swapped in one step (or, where
    the filesystem cannot, the directory uncommitted and removed, then the file renamed in);
    on an object store the file is written beside it and copied to its name (a key beside
    the directory's keys, which load passes over once the manifest is gone), then the
    directory removed, its manifest (the commit) first; through other filesystems with
    directories (``cachemw::`` over a local one), the directory goes before the file is
    moved to its name."""
    parent, _, name = legacy.path.rstrip("/").rpartition("/")
    staged = f"{parent}/.{name}.cachemw-new-{os.getpid()}-{os.urandom(4).hex()}"
    if legacy.local:
        torch_file.save_file(checkpoint, staged)
        try:
            if not exchange(staged, legacy.path):
                legacy.remove_file(MANIFEST_NAME)
                shutil.rmtree(legacy.path)
                os.replace(staged, legacy.path)
                return
        except BaseException:  # the staged file goes whatever failed; re-raised
            if os.path.isfile(staged):
                os.unlink(staged)
            raise
        shutil.rmtree(staged)  # the old directory, swapped out
        return
    url = os.fspath(path).rstrip("/")
    torch_file.save_file(checkpoint, f"{url.rpartition('/')[0]}/{staged.rpartition('/')[2]}")
    if not _object_store(legacy.fs):  # directories (cachemw:: over a local one, memory://)
        legacy.remove_file(MANIFEST_NAME)
        # the directory itself too: a move onto a directory's name lands inside it
        legacy.fs.rm(legacy.path, recursive=True)
        legacy.fs.mv(staged, legacy.path)
        return
    # the file's key beside the directory's keys: load reads the directory while its
    # manifest is there, the file from then on
    legacy.fs.cp_file(staged, legacy.path)
    legacy.remove_file(MANIFEST_NAME)
    inside = legacy.path.rstrip("/") + "/"
    keys = [k for k in legacy.fs.find(inside) if k.startswith(inside)]
    if keys:
        legacy.fs.rm(keys)
    legacy.fs.rm_file(staged)


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"}


def _object_store(fs) -> bool:
    """Whether ``fs`` (or the store a cachemw or wrapping filesystem reads) keeps keys, not
    directories: ``name`` and ``name/...`` can both be there."""
    seen = set()
    while fs is not None and id(fs) not in seen:
        seen.add(id(fs))
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        if _OBJECT_STORES.intersection(protocols):
            return True
        fs = getattr(fs, "target", None) or getattr(fs, "fs", None)
    return False


for _other in _BASES[1:]:
    _other.register(CachemwCheckpointIO)
