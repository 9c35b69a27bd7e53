"""What a version-pinned read of the source shares across stores (see source.py): the
error of a file that moved on, the check of its version after a read, the store's info
with an HTTP store's failures told apart from a missing file, and a store client's own
errors (botocore's, aiohttp's) as the OSErrors the fsspec boundary raises."""
from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import NamedTuple

from fsspec.implementations.local import LocalFileSystem

from ..keys import stat_token, version_token

NO_VERSION = "no ETag"  # why a first GET named no version (see SourceTier.read_first)
CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+)\s*$")


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


def http_request_error(path: str, exc: BaseException) -> OSError:
    """``exc`` (a request that got no answer) as an OSError naming ``path`` and the cause,
    its errno kept (ECONNREFUSED: a ConnectionRefusedError still), EIO if it has none."""
    code = getattr(exc, "errno", None)
    if not isinstance(code, int) or code <= 0:  # none, or a resolver's (negative) code
        code = errno.ETIMEDOUT if isinstance(exc, TimeoutError) else errno.EIO
    return OSError(code, f"{path}: {type(exc).__name__}: {exc}")


# The packages whose errors are a store client's failures (S3 through s3fs: botocore,
# aiobotocore, aiohttp under them), told by the module of their classes: importing botocore
# to name them would cost every reader process (a DataLoader worker) its import.
_CLIENT_PACKAGES = frozenset({"botocore", "aiobotocore", "aiohttp"})


def client_error(fs, path: str, exc: BaseException) -> OSError | None:
    """``exc`` as an OSError naming ``path``'s URL and the cause, if it is a store client's
    own failure that fsspec's filesystem let through (s3fs turns the store's error answers
    into OSErrors, not a connection that failed or timed out: botocore's
    EndpointConnectionError is no OSError, and its timeouts are OSErrors without an errno);
    None for anything else (an OSError of the filesystem's own, a programming error).

    The errno is the cause's (ECONNREFUSED for a refused connection: a
    ConnectionRefusedError still), ETIMEDOUT for a timeout (a TimeoutError), else EIO; an
    HTTP status (aiohttp's error answers) is said as http_status_error says it."""
    if not from_client(exc):
        return None
    url = _url_of(fs, path)
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status >= 400:
        return http_status_error(url, status)
    code = _cause_errno(exc)
    if code is None:
        timeout = isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__
        code = errno.ETIMEDOUT if timeout else errno.EIO
    return OSError(code, f"{url}: {type(exc).__name__}: {exc}")


def from_client(exc: BaseException) -> bool:
    """Whether ``exc`` is an error of a store client's own (its class, or a base of it, is
    botocore's, aiobotocore's or aiohttp's)."""
    return any(c.__module__.partition(".")[0] in _CLIENT_PACKAGES for c in type(exc).__mro__)


@contextlib.contextmanager
def store_errors(fs, path: str):
    """The calls in the block, a store client's own failures raised as OSErrors
    (``client_error``), chained to them."""
    try:
        yield
    except Exception as exc:
        mapped = client_error(fs, path, exc)
        if mapped is None:
            raise
        raise mapped from exc


def store_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says that the store failed (``store_errors`` raised it: no answer,
    a timeout, a store in trouble), not what a path is (missing, refused, a directory)."""
    return (isinstance(exc, OSError) and from_client(exc.__cause__ or exc)
            and not isinstance(exc, (FileNotFoundError, PermissionError, NotADirectoryError,
                                     IsADirectoryError)))


def _cause_errno(exc: BaseException) -> int | None:
    """The errno of the OSError behind ``exc`` (``exc``'s own, its cause's, or the one
    botocore keeps in ``kwargs["error"]``), if one has a positive one (a resolver's codes
    are negative: not errnos)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = getattr(exc, "errno", None)
        if isinstance(exc, OSError) and isinstance(code, int) and code > 0:
            return code
        kept = getattr(exc, "kwargs", None)
        kept = kept.get("error") if isinstance(kept, dict) else None
        exc = kept if isinstance(kept, BaseException) else (exc.__cause__ or exc.__context__)
    return None


def _url_of(fs, path: str) -> str:
    """``path`` as its URL on ``fs`` (``s3://bucket/key``), for messages."""
    try:
        return fs.unstrip_protocol(path)
    except Exception:  # a message must not fail
        return str(path)


def http_status_error(path: str, status: int) -> OSError:
    """The OSError for an HTTP error status: a file that is not there (404, 410) is
    FileNotFoundError, a refusal (401, 403) PermissionError, anything else (a server in
    trouble: 500, 503) EIO, so an outage never reads as a missing file."""
    if status in (404, 410):
        return FileNotFoundError(errno.ENOENT, f"{path}: not found (HTTP {status})", path)
    if status in (401, 403):
        return PermissionError(errno.EACCES, f"{path}: HTTP {status} from the server "
                               f"(access denied)")
    return OSError(errno.EIO, f"{path}: HTTP {status} from the server")


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
