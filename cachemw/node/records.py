"""The node cache's records: a cached block, a fill in flight (a lease), a tier's state.
Kept by NodeCache (cache.py) under its lock; the move and prefetch executors read them."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..config import TierConfig
from ..tiers.directory import DirectoryTier


@dataclass
class Entry:
    tier: str
    stored: int
    tag: bytes | None  # digest of the source URL (keys.url_tag)


@dataclass
class Inflight:
    conn: object
    tier: str
    nbytes: int
    tag: bytes | None
    lease: int = 0  # its number: names its staged file (tiers/directory.py)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # evicted or invalidated while in flight: do not index it
    claimant: str | None = None  # the client whose claim it came with (claims.holder_name)


@dataclass
class TierState:
    config: TierConfig
    tier: DirectoryTier
    used: int = 0
    reserved: int = 0
    blocks: int = 0
    hits: int = 0
    hit_bytes: int = 0
    evictions: int = 0
    demotions: int = 0
    full_until: float = 0.0  # set when a fill hit ENOSPC: no admission until then
    broken: str | None = None  # its directory is gone and cannot be made again: why
