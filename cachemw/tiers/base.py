"""The small protocol every block tier speaks, so the node cache and the placement engine
can drive DRAM, NVMe and GPU tiers alike.

A tier stores opaque, checksummed blocks by key. It keeps no accounting of its own: the
node cache (one per node, in the daemon) owns capacity and eviction, so the tier can be
used from any process of the node (clients read and fill; the daemon evicts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable


@dataclass(frozen=True)
class BlockEntry:
    """A block found in a tier: its key, the bytes it occupies, and when it was last used."""

    key: str
    stored_bytes: int
    last_used: float
    tag: bytes = b""  # digest of the source URL (see blockfile)


@dataclass(frozen=True)
class TierInfo:
    name: str
    path: str
    total_bytes: int
    free_bytes: int


@runtime_checkable
class Tier(Protocol):
    name: str

    def get(self, key: str, length: int, start: int = 0, end: int | None = None) -> bytes | None:
        """Verified bytes ``[start, end)`` of a block of ``length`` data bytes; None if absent.

        Raises :class:`cachemw.blockfile.CorruptBlock` if the stored block fails its checksum.
        """

    def put(self, key: str, data: bytes, tag: bytes = b"") -> int:
        """Store a block atomically, tagged with its source; returns the bytes it occupies."""

    def delete(self, key: str) -> int:
        """Drop a block; returns the bytes freed (0 if it was absent)."""

    def contains(self, key: str) -> bool: ...

    def stat(self) -> TierInfo: ...

    def scan(self) -> Iterator[BlockEntry]:
        """Every block stored (to re-index after a restart)."""

    def close(self) -> None: ...
