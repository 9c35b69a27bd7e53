"""A rank's snapshot files in the fast tier, mapped once and overwritten in place save after save.

The files live in a private pool directory (``.pool-<host>-<pid>-r<rank>-<id>``) and are
hard-linked into each step's directory, so committing, draining and retention work on the step
directory as for any other checkpoint while the pages stay with the pool: removing a step
directory drops links, not memory. The mappings are kept (populated) between saves, so a
snapshot after the first is a plain copy into mapped pages, with no page fault and no
allocation, as with reused staging buffers, but the copy *is* the in-memory checkpoint.

``seal`` frames a chunk already in place as a ``torch.save`` blob: ``torch.save`` runs on a
tensor over the mapped data, and a sink writes the header it produces just before the data and
the tail just after, without copying the data (``torch.save`` hands over the tensor's own
memory, which is recognized by address). See ``slot_layout`` for why the room suffices.
"""
from __future__ import annotations

import errno
import functools
import io
import mmap
import os
import shutil
import socket
import uuid

import numpy as np
import torch
import xxhash

from cachemw.processes import process_alive, process_start

from .chunk_codec import StoredItem, _address
from .slot_layout import FileLayout, Slot, SnapshotLayout, round_up

POOL_PREFIX = ".pool-"


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class _Stream(io.RawIOBase):
    """A write-only stream for ``torch.save`` that knows its position (``pos``)."""

    pos = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos


class _Measure(_Stream):
    """Counts what ``torch.save`` writes and where the tensor's own memory starts."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        super().__init__()
        self.ptr, self.nbytes, self.data_at = ptr, nbytes, -1

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        if mv.nbytes == self.nbytes and self.data_at < 0 and _address(mv) == self.ptr:
            self.data_at = self.pos
        self.pos += mv.nbytes
        return mv.nbytes


@functools.lru_cache(maxsize=None)
def blob_reserve(dtype: str, ndim: int) -> tuple[int, int]:
    """(header, tail) room for the ``torch.save`` blob of any tensor of this dtype and rank.

    Measured on a one-element tensor; a bigger one differs only in the pickled integers (storage
    size, offset, sizes, strides: at most 9 more bytes each), shifted by 64-byte record padding,
    and in zip64 fields for records over 4 GiB: the margins below cover both.
    """
    proxy = torch.zeros((1,) * ndim, dtype=dtype_of(dtype))
    sink = _Measure(proxy.data_ptr(), proxy.element_size())
    torch.save(proxy, sink)
    if sink.data_at < 0:
        raise ValueError(f"torch.save did not write a {dtype} tensor's memory as one record")
    tail = sink.pos - sink.data_at - proxy.element_size()
    return sink.data_at + round_up(9 * (2 + 2 * ndim), 64) + 128, tail + 256


class _InPlaceSink(_Stream):
    """Receives ``torch.save`` of a tensor lying at ``slot.data_pos``; writes header and tail around it."""

    def __init__(self, mm: mmap.mmap, slot: Slot, ptr: int) -> None:
        super().__init__()
        self.mm, self.slot, self.ptr = mm, slot, ptr
        self.nbytes = slot.request.nbytes
        self.head = bytearray()
        self.hasher = xxhash.xxh3_64()
        self.blob_start = -1
        self.done = 0  # data bytes seen

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if self.blob_start < 0:
            if n and _address(mv) == self.ptr:  # the data record: the header is complete
                self.blob_start = self.slot.data_pos - len(self.head)
                if self.blob_start < self.slot.start:
                    raise ValueError(f"chunk {self.slot.request.key!r}: torch.save header of {len(self.head)} "
                                     f"bytes exceeds its room of {self.slot.data_pos - self.slot.start}")
                self.mm[self.blob_start:self.slot.data_pos] = self.head
                self.hasher.update(self.head)
            else:
                self.head += mv
                self.pos += n
                return n
        at = self.blob_start + self.pos
        if self.done < self.nbytes:
            if at != self.slot.data_pos + self.done or _address(mv) != self.ptr + self.done:
                raise ValueError(f"chunk {self.slot.request.key!r}: torch.save wrote its data out of place")
            self.done += n  # already in place: hash it, copy nothing
        else:
            if at + n > self.slot.end:
                raise ValueError(f"chunk {self.slot.request.key!r}: torch.save tail exceeds its room")
            self.mm[at:at + n] = mv
        self.hasher.update(mv)
        self.pos += n
        return n


class FilePool:
    """The mapped snapshot files of one rank; ``ensure(layout)`` (re)creates them when the layout changes."""

    def __init__(self, fast_dir: str, rank: int) -> None:
        self.fast_dir = fast_dir
        self.rank = rank
        self.dir: str | None = None
        self.layout: SnapshotLayout | None = None
        self.maps: dict[str, mmap.mmap] = {}
        self.linked: str | None = None  # the step directory holding links to these files
        self._views: dict[str, torch.Tensor] = {}  # per chunk key, valid while the layout is

    def ensure(self, layout: SnapshotLayout) -> bool:
        """Have files for ``layout``; True if the existing (mapped, populated) ones were reused."""
        if layout == self.layout and self.dir is not None and self._intact():
            return True
        self.release()
        pid = os.getpid()
        name = f"{POOL_PREFIX}{socket.gethostname()}-{pid}-{process_start(pid) or 0}-r{self.rank}-{uuid.uuid4().hex[:8]}"
        self.dir = os.path.join(self.fast_dir, name)
        os.makedirs(self.dir, mode=0o700)
        try:
            for f in layout.files:
                self.maps[f.rel] = _map_new(os.path.join(self.dir, f.rel), f.size)
        except BaseException:  # no half-made pool left, whatever failed; re-raised
            self.release()
            raise
        self.layout = layout
        return False

    def _intact(self) -> bool:
        """Every pool file still has its mapped size (a truncated mapped file means SIGBUS on copy)."""
        try:
            return all(os.stat(os.path.join(self.dir, f.rel)).st_size == f.size == len(self.maps[f.rel])
                       for f in self.layout.files)
        except (OSError, KeyError):
            return False

    def view(self, f: FileLayout, slot: Slot) -> torch.Tensor:
        """The chunk's tensor over the mapped file (its storage is exactly the chunk's bytes)."""
        req = slot.request
        view = self._views.get(req.key)
        if view is None:
            arr = np.frombuffer(self.maps[f.rel], dtype=np.uint8, count=req.nbytes, offset=slot.data_pos)
            view = self._views[req.key] = torch.from_numpy(arr).view(dtype_of(req.dtype)).reshape(req.sizes)
        return view

    def link_into(self, step_dir: str) -> None:
        for f in self.layout.files if self.layout else ():
            os.link(os.path.join(self.dir, f.rel), os.path.join(step_dir, f.rel))
        self.linked = os.path.basename(step_dir)

    def seal(self, f: FileLayout, slot: Slot) -> StoredItem:
        """Frame the chunk in place as a torch.save blob; return where it is and its checksum."""
        view = self.view(f, slot)
        sink = _InPlaceSink(self.maps[f.rel], slot, view.data_ptr())
        torch.save(view, sink)
        if sink.done != slot.request.nbytes:
            raise ValueError(f"chunk {slot.request.key!r}: torch.save did not hand over the tensor's memory")
        return StoredItem(f.rel, sink.blob_start, sink.pos, sink.hasher.hexdigest(), "raw", sink.pos,
                          slot.data_pos - sink.blob_start, slot.request.nbytes, file_size=f.size)

    def flush(self, rel: str) -> None:
        self.maps[rel].flush()

    def release(self) -> None:
        """Drop the pool: unmap and unlink (pages still linked from a committed step stay)."""
        self._views.clear()  # they export the mappings' buffers
        for mm in self.maps.values():
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
        self.maps.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir, self.layout, self.linked = None, None, None


def _map_new(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS mid-copy
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here
                raise
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def sweep_pools(fast_dir: str) -> list[str]:
    """Remove pool directories of dead processes of this host (a reused pid counts as dead)."""
    removed = []
    host = socket.gethostname()
    try:
        names = os.listdir(fast_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(POOL_PREFIX):
            continue
        rest = name[len(POOL_PREFIX):]
        parts = rest.rsplit("-", 4)  # host-pid-start-rN-id (host may hold dashes)
        if len(parts) == 5 and parts[1].isdigit() and parts[2].isdigit() and parts[3].startswith("r"):
            owner, pid, started = parts[0], int(parts[1]), int(parts[2])
        else:  # host-pid-rN-id, from before start times were recorded
            parts = rest.rsplit("-", 3)
            if len(parts) != 4 or not parts[1].isdigit():
                continue
            owner, pid, started = parts[0], int(parts[1]), 0
        if owner != host or process_alive(pid, started or None):  # 0: start unknown
            continue
        shutil.rmtree(os.path.join(fast_dir, name), ignore_errors=True)
        removed.append(name)
    return removed


def held_bytes(directory: str) -> int:
    """Memory (tmpfs) or disk held by the files under ``directory``: allocated blocks, each inode once.

    Pool files are hard-linked into step directories; counting sizes per path would count
    them twice.
    """
    seen, total = set(), 0
    for dirpath, _, files in os.walk(directory):
        for name in files:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total
