"""A DCP StorageReader that verifies every chunk's checksum and reads tensors in place.

For an uncompressed tensor chunk whose destination is one contiguous CPU tensor of the same
extent (the usual case: same sharding, or a replicated tensor loaded whole), the raw bytes are
``readinto`` the destination directly: one copy from the page cache, as ``torch.load`` does,
instead of DCP's read + ``torch.load`` + ``copy_``. Everything else takes the general path.
A checksum mismatch raises ``ChecksumError`` naming the chunk, the file and the byte range.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor

from torch.futures import Future
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .chunk_codec import StoredItem, byte_view, checksum, decode
from .errors import ChecksumError, CheckpointNotFoundError
from .planner import item_key
from .storage_io import Location, as_location
from .writer import METADATA_NAME, metadata_sum, read_manifest


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """``require_manifest``: refuse uncommitted directories; ``verify``: check checksums."""

    thread_count: int = 2
    verify: bool = True
    require_manifest: bool = True

    def __post_init__(self) -> None:
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")


def narrow_box(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (off, length) in enumerate(zip(offsets, lengths)):
        if off != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, int(off), int(length))
    return tensor


def _read_exact(f: IO[bytes], view) -> None:
    mv = memoryview(view).cast("B")
    got = 0
    while got < mv.nbytes:
        n = f.readinto(mv[got:])
        if not n:
            raise EOFError("unexpected end of checkpoint data file")
        got += n


def metadata_damage(location: Location) -> ChecksumError | None:
    """The ChecksumError a load of the committed checkpoint at ``location`` would meet in
    its ``.metadata`` (checked against its manifest's record of it; None if sound, or if
    the manifest, of an earlier release, has no such record)."""
    recorded = (read_manifest(location) or {}).get("metadata")
    if not isinstance(recorded, dict):
        return None
    where = f"{location.url}/{METADATA_NAME}"
    try:
        data = location.read_bytes(METADATA_NAME)
    except FileNotFoundError:
        return ChecksumError(f"{where}: missing")
    return _mismatch(data, recorded, where)


def _mismatch(data: bytes, recorded: dict, where: str) -> ChecksumError | None:
    """The ChecksumError of ``.metadata`` bytes that are not those the manifest recorded."""
    if len(data) != recorded.get("size") or metadata_sum(data) != recorded.get("checksum"):
        return ChecksumError(f"{where}: damaged (checksum mismatch with the manifest)")
    return None


class CachemwStorageReader(StorageReader):
    """Usable on its own: ``dcp.load(sd, storage_reader=CachemwStorageReader(path))``."""

    def __init__(self, path: str | os.PathLike | Location | None = None, *, thread_count: int = 2,
                 verify: bool = True, require_manifest: bool = True) -> None:
        super().__init__()
        self.config = ReaderConfig(thread_count, verify, require_manifest)
        self.location = as_location(path) if path is not None else None
        self.manifest: dict | None = None
        self.stored: dict[str, StoredItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.location = as_location(checkpoint_id)
        if self.location is None:
            raise ValueError("CachemwStorageReader needs a path or a checkpoint_id")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.manifest = read_manifest(self.location)
        if self.manifest is None and self.config.require_manifest:
            raise CheckpointNotFoundError(f"{self.location.url} has no manifest: not a committed checkpoint")
        where = f"{self.location.url}/{METADATA_NAME}"
        try:
            data = self.location.read_bytes(METADATA_NAME)
        except FileNotFoundError as exc:
            if self.manifest is not None:  # committed (it is written after .metadata): damaged
                raise ChecksumError(f"{where}: missing (the manifest is there: a damaged "
                                    "checkpoint)") from exc
            raise CheckpointNotFoundError(f"{self.location.url} has no {METADATA_NAME}") from exc
        recorded = (self.manifest or {}).get("metadata")  # absent in earlier checkpoints
        damage = _mismatch(data, recorded, where) if isinstance(recorded, dict) else None
        if damage is not None:
            raise damage
        try:
            metadata = pickle.loads(data)
        except Exception as exc:  # unchecked (an earlier checkpoint) and not whole
            raise ChecksumError(f"{where}: damaged ({type(exc).__name__}: {exc})") from exc
        if not isinstance(metadata, Metadata):
            raise ChecksumError(f"{where}: damaged (not DCP metadata)")
        metadata.storage_meta = None
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        if self.manifest is None:
            self.manifest = read_manifest(self.location)
        items = (self.manifest or {}).get("items", {})
        self.stored = {k: StoredItem.from_json(v) for k, v in items.items()}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self._info(req).relative_path, []).append(req)
        jobs = list(per_file.items())
        if len(jobs) <= 1 or self.config.thread_count == 1:
            for rel, reqs in jobs:
                self._read_file(rel, reqs, planner)
        else:
            with ThreadPoolExecutor(min(len(jobs), self.config.thread_count), thread_name_prefix="cachemw-read") as pool:
                for fut in [pool.submit(self._read_file, rel, reqs, planner) for rel, reqs in jobs]:
                    fut.result()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- internals --------------------------------------------------------------------------
    def _info(self, req: ReadItem) -> StoredItem:
        stored = self.stored.get(item_key(req.storage_index))
        if stored is not None:
            return stored
        info = self.storage_data[req.storage_index]
        if info.transform_descriptors:
            raise ValueError(f"chunk {item_key(req.storage_index)} uses DCP transforms {info.transform_descriptors}; "
                             "load it with DCP's FileSystemReader")
        return StoredItem(info.relative_path, info.offset, info.length, checksum="")

    def _read_file(self, rel: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        with self.location.open(rel, "rb") as f:
            for req in sorted(reqs, key=lambda r: self._info(r).offset):
                info = self._info(req)
                if not (req.type == LoadItemType.TENSOR and self._read_in_place(f, req, info, planner)):
                    self._read_general(f, req, info, planner)

    def _mismatch(self, req: ReadItem, info: StoredItem) -> ChecksumError:
        return ChecksumError(
            f"checksum mismatch in chunk {item_key(req.storage_index)!r} ({info.relative_path} bytes "
            f"{info.offset}..{info.offset + info.length}) of checkpoint {self.location.url}")

    def _verify(self, req: ReadItem, info: StoredItem, *parts) -> None:
        if self.config.verify and info.checksum and checksum(*parts) != info.checksum:
            raise self._mismatch(req, info)

    def _read_in_place(self, f: IO[bytes], req: ReadItem, info: StoredItem, planner: LoadPlanner) -> bool:
        if info.codec != "raw" or info.data_offset < 0 or any(req.storage_offsets):
            return False
        md = self.metadata.state_dict_metadata.get(req.storage_index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return False
        target = planner.resolve_tensor(req).detach()
        if (target.device.type != "cpu" or not target.is_contiguous() or target.dtype != md.properties.dtype
                or target.numel() * target.element_size() != info.data_nbytes):
            return False
        f.seek(info.offset)
        head = f.read(info.data_offset)
        body = byte_view(target) if info.data_nbytes else b""
        if info.data_nbytes:
            try:
                _read_exact(f, body)
            except EOFError:
                raise ChecksumError(f"chunk {item_key(req.storage_index)!r} truncated in "
                                    f"{info.relative_path}") from None
        tail = f.read(info.length - info.data_offset - info.data_nbytes)
        self._verify(req, info, head, body, tail)
        planner.commit_tensor(req, target)
        return True

    def _read_general(self, f: IO[bytes], req: ReadItem, info: StoredItem, planner: LoadPlanner) -> None:
        f.seek(info.offset)
        stored = f.read(info.length)
        if len(stored) != info.length:
            raise ChecksumError(f"chunk {item_key(req.storage_index)!r} truncated in {info.relative_path}")
        self._verify(req, info, stored)
        raw = decode(stored, info)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(raw))
            return
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        tensor = narrow_box(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(f"chunk {item_key(req.storage_index)!r}: size {tuple(tensor.size())} does not fit "
                             f"destination {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
