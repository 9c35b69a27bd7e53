"""The writable file of a ``cachemw`` filesystem: the target's own, which the cache lets
go of once it is closed (client/fs.py: writes go straight to the target)."""
from __future__ import annotations

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
