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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..keys import url_tag
from ..node import replicas
from ..reports import remote_hit
from ..tiers.source import ChangedSourceError, source_for
from .peers import INLINE_MOST

log = logging.getLogger(__name__)

OWNER_LEASE_WAIT = 3.0  # well under a peer's timeout: a slow fill must not evict us from rings

# Blocks (and bytes) per call to an owner, and calls in flight at once per fetch. Why: an
# owner answers a call when its last block is ready, and the caller gives a call
# ``peer_timeout`` (plus its bytes' transfer time, peers.py) before it takes the owner for
# dead: a prefetch pass's hundreds of blocks in one call, served by an owner that lacks
# them, ran past it over a store with latency, the healthy owner left the ring and every
# block was read from the source again. A call this size costs its owner about one source
# latency (SERVE_CONCURRENCY reads side by side), as a reader's miss call does. Its reply
# travels inline in Ray's answer (peers.py, PIECE), which Ray keeps under 10 MiB a reply
# (task_rpc_inlined_bytes_limit): past that it puts the rest in its object store.
BATCH_BLOCKS = 16
BATCH_BYTES = INLINE_MOST
CALLS_IN_FLIGHT = 4
SERVE_CONCURRENCY = 16  # source reads an owner runs side by side for one call's blocks
# Replicas asked for by one pass of the copier: the rest are asked again at their next hit.
COPY_MAX_BLOCKS = 256
# A replica the engine refused is asked for again after replicate_after << refusals reads.
MAX_BACKOFF = 8


def batches(items: list[tuple]) -> list[list[tuple]]:
    """``items`` (key, length, ...) in order, cut into calls of at most BATCH_BLOCKS blocks
    and BATCH_BYTES bytes (a bigger block goes alone)."""
    out: list[list[tuple]] = []
    size = 0
    for item in items:
        if not out or len(out[-1]) >= BATCH_BLOCKS or size + item[1] > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1]
    return out


def serve_blocks(node, requests: list[tuple]) -> list[bytes | None]:
    """Owner side: each request is (key, length, url, (target_json, path, index, bs, size,
    version)); a block the owner cannot serve in time, or whose source has another version
    here, is None (the requester reads its own source). Without a source (url and source
    None: a replica's copy), only a block held here is served. The blocks are served side
    by side (at most SERVE_CONCURRENCY), so the ones read from the source wait on it once:
    one after another, a call of 16 cold blocks over a store with 100 ms latency took 1.6 s."""
    if len(requests) < 2 or not all(_concurrent(r[3]) for r in requests):
        return [_serve_safely(node, r) for r in requests]
    with ThreadPoolExecutor(min(SERVE_CONCURRENCY, len(requests)),
                            thread_name_prefix="cachemw-serve") as pool:
        return list(pool.map(lambda r: _serve_safely(node, r), requests))


def _concurrent(source) -> bool:
    """Whether the source of a request takes reads from several threads (tiers/source.py)."""
    try:
        return source is None or bool(getattr(source_for(source[0]), "concurrent", True))
    except Exception:  # a target it cannot open: served one by one, each failing alone
        return False


def _serve_safely(node, request: tuple) -> bytes | None:
    key, length, url, source = request
    try:
        return _serve_one(node, key, length, url, source)
    except Exception as exc:  # one bad block never fails the batch
        log.warning("could not serve block %s of %s: %s", key, url, exc)
        return None


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

    CALLS_IN_FLIGHT = CALLS_IN_FLIGHT
    batches = staticmethod(batches)  # (node/prefetch.py cuts its calls as fetch_batches does)

    def __init__(self, node, router, *, replicate_after: int = 2, memory: int = 1 << 20) -> None:
        self.node = node
        self.router = router
        self.replicate_after = replicate_after
        self._flights: dict[str, _Flight] = {}
        self._counts: OrderedDict[str, int] = OrderedDict()
        # key -> times the engine refused a replica of it (asked again later each time)
        self._refusals: OrderedDict[str, int] = OrderedDict()
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
                results = self.fetch_batches(mine)
                for owner, batch in mine.items():
                    for item, data in zip(batch, results[owner]):
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

    def fetch_batches(self, by_owner: dict[str, list[tuple]]) -> dict[str, list]:
        """The blocks of ``by_owner``'s requests from their owners (None for each one not
        given), in calls of at most BATCH_BLOCKS blocks / BATCH_BYTES bytes (see batches),
        CALLS_IN_FLIGHT at once; an owner that fails a call is not asked again here."""
        out = {owner: [None] * len(items) for owner, items in by_owner.items()}
        rounds: list[dict[str, tuple[int, list]]] = []  # per call: owner -> (first, requests)
        for owner, items in by_owner.items():
            first = 0
            for n, batch in enumerate(batches(items)):
                if n == len(rounds):
                    rounds.append({})
                rounds[n][owner] = (first, batch)
                first += len(batch)
        failed: set[str] = set()

        def call(calls: dict[str, tuple[int, list]]) -> None:
            calls = {o: c for o, c in calls.items() if o not in failed}
            if not calls:
                return
            results = self.router.fetch_many({o: batch for o, (_, batch) in calls.items()})
            for owner, (first, batch) in calls.items():
                blocks = results.get(owner)
                if blocks is None:
                    failed.add(owner)
                    continue
                for i, data in enumerate(blocks[:len(batch)]):
                    out[owner][first + i] = data

        if len(rounds) < 2:
            for calls in rounds:
                call(calls)
        else:
            with ThreadPoolExecutor(min(CALLS_IN_FLIGHT, len(rounds)),
                                    thread_name_prefix="cachemw-owners") as pool:
                for done in [pool.submit(call, calls) for calls in rounds]:
                    done.result()
        return out

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
            if at_owner is not None and self._seen(key) >= self._threshold(key):
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

    def _threshold(self, key: str) -> int:
        """Reads of ``key`` that make it wanted as a replica: ``replicate_after``, doubled
        for each time the engine refused it (up to MAX_BACKOFF times)."""
        with self._lock:
            refused = self._refusals.get(key, 0)
        return self.replicate_after << min(refused, MAX_BACKOFF)

    def _refused(self, key: str) -> None:
        with self._lock:
            self._counts.pop(key, None)
            self._refusals[key] = self._refusals.pop(key, 0) + 1
            while len(self._refusals) > self._memory:
                self._refusals.popitem(last=False)

    def copy(self, wanted: dict[str, tuple[int, bytes]]) -> int:
        """Copy blocks, key -> (length, url tag), from their owners into this node's tiers
        where the placement engine wants them. The engine is asked first (reserve_replica):
        only a block it gives a tier is fetched, so a full tier costs no transfer (fetched
        first, every hot remote block was sent again and thrown away each time it was
        refused). At most COPY_MAX_BLOCKS per pass, from what the owners hold, in bounded
        calls (fetch_batches); the rest is asked for again at its next hit. A block refused
        is asked for again only after twice as many reads as the time before (_threshold).
        Returns the count of copies kept."""
        by_owner: dict[str, list[tuple]] = {}
        fills: dict[str, object] = {}
        try:
            for key, (length, tag) in wanted.items():
                if len(fills) >= COPY_MAX_BLOCKS:
                    break
                if self.node.block_path(key) is not None or not self.is_remote(key):
                    with self._lock:
                        self._counts.pop(key, None)
                    continue
                fill = self.node.reserve_replica(key, length, tag)
                if fill is None:
                    self._refused(key)
                    continue
                fills[key] = fill
                by_owner.setdefault(self.router.owner(key), []).append((key, length, None, None))
            if not by_owner:
                return 0
            kept = 0
            results = self.fetch_batches(by_owner)
            for owner, batch in by_owner.items():
                for (key, length, _, _), data in zip(batch, results[owner]):
                    ok = data is not None and len(data) == length
                    landed = replicas.land(self.node, key, fills.pop(key), data if ok else None)
                    kept += landed
                    with self._lock:  # counted afresh (replicate_after reads to ask again)
                        self._counts.pop(key, None)
                        if landed:
                            self._refusals.pop(key, None)
            return kept
        finally:  # whatever failed, no reserved room is left behind
            for key, fill in fills.items():
                self.node.end_unfilled(key, fill, "error")
