"""The node-shared half of the metadata cache (metadata.py), and what the process knows
across its filesystems.

Files' ``info`` goes to the node's table (metatable.py), listings to record files of their
own, both written behind the reads (by the fill writer, fills.py). Until a record is
written it is this process's, whichever of its filesystems learnt it: a second instance
(made with other options by pandas or HF datasets, or with ``skip_instance_cache``) finds
it here rather than asking the source again, and so does not find a warmed file gone
because its record is still queued. What the process dropped (a write through the cache,
a read that found the version it knew gone at the source) is the process's too: metadata
fetched before a drop is taken from nowhere again, not even from a table that could not
mark the drop (the table of a daemon that stopped and freed it; a lock held too long).

Record files are pickles in a 0700 directory that also holds the daemon's secret: anyone
able to write them already controls the daemon.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time

from ..files import atomic_write, make_private_dirs
from ..keys import path_key, stated_size, version_token
from .metatable import MetaTable

log = logging.getLogger(__name__)

_DROPPED = "cachemw-dropped"  # a tombstone record (see _drop_shared); loads ignore it

# (node's metadata directory, kind, URL) -> (value, fetched) of records queued for that
# node's tables (written behind the reads, see _store_shared) until they are written
# there, by any filesystem of the process that shares the directory (filesystems of
# other runtime directories are other nodes' caches: not theirs to find); its own lock, taken inside the records lock, never the other way, so that a
# reader queueing a record does not wait for the writer threads' record writes
_unwritten: dict[tuple[str, str], tuple] = {}
_unwritten_lock = threading.Lock()
# held while a record is written or dropped: a drop is never overtaken by a write
_records_lock = threading.Lock()
# URL -> when this process last dropped what it knew of the file (a write through the
# cache, a read that found its version gone): metadata fetched before is not taken again,
# from the node's table or anywhere, even where the table could not mark the drop (a
# daemon that stopped and freed it, a busy lock)
forgotten: dict[str, float] = {}  # (never rebound: imported by name)
_FORGOTTEN_MAX = 65536  # the oldest marks go past this (the node's table keeps its drops)


def _is_drop(record) -> bool:
    return isinstance(record, tuple) and len(record) == 2 and record[0] == _DROPPED


def forgotten_after(url: str, fetched: float) -> bool:
    """Did this process drop what it knew of ``url`` after metadata ``fetched`` then?"""
    return fetched <= forgotten.get(url, -1.0)


def mark_forgotten(url: str, when: float) -> None:
    forgotten.pop(url, None)  # re-inserted: the dict stays in the order of the marks
    forgotten[url] = when
    while len(forgotten) > _FORGOTTEN_MAX:
        try:
            del forgotten[next(iter(forgotten))]
        except (KeyError, StopIteration, RuntimeError):  # another thread's mark meanwhile
            break


class SharedRecords:
    """The node-shared records of a MetadataCache (mixed into it): it provides
    ``_meta_dir()``, ``_since()``, ``_url(path)``, ``_fresh(fetched)``, ``validate`` and
    ``_defer``."""

    _table: MetaTable | None = None
    _fresh_from = 0.0  # since(), read when the node's table is opened
    _warned_drop = False

    def _shared_table(self) -> MetaTable | None:
        meta_dir = self._meta_dir()
        if meta_dir is None:
            return None
        table, since = self._table, self._since()
        # another daemon (this one stopped, its DRAM tier and table freed, a new one
        # started): its table, not the one mapped from the freed files
        if table is None or table.dir != f"{meta_dir}/info" or since != self._fresh_from:
            self._fresh_from = since
            table = self._table = MetaTable(f"{meta_dir}/info")
        return table

    def _record_path(self, kind: str, path: str) -> str | None:
        """The file of ``path``'s record of ``kind`` (a listing), named by the path's URL
        (urls.target_url), as the table's records are: by the path alone, two stores with
        the same paths (two endpoints, two ``dir`` roots) shared it, and one's ``ls`` gave
        the other's listing."""
        meta_dir = self._meta_dir()
        if meta_dir is None:
            return None
        key = path_key(f"{kind}\0{self._url(path)}")
        return f"{meta_dir}/{key[:2]}/{key}"

    def _load_shared(self, kind: str, path: str, fresh_only: bool = True):
        """(value, fetched) the node shares for ``path`` (or this process has queued for it,
        not written yet), or None."""
        url = self._url(path)
        floor = forgotten.get(url, -1.0) if forgotten else -1.0  # dropped then
        found = None
        if kind == "info":
            table = self._shared_table()
            rec = None if table is None else table.get(url)
            if rec is not None and rec[1]:
                floor = max(floor, rec[0])
            elif rec is not None and rec[0] > floor and (not fresh_only or self._fresh(rec[0])):
                try:
                    found = pickle.loads(rec[3]), rec[0]
                except Exception:  # written by another version of cachemw, say: not ours
                    pass
        else:
            rec = self._record_path(kind, path)
            try:
                with open(rec, "rb") as f:  # (no directory: TypeError, below)
                    record = pickle.load(f)
                if _is_drop(record):
                    floor = max(floor, record[1])
                else:
                    stored_path, value, fetched = record
                    if stored_path == path and fetched > floor:
                        found = value, fetched
            except Exception:  # none, torn or foreign: ignore it, it will be rewritten
                pass
        if found is None or not self._fresh(found[1]):
            queued = _unwritten.get((self._meta_dir(), kind, url)) if _unwritten else None
            if queued is not None and queued[1] > floor and (
                    found is None or queued[1] > found[1]):
                found = queued
        if found is None or (fresh_only and not self._fresh(found[1])):
            return None
        return found

    def _store_shared(self, kind: str, path: str, value, fetched: float) -> None:
        meta_dir = self._meta_dir()
        if self.validate == "always" or meta_dir is None:
            return
        if self._defer is None:
            self._write_shared((kind, path), (value, fetched))
            return
        key = (meta_dir, kind, self._url(path))
        with _unwritten_lock:
            queued = _unwritten.get(key)
            if queued is not None and queued[1] > fetched:
                return  # a later answer is queued already
            _unwritten[key] = (value, fetched)
        self._defer(self._write_deferred, (kind, path))

    def _write_deferred(self, which: tuple[str, str]) -> None:
        """Write the latest value queued for ``which`` unless it was dropped since its
        metadata was fetched: here (the lock keeps a drop from being overtaken by a write
        under way) or by any process of the node (its tombstone, see _drop_shared). It
        stays queued, so found by this process's lookups, until it is written."""
        key = (self._meta_dir(), which[0], self._url(which[1]))
        with _records_lock:
            queued = _unwritten.get(key)
            if queued is None:
                return
            try:
                # (dropped through a filesystem of another runtime directory: not
                # written to this one's either)
                if not forgotten_after(key[2], queued[1]):
                    self._write_shared(which, queued)
            finally:
                with _unwritten_lock:
                    if _unwritten.get(key) is queued:
                        del _unwritten[key]

    def _write_shared(self, which: tuple[str, str], queued: tuple) -> None:
        kind, path = which
        value, fetched = queued
        if kind == "info":
            table = self._shared_table()
            if table is not None:  # refused if dropped since
                table.store(self._url(path), value, fetched,
                            (stated_size(value), version_token(value),
                             value.get("type", "file")))
            return
        rec = self._record_path(kind, path)
        if rec is not None and not self._dropped_since(rec, fetched):
            self._write_record(rec, pickle.dumps((path, value, fetched),
                                                 protocol=pickle.HIGHEST_PROTOCOL))

    @staticmethod
    def _dropped_since(rec: str, fetched: float) -> bool:
        try:
            with open(rec, "rb") as f:
                record = pickle.load(f)
        except Exception:  # none, torn or foreign: nothing says it was dropped
            return False
        return _is_drop(record) and record[1] >= fetched

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

    def _drop_shared(self, kind: str, path: str, written: bool = True) -> None:
        """A tombstone, not a removal: metadata fetched earlier that some process has yet to
        write (written behind its reads) must not bring it back. ``written``: the file was
        written through the cache (see MetaTable.drop)."""
        url, meta_dir = self._url(path), self._meta_dir()
        with _records_lock:
            with _unwritten_lock:
                _unwritten.pop((meta_dir, kind, url), None)
            if meta_dir is None:
                return
            now = time.time()
            if kind == "info":
                table = self._shared_table()
                if table is not None and not table.drop(url, now, written) \
                        and not self._warned_drop:
                    self._warned_drop = True
                    log.warning("could not mark %s dropped in the node's metadata table %s; "
                                "other processes may read it at its old version until a read "
                                "finds the source changed", path, table.dir)
            else:
                rec = self._record_path(kind, path)
                if rec is not None:
                    self._write_record(rec, pickle.dumps((_DROPPED, now)))


def _reset_in_child() -> None:
    """A forked child must not inherit a lock held by its parent's writer thread, nor
    records only the parent will write."""
    global _records_lock, _unwritten_lock
    _records_lock = threading.Lock()
    _unwritten_lock = threading.Lock()
    _unwritten.clear()


os.register_at_fork(after_in_child=_reset_in_child)
