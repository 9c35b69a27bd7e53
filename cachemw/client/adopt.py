"""Leasing blocks fetched before their lease, behind the reads, many to a request.

A miss on a node of its own fetches its block under the block's claim (cachemw.claims), and
a cold read learns the block's key from the GET that brought it (reader.read_cold): either
way the bytes are in hand before the daemon has been asked. The fill writer (fills.py)
then runs ``Adoptions`` on a batch of such blocks: one ``LEASE_FETCHED`` request per claim
state, the fills granted written and noted together (``FillWriter.store_many``). Each
request and note wakes the daemon, a process switch on a busy node: per 128 KiB miss the
two of them had cost more CPU, client and daemon together, than writing the block file.

Every lease granted ends (filled, or aborted here) and every claim is released or kept
for a block asked for again, whatever raises on the way.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

from .fills import Fill, FillWriter
from ..claims import Claims, holder_name
from ..keys import url_tag

log = logging.getLogger(__name__)

LATER = ("nofill", "later")


class Adopted(NamedTuple):
    """A block fetched before its lease."""

    piece: NamedTuple  # reader.Piece: the block's file, index, range, key, length
    data: bytes
    dropped: Callable[[], bool]  # was its file written through the cache since it was asked?
    claimed: bool  # this process holds the block's claim
    duplicates: str  # the counter of a fetch another process's fill made a duplicate


class Adoptions:
    """``adoptions(entries)``: cache blocks fetched before their lease, each leased now and
    filled with its bytes, unless another process filled it or is filling it (a duplicate
    fetch, counted) or the file was written through the cache since it was asked for
    (``dropped()``, asked once the lease is ours). A write through the cache marks the
    file dropped in the node's table, then has the daemon cancel the fills in flight and
    drop the file's blocks (fs._written): a lease granted before the cancel is cancelled,
    one granted after the mark sees it here. A claim ends with the lease it came with (the
    daemon releases it), or here when no lease came.

    The daemon grants a batch part of a tier at a time and answers the rest "later"
    (node.cache.NodeCache.lease_fetched): those are asked again once the notes of the
    fills granted are sent, on the same connection (which the daemon reads in order), their
    claims kept meanwhile; a round that granted none ends it (read uncached).
    """

    def __init__(self, client, fills: FillWriter, claims: Claims, item_of: Callable,
                 tier_named: Callable, timed: Callable) -> None:
        """The reader's collaborators: its daemon link, fill writer and claims; what the
        daemon needs to know of a block (``item_of(piece)``), a tier by name
        (``tier_named(name)``), and its timer of waits (``timed(counter, name, started,
        blocks)``)."""
        self.client, self.fills, self.claims = client, fills, claims
        self.item_of, self.tier_named, self.timed = item_of, tier_named, timed

    def __call__(self, entries: list[Adopted]) -> None:
        while entries:
            fills: list[Fill] = []
            later: list[Adopted] = []
            granted = 0
            try:
                try:
                    for claimed in (True, False):
                        group = [e for e in entries if bool(e.claimed) is claimed]
                        if group:
                            granted += self._lease(group, claimed, fills, later)
                finally:  # the leases granted end with their fills, whatever failed
                    if fills:
                        self.fills.store_many(fills)
            except BaseException:  # nothing is asked again: the claims kept for it end
                self._release_claims(later)
                raise
            if later and not granted:  # never from this daemon: not to loop on one that did
                self._release_claims(later)
                self.client.count("bypassed", len(later))
                return
            entries = later

    def _release_claims(self, entries: list[Adopted]) -> None:
        for entry in entries:
            if entry.claimed:
                self.claims.release(entry.piece.key)

    def _lease(self, group: list[Adopted], claimed: bool, fills: list[Fill],
               later: list[Adopted]) -> int:
        """Lease the blocks of ``group``; their fills go to ``fills``, the entries to ask
        for again to ``later`` (their claims kept). Returns the leases granted."""
        client = self.client
        asked = time.perf_counter()
        replies = None
        try:
            replies = client.lease_fetched([self.item_of(e.piece) for e in group], claimed)
        finally:
            if claimed:  # a claim not granted its lease ends here (unless asked later);
                for i, entry in enumerate(group):  # a lease aborted by the daemon keeps it
                    if replies is None:  # the daemon may have granted, and released it
                        self.claims.release(entry.piece.key, holder_name())  # on disconnect
                    elif replies[i] != LATER and replies[i][0] != "fill":
                        self.claims.release(entry.piece.key)
        client.count("lease_requests")
        if not self.fills.on_writer():  # the reader waited for it (a full queue)
            client.count("lease_waits", len(group))
            self.timed("lease_seconds", "lease_wait", asked, len(group))
        if replies is None:
            client.count("fallbacks", len(group))
            return 0
        done = 0
        try:
            for done, (entry, reply) in enumerate(zip(group, replies)):
                self._resolve(entry, reply, fills, later)
            done = len(group)
        finally:  # an entry raised: it and the rest end here
            held = {f.key for f in fills}
            for entry, reply in zip(group[done:], replies[done:]):
                key = entry.piece.key
                if reply[0] == "fill" and key not in held:
                    client.abort(key, "error")
                elif reply == LATER and claimed and not any(e is entry for e in later):
                    self.claims.release(key)
        return sum(reply[0] == "fill" for reply in replies)

    def _resolve(self, entry: Adopted, reply: tuple, fills: list[Fill],
                 later: list[Adopted]) -> None:
        client = self.client
        piece = entry.piece
        kind = reply[0]
        if kind == "fill":
            try:
                tier = None if entry.dropped() else self.tier_named(reply[1])
            except Exception:  # a bug: this block's lease ends, the batch goes on
                log.exception("cachemw: adopting block %s", piece.key)
                tier = None
            if tier is None:
                client.abort(piece.key, "error")
                client.count("bypassed")
            else:
                client.count("misses")
                fills.append(Fill(piece.key, tier, entry.data, url_tag(piece.meta.url),
                                  client.link(), reply[2]))
        elif kind == "present" and not self._tier_has(reply[1], piece.key):
            client.drop(piece.key, "missing")  # indexed but gone: let it be filled again
            client.count("bypassed")
        elif kind in ("present", "data") or reply == ("nofill", "busy"):  # another's fill
            client.count("misses")
            client.count(entry.duplicates)
        elif reply == LATER:
            later.append(entry)
        else:
            client.count("fallbacks" if kind == "fallback" else "bypassed")

    def _tier_has(self, tier_name: str, key: str) -> bool:
        tier = self.tier_named(tier_name)
        return tier is not None and tier.contains(key)
