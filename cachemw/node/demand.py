"""Reads waiting on a block count as reads of it when the placement engine decides whether
to keep it; and the batch of leases a reader waits on (``lease_many``), whose reads they
are. A mixin of NodeCache (cache.py): it works on the node's placer, leases and lock.

Why: of the processes of a node that miss one block at once, one fetches it (its claim's
holder) and asks for its lease afterwards; the others' leases wait here meanwhile. The
engine hears of a read when its lease is decided, so it used to see only the holder's:
on a full tier its admission gate (history: a block enters only if read more often than
what it would displace) refused a block read once, the holder's claim ended with nothing
cached, and each waiter in turn took the claim, was refused or admitted on its own read,
and read the source itself: 8 processes reading one cold file fetched it 4 times. Now the
decision hears the waiting reads too (each once: a waiter's later hit or miss of it is not
told again), and the block is fetched once whenever the engine keeps it on the reads that
were made of it.
"""
from __future__ import annotations

import time
from collections import OrderedDict

#: at most this many of a block's waiting reads are told ahead, and told-ahead counts of
#: this many blocks kept (the oldest forgotten first): a bound on memory, not a policy
MOST_TOLD = 64
KEPT = 4096


class WaitingReads:
    def lease_many(self, items: list[tuple], conn: object) -> list[tuple]:
        """Leases for many blocks at once: (key, length, url, source) each.

        Blocks owned by another node (and not replicated here) are fetched from their
        owners, one call per owner, and answered ("data", bytes) or ("fallback", why).
        They are asked for before any lease here is taken: a batch that held its node's
        leases while it waited on an owner could wait on a batch of the owner's that held
        the owner's leases and waited on us (readers on two nodes missing one multi-block
        file at once), and each owner's serve then waited out its lease wait and answered
        nothing (review nodes6: 3 s stalls).

        The batch waits on other processes' fetches (claims, fills in flight) for
        ``lease_wait`` in all, not per block: a holder that makes no progress (a stopped
        process holding a file's claims) costs its waiters that once, after which they are
        answered ("nofill", "busy") and fetch the rest themselves.
        """
        replies: list = [None] * len(items)
        local = [i for i, (key, _, _, source) in enumerate(items)
                 if self.remote is None or source is None or not self.remote.is_remote(key)]
        self._want([items[i][0] for i in local])  # each a read waiting from now on
        asked = 0
        try:
            self._ask_owners(items, set(local), replies)
            deadline = time.monotonic() + self.lease_wait
            for i in local:
                key, length, url, _ = items[i]
                replies[i] = self.lease(key, length, url, conn, wanted=True,
                                        wait=max(1e-3, deadline - time.monotonic()))
                self._unwant(key)
                asked += 1
        finally:  # the leases not answered (one raised): no longer waiting
            for i in local[asked:]:
                self._unwant(items[i][0])
        return replies

    def _ask_owners(self, items: list[tuple], local: set[int], replies: list) -> None:
        """Answer the items not in ``local`` (owned elsewhere): a copy held here, or the
        owner's reply."""
        remote_items, remote_at = [], []
        for i, item in enumerate(items):
            if i in local:
                continue
            with self._lock:
                entry = self._index.get(item[0])
            if entry is not None:
                replies[i] = ("present", entry.tier)
            else:
                remote_items.append(item)
                remote_at.append(i)
        if remote_items:
            for i, reply in zip(remote_at, self.remote.fetch(remote_items)):
                replies[i] = reply

    def _init_waiting_reads(self) -> None:
        self._waiting: dict[str, int] = {}  # key -> leases of this daemon waiting for it
        # key -> (reads told the engine ahead of their own lease or hit report, until when)
        self._told_ahead: OrderedDict[str, tuple[int, float, bool]] = OrderedDict()

    def _want(self, keys: list[str]) -> None:
        """A batch's leases are asked: each is a read waiting on its block until answered
        (``_unwant``), counted from the batch's start, since its leases are decided one
        after another and a later one's block may be decided while an earlier one waits."""
        with self._lock:
            for key in keys:
                self._waiting[key] = self._waiting.get(key, 0) + 1

    def _unwant(self, key: str) -> None:
        with self._lock:
            n = self._waiting.get(key, 0) - 1
            if n > 0:
                self._waiting[key] = n
            else:
                self._waiting.pop(key, None)

    def _decide_miss(self, key: str, nbytes: int, waiting: bool) -> tuple[str | None, list]:
        """The engine's decision on a miss of ``key`` (under the node's lock): (tier to
        admit it into or None, moves to run first). Refused on this read alone, it is
        asked again for each other read waiting on the block, until admitted. ``waiting``:
        this lease is one of those (counted by ``_want``). A read told ahead of its own
        lease is not told again: refused then, it is refused now."""
        told = self._take_told(key)
        if told == "refused":
            return None, []
        # (told and admitted: the fill it was decided for did not land; asked again)
        tier, moves = self.placer.miss(key, nbytes)
        others = min(MOST_TOLD, self._waiting.get(key, 0) - int(waiting))
        ahead = 0
        while tier is None and ahead < others:
            tier, more = self.placer.miss(key, nbytes)
            moves.extend(more)
            ahead += 1
        if ahead:
            until = time.monotonic() + 2 * self.lease_wait  # the waiters' reads come by then
            self._told_ahead[key] = (ahead, until, tier is not None)
            self._told_ahead.move_to_end(key)
            while len(self._told_ahead) > KEPT:
                self._told_ahead.popitem(last=False)
        return tier, moves

    def _take_told(self, key: str) -> str | None:
        """One read of ``key`` told the engine ahead (under the node's lock), used up:
        "admitted" or "refused", what the engine decided then; None if none was."""
        told = self._told_ahead.get(key)
        if told is None:
            return None
        n, until, admitted = told
        if until < time.monotonic():
            del self._told_ahead[key]
            return None
        if n > 1:
            self._told_ahead[key] = (n - 1, until, admitted)
        else:
            del self._told_ahead[key]
        return "admitted" if admitted else "refused"

    def _hits_to_tell(self, keys: list[str]) -> list[str]:
        """The reported hits the engine has not heard of yet (a waiting read told ahead
        is reported as a hit once its block has landed)."""
        with self._lock:
            return [key for key in keys if not self._take_told(key)]
