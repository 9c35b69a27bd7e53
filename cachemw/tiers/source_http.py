"""HTTP reads (fsspec's ``HTTPFileSystem``) pinned to a version: one GET on fsspec's own
session with ``If-Match`` on a strong ETag, the answer's status and ETag checked here; the
first GET of a cold file names its version (see source.py)."""
from __future__ import annotations

import errno

from ..keys import version_fields
from ..store_errors import http_request_error, http_status_error
from .pinning import CONTENT_RANGE, NO_VERSION, FirstBlock, changed, check_after, sync

#: GETs one range may take from a server that answers less than asked (capped ranges)
MOST_PARTS = 256


async def _http_get(fs, url: str, headers: dict):
    """(status, response headers, final URL, body) of one GET on fsspec's own session."""
    session = await fs.set_session()
    kwargs = {**fs.kwargs, "headers": headers}
    async with session.get(fs.encode_url(url), **kwargs) as r:
        return r.status, r.headers, str(r.url), await r.read()


def read_http(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    """GETs on fsspec's own session (its client options and request options): the
    response's status and ETag are checked here, which fsspec's ``cat_file`` does not
    show, so a server that ignores ``If-Match`` (or ``Range``) is still caught. Without
    an ETag to pin it to, the same GET (not fsspec's ``cat_file``, which takes the whole
    body a server that ignores Range sends for the range it asked), checked afterwards.

    A 206's ``Content-Range`` must be the range asked for: another one (a server or proxy
    shifting it) is an EIO, where its bytes were kept as the block asked for, under every
    ``validate`` (review loaders6). One that stops short (a server capping range replies)
    is followed by GETs of the rest, where every read of the file failed as changed."""
    parts, at, unpinned = [], start, False
    for _ in range(MOST_PARTS if end is not None else 1):
        data, last, no_validator = _read_http_part(fs, path, at, end, version)
        parts.append(data)
        unpinned = unpinned or no_validator
        if end is None or last is None or last + 1 >= end:  # all of it (shorter now: a 416)
            # no validator (or an ETag on HEAD but none on GET): the version asked again
            # after the read, once for all its parts (not a HEAD each, diffrev-11)
            if unpinned:
                check_after(fs, path, version)
            return b"".join(parts)
        at = last + 1
    raise OSError(errno.EIO, f"{path}: the server answers ranges of {len(parts[0])} bytes at "
                             f"most: {MOST_PARTS} GETs did not read [{start}, {end})")


def _read_http_part(fs, path: str, start: int, end: int | None, version: str):
    """One GET of ``[start, end)`` (see read_http): its bytes, the last byte a 206 said it
    holds (None for all that was asked: a 200, or no Range sent), and whether nothing pinned
    it to ``version`` (the read is then to be checked after)."""
    etag = version_fields(version).get("ETag")
    headers = dict(fs.kwargs.get("headers") or {})
    if etag and not etag.startswith("W/"):  # If-Match compares strong ETags only
        headers["If-Match"] = etag
    if end is not None or start:
        headers["Range"] = f"bytes={start}-" + ("" if end is None else str(end - 1))
    status, response, _, data = http_request(fs, path, headers)
    got = response.get("ETag")
    if status == 412 or (etag and status < 300 and got is not None and got != etag):
        raise changed(path, version,
                       detail=f"the server has ETag {got}" if got else "its ETag moved")
    if status == 416:  # a range within the version's size: the file is shorter now (a
        # server that ignores If-Match, a weak ETag, which If-Match cannot name, or none)
        raise changed(path, version, detail="it is shorter now (HTTP 416)")
    last = None
    if status == 200 and "Range" in headers:  # the server ignored Range: all of it came
        data = data[start:end]
    elif status == 206 and "Range" in headers:
        last = _sent_range(path, response.get("Content-Range"), start, end, len(data))
    elif status not in (200, 206):
        raise http_status_error(path, status)
    return data, last, not etag or got is None


def _sent_range(path: str, header: str | None, start: int, end: int | None, got: int) -> int | None:
    """The last byte a 206 holds, checked against the range asked for; None when it has no
    Content-Range and holds what was asked (as taken before). An EIO for another range."""
    if header is None:
        if end is None or got == end - start:
            return None
        raise OSError(errno.EIO, f"{path}: the server answered {got} bytes for the "
                                 f"{end - start} asked at {start}, without saying which")
    found = CONTENT_RANGE.match(header)
    if found is None or int(found.group(1)) != start or int(found.group(2)) < start \
            or (end is not None and int(found.group(2)) >= end) \
            or int(found.group(2)) - start + 1 != got:
        raise OSError(errno.EIO, f"{path}: the server answered another range than asked "
                                 f"(Content-Range: {header}, {got} bytes, for bytes "
                                 f"{start}-{'' if end is None else end - 1})")
    return int(found.group(2))


def http_request(fs, path: str, headers: dict):
    """``_http_get``, its failures OSErrors that name the URL: aiohttp's errors are not all
    OSErrors (a server that hung up mid-response), nor do they name the URL."""
    try:
        return sync(fs, _http_get, fs, path, headers)
    except Exception as exc:
        raise http_request_error(path, exc) from exc


def first_http(fs, path: str, start: int, end: int):
    """A GET of ``[start, end)`` without a validator, its info as fsspec's HTTP ``info``
    (a HEAD) makes it (``_file_info``): the same size and ETag, so the same version
    token. ``Accept-Encoding: identity``, as fsspec's HEAD sends it, so the sizes are of
    the same bytes."""
    headers = dict(fs.kwargs.get("headers") or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    headers["Accept-Encoding"] = "identity"
    status, response, url, data = http_request(fs, path, headers)
    if status >= 400 and status != 416:  # 416: empty, or past the end: the info tells
        raise http_status_error(path, status)
    if status not in (200, 206) or response.get("Content-Encoding", "identity") not in ("identity", ""):
        return None  # 416, an encoded body: the info path, as before
    etag = response.get("ETag")
    if not etag:
        return NO_VERSION
    if status == 206:
        found = CONTENT_RANGE.match(response.get("Content-Range", ""))
        if found is None or int(found.group(1)) != start or found.group(3) == "*":
            return None  # an unknown total, another range than asked
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
