"""Serving the blocks this node owns to other nodes, and the remote side of a miss.

Owner side: a peer asks for blocks by key, with a reference to their source; the owner
answers from its tiers or fetches each block from the source once (the same single-flight
lease as local readers) and keeps it. Requester side: a node's misses on blocks owned
elsewhere are grouped by owner, fetched with one call per owner, and shared by every local
process that missed the same block meanwhile.

Replicas: a block owned elsewhere that this node reads ``replicate_after`` times is copied
here when the placement engine wants it. Its reads are this daemon's fetches of it and the
hits its readers had at the owner's block server (sent straight from there, never seen by
this daemon: the readers report them, cachemw.reports ``remote_hit_tier``); those are
copied by a thread of their own, one call per owner, from what the owner holds.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field


from ..keys import url_tag
from ..reports import remote_hit
from ..tiers.source import ChangedSourceError, source_for

log = logging.getLogger(__name__)

OWNER_LEASE_WAIT = 3.0  # well under a peer's timeout: a slow fill must not evict us from rings
def serve_blocks(node, requests: list[tuple]) -> list[bytes | None]:
    """Owner side: each request is (key, length, url, (target_json, path, index, bs, size,
    version)); a block the owner cannot serve in time, or whose source has another version
    here, is None (the requester reads its own source). Without a source (url and source
    None: a replica's copy), only a block held here is served."""
    out = []
    for key, length, url, source in requests:
        try:
            out.append(_serve_one(node, key, length, url, source))
        except Exception as exc:  # one bad block never fails the batch
            log.warning("could not serve block %s of %s: %s", key, url, exc)
            out.append(None)
    return out


class _Requester:
    """The connection identity of owner-side fills (leases are per connection)."""


def _serve_one(node, key, length, url, source):
    data = node.read_local(key, length)
    if data is not None:
        node.count("served_remote")
        return data
    if source is None:  # a copy of what the owner holds, asked for a replica
        return None
    requester = _Requester()
    reply = node.lease(key, length, url, requester, wait=OWNER_LEASE_WAIT)
    kind, tier = reply[0], reply[1]
    if kind == "nofill" and tier == "busy":
        return None  # another fill of it is slow: do not hold the peer past its timeout
    if kind == "present":
        data = node.read_local(key, length)
        if data is not None:
            node.count("served_remote")
            return data
    target_json, path, index, block_size, file_size, version = source
    try:
        # pinned to the requester's version by the source tier itself (no stat beforehand:
        # the file could change between that and the read)
        block = source_for(target_json).read_block(path, index, block_size, file_size, version)
    except ChangedSourceError:  # the requester saw another version: it reads its source
        if kind == "fill":
            node.abort(key, "changed", requester)
        return None
    except BaseException:  # the lease ends whatever failed; re-raised
        if kind == "fill":
            node.abort(key, "source-error", requester)
        raise
    node.count("bytes_from_source", len(block))
    node.count("misses")
    if kind == "fill":
        try:
            stored = node.tier(tier).stage(key, block, reply[2], tag=url_tag(url))
        except OSError as exc:
            node.abort(key, "nospace" if exc.errno in (28, 122) else "error", requester)
        except BaseException:  # whatever it is, the lease ends here: no one waits on it
            node.abort(key, "error", requester)
            raise
        else:
            node.filled(key, tier, stored, requester, reply[2])  # publishes it
            node.count("fills")
    node.count("served_remote")
    return block


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    data: bytes | None = None


class RemoteReads:
    """Requester side: single-flight fetches of blocks owned by other nodes."""

    def __init__(self, node, router, *, replicate_after: int = 2, memory: int = 1 << 20) -> None:
        self.node = node
        self.router = router
        self.replicate_after = replicate_after
        self._flights: dict[str, _Flight] = {}
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._memory = memory
        self._lock = threading.Lock()
        self._wanted: dict[str, tuple[int, bytes]] = {}  # key -> (length, url tag): to copy
        self._wake = threading.Event()
        self._closed = False
        self._copier: threading.Thread | None = None

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def directory(self) -> dict | None:
        """For readers of this node: the ring and the owners' block servers (blockserver.py)."""
        return self.router.directory()

    def peer_silent(self, owner: str) -> None:
        """A reader's direct transfer from ``owner`` (a name on the ring) timed out."""
        self.router.silent(owner)

    def is_remote(self, key: str) -> bool:
        return self.router.owner(key) != self.router.self_id

    def fetch(self, items: list[tuple], wait: float = 30.0,
              replicate: bool = True) -> list[tuple]:
        """Replies ("data", bytes) or ("fallback", why) for (key, length, url, source) items.
        ``replicate``: a block fetched ``replicate_after`` times may be kept here (not for
        a prefetch, which keeps its blocks here anyway)."""
        mine: dict[str, list[tuple]] = {}
        flights: list[tuple[str, _Flight, bool]] = []
        with self._lock:
            for item in items:
                key = item[0]
                flight = self._flights.get(key)
                owned = flight is None
                if owned:
                    flight = self._flights[key] = _Flight()
                    mine.setdefault(self.router.owner(key), []).append(item)
                flights.append((key, flight, owned))
        try:
            if mine:
                results = self.router.fetch_many(mine)
                for owner, batch in mine.items():
                    blocks = results.get(owner)
                    for i, item in enumerate(batch):
                        data = None if blocks is None else blocks[i]
                        if data is not None and len(data) != item[1]:
                            data = None  # the owner saw another version: read the source
                        flight = self._flights[item[0]]
                        flight.data = data
                        if data is not None and replicate:
                            self._maybe_replicate(item, data)
        finally:  # whatever failed, the flights this call owns end (data None: a fallback),
            for key, flight, owned in flights:  # or every later read of them would wait
                if owned:
                    with self._lock:
                        self._flights.pop(key, None)
                    flight.done.set()
        replies = []
        for key, flight, owned in flights:
            if not owned and not flight.done.wait(wait):
                replies.append(("fallback", "peer fetch still running"))
                continue
            if flight.data is None:
                self.node.count("peer_fallbacks")
                replies.append(("fallback", "owner unavailable"))
            else:
                replies.append(("data", flight.data))
        return replies

    def _seen(self, key: str) -> int:
        """Count a read of ``key`` at its owner; how many so far (of the keys remembered)."""
        with self._lock:
            n = self._counts.pop(key, 0) + 1
            self._counts[key] = n
            while len(self._counts) > self._memory:
                self._counts.popitem(last=False)
        return n

    def _maybe_replicate(self, item: tuple, data: bytes) -> None:
        """Keep a local copy of a block this node keeps asking for (hot), in free space only."""
        key, length, url, _ = item
        if self._seen(key) >= self.replicate_after:
            self.node.admit_replica(key, data, url)

    def note_hits(self, accesses: list[tuple[str, str]]) -> None:
        """Hits reported by this node's readers, (key, tier) each: those at owner nodes
        count as reads of their blocks here; one read ``replicate_after`` times is copied
        here (``copy``, by the copier thread: on a reader's report, not a wait for it)."""
        wanted = {}
        for key, tier in accesses:
            at_owner = remote_hit(tier)
            if at_owner is not None and self._seen(key) >= self.replicate_after:
                wanted[key] = at_owner
        if not wanted:
            return
        with self._lock:
            self._wanted.update(wanted)
            if self._copier is None and not self._closed:
                self._copier = threading.Thread(target=self._copy_loop, daemon=True,
                                                name="cachemw-replicas")
                self._copier.start()
        self._wake.set()

    def _copy_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                wanted, self._wanted = self._wanted, {}
            if wanted and not self._closed:
                try:
                    self.copy(wanted)
                except Exception:  # the copier never dies: the next hits ask again
                    log.exception("copying hot blocks from their owners failed")

    def copy(self, wanted: dict[str, tuple[int, bytes]]) -> int:
        """Copy blocks, key -> (length, url tag), from their owners into this node's tiers
        where the placement engine wants them (admit_replica): one call per owner, for what
        the owner holds. A block not copied is counted afresh (``replicate_after`` reads
        more before it is asked for again). Returns the count of copies kept."""
        by_owner: dict[str, list[tuple]] = {}
        for key, (length, _tag) in wanted.items():
            with self._lock:
                self._counts.pop(key, None)
            if self.node.block_path(key) is None and self.is_remote(key):
                by_owner.setdefault(self.router.owner(key), []).append((key, length, None, None))
        if not by_owner:
            return 0
        kept = 0
        results = self.router.fetch_many(by_owner)
        for owner, batch in by_owner.items():
            blocks = results.get(owner) or [None] * len(batch)
            for (key, length, _, _), data in zip(batch, blocks):
                if data is not None and len(data) == length:
                    kept += self.node.admit_replica(key, data, None, tag=wanted[key][1])
        return kept
