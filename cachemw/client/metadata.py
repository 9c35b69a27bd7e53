"""Metadata (``info`` and ``ls``) of the source, cached under the validation policy.

A metadata storm (millions of ``stat``/``HEAD`` calls every epoch) is half of what stalls
training on a PFS, so metadata is cached like data: in the process (a dict) and for the
whole node, in the daemon's ``meta`` directory, so a new DataLoader worker does not ask the
source again, and an ``immutable`` dataset stays readable once warmed even if the source
goes away. Files' ``info`` is shared through a table every process maps (metatable.py:
no file to open per path); directory listings, few and large, as one record file each
(shared_records.py, which also keeps what one filesystem of the process learnt, until it
is written for the node, and dropped for every filesystem of the process).

What a process keeps of a file for reading is a ``FileMeta`` (a tuple of plain values):
a worker that reads thousands of files for the first time must not leave thousands of
objects for the garbage collector to track (a full collection in a forked child of a large
trainer touches, and so copies, every page of its heap: ~90 ms here).

Policies: ``immutable`` never asks the source again once a path is known; ``ttl`` asks
again after ``ttl`` seconds; ``always`` asks on every open/read. Asking means asking the
store: the target filesystem's own caches (s3fs's listings) are bypassed each time.
"""
from __future__ import annotations

import errno
import os
import posixpath
import struct
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, NamedTuple

from ..keys import other_content, stated_size, version_token
from ..tiers.fork_safe import ForkSafe
from ..tiers.source import source_info
from .metatable import written_at
from .shared_records import SharedRecords, forgotten, forgotten_after, mark_forgotten
from .urls import target_url


class FileMeta(NamedTuple):
    """What a read needs to know of a source file, captured at one moment (``fetched``)."""

    path: str
    url: str
    size: int
    version: str
    fetched: float


_caches: "weakref.WeakSet[MetadataCache]" = weakref.WeakSet()

RELOOK = 5.0  # seconds before a directory listing found stale is read again (_listed)


class MetadataCache(SharedRecords):
    target = ForkSafe()  # the store asked for info and listings (a forked child's own)

    def __init__(self, target, validate: str, ttl: float, meta_dir: Callable[[], str | None],
                 defer: Callable | None = None, since: Callable[[], float] = lambda: 0.0) -> None:
        """``defer(fn, arg)``: run ``fn(arg)`` later, off the reader's path (the fill
        writer); node-shared records are then written there. None: written at once.
        ``since()``: when the node's daemon started; under ``ttl`` metadata fetched before
        is not fresh: the node's table may hold a previous job's (it outlives jobs on the
        NVMe tier), and a file changed between the jobs must be read anew."""
        self._defer = defer
        # told each version of a file found superseded (the source has another, or none):
        # set by the filesystem, which has the node's daemon drop that version's blocks
        self.superseded: Callable[[FileMeta], None] | None = None
        self._table = None  # the node's table, mapped at its first use (_shared_table)
        self._warned_drop = False
        _caches.add(self)
        self.target = target
        self._url = target_url(target)  # target.unstrip_protocol, cheaper for local paths
        self.validate = validate
        self.ttl = ttl
        self._meta_dir = meta_dir
        self._since = since
        self._fresh_from = 0.0  # since(), read when the node's table is opened
        self._infos: dict[str, tuple[dict, float]] = {}
        self._drops_seen = 0  # the node's drop count when this process last looked
        # path -> FileMeta packed in a string (_pack): a string is no object the garbage
        # collector tracks or counts, a tuple per file is (see the module docstring)
        self._files: dict[str, str] = {}
        self._listings: dict[str, tuple[list[dict], float]] = {}
        # directory -> (its node-shared listing by file name or None, fetched, looked at)
        self._dir_entries: dict[str, tuple[dict | None, float, float]] = {}
        self.source_calls = 0

    def _fresh(self, fetched: float) -> bool:
        if self.validate == "immutable":
            return True
        if self.validate == "always":
            return False
        return fetched >= self._fresh_from and time.time() - fetched < self.ttl

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
        found = self._infos[path] = self._lookup(path)
        return found[0]

    def _lookup(self, path: str) -> tuple[dict, float]:
        """(info, fetched) from the node's shared metadata, else from the source (shared)."""
        shared = self._load_shared("info", path) if self.validate != "always" else None
        if shared is None:
            shared = self._listed(path)
        return shared if shared is not None else self._ask(path)

    def _listed(self, path: str) -> tuple[dict, float] | None:
        """``path``'s entry in its directory's listing as the node shares it (an ``ls``
        record), if fresh and the file not dropped since, checked at each lookup:
        (info, fetched). Why: ``cachemw warm``, ``find`` and ``glob`` list a dataset, and
        its listings give every file's size and version; a process that had not listed it
        asked the source for each file again, and under immutable a warmed file was
        unreadable once its source had gone, against the README (review readme4).

        The listing is read once into an index of this process (``_dir_entries``), not into
        its per-file info: a sibling replaced at the source and dropped since must be
        checked when it is looked up, not taken as the listing had it. A listing found
        stale, none, or without the file is kept, and read again only after RELOOK
        seconds: read and unpickled at every lookup of its directory's files, it cost 64 ms
        a lookup in a directory of 50,000 (review diffrev-5)."""
        if self.validate == "always":
            return None
        parent = self.target._parent(path)
        if not parent or parent == path:
            return None
        held = self._dir_entries.get(parent)
        now = time.monotonic()
        if held is None or (now - held[2] >= RELOOK and (
                held[0] is None or path not in held[0] or not self._fresh(held[1]))):
            found = self._load_shared("ls", parent, fresh_only=False)
            index = None if found is None else {
                e.get("name"): e for e in found[0] if _versioned_file(e, parent)}
            held = self._dir_entries[parent] = (index, found[1] if found else 0.0, now)
        index, fetched, _ = held
        entry = None if index is None or not self._fresh(fetched) else index.get(path)
        if entry is None:
            return None
        url = self._url(path)
        if forgotten and forgotten_after(url, fetched):
            return None
        table = self._shared_table()
        rec = None if table is None else table.get(url)
        if rec is not None and rec[1] and rec[0] >= fetched:  # dropped since it was listed
            return None
        return entry, fetched

    def _ask(self, path: str) -> tuple[dict, float]:
        """(info, fetched) from the source; shared with the node."""
        self.source_calls += 1
        asked = time.time()  # before the call: a drop during it must win (_dropped_since)
        try:  # a failure of the store's own (an HTTP 503) is not a missing file
            info = self._ask_source(partial(source_info, self.target), path)
        except FileNotFoundError:
            # what this filesystem held of it (stale) goes; what the node and the process
            # know stays: a version read before the source went (its fills written behind,
            # its record queued) is still that version's, and under immutable a warmed
            # file stays readable (a read of a version that fails drops it: moved_on)
            for table in (self._infos, self._files, self._listings, self._dir_entries):
                table.pop(path, None)
            raise
        self._store_shared("info", path, info, asked)
        return info, asked

    def file(self, path: str) -> FileMeta:
        """The file's metadata for reading; raises FileNotFoundError / IsADirectoryError.

        Kept in the process as one FileMeta per file (plain values only); the info it came
        from is kept only if this process asked the source for it (or called info())."""
        meta, _ = self.known_file(path)
        return meta if meta is not None else self.ask_file(path)

    def file_to_open(self, path: str) -> FileMeta:
        """``file()`` for an open, which starts a reader on one version: where another
        process of the node wrote the file through the cache after this one learnt it, its
        blocks are gone and the source has another version, so it is learnt again (else
        the open file's first read would fail on the version it was opened at). What this
        process holds is checked against the node's drops only when some process wrote
        through the cache since it last looked (one mapped word: a lookup per open cost
        ~20 % of a small file's open and read)."""
        table = self._shared_table()
        drops = 0 if table is None else table.drops()
        if drops != self._drops_seen:
            self._drops_seen = drops
            self._files.clear()  # learnt again from the node's table, which has the drops
            self._infos.clear()
        return self.file(path)

    def ask_file(self, path: str) -> FileMeta:
        """``file()`` for a caller whose ``known_file()`` has just said None: the source's
        answer (shared with the node), without looking in this process and the node's
        table a second time."""
        old = self._last_version(path)
        return self._superseding(old, self._keep(path, *self._ask(path)))

    def _last_version(self, path: str) -> FileMeta | None:
        """What the node knew of ``path`` before the source is asked again (stale, or a
        previous job's), if superseded versions are told."""
        return None if self.superseded is None else self.known(path)

    def _superseding(self, old: FileMeta | None, new: FileMeta) -> FileMeta:
        """``new``, after telling ``superseded`` of ``old`` if the source has moved on from
        it. Why: the blocks of a file's earlier version are never read again, and were
        left to eviction; under the history policy their read counts kept the new
        version's blocks out of a full tier (a dataset rewritten in place after 5 epochs
        was two thirds uncached for the next 11, and a third of the old blocks stayed for
        good: review loaders5).

        Only an older answer (fetched before ``new`` was asked for: a late answer must not
        call the newer version superseded) that says another content: a field both tokens
        carry differs. A versioned bucket's listing gives an object's ETag without the
        VersionId its HEAD and GET give: the same bytes under two tokens (diffrev-6)."""
        if (old is not None and old.size > 0 and old.fetched <= new.fetched
                and other_content(old.version, new.version)):
            self.superseded(old)
        return new

    def known_file(self, path: str) -> tuple[FileMeta | None, bool]:
        """What ``file()`` returns if that needs no call to the source (a fresh record in
        this process or in the node's table), else None; and whether this process or the
        node has any record of the file, fresh or not (a dropped one is none).
        IsADirectoryError if the node knows it as a directory. Nothing fetched before this
        process last dropped the file (``forgotten``: a write, a read that met another
        version) is taken, from any of its filesystems or the node."""
        seen = False
        hit = self._files.get(path)
        if hit is not None:
            meta = _unpack(path, hit)
            if forgotten and forgotten_after(meta.url, meta.fetched):
                self._files.pop(path, None)
            elif self._fresh(meta.fetched):
                return meta, True
            else:
                seen = True
        found = self._infos.get(path)
        if found is not None:
            if forgotten and forgotten_after(self._url(path), found[1]):
                self._infos.pop(path, None)
            elif self._fresh(found[1]):
                return self._keep(path, *found), True
            else:
                seen = True
        if self.validate == "always":
            return None, seen
        table = self._shared_table()
        url = self._url(path)
        shared = None if table is None else table.get(url)
        if shared is not None and not shared[1] and not (
                forgotten and forgotten_after(url, shared[0])):  # a record, not a drop
            if not self._fresh(shared[0]):
                seen = True
            elif len(shared[2]) >= 3:  # the node knows it: no unpickling of its info
                size, version, kind = shared[2][:3]
                if kind == "directory":
                    raise is_a_directory(path)
                meta = FileMeta(path, url, size, version, shared[0])
                self._files[path] = _pack(meta)
                return meta, True
        found = self._load_shared("info", path)  # its info, or one queued here unwritten
        if found is None:
            found = self._listed(path)
        if found is not None:
            return self._keep(path, *found), True
        return None, seen

    def learned(self, path: str, info: dict, fetched: float) -> FileMeta:
        """A file's info that came with a read of it (a GET that named its version, see
        tiers/source.py read_first), asked at ``fetched``: kept here; ``share`` it next."""
        old = self._last_version(path)
        return self._superseding(old, self._keep(path, info, fetched))

    def share(self, path: str, info: dict, fetched: float) -> None:
        """Share ``learned`` info with the node as info from the source is, so no process
        of the node asks the source for it again."""
        self._store_shared("info", path, info, fetched)

    def dropped_since(self, path: str, when: float) -> bool:
        """True if a process of the node wrote ``path`` through the cache at or after
        ``when`` (a drop that only said a read met another version, or none, at the source
        does not count: the blocks fetched before it are still their version's)."""
        table = self._shared_table()
        found = None if table is None else table.get(self._url(path))
        return found is not None and written_at(found) >= when

    def _keep(self, path: str, info: dict, fetched: float) -> FileMeta:
        if info.get("type", "file") == "directory":
            raise is_a_directory(path)
        meta = FileMeta(path, self._url(path), stated_size(info),
                        version_token(info), fetched)
        self._files[path] = _pack(meta)
        return meta

    def files(self, paths: list[str], concurrency: int = 16,
              missing_ok: bool = False) -> list[FileMeta | None]:
        """``file()`` of each path, in order; those not fresh here are asked of the source
        ``concurrency`` at a time. Why: an announced epoch names every file of the dataset,
        and where a listing gives no versions (HTTP) each costs a request; one at a time,
        an epoch's start waited files x latency. ``missing_ok``: None for a path not at the
        source, where FileNotFoundError would end the whole call."""
        found: dict[str, FileMeta] = {}
        missing = []
        for path in dict.fromkeys(paths):
            hit = self._files.get(path)
            meta = None if hit is None else _unpack(path, hit)
            if meta is not None and self._fresh(meta.fetched) \
                    and not (forgotten and forgotten_after(meta.url, meta.fetched)):
                found[path] = meta
            else:
                missing.append(path)
        def ask(path: str) -> FileMeta | None:
            try:
                return self.file(path)
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise
        if len(missing) > 1 and concurrency > 1:
            with ThreadPoolExecutor(min(concurrency, len(missing)),
                                    thread_name_prefix="cachemw-meta") as pool:
                found.update(zip(missing, pool.map(ask, missing)))
        else:
            found.update((path, ask(path)) for path in missing)
        return [found[path] for path in paths]

    def known_paths(self) -> list[str]:
        return list(set(self._infos) | set(self._files))

    def url(self, path: str) -> str:
        """The URL naming ``path``'s file in the cache (urls.target_url): its blocks are
        tagged with it, and the daemon drops them by it."""
        return self._url(path)

    def known(self, path: str) -> FileMeta | None:
        """What this node last knew of a file, fresh or not, without asking the source."""
        hit = self._files.get(path)
        if hit is not None:
            return _unpack(path, hit)
        found = self._infos.get(path) or self._load_shared("info", path, fresh_only=False)
        if found is None or found[0].get("type", "file") != "file":
            return None
        info = found[0]
        return FileMeta(path, self._url(path), stated_size(info),
                        version_token(info), found[1])

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
        self._listings[path] = shared
        self._prime(path, *shared)
        return shared[0]

    def _prime(self, path: str, listing: list[dict], fetched: float) -> None:
        """Per-file info from a listing of ``path``: listing a dataset costs one call."""
        infos = self._infos  # (what this process asked of a file itself comes first)
        for entry in listing:
            name = entry.get("name")
            if _versioned_file(entry, path) \
                    and not (forgotten and forgotten_after(self._url(name), fetched)):
                infos.setdefault(name, (entry, fetched))

    # -- invalidation ------------------------------------------------------------------

    def forget(self, path: str, written: bool = True) -> None:
        """Drop what is known of ``path`` here, in the process and node-wide: it was written
        through the cache (``written``: the blocks fetched before are cancelled too, see
        dropped_since), or a read found the version known gone (``moved_on``)."""
        mark_forgotten(self._url(path), time.time())
        for table in (self._infos, self._files, self._listings, self._dir_entries):
            table.pop(path, None)
        self._drop_shared("info", path, written)
        self._drop_shared("ls", path)

    def moved_on(self, meta: FileMeta) -> None:
        """A read of ``meta``'s version met another version at the source, or no file
        (ChangedSourceError, FileNotFoundError): what the process and the node know of the
        file is dropped, so that the next read, a retry or a reopen, under every validate
        mode, asks the source. Not a write: fills of that version under way are not refused
        as a write's are (``dropped_since``); but the version is gone at the source, and its
        blocks, never to be read by a new open, are told ``superseded`` (an open file of that
        version then fetches, and fails on, the blocks it does not hold). Once per version
        learnt: the other blocks of a read failing with it find it dropped already."""
        if forgotten and forgotten_after(meta.url, meta.fetched):
            for table in (self._infos, self._files):
                table.pop(meta.path, None)
            return
        self.forget(meta.path, written=False)
        if self.superseded is not None and meta.size > 0:
            self.superseded(meta)

    def forget_tree(self, path: str) -> None:
        """Drop ``path``, everything cached under it, and the listings of its ancestors."""
        prefix = path.rstrip("/") + "/"
        for table in (self._infos, self._files, self._listings, self._dir_entries):
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


# size, fetched, the URL's length: binary, held in the string as Latin-1 characters
_HEAD = struct.Struct("<qdQ")
_HEAD_CHARS = _HEAD.size
_new_tuple = tuple.__new__


def _versioned_file(entry: dict, listed: str) -> bool:
    """Whether a listing's entry gives a file's version: not a symlink's (fsspec's local
    listing gives the link's own mtime and inode there, not its target's, the version a
    read would see), nor one without a size (fsspec's HTTP listing: links only)."""
    name = entry.get("name")
    return bool(name) and entry.get("type") == "file" and name != listed \
        and not entry.get("islink") and isinstance(entry.get("size"), int)


def is_a_directory(path: str) -> IsADirectoryError:
    """The error a read of a directory raises, as ``open()`` and fsspec's local filesystem
    raise it: with its errno (EISDIR), so that ``e.errno == errno.EISDIR`` holds."""
    return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)


def _pack(meta: FileMeta) -> str:
    """``meta`` (its path aside) as one string: a binary head (size, fetched, the URL's
    length) as Latin-1 characters, the URL, the version (a URL or version may hold any
    character; the length keeps them apart). Every hit unpacks it: parsing the numbers
    from decimal text and a FileMeta made through its Python ``__new__`` cost 12k
    instructions a hit, about a sixth of a 4 KiB hit; this costs 7k."""
    return _HEAD.pack(meta.size, meta.fetched, len(meta.url)).decode("latin-1") + meta.url \
        + meta.version


def _unpack(path: str, packed: str) -> FileMeta:
    size, fetched, n = _HEAD.unpack(packed[:_HEAD_CHARS].encode("latin-1"))
    n += _HEAD_CHARS
    return _new_tuple(FileMeta, (path, packed[_HEAD_CHARS:n], size, packed[n:], fetched))


def _reset_all_in_child() -> None:
    """A forked child must not inherit a lock held by its parent's writer thread (the
    process-wide records: shared_records.py)."""
    for cache in list(_caches):
        if cache._table is not None:  # its mappings stay valid; its writer lock may not
            cache._table = cache._table.forked()


os.register_at_fork(after_in_child=_reset_all_in_child)
