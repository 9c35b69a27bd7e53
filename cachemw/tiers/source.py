"""The source tier: the store the dataset really lives on (a PFS path, S3, any fsspec URL).

It is the bottom of the hierarchy and the fallback for every failure above it, so it is
addressed by path and byte range rather than by block key.

Every read from it names the version it is for (the token of the block key it fills, or
of the file an open handle pinned) and returns bytes of that version or raises
``ChangedSourceError``: a block cached under a version's key holds that version's bytes,
and a read that mixes cached blocks with fetched ones never mixes versions. The check is
here, once, for every caller: a client's fills and direct reads, an owner node's fills for
its peers, the daemon's prefetches. How a read is pinned depends on the store:

- local files (fsspec's own ``LocalFileSystem``): open, ``fstat`` the descriptor and
  compare its token with the version, ``pread``, ``fstat`` again (an in-place rewrite
  during the read moves mtime and ctime): a replaced file is caught by its inode, a
  rewritten one by its times. Costs two ``fstat`` calls on a miss; hits are untouched.
- S3 (s3fs): one GET pinned to the version: ``VersionId`` when the token has one (a
  version-aware bucket: the bytes stay readable after an overwrite), and ``IfMatch`` on the
  ETag; the ETag the response carries is compared too, for stores that ignore ``IfMatch``.
- HTTP (fsspec's ``HTTPFileSystem``): a GET with ``If-Match`` on a strong ETag (412 if the
  resource has another one), and the ETag of the response compared, for servers that
  ignore ``If-Match`` (and weak ETags, which ``If-Match`` cannot compare). Without an
  ETag, the same GET, checked as below. A server that ignores ``Range`` is read all the
  same (its whole body, cut). Its errors are told: 404 and 410 FileNotFoundError, 401
  and 403 PermissionError, others (500, 503, no connection) an OSError naming the URL
  and the cause, never a missing file (fsspec's ``info`` says FileNotFoundError for
  all: ``source_info`` tells them apart).
- anything else (and S3 without an ETag): read, then ask the
  store for the file's info past the target's own caches (``invalidate_cache(path)``
  first) and compare tokens. A change before or during the read is then always seen; a
  change after it costs a spurious retry, never wrong bytes.

A file whose version nobody knows yet (``read_first``): on HTTP and S3 a GET tells the
version along with the bytes (ETag, and the size in ``Content-Range`` or
``Content-Length``), so the first block of a cold read is fetched with a plain GET and the
file's info is made from that response, the same info (so the same version token) a HEAD
would have given: one request per cold file instead of a HEAD, then a GET. Where the
response cannot name the version (no ETag, no size, an encoded body, a refused range) the
caller asks for the info first, as for any other store.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from typing import NamedTuple

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..keys import block_length, stat_token, version_fields, version_token
from .fork_safe import ForkSafe

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20  # reads to the end of a file whose size is unknown, this much a call
_NO_VERSION = "no ETag"  # why a first GET named no version (see SourceTier.read_first)
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+)\s*$")


class FirstBlock(NamedTuple):
    """A cold file's block and its info, from one response (``SourceTier.read_first``)."""

    info: dict  # as the target's ``info`` gives it: the same ``version_token``
    data: bytes  # exactly the block's bytes at that version


class ChangedSourceError(OSError):
    """The source file no longer matches the version the cache recorded for it.

    Built as a plain ``OSError(errno.ESTALE, message)`` (see ``_changed``), so it pickles
    and unpickles as one (a DataLoader worker's error crosses a process boundary)."""


# The failures of a read after which what the node knows of the path is dropped: the file
# moved on to another version, or is gone. A reopen (or a retry) then reads what is there now.
MOVED_ON = (ChangedSourceError, FileNotFoundError)


def _changed(path: str, expected: str, found: str | None = None,
             detail: str = "") -> ChangedSourceError:
    what = f"it is now {found}" if found else detail or "it was changed or replaced"
    return ChangedSourceError(errno.ESTALE, f"{path}: the source no longer has the version "
                              f"being read ({expected}): {what}; reopen the file (or read "
                              f"it again) to get the new version")


class SourceTier:
    name = "source"
    fs = ForkSafe()

    def __init__(self, fs) -> None:
        self.fs = fs
        self._read = _reads_for(fs)
        self._first = _firsts_for(fs)
        self._versioned = False  # a first GET of this store has named a version

    @property
    def concurrent(self) -> bool:
        """True if the store takes requests from several threads at once (client/fanout.py):
        fsspec's local filesystem, its async ones (S3, HTTP, GCS, Azure: each request a task
        on the store's loop), a ``dir`` filesystem over either. Not fsspec's tar or zip
        readers (one shared file object, sought then read) nor its FTP (one connection)."""
        return _takes_threads(self.fs)

    @property
    def tells_versions(self) -> bool:
        """True if a GET of this store may name the file's version (see read_first)."""
        return self._first is not None

    def read_first(self, path: str, index: int, block_size: int) -> FirstBlock | None:
        """Block ``index`` of ``path`` and the file's info, both from one GET, for a file
        whose version is not known yet; FileNotFoundError if the store has no such file,
        and on HTTP the OSError its error answer or a failed request says (``_read_http``).

        None if the response does not name the version (no ETag, no size, a body encoded
        for transfer, a range the store refused): the caller asks for the file's info, then
        reads (an empty file, a range past the end and a key that is an S3 "directory" take
        that way too, where the info says what they are). A store whose first answer had
        no ETag is not asked this way again (logged once): each of its files would cost a
        wasted GET."""
        first = self._first
        if first is None:
            return None
        start = index * block_size
        got = first(self.fs, path, start, start + block_size)
        if got is _NO_VERSION and not self._versioned:
            self._first = None
            log.info("%s: the store sends no ETag with its data; cachemw asks it for each "
                     "file's info (HEAD) before the file's first read", path)
        if not isinstance(got, FirstBlock):
            return None
        self._versioned = True
        length = block_length(int(got.info["size"]), index, block_size)
        if len(got.data) != length:  # a store answering with other bytes than asked
            return None
        return got

    def read_block(self, path: str, index: int, block_size: int, file_size: int,
                   version: str) -> bytes:
        """Bytes of block ``index`` of ``path`` at ``version``, exactly as long as the file's
        size says; ChangedSourceError if the source has another version."""
        length = block_length(file_size, index, block_size)
        start = index * block_size
        if length == 0:
            return b""
        data = self._read(self.fs, path, start, start + length, version)
        if len(data) != length:
            raise _changed(path, version, detail=f"{length} bytes expected at offset "
                           f"{start}, the source returned {len(data)}")
        return data

    def read_range(self, path: str, start: int, end: int, version: str) -> bytes:
        """Bytes ``[start, end)`` of ``path`` at ``version`` (``end`` within its size)."""
        if end <= start:
            return b""
        return self._read(self.fs, path, start, end, version)

    def read_all(self, path: str, version: str) -> bytes:
        """The whole file, read to its end: for files whose size the source states as 0
        (``/proc`` files, and empty files), which may hold bytes all the same."""
        return self._read(self.fs, path, 0, None, version)


_sources: dict[str, SourceTier] = {}
_sources_lock = threading.Lock()


def source_for(target_json: str) -> SourceTier:
    """The source a client described in fsspec's own JSON form (owner fills for other
    nodes, prefetches of announced blocks), built once per process."""
    with _sources_lock:
        src = _sources.get(target_json)
        if src is None:
            src = _sources[target_json] = SourceTier(fsspec.AbstractFileSystem.from_json(target_json))
        return src


def _takes_threads(fs) -> bool:
    inner = getattr(fs, "fs", None)
    if type(fs).__name__ == "DirFileSystem" and inner is not None:
        return _takes_threads(inner)
    return isinstance(fs, LocalFileSystem) or bool(getattr(fs, "async_impl", False))


def _reads_for(fs):
    """The version-pinned read for ``fs``. Descriptor reads are taken only by fsspec's own
    local filesystem and subclasses that keep its read methods: a subclass that changes
    how a file is read (adds latency, logs calls) is read through its own ``cat_file``."""
    cls = type(fs)
    if (isinstance(fs, LocalFileSystem) and cls.cat_file is LocalFileSystem.cat_file
            and cls._open is LocalFileSystem._open):
        return _read_local
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocols and hasattr(fs, "_call_s3"):
        return _read_s3
    if ("http" in protocols or "https" in protocols) and hasattr(fs, "set_session"):
        return _read_http
    return _read_checked


def _firsts_for(fs):
    """The version-telling first GET for ``fs`` (see SourceTier.read_first), or None."""
    read = _reads_for(fs)
    if read is _read_http:
        return _first_http
    if read is _read_s3:
        return _first_s3
    return None


# Filesystems whose SEEK_DATA takes the inode lock that a write() holds while it copies
# its bytes in: an lseek there returns only once a write in progress has ended.
_SEEK_WAITS_FOR_WRITES = frozenset({"tmpfs", "ext4", "ext3", "ext2", "btrfs"})
_seek_waits: dict[int, bool] = {}  # st_dev -> whether its filesystem is one of those


def _waits_for_writes(dev: int) -> bool:
    known = _seek_waits.get(dev)
    if known is None:
        known = _seek_waits[dev] = _fs_type(dev) in _SEEK_WAITS_FOR_WRITES
    return known


def _fs_type(dev: int) -> str:
    """The type of the filesystem mounted from device ``dev`` ('' if not found)."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass
    return ""


def _read_local(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    """The bytes of ``path`` at ``version``, by ``fstat`` of the descriptor before and
    after the read. A write() already under way when the read begins (another process
    rewriting the file in place) set the file's times when it began, so both stats would
    show the new version while the read saw part of the old bytes: on filesystems whose
    SEEK_DATA waits for it (tmpfs, ext4, btrfs), an lseek first lets it end. A write that
    begins during the read changes the times the second stat sees (the README's limits)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        if stat.S_ISREG(before.st_mode) and _waits_for_writes(before.st_dev):
            try:
                os.lseek(fd, 0, os.SEEK_DATA)
            except OSError:  # ENXIO: no data (empty); anything else: it did not wait
                pass
        if stat_token(before) != version:
            raise _changed(path, version, stat_token(before))
        if end is None:
            if not stat.S_ISREG(before.st_mode):  # a FIFO or device may never end
                raise OSError(errno.EINVAL, f"{path}: not a regular file (a device, FIFO "
                              f"or socket); read it directly, not through cachemw")
            chunks = []
            while True:
                chunk = os.pread(fd, _READ_CHUNK, start)
                if not chunk:
                    break
                chunks.append(chunk)
                start += len(chunk)
            data = b"".join(chunks)
        else:
            data = os.pread(fd, end - start, start)
            while len(data) < end - start:  # a short read: very large ones, signals
                more = os.pread(fd, end - start - len(data), start + len(data))
                if not more:
                    break  # the file is shorter than its version says: read_block tells
                data += more
        after = os.fstat(fd)
        if stat_token(after) != version:
            raise _changed(path, version, stat_token(after))
        return data
    finally:
        os.close(fd)


def _sync(fs, coroutine, *args):
    """Run ``coroutine(*args)`` on the async filesystem ``fs``'s loop. fsspec.asyn is
    imported here, not with this module: every reader process imports this module, and
    only one reading an async store (which imported fsspec.asyn itself) needs it; it is
    ~600 objects and 1-2 ms more for each DataLoader worker to import."""
    from fsspec.asyn import sync

    return sync(fs.loop, coroutine, *args)


async def _s3_get(fs, bucket: str, key: str, kwargs: dict) -> tuple[str, bytes]:
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kwargs)
    try:
        return resp.get("ETag", ""), await resp["Body"].read()
    finally:
        resp["Body"].close()


def _read_s3(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    fields = version_fields(version)
    etag = fields.get("ETag")
    if not etag:  # a store that gives no ETag: check the info afterwards
        return _read_checked(fs, path, start, end, version)
    bucket, key, path_version = fs.split_path(path)
    kwargs = {"IfMatch": etag}
    version_id = fields.get("VersionId") or path_version
    if version_id:
        kwargs["VersionId"] = version_id
    if end is not None:
        kwargs["Range"] = f"bytes={start}-{end - 1}"
    elif start:
        kwargs["Range"] = f"bytes={start}-"
    try:
        got, data = _sync(fs, _s3_get, fs, bucket, key, kwargs)
    except OSError as exc:
        if _s3_code(exc) in ("PreconditionFailed", "412", "NoSuchVersion"):
            raise _changed(path, version, detail="its ETag or version moved") from exc
        raise
    if got and got.strip('"') != etag.strip('"'):
        raise _changed(path, version, detail=f"the store sent ETag {got}")
    return data


async def _s3_get_response(fs, bucket: str, key: str, kwargs: dict) -> tuple[dict, bytes]:
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kwargs)
    try:
        return resp, await resp["Body"].read()
    finally:
        resp["Body"].close()


def _first_s3(fs, path: str, start: int, end: int):
    """GetObject of ``[start, end)``, its info as s3fs's ``info`` (a HeadObject) makes it:
    the same ETag, size and VersionId, so the same version token."""
    bucket, key, version_id = fs.split_path(path)
    if not key:
        return None
    kwargs = {"Range": f"bytes={start}-{end - 1}"}
    if version_id:
        kwargs["VersionId"] = version_id
    try:
        resp, data = _sync(fs, _s3_get_response, fs, bucket, key, kwargs)
    except OSError:  # no such key (it may be a "directory"), an empty object's refused
        return None  # range, ...: the info path says what it is, as it did before
    if not resp.get("ETag"):
        return _NO_VERSION
    found = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
    if found is not None:
        if int(found.group(1)) != start:
            return None
        size = int(found.group(3))
    elif resp.get("ContentLength") == len(data):  # the whole object came
        size, data = len(data), data[start:end]
    else:
        return None
    return FirstBlock({"ETag": resp.get("ETag", ""), "LastModified": resp.get("LastModified", ""),
                       "size": size, "name": f"{bucket}/{key}", "type": "file",
                       "StorageClass": resp.get("StorageClass", "STANDARD"),
                       "VersionId": resp.get("VersionId"),
                       "ContentType": resp.get("ContentType")}, data)


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an error s3fs translated into an OSError."""
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
        exc = exc.__cause__
    return None


async def _http_get(fs, url: str, headers: dict):
    """(status, response headers, final URL, body) of one GET on fsspec's own session."""
    session = await fs.set_session()
    kwargs = {**fs.kwargs, "headers": headers}
    async with session.get(fs.encode_url(url), **kwargs) as r:
        return r.status, r.headers, str(r.url), await r.read()


def _read_http(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    """One GET on fsspec's own session (its client options and request options): the
    response's status and ETag are checked here, which fsspec's ``cat_file`` does not
    show, so a server that ignores ``If-Match`` (or ``Range``) is still caught. Without
    an ETag to pin it to, the same GET (not fsspec's ``cat_file``, which takes the whole
    body a server that ignores Range sends for the range it asked), checked afterwards."""
    etag = version_fields(version).get("ETag")
    headers = dict(fs.kwargs.get("headers") or {})
    if etag and not etag.startswith("W/"):  # If-Match compares strong ETags only
        headers["If-Match"] = etag
    if end is not None or start:
        headers["Range"] = f"bytes={start}-" + ("" if end is None else str(end - 1))
    status, response, _, data = _http_request(fs, path, headers)
    got = response.get("ETag")
    if status == 412 or (etag and status < 300 and got is not None and got != etag):
        raise _changed(path, version,
                       detail=f"the server has ETag {got}" if got else "its ETag moved")
    if status == 416:  # a range within the version's size: the file is shorter now (a
        # server that ignores If-Match, a weak ETag, which If-Match cannot name, or none)
        raise _changed(path, version, detail="it is shorter now (HTTP 416)")
    if status == 200 and "Range" in headers:  # the server ignored Range: all of it came
        data = data[start:end]
    elif status not in (200, 206):
        raise _http_status_error(path, status)
    if not etag or got is None:  # no validator (or an ETag on HEAD but none on GET):
        _check_after(fs, path, version)  # the version asked again after the read
    return data


def _http_request(fs, path: str, headers: dict):
    """``_http_get``, its failures OSErrors that name the URL: aiohttp's errors are not all
    OSErrors (a server that hung up mid-response), nor do they name the URL."""
    try:
        return _sync(fs, _http_get, fs, path, headers)
    except Exception as exc:
        raise _http_request_error(path, exc) from exc


def _http_request_error(path: str, exc: BaseException) -> OSError:
    """``exc`` (a request that got no answer) as an OSError naming ``path`` and the cause,
    its errno kept (ECONNREFUSED: a ConnectionRefusedError still), EIO if it has none."""
    code = getattr(exc, "errno", None)
    if not isinstance(code, int) or code <= 0:  # none, or a resolver's (negative) code
        code = errno.ETIMEDOUT if isinstance(exc, TimeoutError) else errno.EIO
    return OSError(code, f"{path}: {type(exc).__name__}: {exc}")


def _http_status_error(path: str, status: int) -> OSError:
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
        return fs.info(path)
    except FileNotFoundError as exc:
        cause = exc.__cause__
        # fsspec's mask has no errno; only an HTTP store's failures are told apart here
        if cause is None or exc.errno is not None or _reads_for(fs) is not _read_http:
            raise
        status = getattr(cause, "status", None)  # aiohttp's ClientResponseError
        if isinstance(status, int):  # (a 404 too: FileNotFoundError, saying why)
            raise _http_status_error(path, status) from cause
        raise _http_request_error(path, cause) from cause


def _first_http(fs, path: str, start: int, end: int):
    """A GET of ``[start, end)`` without a validator, its info as fsspec's HTTP ``info``
    (a HEAD) makes it (``_file_info``): the same size and ETag, so the same version
    token. ``Accept-Encoding: identity``, as fsspec's HEAD sends it, so the sizes are of
    the same bytes."""
    headers = dict(fs.kwargs.get("headers") or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    headers["Accept-Encoding"] = "identity"
    status, response, url, data = _http_request(fs, path, headers)
    if status >= 400 and status != 416:  # 416: empty, or past the end: the info tells
        raise _http_status_error(path, status)
    if status not in (200, 206) or response.get("Content-Encoding", "identity") not in ("identity", ""):
        return None  # 416, an encoded body: the info path, as before
    etag = response.get("ETag")
    if not etag:
        return _NO_VERSION
    if status == 206:
        found = _CONTENT_RANGE.match(response.get("Content-Range", ""))
        if found is None or int(found.group(1)) != start:
            return None  # an unknown total ("*/..."), another range than asked
        size = int(found.group(3))
    else:  # the server ignored Range: the whole file came
        size = len(data)
        if int(response.get("Content-Length", size)) != size:
            return None
        data = data[start:end]
    info = {"name": path, "size": size, "url": url, "ETag": etag, "type": "file"}
    if "Content-Type" in response:
        info["mimetype"] = response["Content-Type"].partition(";")[0]
    if response.get("Accept-Ranges") == "none":
        info["partial"] = False
    if response.get("Last-Modified"):
        info["Last-Modified"] = response["Last-Modified"]
    return FirstBlock(info, data)


def _read_checked(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    try:
        if end is None and start == 0:
            data = fs.cat_file(path)
        else:
            data = fs.cat_file(path, start=start, end=end)
    except OSError:
        raise
    except Exception as exc:  # a client's own error (a range refused as the file shrank):
        # a changed file is said so; anything else is an OSError at this boundary
        _check_after(fs, path, version)
        raise OSError(errno.EIO, f"{path}: {type(exc).__name__}: {exc}") from exc
    _check_after(fs, path, version)
    return data


def _check_after(fs, path: str, version: str) -> None:
    if isinstance(fs, LocalFileSystem) and type(fs).info is LocalFileSystem.info:
        found = stat_token(os.stat(path))  # what its info says (links followed), 3x cheaper
    else:
        fs.invalidate_cache(path)  # the store's answer, not a listing the target kept
        found = version_token(source_info(fs, path))
    if found != version:
        raise _changed(path, version, found)
