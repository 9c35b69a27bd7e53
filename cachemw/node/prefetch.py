"""Fetching announced blocks ahead of the reader, as the placement engine plans them
(clairvoyant, from an announced order), from the node cache's maintenance thread,
``CONCURRENCY`` source reads at a time.

In a cluster, a planned block another node owns is fetched from its owner, as a miss of it
is (cluster/owner.py RemoteReads), in calls of at most 16 blocks (RemoteReads.batches), and kept here
too, so that its read here is a hit: the owner serves it from its tiers, or fetches it from
the source once, cluster-wide, and keeps it. Only a block its owner cannot give (down, hung
past ``peer_timeout``, another version there) is read from the source here, counted as a
miss is (``peer_fallbacks``).

The node puts each planned block in flight as a fill before the first is fetched
(NodeCache.reserve_prefetches), so a reader that gets there first waits for it (single
flight) instead of reading the source a second time; whatever happens, every planned fill
is finished or released here.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .. import trace
from ..keys import url_tag
from ..tiers.source import ChangedSourceError, source_for

log = logging.getLogger(__name__)


# Source reads a prefetch pass keeps in flight. Why: readers that reach a planned block
# wait for its fill, so a prefetcher reading one block at a time is as fast as one reader:
# against a store that answers each request after a latency (a PFS, S3), slower than the
# DataLoader's own workers. Blocks are started in the order they will be read.
CONCURRENCY = 16

# A failing store fails every block of an announced order alike (no credentials, a store
# unreachable): said once a minute per kind of failure, with how many failed since.
SAY_EVERY = 60.0
_said: dict[str, list] = {}  # kind -> [when said, failures since]
_said_lock = threading.Lock()


def _say_failed(url: str, index: int, exc: Exception, now: float | None = None) -> None:
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    now = time.monotonic() if now is None else now
    with _said_lock:
        said = _said.setdefault(kind, [-SAY_EVERY, 0])
        if now - said[0] < SAY_EVERY:
            said[1] += 1
            return
        more, said[0], said[1] = said[1], now, 0
    log.warning("prefetch of %s block %d failed: %s%s", url, index, exc,
                f" ({more} more prefetches failed so since the last such message)" if more else "")


def run_prefetch(node, budget: int) -> None:
    """One prefetch pass of ``node`` (a NodeCache) for at most ``budget`` bytes."""
    room, planned = node.reserve_prefetches(budget)
    ended = [False] * len(planned)

    def fetch(i: int, block: bytes | None = None) -> None:
        move, (_length, url, source), fill = planned[i]
        _fetch_one(node, move, url, source, fill, block)
        ended[i] = True

    def from_owners(at: list[int]) -> list[int]:
        """Fetch the blocks at ``at`` from their owners; those to read from the source."""
        replies = node.remote.fetch([(planned[i][0].key, *planned[i][1]) for i in at],
                                    replicate=False)  # (kept here as prefetched)
        unserved = []
        for i, reply in zip(at, replies):
            if reply[0] == "data":
                fetch(i, reply[1])
            else:
                unserved.append(i)
        return unserved

    try:
        node.run_moves(room)  # make room first
        remote = node.remote
        at_owners = [i for i, (move, _, _) in enumerate(planned)
                     if remote is not None and remote.is_remote(move.key)]
        asked = set(at_owners)
        here = [i for i in range(len(planned)) if i not in asked]
        # calls to owners of bounded size (cluster/owner.py batches), a few at once: each
        # call's blocks are here (and their readers' waits end) as it ends
        calls = remote.batches([(i, planned[i][0].size) for i in at_owners]) if at_owners else []
        in_flight = min(remote.CALLS_IN_FLIGHT, len(calls)) if calls else 1
        if len(here) == 1 and not at_owners:
            fetch(here[0])
        elif planned:
            with ThreadPoolExecutor(min(CONCURRENCY, len(planned)),
                                    thread_name_prefix="cachemw-prefetch") as pool, \
                    ThreadPoolExecutor(in_flight, thread_name_prefix="cachemw-prefetch-owners") as owners:
                asks = [owners.submit(from_owners, [i for i, _ in call]) for call in calls]
                futures = [pool.submit(fetch, i) for i in here]
                for ask in asks:
                    futures += [pool.submit(fetch, i) for i in ask.result()]
                for future in futures:
                    future.result()
    finally:
        for done, (move, _, fill) in zip(ended, planned):
            if not done:  # not ended (an error above): release, never leak
                node.end_unfilled(move.key, fill, "error")


def _fetch_one(node, move, url, source, fill, block: bytes | None = None) -> None:
    """Fetch one planned block (unless given ``block``, its bytes from its owner) and end
    its fill as a client's fill ends: published under the node lock unless evicted or
    invalidated meanwhile (NodeCache.land); if a reader waiting on it has published it
    already, nothing is left to do."""
    target_json, path, index, block_size, file_size, version = source
    started = time.perf_counter()
    from_source = block is None
    try:
        if from_source:  # the announced version or nothing: kept under its version's key
            block = source_for(target_json).read_block(path, index, block_size, file_size,
                                                       version)
        stored = node.tier(move.tier).stage(move.key, block, fill.lease,
                                            tag=url_tag(url) if url else b"")
    except ChangedSourceError as exc:  # announced, then changed: its reader will see it too
        node.count("prefetch_changed")
        log.debug("prefetch of %s block %d skipped: %s", url, index, exc)
    except Exception as exc:  # any failure of a prefetch costs only the prefetch
        node.count("prefetch_errors")
        _say_failed(url, index, exc)
    else:
        node.land(move.key, fill, stored)
        if trace.ENABLED:
            trace.event("prefetch", trace.PLACEMENT, started, None,
                        {"file": path, "block": index, "tier": move.tier, "bytes": len(block)})
        node.count("prefetched")
        if from_source:
            node.count("bytes_from_source", len(block))
        else:
            node.count("prefetched_from_owners")
        return
    node.end_unfilled(move.key, fill, "error")
