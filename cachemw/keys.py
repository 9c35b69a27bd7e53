"""Stable names for cached things: file version tokens and block keys.

Keys are blake2b digests, never Python's salted ``hash()``: every process of a node (and,
for routing, every node) must compute the same key for the same block.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

_VERSION_FIELDS = ("ETag", "etag", "e_tag", "md5", "generation", "version_id", "VersionId")
_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def version_token(info: Mapping) -> str:
    """A string that changes whenever the file's content may have changed.

    Object stores give an ETag (or generation); POSIX filesystems give size + mtime, plus
    the inode where known, so a file replaced by rename with the same size and mtime still
    counts as changed.
    """
    size = info.get("size")
    for name in _VERSION_FIELDS:
        value = info.get(name)
        if value:
            return f"{size}:{name}={value}"
    parts = [str(size)]
    for name in _TIME_FIELDS:
        value = info.get(name)
        if value is not None:
            parts.append(f"{name}={value}")
            break
    if info.get("ino") is not None:
        parts.append(f"ino={info['ino']}")
    return ":".join(parts)


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


def block_count(size: int, block_size: int) -> int:
    """Blocks of a file of ``size`` bytes; an empty file still has one (empty) block."""
    return max(1, -(-size // block_size))


def block_length(size: int, index: int, block_size: int) -> int:
    return max(0, min(block_size, size - index * block_size))
