"""Writes through a ``cachemw`` filesystem (client/fs.py: they go straight to the target):
the writable file, the target's own, which the cache lets go of once it is closed (and
again when a transaction commits it), and what a removal or a move reaches."""
from __future__ import annotations

import posixpath

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
    """Where a move of ``sources`` (``moved``: what they expanded to) to ``dest`` may put
    each file, without listing ``dest``: under ``dest`` itself, or, into a directory there,
    under ``dest/<name of its source>`` (review api7: a mv into a directory left the mover
    reading the old file it replaced)."""
    dest = dest.rstrip("/")
    out = []
    for src in sources:
        src = src.rstrip("/")
        name = posixpath.basename(src)
        for p in moved:
            if p == src:
                out += [dest, f"{dest}/{name}"]
            elif p.startswith(src + "/"):
                rel = p[len(src) + 1:]
                out += [f"{dest}/{rel}", f"{dest}/{name}/{rel}"]
    return out
