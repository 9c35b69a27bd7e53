"""HTTP reads (fsspec's ``HTTPFileSystem``) pinned to a version: one GET on fsspec's own
session with ``If-Match`` on a strong ETag, the answer's status and ETag checked here; the
first GET of a cold file names its version (see source.py)."""
from __future__ import annotations

from ..keys import version_fields
from ..store_errors import http_request_error, http_status_error
from .pinning import CONTENT_RANGE, NO_VERSION, FirstBlock, changed, check_after, sync


async def _http_get(fs, url: str, headers: dict):
    """(status, response headers, final URL, body) of one GET on fsspec's own session."""
    session = await fs.set_session()
    kwargs = {**fs.kwargs, "headers": headers}
    async with session.get(fs.encode_url(url), **kwargs) as r:
        return r.status, r.headers, str(r.url), await r.read()


def read_http(fs, path: str, start: int, end: int | None, version: str) -> bytes:
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
    status, response, _, data = http_request(fs, path, headers)
    got = response.get("ETag")
    if status == 412 or (etag and status < 300 and got is not None and got != etag):
        raise changed(path, version,
                       detail=f"the server has ETag {got}" if got else "its ETag moved")
    if status == 416:  # a range within the version's size: the file is shorter now (a
        # server that ignores If-Match, a weak ETag, which If-Match cannot name, or none)
        raise changed(path, version, detail="it is shorter now (HTTP 416)")
    if status == 200 and "Range" in headers:  # the server ignored Range: all of it came
        data = data[start:end]
    elif status not in (200, 206):
        raise http_status_error(path, status)
    if not etag or got is None:  # no validator (or an ETag on HEAD but none on GET):
        check_after(fs, path, version)  # the version asked again after the read
    return data


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
