"""The files ``cachemw`` opens for reading: ``CachedFile`` (blocks through the cache,
pinned to the version it was opened at) and ``BytesFile`` (a file read whole on open)."""
from __future__ import annotations

import operator
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from fsspec.spec import AbstractBufferedFile

from .. import blockfile, trace
from ..blockfile import PAGE_SIZE, TIER_FAULTS, CorruptBlock, OpenBlock, page_hash as _hash
from ..keys import block_key, block_length

if TYPE_CHECKING:  # fs.py opens these files: a type only, no import at run time
    from .fs import CacheFileSystem


def offset(value):
    """A read's ``start`` or ``end`` as given by a caller (None, or any integer: a numpy
    one, as offsets read from an index file are) as a Python int. A numpy unsigned one,
    kept as given, wrapped round in ``start - base`` and a read across a block boundary
    came back short, without an error (review api7). A float is a TypeError, as a file's
    seek makes it."""
    return None if value is None else operator.index(value)


def clip(start, end, size):
    """``start``/``end`` of a read (None, negative: from the end) as offsets in ``[0, size]``."""
    start = 0 if start is None else (max(size + start, 0) if start < 0 else min(start, size))
    end = size if end is None else (max(size + end, 0) if end < 0 else min(end, size))
    return start, end


class _Held:
    """The block files this process's open files hold open, all of them together: each
    OpenBlock holds a descriptor, and a dataset that keeps 20 large files open and reads
    them at random would otherwise reach the usual soft limit of 1024 (MAX_OPEN each).
    At ``cap``, a file closes its oldest open block for a new one, and a file holding none
    reads the normal way (open, read, close each time).

    Fork-safe: a forked child (a DataLoader worker) inherits the parent's open files with
    their blocks and their descriptors, and closes them as it closes those files, so it
    starts from the number of blocks it holds in them: counted afresh in the child (the
    parent's count may include a block another thread was between opening and storing,
    which the child holds in no file), under a lock of its own (the parent's may have been
    held by a thread the child does not have)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.n = 0
        self.lock = threading.Lock()
        self.files: weakref.WeakSet = weakref.WeakSet()  # the open files, for the recount

    def take(self) -> bool:
        """One more block file held open, if the cap allows."""
        with self.lock:
            if self.n >= self.cap:
                return False
            self.n += 1
            return True

    def give(self) -> None:
        with self.lock:
            self.n -= 1

    def forked(self) -> None:
        self.lock = threading.Lock()
        self.n = sum(block is not None for f in list(self.files)
                     for block in list(f._blocks.values()))


HELD = _Held(256)
os.register_at_fork(after_in_child=HELD.forked)


class CachedFile(AbstractBufferedFile):
    """A read-only file whose bytes come from the cache; ``cache_type="none"`` by default
    because the tiers already are the cache (fsspec's readahead would only re-copy).

    An open file keeps the version it was opened at (``meta``), whatever ``validate`` says
    (that bounds how long metadata is trusted for new opens and reads, not what an open file
    may switch to): its cached blocks are keyed by that version, and a block it has to fetch
    is fetched pinned to it. If the source has another version by then, the read raises
    ChangedSourceError (an OSError): reopen the file to read the new one.

    Reads that fall inside one cached block are served from the block file held open (see
    blockfile.OpenBlock): the small random reads of HDF5 or Parquet readers then cost one
    ``pread`` and the checksums of the pages they touch, not an open, a check of the
    block's tail and a read.
    """

    MAX_OPEN = 128  # block files held open (1 GiB of 8 MiB blocks); evicted ones are closed
    # (and HELD.cap, 256, in all: see _Held)
    MAX_TABLES = 1024  # page tables kept of blocks opened before (16 KiB each at most)

    def __init__(self, fs: CacheFileSystem, path: str, meta, **kwargs) -> None:
        self.meta = meta
        self._blocks: dict[int, OpenBlock | None] = {}  # None: read the normal way
        # (inode, page table) of blocks opened before: opened again (random reads over
        # more blocks than MAX_OPEN), a block's file needs no second read of its tail
        self._tables: dict[int, tuple] = {}
        self._tally = fs.client.hit_tally()  # reads served from open blocks, and bytes
        self._client = fs.client
        self._bs = fs.options.block_size
        super().__init__(fs, path, mode="rb", size=meta.size, **kwargs)
        HELD.files.add(self)

    def _fetch_range(self, start, end):
        start, end = clip(start, end, self.meta.size)
        # this file keeps its version: if the source has moved on, it fails, and the read
        # that met the change dropped what the process and the node know of the path
        # (metadata.moved_on), so that a reopen reads the new version under every validate
        # mode (under immutable the metadata would otherwise be trusted for good)
        return self.fs.reader.read(self.meta, start, end)

    def seek(self, loc, whence=0):
        if whence == 0 and type(loc) is int and loc >= 0:  # the hot path of random reads
            self.loc = loc
            return loc
        return super().seek(loc, whence)

    def read(self, length=-1):
        if type(length) is not int and length is not None:
            length = operator.index(length)  # a numpy integer: see offset
        # The fast path: a read inside one cached block (after close, nothing is open).
        loc = self.loc
        if length is not None and length > 0:
            end = loc + length
            size = self.size
            if end > size:
                end = size
            bs = self._bs
            index = loc // bs
            if loc < end and (end - 1) // bs == index:
                block = self._blocks.get(index)
                if block is None and index not in self._blocks and not self.closed:
                    block = self._open_block(index)
                if block is not None:
                    base = index * bs
                    start, stop = loc - base, end - base
                    try:
                        lo = start - start % PAGE_SIZE
                        if stop - lo <= 2 * PAGE_SIZE and lo + 2 * PAGE_SIZE <= block.length:
                            # OpenBlock.read inlined for 1-2 whole pages (random 4 KiB
                            # reads: a call is a tenth of one); read() is the reference
                            data = blockfile._pread(block.fd, 2 * PAGE_SIZE, lo)
                            if len(data) != 2 * PAGE_SIZE:
                                raise CorruptBlock(f"{block.path}: truncated")
                            view, first = memoryview(data), lo // PAGE_SIZE
                            if _hash(view[:PAGE_SIZE]) != block.sums[first] or (
                                    stop - lo > PAGE_SIZE
                                    and _hash(view[PAGE_SIZE:]) != block.sums[first + 1]):
                                raise CorruptBlock(f"{block.path}: checksum mismatch in "
                                                   f"page {first} or {first + 1}")
                            view.release()
                            data = data[start - lo:stop - lo]
                        else:
                            data = block.read(start, stop)
                    except OSError as exc:
                        # a damaged page, or the tier's disk failing the read (EIO): the
                        # normal path reads the block from another tier or the source,
                        # counts it and repairs it, as it does for any read; this
                        # process's own errors (EMFILE, ENOMEM) are raised, as there
                        if not isinstance(exc, CorruptBlock) and exc.errno not in TIER_FAULTS:
                            raise
                        self._close_block(index)
                        self._blocks[index] = None  # the normal path from now on
                    else:
                        self.loc = end
                        tally = self._tally
                        tally.nbytes += end - loc
                        reads = tally.reads = tally.reads + 1
                        if not reads & 4095:
                            self._client.fold(tally)
                            self._close_evicted()
                        return data
        return super().read(length)

    def _open_block(self, index: int) -> OpenBlock | None:
        """Open block ``index`` if a tier holds it; None (and the normal path) otherwise."""
        meta, bs = self.meta, self.fs.options.block_size
        key = block_key(meta.url, meta.version, index, bs)
        length = block_length(meta.size, index, bs)
        started = time.perf_counter()
        if not self._held():
            return None
        block = None
        try:
            for tier in self.fs.client.tiers():
                try:
                    block = OpenBlock(tier.block_path(key), length, self._tables.get(index))
                except FileNotFoundError:
                    continue
                except (CorruptBlock, ValueError, OSError):
                    return None  # let the normal path detect, count and repair it
                break
        finally:
            if block is None:
                HELD.give()
        if block is None:
            return None
        self._blocks[index] = block
        if self._tables.pop(index, None) is None and len(self._tables) >= self.MAX_TABLES:
            del self._tables[next(iter(self._tables))]
        self._tables[index] = (block.ino, block.sums)  # (another tier's file: its own)
        self.fs.client.accessed(key, tier.name)  # reads are counted as they happen
        if trace.ENABLED:  # its reads are not traced one by one: each costs less
            trace.block_event("map", started, time.perf_counter(), tier.name, meta.path,
                              index, length)
        return block

    def _held(self) -> bool:
        """A block file may be held open (counted in HELD): room under this file's
        MAX_OPEN and the process's cap, made by closing this file's oldest block if
        need be; False: the block is read the normal way."""
        if len(self._blocks) >= self.MAX_OPEN:
            self._close_block(next(iter(self._blocks)))
        if HELD.take():
            return True
        oldest = next((i for i, block in self._blocks.items() if block is not None), None)
        if oldest is None:
            return False
        self._close_block(oldest)  # the oldest block this file holds gives up its descriptor
        return HELD.take()  # (unless another thread's file took it meanwhile)

    def _close_evicted(self) -> None:
        """Close blocks the daemon evicted: their pages would stay allocated in the DRAM
        tier's tmpfs for as long as this file is open, outside the tier's capacity."""
        for index, block in list(self._blocks.items()):
            if block is not None and not block.still_cached():
                self._close_block(index)

    def _close_block(self, index: int) -> None:
        block = self._blocks.pop(index, None)
        if block is not None:
            block.close()
            HELD.give()

    def close(self):
        self._client.fold(self._tally)
        for index in list(self._blocks):
            self._close_block(index)
        super().close()


class BytesFile(AbstractBufferedFile):
    """A read-only file over bytes already read: a file whose size the source states as 0
    (``/proc`` files) is read whole on open, its size then known."""

    def __init__(self, fs, path: str, data: bytes) -> None:
        self._data = data
        super().__init__(fs, path, mode="rb", size=len(data), cache_type="none")

    def _fetch_range(self, start, end):
        return self._data[start:end]
