"""The files ``cachemw`` opens for reading: ``CachedFile`` (blocks through the cache,
pinned to the version it was opened at) and ``BytesFile`` (a file read whole on open)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fsspec.spec import AbstractBufferedFile

from .. import trace
from ..blockfile import PAGE_SIZE, CorruptBlock, MappedBlock, page_hash
from ..keys import block_key, block_length
from ..tiers.source import MOVED_ON

if TYPE_CHECKING:  # fs.py opens these files: a type only, no import at run time
    from .fs import CacheFileSystem


def clip(start, end, size):
    """``start``/``end`` of a read (None, negative: from the end) as offsets in ``[0, size]``."""
    start = 0 if start is None else (max(size + start, 0) if start < 0 else min(start, size))
    end = size if end is None else (max(size + end, 0) if end < 0 else min(end, size))
    return start, end


class CachedFile(AbstractBufferedFile):
    """A read-only file whose bytes come from the cache; ``cache_type="none"`` by default
    because the tiers already are the cache (fsspec's readahead would only re-copy).

    An open file keeps the version it was opened at (``meta``), whatever ``validate`` says
    (that bounds how long metadata is trusted for new opens and reads, not what an open file
    may switch to): its cached blocks are keyed by that version, and a block it has to fetch
    is fetched pinned to it. If the source has another version by then, the read raises
    ChangedSourceError (an OSError): reopen the file to read the new one.

    Reads that fall inside one cached block are served from a memory map of the block file
    (see blockfile.MappedBlock): the small random reads of HDF5 or Parquet readers then cost
    a page checksum and a copy, not an open, a seek and a read.
    """

    MAX_MAPPED = 256  # 2 GiB of 8 MiB blocks; evicted ones are unmapped (see below)

    def __init__(self, fs: CacheFileSystem, path: str, meta, **kwargs) -> None:
        self.meta = meta
        self._mapped: dict[int, MappedBlock | None] = {}
        self._tally = fs.client.hit_tally()  # reads served from mapped blocks, and bytes
        self._client = fs.client
        self._bs = fs.options.block_size
        super().__init__(fs, path, mode="rb", size=meta.size, **kwargs)

    def _fetch_range(self, start, end):
        start, end = clip(start, end, self.meta.size)
        try:
            return self.fs.reader.read(self.meta, start, end)
        except MOVED_ON:
            # this file keeps its version and fails; what the node knows of the path is
            # dropped, so that a reopen reads the new version under every validate mode
            # (under immutable the metadata would otherwise be trusted for good)
            self.fs.meta.forget(self.path)
            raise

    def seek(self, loc, whence=0):
        if whence == 0 and type(loc) is int and loc >= 0:  # the hot path of random reads
            self.loc = loc
            return loc
        return super().seek(loc, whence)

    def read(self, length=-1):
        # The fast path: a read inside one mapped block (after close, nothing is mapped).
        loc = self.loc
        if length is not None and length > 0:
            end = loc + length
            size = self.size
            if end > size:
                end = size
            bs = self._bs
            index = loc // bs
            if loc < end and (end - 1) // bs == index:
                block = self._mapped.get(index)
                if block is None and index not in self._mapped and not self.closed:
                    block = self._map(index)
                if block is not None:
                    base = index * bs
                    start, stop = loc - base, end - base
                    first, last = start // PAGE_SIZE, (stop - 1) // PAGE_SIZE
                    try:
                        if last - first <= 1 and last < block.full_pages:
                            # MappedBlock.read inlined for 1-2 whole pages (random 4 KiB reads)
                            view, sums, lo = block.view, block.sums, first * PAGE_SIZE
                            mid = lo + PAGE_SIZE
                            if page_hash(view[lo:mid]) != sums[first] or (
                                    last != first
                                    and page_hash(view[mid:mid + PAGE_SIZE]) != sums[last]):
                                raise CorruptBlock(f"{block.path}: checksum mismatch in pages "
                                                   f"{first}-{last}")
                            data = block.mm[start:stop]
                        else:
                            data = block.read(start, stop)
                    except CorruptBlock:
                        self._unmap(index)
                        self._mapped[index] = None  # the normal path repairs it from now on
                    else:
                        self.loc = end
                        tally = self._tally
                        tally.nbytes += end - loc
                        reads = tally.reads = tally.reads + 1
                        if not reads & 4095:
                            self._client.fold(tally)
                            self._drop_evicted_maps()
                        return data
        return super().read(length)

    def _map(self, index: int) -> MappedBlock | None:
        """Map block ``index`` if a tier holds it; None (and the normal path) otherwise."""
        meta, bs = self.meta, self.fs.options.block_size
        key = block_key(meta.url, meta.version, index, bs)
        length = block_length(meta.size, index, bs)
        started = time.perf_counter()
        for tier in self.fs.client.tiers():
            try:
                block = MappedBlock(tier.block_path(key), length)
            except FileNotFoundError:
                continue
            except (CorruptBlock, ValueError, OSError):
                return None  # let the normal path detect, count and repair it
            if len(self._mapped) >= self.MAX_MAPPED:
                self._unmap(next(iter(self._mapped)))
            self._mapped[index] = block
            self.fs.client.accessed(key, tier.name)  # reads are counted as they happen
            if trace.ENABLED:  # its reads are not traced one by one: each costs less
                trace.block_event("map", started, time.perf_counter(), tier.name, meta.path,
                                  index, length)
            return block
        return None

    def _drop_evicted_maps(self) -> None:
        """Unmap blocks the daemon evicted: their pages would stay allocated in the DRAM
        tier's tmpfs for as long as this file is open, outside the tier's capacity."""
        for index, block in list(self._mapped.items()):
            if block is not None and not block.still_cached():
                self._unmap(index)

    def _unmap(self, index: int) -> None:
        block = self._mapped.pop(index, None)
        if block is not None:
            block.close()

    def close(self):
        self._client.fold(self._tally)
        for index in list(self._mapped):
            self._unmap(index)
        super().close()


class BytesFile(AbstractBufferedFile):
    """A read-only file over bytes already read: a file whose size the source states as 0
    (``/proc`` files) is read whole on open, its size then known."""

    def __init__(self, fs, path: str, data: bytes) -> None:
        self._data = data
        super().__init__(fs, path, mode="rb", size=len(data), cache_type="none")

    def _fetch_range(self, start, end):
        return self._data[start:end]
