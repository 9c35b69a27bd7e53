"""One directory on local disk or behind any fsspec URL, with the few operations a commit needs.

Local paths get real durability (fsync of files and of the directory, atomic ``os.replace``);
other filesystems get what they offer (an object is durable once ``close`` returns, ``mv``).
"""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import IO, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from cachemw.files import fsync_path


class Location:
    """A directory ``url`` (plain path or fsspec URL such as ``cachemw::s3://b/ckpt``)."""

    def __init__(self, url: str | os.PathLike) -> None:
        self.url = os.fspath(url)
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.path = self.path.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def child(self, name: str) -> "Location":
        loc = Location.__new__(Location)
        loc.fs, loc.local = self.fs, self.local
        loc.path = self.join(name)
        loc.url = loc.path if self.local else self.url.rstrip("/") + "/" + name
        return loc

    def join(self, *parts: str) -> str:
        return "/".join([self.path, *parts])

    def makedirs(self, rel: str = "") -> None:
        path = self.join(rel) if rel else self.path
        if self.local:
            os.makedirs(path, mode=0o700, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def open(self, rel: str, mode: str = "rb") -> IO[bytes]:
        if self.local:
            return open(self.join(rel), mode)
        return self.fs.open(self.join(rel), mode)

    def close_durably(self, f: IO[bytes]) -> None:
        """Flush and fsync a file opened with ``open(..., "wb")``, then close it."""
        try:
            f.flush()
            if self.local:
                os.fsync(f.fileno())
        finally:
            f.close()

    def sync_dir(self) -> None:
        if self.local:
            fsync_path(self.path)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write ``rel`` so that readers see the old content or the whole new one, never a part."""
        with self.open_atomic(rel) as f:
            f.write(data)

    @contextlib.contextmanager
    def open_atomic(self, rel: str, tmp: str | None = None) -> Iterator[IO[bytes]]:
        """A file to write ``rel`` through: a temp name beside it (``tmp``, or a random one),
        made durable, then renamed.

        ``rel`` appears only once the block exits cleanly; until then readers see the old
        content (or nothing). If the block raises, the temp file is removed and ``rel`` is
        untouched.
        """
        tmp = tmp or f".{rel}.{uuid.uuid4().hex[:8]}.tmp"
        f = self.open(tmp, "wb")
        try:
            try:
                yield f
            finally:
                self.close_durably(f)
        except BaseException:  # the temp file goes whatever failed; re-raised
            self.remove_file(tmp)
            raise
        # From here the temp file may be the only whole copy: a failure leaves it in place.
        if self.local:
            os.replace(self.join(tmp), self.join(rel))
            self.sync_dir()
        else:
            if self.fs.exists(self.join(rel)):
                self.fs.rm(self.join(rel))
            self.fs.mv(self.join(tmp), self.join(rel))

    def read_bytes(self, rel: str) -> bytes:
        with self.open(rel, "rb") as f:
            return f.read()

    def exists(self, rel: str = "") -> bool:
        path = self.join(rel) if rel else self.path
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def size(self, rel: str) -> int:
        return os.path.getsize(self.join(rel)) if self.local else int(self.fs.size(self.join(rel)))

    def mtime(self, rel: str = "") -> float | None:
        path = self.join(rel) if rel else self.path
        if self.local:
            return os.path.getmtime(path)
        info = self.fs.info(path)
        for key in ("mtime", "LastModified", "created"):
            value = info.get(key)
            if isinstance(value, (int, float)):
                return float(value)
            if hasattr(value, "timestamp"):
                return value.timestamp()
        return None

    def listdir(self) -> list[str]:
        """Names (not paths) of the entries of this directory; empty if it does not exist."""
        if self.local:
            try:
                return sorted(os.listdir(self.path))
            except FileNotFoundError:
                return []
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False))
        except FileNotFoundError:
            return []

    def remove_tree(self, rel: str) -> None:
        path = self.join(rel)
        if self.local:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_file(self, rel: str) -> None:
        try:
            if self.local:
                os.remove(self.join(rel))
            else:
                self.fs.rm(self.join(rel))  # rm_file is not implemented by every fsspec filesystem
        except FileNotFoundError:
            pass


def as_location(where: "str | os.PathLike | Location") -> Location:
    return where if isinstance(where, Location) else Location(where)


def split_file(url: str | os.PathLike) -> tuple[Location, str]:
    """(the directory, the name) of a file given as a path or fsspec URL."""
    url = os.fspath(url)
    if "://" not in url and "::" not in url:
        parent, name = os.path.split(os.path.abspath(url))
        return Location(parent), name
    parent, sep, name = url.rstrip("/").rpartition("/")
    if not sep or not name:
        raise ValueError(f"{url!r} names no file inside a directory")
    return Location(parent), name
