"""Writes through a ``cachemw`` filesystem (client/fs.py: they go straight to the target):
the writable file, the target's own, which the cache lets go of once it is closed (and
again when a transaction commits it), and what a removal or a move reaches."""
from __future__ import annotations

import posixpath

from ..keys import block_count, block_key
from ..store_errors import store_errors


class InvalidatingWriter:
    """Wraps the target's writable file: invalidates the cache once the file is closed.
    Its writes reach the store as they fill its buffer, when flushed and when closed: a
    store client's own failure there is raised as an OSError (store_errors)."""

    def __init__(self, f, on_close, target=None, path: str = "") -> None:
        self._f = f
        self._on_close = on_close
        self._closed = False
        self._target = target
        self._path = path

    def write(self, data):
        with store_errors(self._target, self._path):
            return self._f.write(data)

    def flush(self, *args, **kwargs):
        with store_errors(self._target, self._path):
            return self._f.flush(*args, **kwargs)

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            with store_errors(self._target, self._path):
                self._f.close()
        finally:
            self._on_close()

    def commit(self):
        """A write of a transaction (``fs.transaction``, ``autocommit=False``) reaches the
        store here, after close: the cache is invalidated again, or a read between close
        and commit cached the old bytes for good (review api7)."""
        try:
            with store_errors(self._target, self._path):
                self._f.commit()
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
        except Exception:  # a finaliser: nothing may escape it (modules half gone at exit)
            pass


def reached_by(target, strip, paths, recursive: bool, maxdepth) -> list[str]:
    """What a removal or move of ``paths`` (globs, directories) reaches on ``target``, before
    it does (``strip``: the cache's path form): each file another process of the node read
    (a process's own records are not all the node knows) must be dropped by its own path
    (review api7: a rm -r, a mv -r, a rm of a glob left the removed files readable from the
    cache). What the target cannot expand (a path gone) is the operation's to say."""
    try:
        found = target.expand_path(paths, recursive=recursive, maxdepth=maxdepth)
    except Exception:  # noqa: BLE001 - the operation itself raises what it meets
        return []
    return [strip(p) for p in found]


def moved_to(sources: list[str], moved: list[str], dest: str) -> list[str]:
    """Where a move of ``sources`` (``moved``: every file they expanded to, directories'
    trees included) to ``dest`` may put each file, without listing ``dest``: a superset
    (a path dropped that was not written costs a read again). Under ``dest`` by its path
    below its source (a directory moved to a new name), by its name alone (into a
    directory: a file, a glob's files, fsspec's flattened lists), or below the source's
    name (a directory moved into one) (review api7; diffrev-9: globs, lists, a directory
    moved without recursive on a local target)."""
    dest = dest.rstrip("/")
    out = {dest: None}
    for p in moved:
        out[f"{dest}/{posixpath.basename(p.rstrip('/'))}"] = None
    for src in sources:
        base = _literal_part(src)
        name = posixpath.basename(base)
        for p in moved:
            if p.startswith(base + "/"):
                rel = p[len(base) + 1:]
                out[f"{dest}/{rel}"] = out[f"{dest}/{name}/{rel}"] = None
    return list(out)


def _literal_part(path: str) -> str:
    """``path`` without a trailing slash, or, for a glob, the directory before its first
    wildcard."""
    path = path.rstrip("/")
    cut = min((i for i in (path.find(c) for c in "*?[") if i >= 0), default=-1)
    return path if cut < 0 else posixpath.dirname(path[:cut])


def drop_reached(fs, paths: list[str]) -> None:
    """The files a removal or a move reached (reached_by, moved_to) on ``fs`` (a cachemw
    filesystem), each dropped by itself: its metadata marked dropped node-wide (every
    process's records of it go), and, where the node knew it, its blocks, here and at the
    daemon. Not through fs._written: a scan of the process's records and the listings of
    every ancestor per file made a rm -r of 1,000 files 8 s (diffrev-9); the ancestors go
    once, with the operation's own paths."""
    fs.reader.fills.drain()  # no fill of the old bytes may land after this
    for path in dict.fromkeys(paths):
        known = fs.meta.known(path)
        delete_blocks(fs, known)
        fs.meta.forget(path)
        if known is not None:
            fs.client.invalidate(known.url)


def delete_blocks(fs, known) -> None:
    """Delete the blocks of ``known`` (a file's version the node knew, or None) from this
    node's tiers, right here: the new version may carry the same token on a filesystem
    with coarse mtimes."""
    if known is None:
        return
    bs = fs.options.block_size
    keys = [block_key(known.url, known.version, i, bs) for i in range(block_count(known.size, bs))]
    for tier in fs.client.tiers():
        for key in keys:
            tier.delete(key)
