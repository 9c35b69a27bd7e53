"""A store client's own failures (botocore's, aiobotocore's, aiohttp's: most are no
OSErrors) as the OSErrors cachemw raises at its boundaries: the fsspec filesystem, the warm
command, the checkpointer. Shared, so that the checkpointer (which uses the cache only
through its public surface) says a store's outage as the reader does."""
from __future__ import annotations

import contextlib
import errno


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
    None for anything else (an OSError of the filesystem's own, a programming error)."""
    return client_failure(exc, _url_of(fs, path)) if from_client(exc) else None


def client_failure(exc: BaseException, url: str = "") -> OSError | None:
    """``exc`` as an OSError (its text prefixed by ``url``, if given) if it is a store
    client's own failure, else None. The errno is the cause's (ECONNREFUSED for a refused
    connection: a ConnectionRefusedError still), ETIMEDOUT for a timeout (a TimeoutError),
    else EIO; an HTTP status (aiohttp's error answers) is said as http_status_error says it."""
    if not from_client(exc):
        return None
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status >= 400:
        return http_status_error(url or "the store", status)
    code = _cause_errno(exc)
    if code is None:
        timeout = isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__
        code = errno.ETIMEDOUT if timeout else errno.EIO
    return OSError(code, f"{url + ': ' if url else ''}{type(exc).__name__}: {exc}")


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
