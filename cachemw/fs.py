"""``cachemw``: an fsspec filesystem that reads any other fsspec filesystem through the
node's tiered cache.

    fsspec.open("cachemw::s3://bucket/train/x.bin")          # chained, any target
    fsspec.open("cachemw:///lustre/train/x.bin")             # shorthand for a local/PFS path
    fsspec.filesystem("cachemw", target_protocol="file", validate="immutable")

Reads go through the cache (blocks of ``block_size``; smaller files whole); metadata is
cached under the same policy (``validate``: immutable | ttl | always). Writes go straight
to the target and invalidate what was cached of the paths they touch.

Registered through the ``fsspec.specs`` entry point: no ``import cachemw`` needed. Never
imports Ray, so it works in forked DataLoader workers.
"""
from __future__ import annotations

import logging

import fsspec
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

try:  # fsspec >= 2025.x marks filesystems layered over another one (fills in the path)
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

from .client import DaemonClient
from .config import CacheOptions, DaemonConfig
from .blockfile import PAGE_SIZE, CorruptBlock, MappedBlock, page_hash
from .keys import block_count, block_key, block_length
from .metadata import MetadataCache
from .reader import BlockReader
from .tiers.source import ChangedSourceError, SourceTier
from .urls import TargetPaths, own_options

log = logging.getLogger("cachemw.fs")


class CacheFileSystem(_Base):
    protocol = "cachemw"
    # fsspec passes a chained URL's path as ``fo`` (unused here: paths come with each call);
    # left in the instance token it would make one filesystem, with its own daemon
    # connection, per URL opened (a dataset of a million ``cachemw::`` URLs: a million)
    _strip_tokenize_options = ("fo",)

    def __init__(self, target_protocol: str | None = None, target_options: dict | None = None,
                 fs: AbstractFileSystem | None = None, *, validate: str | None = None,
                 ttl: float | None = None, block_size: int | str | None = None,
                 autostart: bool | None = None, runtime_dir: str | None = None,
                 write_behind: int | str | None = None, daemon_options: dict | None = None, fo: str | None = None, **kwargs) -> None:
        kwargs = own_options(kwargs, target_options or {})
        super().__init__(**kwargs)
        if fs is not None and target_protocol is not None:
            raise ValueError("target_protocol: give either fs or target_protocol, not both")
        self.options = CacheOptions.build(validate=validate, ttl=ttl, block_size=block_size,
                                          autostart=autostart, runtime_dir=runtime_dir,
                                          write_behind=write_behind)
        if fs is None:
            fs = fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        if daemon_options:  # a bad daemon option fails here, not as fallbacks on every read
            DaemonConfig.build(runtime_dir=self.options.runtime_dir, **daemon_options)
        self.target = fs
        self.client = DaemonClient(self.options.runtime_dir, autostart=self.options.autostart,
                                   report_interval=self.options.report_interval,
                                   daemon_config=daemon_options)
        self.reader = BlockReader(SourceTier(fs), self.client, self.options.block_size,
                                  self.options.write_behind)
        self.meta = MetadataCache(fs, self.options.validate, self.options.ttl, self._meta_dir,
                                  defer=self.reader.fills.defer)

        stripped: dict[str, str] = {}  # fsspec's path normalisation costs ~5 us a call
        path_of = TargetPaths(fs)

        def _strip_protocol(path):  # per instance: the target decides what a path is
            if isinstance(path, (list, tuple)):
                return [_strip_protocol(p) for p in path]
            if type(path) is str:
                hit = stripped.get(path)
                if hit is not None:
                    return hit
            out = path_of(fsspec.utils.stringify_path(path))
            # not a relative local path: it depends on the working directory of each call
            if type(path) is str and not path_of.relative(path):
                if len(stripped) >= 65536:
                    stripped.clear()
                stripped[path] = out
            return out

        self._strip_protocol = _strip_protocol

    @classmethod
    def _strip_protocol(cls, path):
        """What fsspec's URL parsing sees before a filesystem (so a target) exists.

        Only the chain marker goes: ``cachemw::s3://b/k`` -> ``s3://b/k``, and a bare
        ``cachemw://`` hop -> "" (fsspec then takes the path from the next hop). A
        ``cachemw://path`` URL stays whole: which store's path it names is the target's
        to say, so the instance resolves it (see urls.TargetPaths).
        """
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = fsspec.utils.stringify_path(path)
        if path.startswith("cachemw::"):
            return path[len("cachemw::"):]
        if path == "cachemw://":
            return ""
        return path

    def _meta_dir(self) -> str | None:
        self.client.tiers()
        address = self.client._address
        return None if address is None else address.meta_dir

    def unstrip_protocol(self, name: str) -> str:
        """The chained URL of ``name``: ``cachemw::s3://bucket/key``, ``cachemw::file:///abs``."""
        return f"cachemw::{self.target.unstrip_protocol(self._strip_protocol(name))}"

    def url(self, path: str) -> str:
        """``path`` as this filesystem's own URL: ``cachemw://bucket/key`` over S3,
        ``cachemw:///abs`` over a local target (the target's URL with our protocol)."""
        path = self._strip_protocol(path)
        _, sep, rest = self.target.unstrip_protocol(path).partition("://")
        return f"cachemw://{rest if sep else path}"

    def glob(self, path, maxdepth=None, **kwargs):
        """The matches as ``cachemw://`` URLs (see url()), with their info if ``detail``.

        A URL, not a path, because that is what a caller that globs hands on: HF datasets
        prefixes each match with the first hop of its pattern and re-appends the others;
        from ``cachemw::s3://b/*.parquet`` and the path ``b/k`` that made
        ``cachemw::s3://b/k::s3://b/*.parquet``, which it opens as the local file
        "cachemw"; from the URL it makes ``cachemw://b/k::s3://b/*.parquet``: the path,
        then the target. Every method here takes these URLs back; ``ls``/``find``/``info``
        keep returning the target's paths.
        """
        found = super().glob(path, maxdepth=maxdepth, **kwargs)
        if isinstance(found, dict):
            return {self.url(name): info for name, info in found.items()}
        return [self.url(name) for name in found]

    def expand_path(self, path, recursive=False, maxdepth=None, **kwargs):
        """fsspec's, in paths (it mixes what glob and find return)."""
        found = super().expand_path(path, recursive=recursive, maxdepth=maxdepth, **kwargs)
        return sorted({self._strip_protocol(p) for p in found})

    # -- reads ---------------------------------------------------------------------------

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        meta = self.meta.file(path)
        start, end = _clip(start, end, meta.size)
        try:
            return self.reader.read(meta, start, end)
        except ChangedSourceError:
            self.meta.forget(path)
            meta = self.meta.file(path)
            start, end = _clip(start, end, meta.size)
            return self.reader.read(meta, start, end)
        except FileNotFoundError:
            self.meta.forget(path)
            raise

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Many ranges in one batch: misses go to the daemon (and to owner nodes) together."""
        if not isinstance(starts, list):
            starts = [starts] * len(paths)
        if not isinstance(ends, list):
            ends = [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("cat_ranges: paths, starts and ends must have the same length")
        out: list = [None] * len(paths)
        requests, where = [], []
        for i, (p, s, e) in enumerate(zip(paths, starts, ends)):
            try:
                meta = self.meta.file(self._strip_protocol(p))
            except Exception as exc:
                if on_error == "raise":
                    raise
                out[i] = exc
                continue
            requests.append((meta, *_clip(s, e, meta.size)))
            where.append(i)
        try:
            results = self.reader.read_many(requests)
        except ChangedSourceError:
            for meta, _, _ in requests:
                self.meta.forget(meta.path)
            return [self.cat_file(p, s, e) for p, s, e in zip(paths, starts, ends)]
        for i, data in zip(where, results):
            out[i] = data
        return out

    def cat(self, path, recursive=False, on_error="raise", **kwargs):
        """fsspec's ``cat``, with all the files' misses fetched as one batch."""
        paths = self.expand_path(path, recursive=recursive)
        if not (len(paths) > 1 or isinstance(path, list) or paths[0] != self._strip_protocol(path)):
            return self.cat_file(paths[0], **kwargs)
        results = self.cat_ranges(paths, [None] * len(paths), [None] * len(paths))
        out = {}
        for p, data in zip(paths, results):
            if isinstance(data, Exception):
                if on_error == "raise":
                    raise data
                if on_error == "omit":
                    continue
            out[p] = data
        return out

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
              **kwargs):
        path = self._strip_protocol(path)
        if "r" in mode and "+" not in mode:
            meta = self.meta.file(path)
            return CachedFile(self, path, meta, block_size=block_size,
                              cache_type=kwargs.pop("cache_type", "none"),
                              cache_options=cache_options)
        f = self.target.open(path, mode, block_size=block_size, autocommit=autocommit,
                             cache_options=cache_options, **kwargs)
        return _InvalidatingWriter(f, lambda: self._written(path))

    def info(self, path, **kwargs):
        return self.meta.info(self._strip_protocol(path))

    def ls(self, path, detail=True, **kwargs):
        listing = self.meta.ls(self._strip_protocol(path))
        return listing if detail else [e["name"] for e in listing]

    def created(self, path):
        return self.target.created(self._strip_protocol(path))

    def modified(self, path):
        return self.target.modified(self._strip_protocol(path))

    # -- writes: through to the target, then invalidate ---------------------------------

    def _written(self, path: str) -> None:
        """After a write: no process of this node may read the old bytes from now on.

        The blocks of the version we knew are deleted right here (the new version may
        carry the same token on a filesystem with coarse mtimes), then the daemon drops
        every other block of the file before this returns.
        """
        self.reader.fills.drain()  # no fill of the old bytes may land after this
        known = self.meta.known(path)
        if known is not None:
            bs = self.options.block_size
            keys = [block_key(known.url, known.version, i, bs)
                    for i in range(block_count(known.size, bs))]
            for tier in self.client.tiers():
                for key in keys:
                    tier.delete(key)
        self.client.invalidate(self.target.unstrip_protocol(path))
        self.meta.forget_tree(path)

    def _written_tree(self, path: str) -> None:
        prefix = path.rstrip("/") + "/"
        for p in [p for p in self.meta.known_paths() if p == path or p.startswith(prefix)]:
            self._written(p)
        self._written(path)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        try:
            self.target.pipe_file(path, value, mode=mode, **kwargs)
        finally:
            self._written(path)

    def rm_file(self, path):
        path = self._strip_protocol(path)
        try:
            self.target.rm_file(path)
        finally:
            self._written(path)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = self._strip_protocol(path)
        paths = paths if isinstance(paths, list) else [paths]
        try:
            self.target.rm(paths, recursive=recursive, maxdepth=maxdepth)
        finally:
            for p in paths:
                self._written_tree(p)

    def mkdir(self, path, create_parents=True, **kwargs):
        path = self._strip_protocol(path)
        try:
            self.target.mkdir(path, create_parents=create_parents, **kwargs)
        finally:
            self.meta.forget_tree(path)

    def makedirs(self, path, exist_ok=False):
        path = self._strip_protocol(path)
        try:
            self.target.makedirs(path, exist_ok=exist_ok)
        finally:
            self.meta.forget_tree(path)

    def rmdir(self, path):
        path = self._strip_protocol(path)
        try:
            self.target.rmdir(path)
        finally:
            self.meta.forget_tree(path)

    def cp_file(self, path1, path2, **kwargs):
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        try:
            self.target.cp_file(path1, path2, **kwargs)
        finally:
            self._written(path2)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        try:
            self.target.mv(p1, p2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        finally:
            for p in (p1 if isinstance(p1, list) else [p1]):
                self._written_tree(p)
            for p in (p2 if isinstance(p2, list) else [p2]):
                self._written_tree(p)

    def put_file(self, lpath, rpath, callback=fsspec.callbacks.DEFAULT_CALLBACK, mode="overwrite",
                 **kwargs):
        rpath = self._strip_protocol(rpath)
        try:
            self.target.put_file(lpath, rpath, callback=callback, mode=mode, **kwargs)
        finally:
            self._written(rpath)

    def touch(self, path, truncate=True, **kwargs):
        path = self._strip_protocol(path)
        try:
            self.target.touch(path, truncate=truncate, **kwargs)
        finally:
            self._written(path)

    # -- cache control and visibility ---------------------------------------------------

    def announce(self, paths, *, chunk: int = 8192) -> int:
        """Tell this node's daemon the files (or (path, start, end) ranges) about to be
        read, in order: placement turns clairvoyant and prefetches ahead of the reader.
        Returns the number of blocks announced; 0 if no daemon is reachable."""
        items = []
        for entry in paths:
            path, start, end = (entry, None, None) if isinstance(entry, str) else entry
            meta = self.meta.file(self._strip_protocol(path))
            start, end = _clip(start, end, meta.size)
            items.extend(self.reader.announce_items(meta, start, end))
        sent = 0
        for i in range(0, len(items), chunk):
            if not self.client.announce(items[i:i + chunk]):
                return sent
            sent += len(items[i:i + chunk])
        return sent

    def invalidate_cache(self, path=None):
        if path is None:
            self.meta = MetadataCache(self.target, self.options.validate, self.options.ttl,
                                      self._meta_dir, defer=self.reader.fills.defer)
        else:
            self.meta.forget_tree(self._strip_protocol(path))

    def stats(self) -> dict:
        """This process's counters (hits, misses, fallbacks, ...)."""
        self.reader.fills.drain()
        self.client.fold_tallies()
        return dict(self.client.counters)


def _clip(start, end, size):
    start = 0 if start is None else (max(size + start, 0) if start < 0 else min(start, size))
    end = size if end is None else (max(size + end, 0) if end < 0 else min(end, size))
    return start, end


class CachedFile(AbstractBufferedFile):
    """A read-only file whose bytes come from the cache; ``cache_type="none"`` by default
    because the tiers already are the cache (fsspec's readahead would only re-copy).

    Reads that fall inside one cached block are served from a memory map of the block file
    (see blockfile.MappedBlock): the small random reads of HDF5 or Parquet readers then cost
    a page checksum and a copy, not an open, a seek and a read.
    """

    MAX_MAPPED = 256  # 2 GiB of 8 MiB blocks; evicted ones are unmapped (see below)

    def __init__(self, fs: CacheFileSystem, path: str, meta, **kwargs) -> None:
        self.meta = meta
        self._mapped: dict[int, MappedBlock | None] = {}
        self._fast_reads = 0  # reads served from mapped blocks ...
        self._fast_bytes = 0  # ... and their bytes, not yet added to the client's counters
        self._client = fs.client
        self._bs = fs.options.block_size
        super().__init__(fs, path, mode="rb", size=meta.size, **kwargs)
        fs.client.tallies[id(self)] = self

    def _fetch_range(self, start, end):
        start, end = _clip(start, end, self.meta.size)
        return self.fs.reader.read(self.meta, start, end)

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
                        self._fast_bytes += end - loc
                        reads = self._fast_reads = self._fast_reads + 1
                        if not reads & 4095:
                            self.fold_tally()
                            self._drop_evicted_maps()
                        return data
        return super().read(length)

    def _map(self, index: int) -> MappedBlock | None:
        """Map block ``index`` if a tier holds it; None (and the normal path) otherwise."""
        meta, bs = self.meta, self.fs.options.block_size
        key = block_key(meta.url, meta.version, index, bs)
        length = block_length(meta.size, index, bs)
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
            return block
        return None

    def fold_tally(self) -> None:
        """Add the reads tallied here to the client's counters (every 4,096 reads, on close,
        and when the client asks on stats/flush; a read racing with it in another thread
        may be counted late)."""
        reads, self._fast_reads = self._fast_reads, 0
        nbytes, self._fast_bytes = self._fast_bytes, 0
        if reads:
            self._client.counted_hits(reads, nbytes)

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
        self.fold_tally()
        for index in list(self._mapped):
            self._unmap(index)
        super().close()


class _InvalidatingWriter:
    """Wraps the target's writable file: invalidates the cache once the file is closed."""

    def __init__(self, f, on_close) -> None:
        self._f = f
        self._on_close = on_close
        self._closed = False

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self._f.close()
        finally:
            self._on_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __del__(self):
        try:
            if not self._closed and not self._f.closed:
                self.close()
        except Exception:
            pass
