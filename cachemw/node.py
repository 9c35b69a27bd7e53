"""The node cache: the logic a node daemon runs, as a plain class testable without Ray.

It owns the node's tier accounting: which blocks are where, how full each tier is, who is
filling what. Clients read hits straight from the tier files; on a miss they ask for a
*lease*: the node cache answers "present in tier T" (someone filled it meanwhile), "fill it
into tier T" (the caller fetches from the source and writes the block file, then reports
"filled"), or "do not cache" (tiers full, or the filler is stuck). So a block is fetched
once per node however many processes miss it at once (single flight), fills run in the
clients' processes in parallel, and the daemon stays a light coordinator.

Capacity: a tier never admits past its capacity; above its high watermark a background
pass demotes (to the next tier) or evicts blocks, chosen by the eviction policy, until the
tier is under its low watermark.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from .config import DaemonConfig, TierConfig
from . import blockfile
from .keys import url_tag
from .tiers.directory import DirectoryTier

log = logging.getLogger("cachemw.node")

# Counters clients add to through access reports; the daemon adds the rest.
CLIENT_COUNTERS = (
    "hits", "hit_bytes", "misses", "fills", "bytes_from_source", "fallbacks",
    "bypassed", "corrupt_repaired", "fill_errors", "remote_hits",
)


class LRUEviction:
    """Least-recently-used victims per tier: the simple policy until the placement engine
    drives eviction (it plugs in through the same four methods)."""

    def __init__(self) -> None:
        self._order: dict[str, OrderedDict[str, int]] = defaultdict(OrderedDict)

    def admitted(self, key: str, tier: str, nbytes: int) -> None:
        self._order[tier][key] = nbytes
        self._order[tier].move_to_end(key)

    def accessed(self, key: str, tier: str) -> None:
        order = self._order[tier]
        if key in order:
            order.move_to_end(key)

    def removed(self, key: str, tier: str) -> None:
        self._order[tier].pop(key, None)

    def victims(self, tier: str, nbytes: int) -> list[str]:
        out, freed = [], 0
        for key, size in self._order[tier].items():
            if freed >= nbytes:
                break
            out.append(key)
            freed += size
        return out


@dataclass
class _Entry:
    tier: str
    stored: int
    tag: bytes | None  # digest of the source URL (keys.url_tag)


@dataclass
class _Inflight:
    conn: object
    tier: str
    nbytes: int
    tag: bytes | None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _TierState:
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


class NodeCache:
    def __init__(self, config: DaemonConfig, *, policy=None, lease_wait: float = 30.0) -> None:
        self.config = config
        self.policy = policy or LRUEviction()
        self.lease_wait = lease_wait
        self._lock = threading.Lock()
        self._tiers: dict[str, _TierState] = {}
        for tc in config.tiers:
            self._tiers[tc.name] = _TierState(tc, DirectoryTier(tc.name, tc.path, create=True))
        self._order = [tc.name for tc in config.tiers]
        self._index: dict[str, _Entry] = {}
        self._by_tag: dict[bytes, set[str]] = defaultdict(set)
        self._inflight: dict[str, _Inflight] = {}
        self.counters = dict.fromkeys(CLIENT_COUNTERS, 0)
        self.counters.update(leases=0, waits=0, busy=0, reindexed=0, served_remote=0,
                             peer_fallbacks=0, replicas=0)
        self.remote = None  # RemoteReads, set by a daemon that has peers
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._maintainer: threading.Thread | None = None
        self._reindex()

    # -- lifecycle -----------------------------------------------------------------

    def _reindex(self) -> None:
        """Adopt the blocks already in the tier directories (NVMe survives restarts)."""
        for name in self._order:
            ts = self._tiers[name]
            for entry in sorted(ts.tier.scan(), key=lambda e: e.last_used):
                if entry.key in self._index:  # in a faster tier already: drop the copy
                    ts.tier.delete(entry.key)
                    continue
                self._add(entry.key, name, entry.stored_bytes, entry.tag or None)
                self.counters["reindexed"] += 1
        if self.counters["reindexed"]:
            log.info("re-indexed %d cached blocks", self.counters["reindexed"])
        self._wake.set()

    def start_maintenance(self) -> None:
        if self._maintainer is None:
            self._maintainer = threading.Thread(target=self._maintain_loop, name="cachemw-evict",
                                                daemon=True)
            self._maintainer.start()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._maintainer is not None:
            self._maintainer.join(timeout=5)

    def tier_dirs(self) -> list[dict]:
        return [{"name": n, "path": self._tiers[n].tier.path,
                 "capacity": self._tiers[n].config.capacity} for n in self._order]

    # -- leases: single-flight fills ---------------------------------------------

    def lease(self, key: str, length: int, url: str | None, conn: object) -> tuple[str, str | None]:
        """("present", tier) | ("fill", tier) | ("nofill", reason). Never blocks past lease_wait.

        ``length`` is the block's data length; the tier is charged what the block file
        will occupy (data + checksums + trailer).
        """
        nbytes = length + blockfile.tail_size(length)
        deadline = time.monotonic() + self.lease_wait
        while True:
            with self._lock:
                entry = self._index.get(key)
                if entry is not None:
                    return ("present", entry.tier)
                inflight = self._inflight.get(key)
                if inflight is None:
                    tier = self._choose_tier(nbytes)
                    if tier is None:
                        return ("nofill", "full")
                    self._inflight[key] = _Inflight(conn, tier, nbytes, url_tag(url) if url else None)
                    self._tiers[tier].reserved += nbytes
                    self.counters["leases"] += 1
                    return ("fill", tier)
                self.counters["waits"] += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not inflight.done.wait(remaining):
                with self._lock:
                    self.counters["busy"] += 1
                return ("nofill", "busy")

    def _choose_tier(self, nbytes: int) -> str | None:
        now = time.monotonic()
        for name in self._order:
            ts = self._tiers[name]
            if ts.full_until > now:
                continue
            if ts.used + ts.reserved + nbytes <= ts.config.capacity:
                if ts.used + ts.reserved + nbytes > ts.config.high_bytes:
                    self._wake.set()
                return name
            self._wake.set()
        return None

    def filled(self, key: str, tier: str, stored: int, conn: object) -> None:
        with self._lock:
            inflight = self._inflight.get(key)
            if inflight is None or inflight.conn is not conn:
                return
            del self._inflight[key]
            ts = self._tiers[tier]
            ts.reserved -= inflight.nbytes
            self._add(key, tier, stored, inflight.tag)
        inflight.done.set()

    def abort(self, key: str, reason: str, conn: object) -> None:
        with self._lock:
            inflight = self._inflight.get(key)
            if inflight is None or inflight.conn is not conn:
                return
            del self._inflight[key]
            ts = self._tiers[inflight.tier]
            ts.reserved -= inflight.nbytes
            if reason == "nospace":
                ts.full_until = time.monotonic() + 5.0
                log.warning("%s tier %s is out of space; not admitting for 5 s", ts.config.name,
                            ts.tier.path)
                self._wake.set()
        inflight.done.set()

    def release(self, conn: object) -> None:
        """A client went away: abort the leases it held so waiters can take them."""
        with self._lock:
            keys = [k for k, f in self._inflight.items() if f.conn is conn]
        for key in keys:
            self.abort(key, "disconnected", conn)

    def lease_many(self, items: list[tuple], conn: object) -> list[tuple]:
        """Leases for many blocks at once: (key, length, url, source) each.

        Blocks owned by another node (and not replicated here) are fetched from their
        owners, one call per owner, and answered ("data", bytes) or ("fallback", why).
        """
        replies: list = [None] * len(items)
        remote_items, remote_at = [], []
        for i, item in enumerate(items):
            key, length, url, source = item
            if self.remote is not None and source is not None and self.remote.is_remote(key):
                with self._lock:
                    entry = self._index.get(key)
                if entry is not None:
                    replies[i] = ("present", entry.tier)
                else:
                    remote_items.append(item)
                    remote_at.append(i)
                continue
            replies[i] = self.lease(key, length, url, conn)
        if remote_items:
            for i, reply in zip(remote_at, self.remote.fetch(remote_items)):
                replies[i] = reply
        return replies

    def read_local(self, key: str, length: int) -> bytes | None:
        """A block from this node's tiers, verified; a corrupt copy is dropped (None)."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return None
        try:
            return self._tiers[entry.tier].tier.get(key, length)
        except blockfile.CorruptBlock:
            self.counters["corrupt_repaired"] += 1
            self.drop(key, "corrupt")
            return None

    def tier(self, name: str):
        return self._tiers[name].tier

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def admit_replica(self, key: str, data: bytes, url: str | None) -> bool:
        """Store a copy of a remote block in free space (never evicting anything for it)."""
        nbytes = len(data) + blockfile.tail_size(len(data))
        with self._lock:
            if key in self._index or key in self._inflight:
                return False
            for name in self._order:
                ts = self._tiers[name]
                if ts.used + ts.reserved + nbytes <= ts.config.low_bytes:
                    ts.reserved += nbytes
                    break
            else:
                return False
        try:
            stored = ts.tier.put(key, data, tag=url_tag(url) if url else b"")
        except OSError:
            with self._lock:
                ts.reserved -= nbytes
            return False
        with self._lock:
            ts.reserved -= nbytes
            if key not in self._index:
                self._add(key, name, stored, url_tag(url) if url else None)
                self.counters["replicas"] += 1
        return True

    # -- index ---------------------------------------------------------------------

    def _add(self, key: str, tier: str, stored: int, tag: bytes | None) -> None:
        old = self._index.get(key)
        if old is not None:
            self._remove_locked(key)
        ts = self._tiers[tier]
        self._index[key] = _Entry(tier, stored, tag)
        ts.used += stored
        ts.blocks += 1
        if tag is not None:
            self._by_tag[tag].add(key)
        self.policy.admitted(key, tier, stored)
        if ts.used > ts.config.high_bytes:
            self._wake.set()

    def _remove_locked(self, key: str) -> _Entry | None:
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        ts = self._tiers[entry.tier]
        ts.used -= entry.stored
        ts.blocks -= 1
        self.policy.removed(key, entry.tier)
        if entry.tag is not None:
            keys = self._by_tag.get(entry.tag)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_tag[entry.tag]
        return entry

    def drop(self, key: str, reason: str) -> None:
        """Forget and delete a block (a client found it corrupt, or it was invalidated)."""
        with self._lock:
            entry = self._remove_locked(key)
        if entry is not None:
            self._tiers[entry.tier].tier.delete(key)
        else:  # not indexed (e.g. a stray file): delete wherever it is
            for ts in self._tiers.values():
                ts.tier.delete(key)
        if reason == "corrupt":
            log.warning("dropped corrupt block %s", key)

    def invalidate(self, url: str) -> int:
        """Drop every block of ``url`` (the file was written through the cache)."""
        with self._lock:
            keys = list(self._by_tag.get(url_tag(url), ()))
        for key in keys:
            self.drop(key, "invalidated")
        return len(keys)

    def report(self, counters: dict, accesses: list[tuple[str, str]]) -> None:
        """An access report from a client: counters to add, (key, tier) hits for recency."""
        with self._lock:
            for name, value in counters.items():
                if name in self.counters:
                    self.counters[name] += value
            for key, tier in accesses:
                ts = self._tiers.get(tier)
                if ts is None:
                    continue
                ts.hits += 1
                self.policy.accessed(key, tier)
            for tier, nbytes in counters.get("tier_hit_bytes", {}).items():
                if tier in self._tiers:
                    self._tiers[tier].hit_bytes += nbytes

    # -- eviction / demotion -----------------------------------------------------

    def _maintain_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.maintain()
            except Exception:  # never let the eviction thread die silently
                log.exception("eviction pass failed")

    def maintain(self) -> None:
        """Bring every tier above its high watermark down to its low watermark."""
        for i, name in enumerate(self._order):
            ts = self._tiers[name]
            with self._lock:
                excess = ts.used + ts.reserved - ts.config.low_bytes
                if ts.used + ts.reserved <= ts.config.high_bytes or excess <= 0:
                    continue
                victims = [(k, self._index[k]) for k in self.policy.victims(name, excess)
                           if k in self._index]
            lower = self._tiers[self._order[i + 1]] if i + 1 < len(self._order) else None
            for key, entry in victims:
                if lower is not None and self._demote(key, entry, ts, lower):
                    continue
                with self._lock:
                    if self._index.get(key) is not entry:
                        continue
                    self._remove_locked(key)
                    ts.evictions += 1
                ts.tier.delete(key)

    def _demote(self, key: str, entry: _Entry, upper: _TierState, lower: _TierState) -> bool:
        with self._lock:
            if lower.used + lower.reserved + entry.stored > lower.config.high_bytes:
                return False
            if time.monotonic() < lower.full_until:
                return False
        try:
            data = _read_whole(upper.tier.block_path(key))
            if data is None:
                return False
            stored = lower.tier.put(key, data, tag=entry.tag or b"")
        except OSError as exc:
            log.warning("demoting %s to %s failed: %s", key, lower.config.name, exc)
            return False
        with self._lock:
            if self._index.get(key) is not entry:
                lower.tier.delete(key)
                return True
            self._remove_locked(key)
            self._add(key, lower.config.name, stored, entry.tag)
            upper.demotions += 1
        upper.tier.delete(key)
        return True

    # -- stats ---------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            tiers = {}
            for name in self._order:
                ts = self._tiers[name]
                tiers[name] = {
                    "path": ts.tier.path, "used_bytes": ts.used, "capacity_bytes": ts.config.capacity,
                    "blocks": ts.blocks, "hits": ts.hits, "hit_bytes": ts.hit_bytes,
                    "evictions": ts.evictions, "demotions": ts.demotions,
                    "admitting": ts.full_until <= time.monotonic(),
                }
            return {"node_id": self.config.node_id, "pid": os.getpid(), "tiers": tiers,
                    "counters": dict(self.counters), "inflight": len(self._inflight)}


def _read_whole(path: str) -> bytes | None:
    """A block file's data (verified), its length derived from the file's size."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return None
    return blockfile.read_block(path, blockfile.data_length(size, path))
