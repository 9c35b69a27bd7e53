"""What a version-pinned read of the source shares across stores (see source.py): the
error of a file that moved on, the check of its version after a read, the store's info
with an HTTP store's failures told apart from a missing file, and a store client's own
errors (botocore's, aiohttp's) as the OSErrors the fsspec boundary raises."""
from __future__ import annotations

import errno
import os
import re
from typing import NamedTuple

from fsspec.implementations.local import LocalFileSystem

from ..keys import stat_token, version_token
from ..store_errors import http_request_error, http_status_error, store_errors

NO_VERSION = "no ETag"  # why a first GET named no version (see SourceTier.read_first)
# A 206's Content-Range: first and last byte, and the total ("*": not known). Its unit is
# case-insensitive (RFC 9110: "Bytes" is "bytes", diffrev-11).
CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


class FirstBlock(NamedTuple):
    """A cold file's block and its info, from one response (``SourceTier.read_first``)."""

    info: dict  # as the target's ``info`` gives it: the same ``version_token``
    data: bytes  # exactly the block's bytes at that version


class ChangedSourceError(OSError):
    """The source file no longer matches the version the cache recorded for it.

    Built as a plain ``OSError(errno.ESTALE, message)`` (see ``changed``), so it pickles
    and unpickles as one (a DataLoader worker's error crosses a process boundary)."""


# The failures of a read after which what the node knows of the path is dropped: the file
# moved on to another version, or is gone. A reopen (or a retry) then reads what is there now.
MOVED_ON = (ChangedSourceError, FileNotFoundError)


def changed(path: str, expected: str, found: str | None = None,
             detail: str = "") -> ChangedSourceError:
    what = f"it is now {found}" if found else detail or "it was changed or replaced"
    return ChangedSourceError(errno.ESTALE, f"{path}: the source no longer has the version "
                              f"being read ({expected}): {what}; reopen the file (or read "
                              f"it again) to get the new version")


def sync(fs, coroutine, *args):
    """Run ``coroutine(*args)`` on the async filesystem ``fs``'s loop. fsspec.asyn is
    imported here, not with this module: every reader process imports this module, and
    only one reading an async store (which imported fsspec.asyn itself) needs it; it is
    ~600 objects and 1-2 ms more for each DataLoader worker to import."""
    from fsspec.asyn import sync

    return sync(fs.loop, coroutine, *args)


def is_http(fs) -> bool:
    """fsspec's HTTP filesystem (or one shaped like it: its session, its protocols)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return ("http" in protocols or "https" in protocols) and hasattr(fs, "set_session")


def source_info(fs, path: str) -> dict:
    """``fs.info(path)``, with what fsspec's HTTP ``info`` hides told: it turns any failure
    of its requests (a 503, a refused connection) into ``FileNotFoundError(url)``, the
    failure as its cause; an outage must not read as a missing file (its metadata
    forgotten, dropped by ``cat(on_error="omit")``)."""
    try:
        with store_errors(fs, path):
            return fs.info(path)
    except FileNotFoundError as exc:
        cause = exc.__cause__
        # fsspec's mask has no errno; only an HTTP store's failures are told apart here
        if cause is None or exc.errno is not None or not is_http(fs):
            raise
        status = getattr(cause, "status", None)  # aiohttp's ClientResponseError
        if isinstance(status, int):  # (a 404 too: FileNotFoundError, saying why)
            raise http_status_error(path, status) from cause
        raise http_request_error(path, cause) from cause


def read_checked(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    try:
        if end is None and start == 0:
            data = fs.cat_file(path)
        else:
            data = fs.cat_file(path, start=start, end=end)
    except OSError:
        raise
    except Exception as exc:  # a client's own error (a range refused as the file shrank):
        # a changed file is said so; anything else is an OSError at this boundary
        check_after(fs, path, version)
        raise OSError(errno.EIO, f"{path}: {type(exc).__name__}: {exc}") from exc
    check_after(fs, path, version)
    return data


def check_after(fs, path: str, version: str) -> None:
    if isinstance(fs, LocalFileSystem) and type(fs).info is LocalFileSystem.info:
        found = stat_token(os.stat(path))  # what its info says (links followed), 3x cheaper
    else:
        fs.invalidate_cache(path)  # the store's answer, not a listing the target kept
        found = version_token(source_info(fs, path))
    if found != version:
        raise changed(path, version, found)
