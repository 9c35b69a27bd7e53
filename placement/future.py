"""Policies that know the future: clairvoyant (announced order) and Belady's MIN (offline).

Both evict the cached block whose next read is furthest away, and do not admit a missed
block whose own next read is further than that of every block it would displace (MIN with
bypass). With blocks of equal size this is Belady's optimum: no policy has fewer misses on
the same trace. With blocks of different sizes minimising misses (or missed bytes) is
NP-hard, and MIN is the standard reference used for scoring, not a bound: another policy
can score slightly above it (pin and history on the unet3d and resnet50 workloads).

* ``BeladyPolicy`` gets the whole trace up front (``prepare``) and precomputes, for every
  position, the position of the same key's next read: O(n) time and memory, then
  O(log n) per access. It is only for scoring: a real system never knows all of the future.
* ``ClairvoyantPolicy`` gets the future as a sampler announces it (``announce``), e.g. one
  epoch at a time, as NoPFS derives it from the shuffle seed. Blocks with no announced next
  read rank after all announced ones; among them the older entry goes first, and a missed
  block without an announced next read never displaces another (so between announcements
  it keeps a stable subset, which is optimal under uniform reshuffles).
"""
from __future__ import annotations

import heapq
from bisect import insort
from collections import deque
from typing import Deque, Dict, Hashable, List, Optional, Sequence, Tuple

from .policies import Policy, pop_victims

#: Next-use value of a block that is never read again (or not within the announced order).
NEVER = 1 << 62
#: The next use of a cached block whose announced read was missed (its place fell well
#: behind the cursor unread: the order abandoned, or its reader gone): evicted before any
#: other, also for a newcomer read NEVER again (ClairvoyantPolicy.forget_before).
EXPIRED = NEVER + 1


def next_uses(keys: Sequence[Hashable]) -> List[int]:
    """For each position ``i``, the next position ``j > i`` with ``keys[j] == keys[i]``,
    or NEVER. One backward pass."""
    out = [NEVER] * len(keys)
    last: Dict[Hashable, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        k = keys[i]
        out[i] = last.get(k, NEVER)
        last[k] = i
    return out


class FurthestFirst(Policy):
    """Cache state shared by the two: cached key -> next use, and a max-heap on next use.

    Heap entries are ``(-next_use, seq, key)``; an entry is live iff ``self.next[key]`` still
    equals its next use and its ``seq`` matches (stale entries are skipped when popped).
    """

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self.next: Dict[Hashable, int] = {}
        self._seqs: Dict[Hashable, int] = {}
        self._heap: list = []
        self._seq = 0
        # bytes of cached keys with no known next read: kept as a running sum because the
        # daemon asks for it on every prefetch pass (a scan is O(cached blocks))
        self.dead_bytes = 0

    def set_next_use(self, key: Hashable, nu: int) -> None:
        """Record that cached ``key`` is next read at position ``nu`` (NEVER if unknown)."""
        old = self.next.get(key)
        if (old is not None and old >= NEVER) != (nu >= NEVER):
            size = self.sizes.get(key, 0)
            self.dead_bytes += size if nu >= NEVER else -size
        self._seq += 1
        self.next[key] = nu
        self._seqs[key] = self._seq
        heapq.heappush(self._heap, (-nu, self._seq, key))
        if len(self._heap) > 4 * len(self.sizes) + 64:
            seqs, nxt = self._seqs, self.next
            self._heap = [(-nxt[k], seqs[k], k) for k in self.sizes]
            heapq.heapify(self._heap)

    def _place(self, key: Hashable, size: int, nu: int, hit: bool) -> bool:
        """Update the cache for one read whose key is next needed at ``nu``."""
        if hit:
            self.set_next_use(key, nu)
            return True
        self._insert(key, size, nu)
        return False

    def _insert(self, key: Hashable, size: int, nu: int) -> bool:
        """Cache ``key`` (next read at ``nu``) if blocks needed after ``nu`` make room."""
        if size > self.capacity:
            return False
        need = self.used + size - self.capacity
        if need > 0 and not self._make_room(need, nu):
            return False
        self.sizes[key] = size
        self.used += size
        self.set_next_use(key, nu)
        return True

    def admit_ahead(self, key: Hashable, size: int, pos: int) -> bool:
        """Prefetch: cache ``key`` before its read at announced position ``pos``, evicting
        only blocks needed after ``pos``. True if it is cached now."""
        return key in self.sizes or self._insert(key, size, pos)

    def _make_room(self, need: int, nu: int) -> bool:
        # A victim must be needed strictly later than the newcomer, else bypass the newcomer.
        return self._evict_all(
            pop_victims(self._heap, self._seqs, self.sizes, need, lambda e: -e[0] > nu))

    def discard(self, key: Hashable) -> None:
        if key in self.sizes and self.next.get(key, 0) >= NEVER:
            self.dead_bytes -= self.sizes[key]
        super().discard(key)

    def _forget(self, key: Hashable) -> None:
        del self._seqs[key], self.next[key]


class BeladyPolicy(FurthestFirst):
    """Belady's MIN with bypass; needs the whole trace through :meth:`prepare`."""

    name = "belady"
    needs_future = True

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self._nu: List[int] = []
        self._pos = 0

    def prepare(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> None:
        self._nu = next_uses(keys)
        self._pos = 0

    def access(self, key: Hashable, size: int) -> bool:
        pos = self._pos
        if pos >= len(self._nu):
            raise ValueError("trace is longer than the one given to prepare()")
        self._pos = pos + 1
        return self._place(key, size, self._nu[pos], key in self.sizes)


class ClairvoyantPolicy(FurthestFirst):
    """Furthest-next-use over the announced order (NoPFS-style), for a live system.

    The announced order is a stream of keys; the cursor counts the node's reads, and the
    next one is expected at announced position ``cursor``. Reads out of order (several
    loader workers, hits reported late) are tolerated: the key's places the cursor has
    passed are dropped, and a read up to ``slack`` positions early consumes its place; one
    further ahead consumes none. A key's next use is the first of its places not behind
    the cursor.

    A read of a key with no place left in the order (a file outside it, a read
    made before the order that reaches the daemon after it, another process's reads) does
    not move the cursor while announced reads are ahead. Were it to take the next
    position, that position's block would count as read already and never be prefetched,
    and each position behind it would be expected one read early. Only when ``slack`` such
    reads come in a row is the order taken as abandoned (its reader gone, or reading
    another order than it announced): the cursor then moves with every read again, as it
    does with no order ahead, so the announced blocks' places run out instead of holding
    the cache for reads that will not come. An order whose reader stops partway and
    announces its next one is told apart only if the next one says so (:meth:`withdraw`,
    Engine.announce's ``replace``): else the next order's places come after the rest.
    """

    name = "clairvoyant"
    uses_announced = True
    #: How many positions early a read may come and still consume its announced position.
    slack = 1024

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self._future: Dict[Hashable, Deque[int]] = {}
        self._announced = 0
        self._cursor = 0
        self._strays = 0  # reads in a row outside the order while it was ahead

    @property
    def announced_until(self) -> int:
        """Number of accesses announced so far (positions ``0 .. announced_until - 1``)."""
        return self._announced

    @property
    def cursor(self) -> int:
        """The announced position the next read is expected at: the node's reads, less
        those of keys with no place in an order while it was ahead (see the class)."""
        return self._cursor

    def announce(self, keys: Sequence[Hashable],
                 positions: Optional[Sequence[int]] = None) -> None:
        """``keys`` read next, in order: after everything announced so far, or at the
        given ``positions`` (ascending: the orders of several ranks of one node, laid out
        as they will be read, see Engine.announce)."""
        future, nxt, cursor = self._future, self.next, self._cursor
        if positions is None:
            start = max(self._announced, cursor)  # an order announced late starts now
            positions = range(start, start + len(keys))
        elif len(positions) != len(keys):
            raise ValueError(f"{len(keys)} keys, {len(positions)} positions")
        last = None
        for key, pos in zip(keys, positions):
            if last is not None and pos <= last:
                raise ValueError(f"positions must ascend: {pos} after {last}")
            last = pos
            q = future.get(key)
            if q is None:
                q = future[key] = deque()
            if q and q[-1] > pos:  # before a place announced already (another rank's)
                insort(q, pos)
            else:
                q.append(pos)
            nu = self.next_use(key)
            if key in nxt and nu < NEVER and nxt[key] != nu:
                self.set_next_use(key, nu)  # a cached block: its next read is known now
        if last is not None:
            self._announced = max(self._announced, last + 1)

    def withdraw(self, places: Sequence[Tuple[Hashable, int]], until: int) -> None:
        """Announced reads that will not be made, (key, position) each (their reader
        stopped its epoch early and announces the next); the places left end before
        ``until`` (at least the cursor), where the next order is laid. A cached block whose
        next read was one of them gets its next one left, or none: EXPIRED, the first to
        make room (a withdrawn dead order's blocks held the tier as NEVER, diffrev-12)."""
        future, nxt = self._future, self.next
        for key, pos in places:
            q = future.get(key)
            if q is None:
                continue
            try:
                q.remove(pos)
            except ValueError:  # read (or dropped) already
                pass
            nu = self.next_use(key)
            if not q:
                del future[key]
                nu = EXPIRED  # its reader will not read it (until announced again)
            if key in nxt and nxt[key] != nu:
                self.set_next_use(key, nu)
        self._announced = max(until, self._cursor)
        self._strays = 0

    def next_use(self, key: Hashable) -> int:
        """Announced position of ``key``'s next read at or after the cursor, or NEVER."""
        q = self._future.get(key)
        cursor = self._cursor
        while q and q[0] < cursor:
            q.popleft()
        return q[0] if q else NEVER

    def forget_before(self, key: Hashable, pos: int) -> None:
        """Forget ``key``'s places before ``pos``, and the key with them if it has no other
        (Engine.prefetch, for places well behind the cursor: a key announced and never
        read, as a file's old version after it changed, is not kept for the daemon's
        lifetime). A cached block whose next read was one of them is EXPIRED: the first
        to go, even for a block read NEVER again. Counted as NEVER, the blocks of an order
        announced and never read (prefetched, their places run out) held the tier for
        good, as Belady's rule keeps a block against a newcomer needed no sooner, and a
        trainer that announced nothing was never admitted again (review announce2: 0 hits
        in 1,800 reads of a working set of 150 blocks)."""
        q = self._future.get(key)
        if q is None:
            return
        while q and q[0] < pos:
            q.popleft()
        if not q:
            del self._future[key]
        if self.next.get(key, NEVER) < pos:  # cached, and its announced read never came
            self.set_next_use(key, q[0] if q else EXPIRED)

    def access(self, key: Hashable, size: int) -> bool:
        q = self._future.get(key)
        cursor = self._cursor
        in_order = bool(q)  # a place of its own ahead, however far, or behind
        if q:
            while q and q[0] < cursor:
                q.popleft()  # announced reads that did not happen where expected
            if q and q[0] <= cursor + self.slack:
                q.popleft()  # this read consumes its announced position
            nu = q[0] if q else NEVER
            if not q:
                del self._future[key]
        else:
            nu = NEVER
        if in_order or cursor >= self._announced:
            self._strays = 0
            self._cursor = cursor + 1
        elif self._strays >= self.slack:  # the order is abandoned: its places run out
            self._cursor = cursor + 1
        else:
            self._strays += 1
        return self._place(key, size, nu, key in self.sizes)
