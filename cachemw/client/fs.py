"""``cachemw``: an fsspec filesystem that reads any other fsspec filesystem through the
node's tiered cache.

    fsspec.open("cachemw::s3://bucket/train/x.bin")          # chained, any target
    fsspec.open("cachemw:///lustre/train/x.bin")             # shorthand for a local/PFS path
    fsspec.filesystem("cachemw", target_protocol="file", validate="immutable")

Reads go through the cache (blocks of ``block_size``; smaller files whole); metadata is
cached under the same policy (``validate``: immutable | ttl | always). Writes go straight
to the target and invalidate what was cached of the paths they touch. A store client's own
failures (botocore's: not OSErrors) are raised as OSErrors (store_errors.py).

Registered through the ``fsspec.specs`` entry point: no ``import cachemw`` needed. Never
imports Ray, so it works in forked DataLoader workers.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping

import fsspec
from fsspec.spec import AbstractFileSystem

try:  # fsspec >= 2025.x marks filesystems layered over another one (fills in the path)
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

from .announce import announce_entries, messages, stream_owner
from .fills import drain_all
from .link import DaemonClient
from .. import trace as tracing
from ..config import CacheOptions, DaemonConfig, freeze_gc_in_workers, keep_heap_in_workers
from .metadata import MetadataCache
from .openfile import BytesFile, CachedFile, clip, offset
from .ranges import read_ranges
from .reader import BlockReader
from .silence import ReadCall
from ..tiers.fork_safe import ForkSafe
from ..store_errors import store_errors, store_failed
from ..tiers.source import PAGE_SIZE, ChangedSourceError, SourceTier
from .urls import TargetPaths, own_options, protocols_of, url_path, with_client_kwargs
from .writer import InvalidatingWriter, delete_blocks, drop_reached, moved_to, reached_by

log = logging.getLogger(__name__)


class CacheFileSystem(_Base):
    protocol = "cachemw"
    # fsspec passes a chained URL's path as ``fo`` (unused here: paths come with each call);
    # left in the instance token it would make one filesystem, with its own daemon
    # connection, per URL opened (a dataset of a million ``cachemw::`` URLs: a million)
    _strip_tokenize_options = ("fo",)
    target = ForkSafe()  # the store: a forked child's own where the parent's cannot serve it

    def __init__(self, target_protocol: str | None = None, target_options: dict | None = None,
                 fs: AbstractFileSystem | None = None, *, validate: str | None = None,
                 ttl: float | None = None, block_size: int | str | None = None,
                 autostart: bool | None = None, runtime_dir: str | None = None,
                 write_behind: int | str | None = None, daemon_options: dict | None = None,
                 daemon_timeout: float | None = None, trace: str | None = None,
                 fo: str | None = None, **kwargs) -> None:
        for name, value in (("target_options", target_options), ("daemon_options", daemon_options)):
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{name}: must be a dict of options, got {value!r}")
        if fs is not None and not isinstance(fs, AbstractFileSystem):
            raise ValueError(f"fs: must be an fsspec filesystem, got {fs!r}")
        target_options = with_client_kwargs(target_protocol, dict(target_options or {}),
                                            kwargs.pop("client_kwargs", None))
        protocols = fs.protocol if fs is not None else protocols_of(target_protocol or "file")
        kwargs = own_options(kwargs, target_options,
                             {protocols} if isinstance(protocols, str) else set(protocols))
        super().__init__(**kwargs)
        if type(block_size) is int and block_size == 0:
            # fsspec's "no read-ahead" (HF datasets opens archives with it), not a cache
            # unit: the default unit then
            block_size = None
        if fs is not None and target_protocol is not None:
            raise ValueError("target_protocol: give either fs or target_protocol, not both")
        self.options = CacheOptions.build(validate=validate, ttl=ttl, block_size=block_size,
                                          autostart=autostart, runtime_dir=runtime_dir,
                                          write_behind=write_behind,
                                          daemon_timeout=daemon_timeout, trace=trace)
        if fs is None:
            fs = fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        if self.options.trace:  # this process, and a daemon it starts
            tracing.start(self.options.trace)
            daemon_options = {"trace_dir": self.options.trace, **(daemon_options or {})}
        keep_heap_in_workers()  # a bad CACHEMW_WORKER_HEAP or CACHEMW_GC_FREEZE fails here,
        freeze_gc_in_workers()  # not in a worker
        if daemon_options:  # a bad daemon option fails here, not as fallbacks on every read
            DaemonConfig.build(runtime_dir=self.options.runtime_dir, **daemon_options)
        self.target = fs
        self.client = DaemonClient(self.options.runtime_dir, autostart=self.options.autostart,
                                   report_interval=self.options.report_interval,
                                   timeout=self.options.daemon_timeout,
                                   daemon_config=daemon_options)
        self.reader = BlockReader(SourceTier(fs), self.client, self.options.block_size,
                                  self.options.write_behind)
        self.meta = MetadataCache(fs, self.options.validate, self.options.ttl, self.client.meta_dir,
                                  since=self.client.started,
                                  defer=self.reader.fills.defer)
        self.reader.dropped_since = self.meta.dropped_since
        self.reader.moved_on = self.meta.moved_on
        self.meta.superseded = self._drop_version
        self._warned_gone = False  # announced files not at the store, said once

        stripped: dict[str, str] = {}  # fsspec's path normalisation costs ~5 us a call
        path_of = TargetPaths(fs)
        plain = path_of.plain

        def _strip_protocol(path):  # per instance: the target decides what a path is
            if isinstance(path, (list, tuple)):
                return [_strip_protocol(p) for p in path]
            if type(path) is str:
                if plain and path[:1] == "/" and path[-1:] != "/":
                    return path  # what fsspec would return (urls.plain_local), at once
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

        The chain marker goes: ``cachemw::s3://b/k`` -> ``s3://b/k``, and a bare
        ``cachemw://`` hop -> "" (fsspec then takes the path from the next hop). A
        ``cachemw://path`` URL parsed by fsspec (``url_to_fs``, ``fsspec.open``) is the
        path it names on the target fsspec builds for it (urls.url_path): the path
        ``url_to_fs`` returns is then the one ``ls``, ``find`` and ``info`` answer with,
        which pyarrow (and pandas through it) compares them against. Asked from elsewhere
        it stays whole: which store's path it names is the target's to say, and the
        instance resolves it (urls.TargetPaths).
        """
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = fsspec.utils.stringify_path(path)
        if path.startswith("cachemw::"):
            return path[len("cachemw::"):]
        if path == "cachemw://":
            return ""
        if path.startswith("cachemw://"):
            return url_path(path, sys._getframe(1))
        return path

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

    def walk(self, path, maxdepth=None, topdown=True, on_error="omit", **kwargs):
        """fsspec's, except that a store that fails (does not answer, times out) is an
        error, not an empty tree: "omit" passes over every OSError of a listing, so
        ``find``, ``glob`` and ``du`` of a store out of reach would answer as for nothing
        there. A directory gone or refused is passed over, as fsspec does."""
        if on_error == "omit":
            on_error = _omit_unless_store_failed
        return super().walk(path, maxdepth=maxdepth, topdown=topdown, on_error=on_error,
                            **kwargs)

    def expand_path(self, path, recursive=False, maxdepth=None, **kwargs):
        """fsspec's, in paths (it mixes what glob and find return)."""
        found = super().expand_path(path, recursive=recursive, maxdepth=maxdepth, **kwargs)
        return sorted({self._strip_protocol(p) for p in found})

    # -- reads ---------------------------------------------------------------------------

    def cat_file(self, path, start=None, end=None, **kwargs):
        """Bytes of one version of the file. A block the cache misses is read from the
        source pinned to the version the metadata names; if the source has moved on
        (ChangedSourceError), the call starts over once with fresh metadata, so it returns
        the new version whole rather than the old one's cached blocks around new ones (the
        read that met it dropped what was known of the file: metadata.moved_on)."""
        path = self._strip_protocol(path)
        start, end = offset(start), offset(end)
        with ReadCall(self.client.timeout):  # one daemon_timeout of waits in all (silence.py)
            try:
                return self._read_path(path, start, end)
            except ChangedSourceError:
                return self._read_path(path, start, end)

    def _read_path(self, path, start, end) -> bytes:
        """A file the node has never seen is read cold: on a store whose GET names the
        version (HTTP, S3), that GET is the first request, not a HEAD before it."""
        meta, seen = self.meta.known_file(path)
        if meta is None:
            if not seen and self.options.validate != "always":
                data = self.reader.read_cold(path, start, end, self.meta)
                if data is not None:
                    return data
            meta = self.meta.ask_file(path)
        return self._read(meta, start, end)

    def _reads_to_end(self, meta) -> bool:
        """Whether the file is read to its end, uncached, whatever its stated size: a size
        the source cannot state (0: ``/proc``, or an empty file; none: keys.stated_size),
        or a file of sysfs and the like, which states a page whatever it holds
        (tiers/source.py on_pseudo_fs)."""
        return meta.size <= 0 or (meta.size == PAGE_SIZE
                                  and self.reader.source.on_pseudo_fs(meta.path))

    def _read(self, meta, start, end) -> bytes:
        if self._reads_to_end(meta):
            try:
                data = self.reader.read_unsized(meta)
            except ChangedSourceError:
                raise
            except OSError:
                if self.options.validate != "immutable" or meta.size:
                    raise
                # immutable: the metadata is trusted for good, and a warmed dataset stays
                # readable without its source: a file known as empty is empty
                data = b""
            start, end = clip(start, end, len(data))
            return data[start:end]
        return self.reader.read(meta, *clip(start, end, meta.size))

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Many ranges in one batch, each path's at one version (see ranges.py)."""
        return read_ranges(self, paths, starts, ends, on_error)

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
            meta = self.meta.file_to_open(path)
            if self._reads_to_end(meta):  # read now, to its end (_read): the file is its bytes
                return BytesFile(self, path, self.cat_file(path))
            # block_size 0 is fsspec's "no read-ahead" (HTTP's streaming file), and there
            # is none here (cache_type "none"); a buffered file's line reads need a chunk
            return CachedFile(self, path, meta, block_size=block_size or None,
                              cache_type=kwargs.pop("cache_type", "none"),
                              cache_options=cache_options)
        with store_errors(self.target, path):
            f = self.target.open(path, mode, block_size=block_size, autocommit=autocommit,
                                 cache_options=cache_options, **kwargs)
        return InvalidatingWriter(f, lambda: self._written(path), self.target, path)

    def info(self, path, **kwargs):  # the store's failures: source_info's OSErrors
        return self.meta.info(self._strip_protocol(path))

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        with store_errors(self.target, path):
            listing = self.meta.ls(path)
        return listing if detail else [e["name"] for e in listing]

    def created(self, path):
        path = self._strip_protocol(path)
        with store_errors(self.target, path):
            return self.target.created(path)

    def modified(self, path):
        path = self._strip_protocol(path)
        with store_errors(self.target, path):
            return self.target.modified(path)

    # -- writes: through to the target, then invalidate ---------------------------------

    def _written(self, path: str) -> None:
        """After a write: no process of this node may read the old bytes from now on.

        The blocks of the version we knew are deleted right here (the new version may
        carry the same token on a filesystem with coarse mtimes), then the daemon drops
        every other block of the file before this returns. The node's metadata is marked
        dropped before the daemon cancels the fills in flight: a block fetched before its
        lease (client/adopt.py) whose lease comes after the cancel sees the mark.
        """
        self.reader.fills.drain()  # no fill of the old bytes may land after this
        delete_blocks(self, self.meta.known(path))
        self.meta.forget_tree(path)
        self.client.invalidate(self.meta.url(path))

    def _drop_version(self, old) -> None:
        """Have the node's daemon drop the blocks of ``old``, a version of a file the source
        has moved on from (metadata.py ``_superseding``): left to eviction, they held the
        room (and, by their reads, the rank) the new version's blocks needed. One note,
        whatever the file's size (node/superseded.py)."""
        self.client.superseded(old.url, old.version, old.size, self.options.block_size)

    def _written_tree(self, path: str) -> set[str]:
        """_written for ``path`` and what the process knows under it; returns those paths."""
        prefix = path.rstrip("/") + "/"
        done = {p for p in self.meta.known_paths() if p == path or p.startswith(prefix)}
        for p in done:
            self._written(p)
        self._written(path)
        return done | {path}

    @contextlib.contextmanager
    def _then_forget(self, paths, how: str = "file", reached: list[str] = ()):
        """Run a write on the target, then, even if it failed part-way, forget what the
        cache knew of ``paths``: a file's blocks and metadata (``"file"``), everything
        under a path too (``"tree"``), or only metadata (``"meta"``: directories); and of
        each file in ``reached`` (writer.drop_reached). A store client's own failure is
        raised as an OSError (store_errors.py)."""
        first = paths[0] if isinstance(paths, list) and paths else paths
        try:
            with store_errors(self.target, first):
                yield
        finally:
            done: set[str] = set()
            for p in paths if isinstance(paths, list) else [paths]:
                if how == "meta":
                    self.meta.forget_tree(p)
                elif how == "tree":
                    done |= self._written_tree(p)
                else:
                    self._written(p)
            if reached:
                drop_reached(self, [p for p in reached if p not in done])

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        with self._then_forget(path):
            self.target.pipe_file(path, value, mode=mode, **kwargs)

    def rm_file(self, path):
        path = self._strip_protocol(path)
        with self._then_forget(path):
            self.target.rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = self._strip_protocol(path)
        reached = reached_by(self.target, self._strip_protocol, paths, recursive, maxdepth)
        with self._then_forget(paths if isinstance(paths, list) else [paths], "tree", reached):
            self.target.rm(paths, recursive=recursive, maxdepth=maxdepth)

    def mkdir(self, path, create_parents=True, **kwargs):
        path = self._strip_protocol(path)
        with self._then_forget(path, "meta"):
            self.target.mkdir(path, create_parents=create_parents, **kwargs)

    def makedirs(self, path, exist_ok=False):
        path = self._strip_protocol(path)
        with self._then_forget(path, "meta"):
            self.target.makedirs(path, exist_ok=exist_ok)

    def rmdir(self, path):
        path = self._strip_protocol(path)
        with self._then_forget(path, "meta"):
            self.target.rmdir(path)

    def cp_file(self, path1, path2, **kwargs):
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        with self._then_forget(path2):
            self.target.cp_file(path1, path2, **kwargs)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        both = (p1 if isinstance(p1, list) else [p1]) + (p2 if isinstance(p2, list) else [p2])
        # a directory's whole tree, recursive or not: some targets (local) move it all
        moved = reached_by(self.target, self._strip_protocol, p1, True, maxdepth)
        with self._then_forget(both, "tree", moved + moved_to(both[:-1], moved, both[-1])):
            self.target.mv(p1, p2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def put_file(self, lpath, rpath, callback=fsspec.callbacks.DEFAULT_CALLBACK, mode="overwrite",
                 **kwargs):
        rpath = self._strip_protocol(rpath)
        with self._then_forget(rpath):
            self.target.put_file(lpath, rpath, callback=callback, mode=mode, **kwargs)

    def touch(self, path, truncate=True, **kwargs):
        path = self._strip_protocol(path)
        with self._then_forget(path):
            self.target.touch(path, truncate=truncate, **kwargs)

    # -- cache control and visibility ---------------------------------------------------

    def announce(self, paths, *, chunk: int = 8192, rank: int = 0, ranks: int = 1,
                 group: str | None = None, first: int = 0, replace: bool = False,
                 owner: str | None = None) -> int:
        """Tell this node's daemon the files (or (path, start, end) ranges) about to be
        read, in order: placement turns clairvoyant and prefetches ahead of the reader.
        Returns the number of blocks announced; 0 if no daemon is reachable. A file not at
        the store takes no place in the order (its read will fail; said once).

        Several ranks of the node reading at once (DDP, a process per device, each its
        own shard) each announce their own order with ``rank`` and ``ranks`` (the node's
        ranks, torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE) and the same ``group`` for the
        orders of one epoch: the daemon lays them interleaved, as they will be read, not
        one after another. ``first``: the index, among the blocks of this rank's order,
        of the first block announced here (an order announced in windows: the sum of the
        earlier calls' returns). ``replace``: this process stopped its last order early (a
        training loop ending its epoch after some steps): what ``owner`` announced and has
        not been read is withdrawn first, so the new order is not laid after that unread
        rest; other owners' orders stay. ``owner``: whose orders these are (by default
        this process's, or with ``ranks`` the group's name up to its last ':', which all
        ranks share: name groups ``<owner>:<epoch>``). AnnouncingSampler does all of this,
        each sampler an owner of its own.

        This process's fills written behind its reads (through any of its filesystems) are
        drained first, for as long as the daemon may stay silent at most: each asks the
        daemon for its block's lease, which counts as a read of the node's access stream,
        and one for a block the order names, reaching the daemon after the order, would
        take that block's place in it early, as if read there (a read of a block outside
        the order takes no place: placement/future.py). Other processes' fills
        (DataLoader workers') are theirs to send."""
        owner = stream_owner(rank=rank, ranks=ranks, group=group, first=first,
                             replace=replace, owner=owner, chunk=chunk)
        entries = announce_entries(paths)
        if self.client.backing_off():  # it did not answer a moment ago: the epoch starts
            return 0                   # now, not after a drain and a send that time out
        if not drain_all(timeout=self.client.timeout):
            log.debug("announce: fills of earlier reads still queued after %s s; announcing",
                      self.client.timeout)
        stripped = [self._strip_protocol(path) for path, _, _ in entries]
        metas = self.meta.files(stripped, missing_ok=True)
        items = []
        gone = []
        for (path, start, end), meta in zip(entries, metas):
            if meta is None:  # not at the store: its read will fail, it takes no place
                gone.append(path)
                continue
            if not self._reads_to_end(meta):  # (those are read uncached: nothing to place)
                start, end = clip(offset(start), offset(end), meta.size)
                items.extend(self.reader.announce_items(meta, start, end))
        if gone and not self._warned_gone:
            self._warned_gone = True
            log.warning("announce: %d of the %d files are not at the store (the first: %s); "
                        "the others are announced (said once)", len(gone), len(entries), gone[0])
        sent = 0
        for part, stream in messages(items, chunk, rank=rank, ranks=ranks, group=group,
                                     first=first, replace=replace, owner=owner):
            if not self.client.announce(part, stream):
                return sent
            sent += len(part)
        return sent

    def invalidate_cache(self, path=None):
        if path is None:
            self.meta = MetadataCache(self.target, self.options.validate, self.options.ttl,
                                      self.client.meta_dir, defer=self.reader.fills.defer,
                                      since=self.client.started)
            self.reader.dropped_since = self.meta.dropped_since
            self.reader.moved_on = self.meta.moved_on
        else:
            self.meta.forget_tree(self._strip_protocol(path))

    def stats(self) -> dict:
        """This process's counters (hits, misses, fallbacks, ...)."""
        self.reader.fills.drain()
        self.client.fold_tallies()
        return dict(self.client.counters)



def _omit_unless_store_failed(exc: BaseException) -> None:
    """fsspec's walk ``on_error``: the failure of a listing is passed over, unless the
    store failed (store_errors.py store_failed)."""
    if store_failed(exc):
        raise exc
