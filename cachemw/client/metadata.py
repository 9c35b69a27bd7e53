"""Metadata (``info`` and ``ls``) of the source, cached under the validation policy.

A metadata storm (millions of ``stat``/``HEAD`` calls every epoch) is half of what stalls
training on a PFS, so metadata is cached like data: in the process (a dict) and for the
whole node (one small record file per path in the daemon's ``meta`` directory, so a new
DataLoader worker does not ask the source again, and an ``immutable`` dataset stays
readable once warmed even if the source goes away).

Policies: ``immutable`` never asks the source again once a path is known; ``ttl`` asks
again after ``ttl`` seconds; ``always`` asks on every open/read. Asking means asking the
store: the target filesystem's own caches (s3fs's listings) are bypassed each time.

Record files are pickles in a 0700 directory that also holds the daemon's secret: anyone
able to write them already controls the daemon.
"""
from __future__ import annotations

import os
import pickle
import posixpath
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..files import atomic_write, make_private_dirs
from ..keys import path_key, version_token


@dataclass(frozen=True)
class FileMeta:
    """What a read needs to know of a source file, captured at one moment."""

    path: str
    url: str
    size: int
    version: str
    info: dict


_caches: "weakref.WeakSet[MetadataCache]" = weakref.WeakSet()
_DROPPED = "cachemw-dropped"  # a tombstone record (see _drop_shared); loads ignore it


class MetadataCache:
    def __init__(self, target, validate: str, ttl: float, meta_dir: Callable[[], str | None],
                 defer: Callable | None = None) -> None:
        """``defer(fn, arg)``: run ``fn(arg)`` later, off the reader's path (the fill
        writer); node-shared records are then written there. None: written at once."""
        self._defer = defer
        self._records_lock = threading.Lock()
        self._unwritten: dict[str, bytes] = {}  # record path -> payload, while deferred
        _caches.add(self)
        self.target = target
        self.validate = validate
        self.ttl = ttl
        self._meta_dir = meta_dir
        self._infos: dict[str, tuple[dict, float]] = {}
        self._files: dict[str, tuple[FileMeta, float]] = {}
        self._listings: dict[str, tuple[list[dict], float]] = {}
        self.source_calls = 0

    def _fresh(self, fetched: float) -> bool:
        if self.validate == "immutable":
            return True
        if self.validate == "always":
            return False
        return time.time() - fetched < self.ttl

    # -- node-shared records -------------------------------------------------------

    def _record_path(self, kind: str, path: str) -> str | None:
        meta_dir = self._meta_dir()
        if meta_dir is None:
            return None
        key = path_key(f"{kind}\0{path}")
        return f"{meta_dir}/{key[:2]}/{key}"

    def _load_shared(self, kind: str, path: str, fresh_only: bool = True):
        rec = self._record_path(kind, path)
        if rec is None:
            return None
        try:
            with open(rec, "rb") as f:
                stored_path, value, fetched = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception:  # torn or foreign record: ignore it, it will be rewritten
            return None
        if stored_path != path or (fresh_only and not self._fresh(fetched)):
            return None
        return value, fetched

    def _store_shared(self, kind: str, path: str, value, fetched: float) -> None:
        rec = self._record_path(kind, path)
        if rec is None or self.validate == "always":
            return
        payload = pickle.dumps((path, value, fetched), protocol=pickle.HIGHEST_PROTOCOL)
        if self._defer is None:
            self._write_record(rec, payload)
            return
        with self._records_lock:
            self._unwritten[rec] = (payload, fetched)
        self._defer(self._write_deferred, rec)

    def _write_deferred(self, rec: str) -> None:
        """Write the latest payload queued for ``rec`` unless it was dropped since its
        metadata was fetched: here (the lock keeps a drop from being overtaken by a write
        under way) or by any process of the node (its tombstone, see _drop_shared)."""
        with self._records_lock:
            queued = self._unwritten.pop(rec, None)
            if queued is not None and not self._dropped_since(rec, queued[1]):
                self._write_record(rec, queued[0])

    @staticmethod
    def _dropped_since(rec: str, fetched: float) -> bool:
        try:
            with open(rec, "rb") as f:
                record = pickle.load(f)
        except Exception:  # none, torn or foreign: nothing says it was dropped
            return False
        return (isinstance(record, tuple) and len(record) == 2 and record[0] == _DROPPED
                and record[1] >= fetched)

    @staticmethod
    def _write_record(rec: str, payload: bytes) -> None:
        try:
            try:
                atomic_write(rec, payload)
            except FileNotFoundError:
                make_private_dirs(os.path.dirname(rec))
                atomic_write(rec, payload)
        except OSError:
            pass  # metadata sharing is an optimisation; never fail a read for it

    def _drop_shared(self, kind: str, path: str) -> None:
        rec = self._record_path(kind, path)
        if rec is not None:
            with self._records_lock:
                self._unwritten.pop(rec, None)
                # a tombstone, not an unlink: a record of older metadata that some process
                # has yet to write (written behind its reads) must not bring it back
                self._write_record(rec, pickle.dumps((_DROPPED, time.time())))

    def _ask_source(self, call, path: str, **kwargs):
        """``call(path)`` answered by the store: the target's own caches of ``path`` and of
        its parents are dropped first (s3fs answers ``info`` from a listing of the parent
        it keeps forever, and fsspec shares one s3fs instance between every cachemw
        instance over it), so revalidation under ``ttl`` and ``always`` sees the store."""
        self.target.invalidate_cache(path)
        return call(path, **kwargs)

    # -- info ------------------------------------------------------------------------

    def info(self, path: str) -> dict:
        hit = self._infos.get(path)
        if hit is not None and self._fresh(hit[1]):
            return hit[0]
        shared = self._load_shared("info", path) if self.validate != "always" else None
        if shared is not None:
            self._infos[path] = shared
            return shared[0]
        self.source_calls += 1
        asked = time.time()  # before the call: a drop during it must win (_dropped_since)
        try:
            info = self._ask_source(self.target.info, path)
        except FileNotFoundError:
            self.forget(path)
            raise
        self._infos[path] = (info, asked)
        self._store_shared("info", path, info, asked)
        return info

    def file(self, path: str) -> FileMeta:
        """The file's metadata for reading; raises FileNotFoundError / IsADirectoryError."""
        hit = self._files.get(path)
        if hit is not None and self._fresh(hit[1]):
            return hit[0]
        info = self.info(path)
        if info.get("type", "file") == "directory":
            raise IsADirectoryError(f"{path}: is a directory")
        meta = FileMeta(path, self.target.unstrip_protocol(path), int(info["size"]),
                        version_token(info), info)
        self._files[path] = (meta, self._infos[path][1])
        return meta

    def files(self, paths: list[str], concurrency: int = 16) -> list[FileMeta]:
        """``file()`` of each path, in order; those not fresh here are asked of the source
        ``concurrency`` at a time. Why: an announced epoch names every file of the dataset,
        and where a listing gives no versions (HTTP) each costs a request; one at a time,
        an epoch's start waited files x latency."""
        found: dict[str, FileMeta] = {}
        missing = []
        for path in dict.fromkeys(paths):
            hit = self._files.get(path)
            if hit is not None and self._fresh(hit[1]):
                found[path] = hit[0]
            else:
                missing.append(path)
        if len(missing) > 1 and concurrency > 1:
            with ThreadPoolExecutor(min(concurrency, len(missing)),
                                    thread_name_prefix="cachemw-meta") as pool:
                found.update(zip(missing, pool.map(self.file, missing)))
        else:
            found.update((path, self.file(path)) for path in missing)
        return [found[path] for path in paths]

    def known_paths(self) -> list[str]:
        return list(set(self._infos) | set(self._files))

    def known(self, path: str) -> FileMeta | None:
        """What this node last knew of a file, fresh or not, without asking the source."""
        hit = self._files.get(path)
        if hit is not None:
            return hit[0]
        found = self._infos.get(path) or self._load_shared("info", path, fresh_only=False)
        if found is None or found[0].get("type", "file") != "file":
            return None
        info = found[0]
        return FileMeta(path, self.target.unstrip_protocol(path), int(info["size"]),
                        version_token(info), info)

    # -- ls --------------------------------------------------------------------------

    def ls(self, path: str) -> list[dict]:
        hit = self._listings.get(path)
        if hit is not None and self._fresh(hit[1]):
            return hit[0]
        shared = self._load_shared("ls", path) if self.validate != "always" else None
        if shared is None:
            self.source_calls += 1
            asked = time.time()  # before the call, as in info()
            listing = self._ask_source(self.target.ls, path, detail=True)
            shared = (listing, asked)
            self._store_shared("ls", path, listing, shared[1])
        listing, fetched = shared
        self._listings[path] = shared
        for entry in listing:  # prime per-file info: listing a dataset costs one call
            name = entry.get("name")
            # not from a symlink's entry: fsspec's local listing gives the link's own
            # mtime and inode there, not its target's (the version a read would see); nor
            # from one without a size (fsspec's HTTP listing: links only), which is no version
            if name and entry.get("type") == "file" and name != path and not entry.get("islink") \
                    and isinstance(entry.get("size"), int):
                self._infos.setdefault(name, (entry, fetched))
        return listing

    # -- invalidation ------------------------------------------------------------------

    def forget(self, path: str) -> None:
        """Drop what is known of ``path`` here and node-wide (it was written or deleted)."""
        for table in (self._infos, self._files, self._listings):
            table.pop(path, None)
        self._drop_shared("info", path)
        self._drop_shared("ls", path)

    def forget_tree(self, path: str) -> None:
        """Drop ``path``, everything cached under it, and the listings of its ancestors."""
        prefix = path.rstrip("/") + "/"
        for table in (self._infos, self._files, self._listings):
            for p in [p for p in table if p.startswith(prefix)]:
                self.forget(p)
        self.forget(path)
        parent = path
        while True:
            up = posixpath.dirname(parent.rstrip("/"))
            if not up or up == parent:
                break
            self.forget(up)
            parent = up
        self.forget(self.target.root_marker or "/")


def _reset_all_in_child() -> None:
    """A forked child must not inherit a lock held by its parent's writer thread, nor
    records only the parent will write."""
    for cache in list(_caches):
        cache._records_lock = threading.Lock()
        cache._unwritten = {}


os.register_at_fork(after_in_child=_reset_all_in_child)
