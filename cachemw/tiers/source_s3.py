"""S3 reads (s3fs) pinned to a version: one GetObject with ``IfMatch`` on the ETag (and
``VersionId`` where the bucket keeps versions), the ETag of the answer compared too; the
first GET of a cold file names its version (see source.py). A failure of the client's own
(an endpoint that does not answer: botocore's EndpointConnectionError is no OSError) is
raised as an OSError naming the URL (store_errors.client_error)."""
from __future__ import annotations

from ..keys import version_fields
from ..store_errors import from_client, store_errors
from .pinning import CONTENT_RANGE, NO_VERSION, FirstBlock, changed, read_checked, sync


async def _s3_get(fs, bucket: str, key: str, kwargs: dict) -> tuple[str, bytes]:
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kwargs)
    try:
        return resp.get("ETag", ""), await resp["Body"].read()
    finally:
        resp["Body"].close()


def read_s3(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    fields = version_fields(version)
    etag = fields.get("ETag")
    if not etag:  # a store that gives no ETag: check the info afterwards
        return read_checked(fs, path, start, end, version)
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
        with store_errors(fs, path):
            got, data = sync(fs, _s3_get, fs, bucket, key, kwargs)
    except OSError as exc:
        if _s3_code(exc) in ("PreconditionFailed", "412", "NoSuchVersion"):
            raise changed(path, version, detail="its ETag or version moved") from exc
        raise
    if got and got.strip('"') != etag.strip('"'):
        raise changed(path, version, detail=f"the store sent ETag {got}")
    return data


async def _s3_get_response(fs, bucket: str, key: str, kwargs: dict) -> tuple[dict, bytes]:
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kwargs)
    try:
        return resp, await resp["Body"].read()
    finally:
        resp["Body"].close()


def first_s3(fs, path: str, start: int, end: int):
    """GetObject of ``[start, end)``, its info as s3fs's ``info`` (a HeadObject) makes it:
    the same ETag, size and VersionId, so the same version token."""
    bucket, key, version_id = fs.split_path(path)
    if not key:
        return None
    kwargs = {"Range": f"bytes={start}-{end - 1}"}
    if version_id:
        kwargs["VersionId"] = version_id
    with store_errors(fs, path):  # no answer: raised, not asked again for the info
        try:
            resp, data = sync(fs, _s3_get_response, fs, bucket, key, kwargs)
        except OSError as exc:  # no such key (it may be a "directory"), an empty object's
            if _unanswered(exc):  # refused range, ...: the info path says what it is
                raise
            return None
    if not resp.get("ETag"):
        return NO_VERSION
    found = CONTENT_RANGE.match(resp.get("ContentRange") or "")
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if found is not None:
        if int(found.group(1)) != start or found.group(3) == "*":
            return None  # another range than asked, an unknown total: the info path
        size = int(found.group(3))
    elif status == 200 and resp.get("ContentLength") == len(data):  # the whole object came
        size, data = len(data), data[start:end]
    else:  # a part without its range (the whole object's size unknown): the info path;
        return None  # taken for the whole object, the part was the object's size
    return FirstBlock({"ETag": resp.get("ETag", ""), "LastModified": resp.get("LastModified", ""),
                       "size": size, "name": f"{bucket}/{key}", "type": "file",
                       "StorageClass": resp.get("StorageClass", "STANDARD"),
                       "VersionId": resp.get("VersionId"),
                       "ContentType": resp.get("ContentType")}, data)


def _unanswered(exc: OSError) -> bool:
    """Whether ``exc`` is a request the store never answered (a refused connection, a
    timeout: botocore's timeouts are OSErrors), not an answer s3fs turned into an OSError:
    asking the store again for the info would wait as long again and fail the same way."""
    return _s3_code(exc) is None and from_client(exc)


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an error s3fs translated into an OSError."""
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
        exc = exc.__cause__
    return None
