"""Stable names for cached things: file version tokens and block keys.

Keys are blake2b digests, never Python's salted ``hash()``: every process of a node (and,
for routing, every node) must compute the same key for the same block.
"""
from __future__ import annotations

import hashlib
from typing import Mapping
from urllib.parse import quote, unquote

# What names a version of an object (content digests, generations, version ids): all of
# those the store gives are kept, so the source tier can pin a read to the version
# (s3fs: ``VersionId``, ``IfMatch`` on the ETag; HTTP: ``If-Match``).
_VERSION_FIELDS = ("ETag", "etag", "e_tag", "md5", "generation", "version_id", "VersionId")
# Without those: the first modification time given ...
_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "Last-Modified", "updated", "modified")
# ... plus what a user cannot set back (POSIX ctime, which fsspec's local info calls
# "created", and the inode): a same-size rewrite that restores the mtime, or a file
# replaced by rename with the same size and mtime, still counts as changed.
_UNFORGEABLE_FIELDS = ("created", "ino")


def _quote(value) -> str:
    """``value`` with the token's separators (``:``, ``=``) and ``%`` percent-quoted. Most
    values (sizes, times, inodes, hex ETags) have none: those are kept as they are, so a
    token costs a few string joins on the miss path (``version_fields`` reads either)."""
    text = str(value)
    if ":" in text or "=" in text or "%" in text:
        return quote(text, safe="\"/+ ")
    return text


def version_token(info: Mapping) -> str:
    """A string that changes whenever the file's content may have changed.

    ``size:name=value[:name=value...]``, values percent-quoted where needed (so ``:`` and
    ``=`` only separate); ``version_fields`` reads it back. Object stores give an ETag (or generation,
    version id); POSIX filesystems give size, mtime, ctime and inode. ``stat_token``
    computes the same string from an ``os.stat_result`` through this very function, so the
    token of a file's metadata and of a descriptor read from it cannot drift apart.

    The limit: a POSIX timestamp has the filesystem's granularity (ext4, tmpfs: a kernel
    tick); an in-place rewrite of the same size within the same tick as the version before
    it looks the same (README, "What a read returns").
    """
    parts = [str(info.get("size"))]
    for name in _VERSION_FIELDS:
        value = info.get(name)
        if value:
            parts.append(f"{name}={_quote(value)}")
    if len(parts) == 1:
        for name in _TIME_FIELDS:
            value = info.get(name)
            if value is not None:
                parts.append(f"{name}={_quote(value)}")
                break
        for name in _UNFORGEABLE_FIELDS:
            value = info.get(name)
            if value is not None:
                parts.append(f"{name}={_quote(value)}")
    return ":".join(parts)


def stat_info(st) -> dict:
    """The fields of fsspec's ``LocalFileSystem.info`` that name a version, from a stat
    (of a path, following links, or of an open descriptor), as fsspec computes them."""
    return {"size": st.st_size, "mtime": st.st_mtime,
            "created": getattr(st, "st_birthtime", st.st_ctime), "ino": st.st_ino}


def stat_token(st) -> str:
    """``version_token`` of a local file from its stat: the same string its info gives."""
    return version_token(stat_info(st))


def version_fields(token: str) -> dict[str, str]:
    """The ``name=value`` fields of a version token (``size`` included), unquoted."""
    size, _, rest = token.partition(":")
    out = {"size": size}
    for part in rest.split(":") if rest else ():
        name, _, value = part.partition("=")
        out[name] = unquote(value)
    return out


def other_content(old: str, new: str) -> bool:
    """Whether two version tokens of one file name other bytes for certain: a field both
    carry (the size among them) differs. Tokens of one object may carry different fields
    (an S3 listing gives an ETag, a HEAD of a versioned bucket its VersionId too): those
    with no field in common but the size, the same size, are not told apart."""
    if old == new:
        return False
    a, b = version_fields(old), version_fields(new)
    return any(a[name] != b[name] for name in a.keys() & b.keys())


def block_key(url: str, version: str, index: int, block_size: int) -> str:
    """Key of block ``index`` of ``url`` at ``version`` cut at ``block_size`` (32 hex chars)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{url}\0{version}\0{block_size}\0{index}".encode())
    return h.hexdigest()


def path_key(url: str) -> str:
    """Key of a path's metadata record (independent of its version)."""
    return hashlib.blake2b(url.encode(), digest_size=16).hexdigest()


def url_tag(url: str) -> bytes:
    """16-byte digest of a source URL, recorded in each of its block files."""
    return hashlib.blake2b(url.encode(), digest_size=16, person=b"cachemw-url").digest()


def stated_size(info: Mapping) -> int:
    """The file's size as its source states it, or -1 where it states none: an HTTP server
    that answers without a Content-Length (a chunked response) gives fsspec no size. Such
    a file is read whole from the source and not cached (client/fs.py _reads_to_end)."""
    size = info.get("size")
    return -1 if size is None else int(size)


def block_count(size: int, block_size: int) -> int:
    """Blocks of a file of ``size`` bytes; an empty file still has one (empty) block."""
    return max(1, -(-size // block_size))


def block_length(size: int, index: int, block_size: int) -> int:
    return max(0, min(block_size, size - index * block_size))
