"""Executing the engine's prefetch plan on a node: fetch announced blocks ahead of the
reader, as the placement engine plans them (clairvoyant, from an announced order).

Each planned block is a fill in flight before the first is fetched, so a reader that
gets there first waits for it (single flight) instead of reading the source a second
time; whatever happens, every planned fill is finished or released.
"""
from __future__ import annotations

import logging

from ..keys import url_tag
from ..placement import Prefetch
from ..tiers.source import ChangedSourceError

log = logging.getLogger(__name__)


def run_prefetch(node, budget: int) -> None:
    from .cache import _Inflight
    from ..cluster.owner import source_for

    planned = []
    with node._lock:  # a lease decides under this lock too: none slips in between
        moves = node.placer.prefetch(budget)
        for move in moves:
            if not isinstance(move, Prefetch):
                continue
            known = node._sources.pop(move.key, None)
            if move.key in node._index or move.key in node._inflight:
                continue
            if known is None:
                node.placer.drop(move.key)
                continue
            url = known[1]
            fill = _Inflight(node, move.tier, move.size, url_tag(url) if url else None,
                             next(node._lease_numbers))
            node._inflight[move.key] = fill
            node._tiers[move.tier].reserved += move.size
            planned.append((move, known, fill))
    try:
        node._run([m for m in moves if not isinstance(m, Prefetch)])  # make room first
        while planned:
            move, (length, url, source), fill = planned.pop(0)
            _fetch_one(node, move, url, source, fill, source_for)
    finally:
        for move, _, fill in planned:  # not fetched (an error above): release, never leak
            _finish(node, move, fill, None, 0)


def _fetch_one(node, move, url, source, fill, source_for) -> None:
    target_json, path, index, block_size, file_size, version = source
    block, stored, staged = None, 0, False
    try:
        # the announced version or nothing: a block is kept under its version's key
        block = source_for(target_json).read_block(path, index, block_size, file_size, version)
        stored = node._tiers[move.tier].tier.stage(move.key, block, fill.lease,
                                                   tag=url_tag(url) if url else b"")
        staged = True
    except ChangedSourceError as exc:  # announced, then changed: its reader will see it too
        node.count("prefetch_changed")
        log.debug("prefetch of %s block %d skipped: %s", url, index, exc)
    except Exception as exc:
        log.warning("prefetch of %s block %d failed: %s", url, index, exc)
    finally:  # whatever happened, the lease ends here: no reader waits on it for nothing
        _finish(node, move, fill, block if staged else None, stored)


def _finish(node, move, fill, block, stored) -> None:
    """End a prefetch as a client's fill ends (node._land / end_unfilled): published under
    the node lock unless evicted or invalidated meanwhile; if a reader waiting on it has
    published it already, nothing is left to do (its room was given back then)."""
    if block is None:
        node.end_unfilled(move.key, fill, "error")
        return
    node._land(move.key, fill, stored)
    with node._lock:
        node.counters["prefetched"] = node.counters.get("prefetched", 0) + 1
        node.counters["bytes_from_source"] += len(block)
