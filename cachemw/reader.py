"""The read path: byte ranges of a source file, served block by block through the tiers.

A hit is read straight from a tier file and verified. A miss asks the daemon for a lease
and, when told to, fetches the whole block from the source and fills the tier; every other
outcome (daemon unreachable, tiers full, filler stuck, block evicted under us) reads the
source directly and is counted, so losing the cache costs speed and never a read.
"""
from __future__ import annotations

import errno
import logging

from .blockfile import CorruptBlock
from .client import DaemonClient
from .keys import block_key, block_length
from .metadata import FileMeta
from .tiers.source import SourceTier

log = logging.getLogger("cachemw.reader")


class BlockReader:
    def __init__(self, source: SourceTier, client: DaemonClient, block_size: int) -> None:
        self.source = source
        self.client = client
        self.block_size = block_size
        self._fill_warned = False

    def read(self, meta: FileMeta, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the file (already clipped to its size)."""
        if end <= start:
            return b""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if first == last:
            base = first * bs
            return self._block(meta, first, start - base, end - base)
        parts = []
        for i in range(first, last + 1):
            base = i * bs
            parts.append(self._block(meta, i, max(start - base, 0),
                                     min(end - base, block_length(meta.size, i, bs))))
        return b"".join(parts)

    def _block(self, meta: FileMeta, index: int, lo: int, hi: int) -> bytes:
        length = block_length(meta.size, index, self.block_size)
        key = block_key(meta.url, meta.version, index, self.block_size)
        client = self.client
        for tier in client.tiers():
            try:
                data = tier.get(key, length, lo, hi)
            except CorruptBlock as exc:
                log.warning("corrupt cached block of %s (block %d): %s; refetching",
                            meta.url, index, exc)
                client.count("corrupt_repaired")
                tier.delete(key)
                client.drop(key, "corrupt")
                continue
            if data is not None:
                client.hit(key, tier.name, len(data))
                return data
        return self._miss(meta, index, key, length, lo, hi)

    def _miss(self, meta: FileMeta, index: int, key: str, length: int, lo: int, hi: int) -> bytes:
        client = self.client
        lease = client.lease(key, length, meta.url)
        if lease is None:
            client.count("fallbacks")
            return self._direct(meta, index, lo, hi)
        kind, tier_name = lease
        if kind == "present":
            tier = self._tier(tier_name)
            try:
                data = tier.get(key, length, lo, hi) if tier is not None else None
            except CorruptBlock:
                data = None
            if data is not None:
                client.hit(key, tier_name, len(data))
                return data
        if kind != "fill":
            client.count("bypassed")
            return self._direct(meta, index, lo, hi)
        try:
            block = self.source.read_block(meta.path, index, self.block_size, meta.size)
        except BaseException:
            client.abort(key, "source-error")
            raise
        client.count("misses")
        client.count("bytes_from_source", len(block))
        tier = self._tier(tier_name)
        try:
            stored = tier.put(key, block)
        except OSError as exc:
            reason = "nospace" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "error"
            client.abort(key, reason)
            client.count("fill_errors")
            if not self._fill_warned:
                log.warning("could not fill the %s tier (%s); reading on from the source", tier_name, exc)
                self._fill_warned = True
        else:
            client.filled(key, tier_name, stored)
            client.count("fills")
        client.maybe_flush()
        return block if lo == 0 and hi == len(block) else block[lo:hi]

    def _direct(self, meta: FileMeta, index: int, lo: int, hi: int) -> bytes:
        base = index * self.block_size
        data = self.source.read_range(meta.path, base + lo, base + hi)
        self.client.count("bytes_from_source", len(data))
        self.client.maybe_flush()
        return data

    def _tier(self, name: str | None):
        for tier in self.client.tiers():
            if tier.name == name:
                return tier
        return None
