"""A DCP StorageWriter: per-chunk xxh3 checksums, optional lz4, fsync, manifest written last.

Layout of a checkpoint directory (compatible with DCP's ``FileSystemReader`` when
uncompressed): data files ``__<rank>_<n>.distcp``, DCP's pickled ``.metadata``, and
``cachemw-manifest.json`` holding per-chunk checksums and codecs. The manifest is the commit
mark: it is written by the coordinator last, after every rank's files are fsynced (DCP calls
``finish`` only once all ranks' ``write_data`` results are in), through temp + fsync + rename.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash
from torch.futures import Future
from typing import Any, Callable

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from cachemw import trace

from .chunk_codec import StoredItem, write_chunk
from .errors import ChecksumError
from .planner import item_key, item_nbytes
from .storage_io import Location, as_location

MANIFEST_NAME = "cachemw-manifest.json"
METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"
MANIFEST_FORMAT = "cachemw-checkpoint/2"  # 2: sealed with a checksum of its own
UNSEALED_FORMATS = ("cachemw-checkpoint/1",)  # written before manifests were sealed


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """``compression``: None or "lz4"; ``thread_count``: files written in parallel per rank."""

    compression: str | None = None
    frame_bytes: int = 1 << 20
    thread_count: int = 2
    sync_files: bool = True

    def __post_init__(self) -> None:
        if self.compression not in (None, "lz4"):
            raise ValueError(f"compression must be None or 'lz4', got {self.compression!r}")
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")
        if not 4096 <= self.frame_bytes < 1 << 31:
            raise ValueError(f"frame_bytes must be in [4096, 2**31), got {self.frame_bytes}")


def bucket_items(items: list[WriteItem], buckets: int) -> list[list[WriteItem]]:
    """Spread items over ``buckets`` files, largest first to the lightest file."""
    out: list[list[WriteItem]] = [[] for _ in range(max(1, min(buckets, len(items))))]
    load = [0] * len(out)
    for item in sorted(items, key=lambda i: -(item_nbytes(i) or 1)):
        k = load.index(min(load))
        out[k].append(item)
        load[k] += item_nbytes(item) or 1
    return [b for b in out if b]


class CachemwStorageWriter(StorageWriter):
    """Usable on its own: ``dcp.save(sd, storage_writer=CachemwStorageWriter(path))``."""

    def __init__(self, path: str | os.PathLike | Location | None = None, *, compression: str | None = None,
                 frame_bytes: int = 1 << 20, thread_count: int = 2, sync_files: bool = True,
                 manifest_extra: dict | None = None,
                 on_file_durable: Callable[[str], None] | None = None, reuse_files: bool = False,
                 in_place: Any = None) -> None:
        super().__init__()
        self.config = WriterConfig(compression, frame_bytes, thread_count, sync_files)
        self.location = as_location(path) if path is not None else None
        self.manifest_extra = dict(manifest_extra or {})
        self.on_file_durable = on_file_durable
        self.reuse_files = reuse_files  # overwrite existing files in place (recycled tmpfs pages)
        # A FilePool holding this rank's chunks already in place (fast-tier snapshot): frame and
        # checksum them there; only what is not in the pool (pickled values) is written here.
        self.in_place = in_place
        self.rank = 0
        self.save_id = uuid.uuid4().hex
        self.files_written: list[str] = []
        self.bytes_written = 0  # by this rank, once write_data is done

    # -- StorageWriter protocol -------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.location = as_location(checkpoint_id)
        if self.location is None:
            raise ValueError("CachemwStorageWriter needs a path or a checkpoint_id")
        self.save_id = uuid.uuid4().hex
        self.files_written = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank") or 0
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.location.makedirs()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data if isinstance(plan.storage_data, str) else f"__{self.rank}_"
        if self.in_place is not None:
            results = self._write_in_place(prefix, plan, planner)
            self.bytes_written = sum(r.size_in_bytes for r in results)
            self._check_written()
            fut_in_place: Future[list[WriteResult]] = Future()
            fut_in_place.set_result(results)
            return fut_in_place
        buckets = bucket_items(list(plan.items), self.config.thread_count)
        with trace.span("serialize", trace.CHECKPOINT, items=len(plan.items)):
            jobs = [(f"{prefix}{n}.distcp", [(item, planner.resolve_data(item)) for item in bucket])
                    for n, bucket in enumerate(buckets)]
        if len(jobs) <= 1:
            results = [self._write_file(rel, pairs) for rel, pairs in jobs]
        else:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="cachemw-write") as pool:
                results = list(pool.map(lambda job: self._write_file(*job), jobs))
        self.bytes_written = sum(r.size_in_bytes for rs in results for r in rs)
        self._check_written()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for rs in results for r in rs])
        return fut

    def _check_written(self) -> None:
        """Every file this rank wrote is still there before DCP's gather leads to the commit.

        A node's ranks share a fast tier; a file removed behind this rank must fail the save,
        never be committed as missing data.
        """
        if self.location.local:
            for rel in self.files_written:
                if not os.path.exists(self.location.join(rel)):
                    raise FileNotFoundError(f"{self.location.join(rel)} vanished before the commit")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with trace.span("commit", trace.CHECKPOINT, at=self.location.url):
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        flat = [wr for rank_results in results for wr in rank_results]
        stored: dict[str, StoredItem] = {item_key(wr.index): wr.storage_data for wr in flat}
        metadata.version = DCP_VERSION
        metadata.storage_data = {
            wr.index: _StorageInfo(wr.storage_data.relative_path, wr.storage_data.offset, wr.storage_data.length)
            for wr in flat
        }
        metadata.storage_meta = self.storage_meta()
        pickled = pickle.dumps(metadata)
        self.location.write_atomic(METADATA_NAME, pickled)
        files: dict[str, int] = {}
        for item in stored.values():
            files[item.relative_path] = max(files.get(item.relative_path, 0), item.offset + item.length,
                                            item.file_size)
        manifest = {
            "format": MANIFEST_FORMAT,
            "save_id": self.save_id,
            "created": time.time(),
            "compression": self.config.compression,
            "files": files,
            "items": {k: v.to_json() for k, v in sorted(stored.items())},
            # DCP's .metadata (every tensor's shape, dtype and chunk offsets) is checked too
            "metadata": {"size": len(pickled), "checksum": metadata_sum(pickled)},
            "extra": self.manifest_extra,
        }
        self.location.write_atomic(MANIFEST_NAME, seal_manifest(manifest))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.location.url if self.location else None, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- internals --------------------------------------------------------------------------
    def _write_in_place(self, prefix: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        layout = self.in_place.layout
        slots = layout.slots()
        per_file: dict[str, list] = {}
        extra: list[tuple[WriteItem, Any]] = []
        for item in plan.items:
            key = item_key(item.index)
            if key in slots:
                f, slot = slots[key]
                if not f.rel.startswith(prefix):
                    raise ValueError(f"snapshot file {f.rel} does not belong to this rank's plan ({prefix}*)")
                per_file.setdefault(f.rel, []).append((item, f, slot))
            elif item.tensor_data is None:
                extra.append((item, planner.resolve_data(item)))
            elif item_nbytes(item) == 0:
                chunk = item.tensor_data.chunk
                extra.append((item, torch.empty(tuple(chunk.sizes), dtype=item.tensor_data.properties.dtype)))
            else:
                raise ValueError(f"chunk {key!r} of the save plan is not in the snapshot: the plan changed after it")

        def seal_file(rel: str) -> list[WriteResult]:
            with trace.span("write", trace.CHECKPOINT, file=rel, in_place=True):
                return seal(rel)

        def seal(rel: str) -> list[WriteResult]:
            if self.location.local and not os.path.samefile(self.location.join(rel), os.path.join(self.in_place.dir, rel)):
                raise ValueError(f"{self.location.join(rel)} is not this rank's snapshot file")
            out = []
            for item, f, slot in per_file[rel]:
                stored = self.in_place.seal(f, slot)
                out.append(WriteResult(index=item.index, size_in_bytes=stored.length, storage_data=stored))
            if self.config.sync_files:
                self.in_place.flush(rel)
            self.files_written.append(rel)
            if self.on_file_durable is not None:
                self.on_file_durable(rel)
            return out

        jobs = [lambda rel=rel: seal_file(rel) for rel in per_file]
        if extra:
            jobs.append(lambda: self._write_file(layout.extra_rel, extra))
        if len(jobs) <= 1:
            return [r for job in jobs for r in job()]
        with ThreadPoolExecutor(min(len(jobs), self.config.thread_count), thread_name_prefix="cachemw-write") as pool:
            return [r for rs in pool.map(lambda job: job(), jobs) for r in rs]

    def _write_file(self, rel: str, pairs: list[tuple[WriteItem, Any]]) -> list[WriteResult]:
        with trace.span("write", trace.CHECKPOINT, file=rel) as span:
            results = self._write_one(rel, pairs)
            span.args["bytes"] = sum(r.size_in_bytes for r in results)
            return results

    def _write_one(self, rel: str, pairs: list[tuple[WriteItem, Any]]) -> list[WriteResult]:
        codec = self.config.compression or "raw"
        reuse = self.reuse_files and self.location.local and self.location.exists(rel)
        if reuse and os.stat(self.location.join(rel)).st_nlink > 1:
            # Also linked elsewhere (a snapshot pool's mapped file, another step): writing into it
            # would change those bytes too. Write a fresh file instead.
            os.unlink(self.location.join(rel))
            reuse = False
        out = self.location.open(rel, "r+b" if reuse else "wb")
        results = []
        try:
            for item, data in pairs:
                stored = write_chunk(out, rel, out.tell(), data, codec, self.config.frame_bytes)
                results.append(WriteResult(index=item.index, size_in_bytes=stored.length, storage_data=stored))
            if reuse:
                out.truncate()
        finally:
            if self.config.sync_files:
                self.location.close_durably(out)
            else:
                out.close()
        self.files_written.append(rel)
        if self.on_file_durable is not None:
            self.on_file_durable(rel)
        return results


def metadata_sum(data: bytes) -> str:
    """The checksum of a checkpoint's ``.metadata`` that its manifest records."""
    return xxhash.xxh3_64_hexdigest(data)


def _manifest_sum(manifest: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(manifest, sort_keys=True).encode())


def seal_manifest(manifest: dict) -> bytes:
    """The manifest as written: JSON with the checksum of the rest of it. The manifest names
    every chunk's file, range, item and checksum, so a flipped bit in it could give one
    item's sound chunk to another: it is checked as the chunks are."""
    return json.dumps({**manifest, "checksum": _manifest_sum(manifest)}).encode()


def parse_manifest(data: bytes, where: str) -> dict:
    """A manifest's content, checked; ChecksumError if it is damaged (not JSON, an unknown
    format, or not what its checksum says)."""
    try:
        manifest = json.loads(data)
        fmt = manifest.get("format")
    except (ValueError, AttributeError):  # not JSON (UnicodeDecodeError is a ValueError)
        raise ChecksumError(f"{where}: the checkpoint's manifest is damaged (not JSON)") from None
    if fmt in UNSEALED_FORMATS:
        return manifest
    if fmt != MANIFEST_FORMAT:
        raise ChecksumError(f"{where}: the checkpoint's manifest is damaged or of an unknown "
                            f"format ({fmt!r})")
    checksum = manifest.pop("checksum", None)
    if checksum != _manifest_sum(manifest):
        raise ChecksumError(f"{where}: the checkpoint's manifest is damaged (checksum mismatch)")
    return manifest


def read_manifest(location: Location) -> dict | None:
    """The manifest of a checkpoint directory, or None if it is not committed."""
    try:
        data = location.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        return None
    return parse_manifest(data, f"{location.url}/{MANIFEST_NAME}")
