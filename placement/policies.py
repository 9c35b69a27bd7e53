"""Online policies that see only the past: LRU, pin and history.

Every policy manages one cache of ``capacity`` bytes and answers one question per access:
was it a hit, and if not, does the block go in (and what leaves)? Victims are appended to
``policy.evicted`` so a caller that needs them (the Engine) can drain the list; the
simulator just clears it. A policy never does I/O and is deterministic: ties are broken by
access order, never by Python's salted ``hash()``.

Why these three:

* ``LRUPolicy`` is the baseline most caches ship, and the worst choice under shuffled epochs:
  when the cache is smaller than the dataset, each epoch's random order evicts a block just
  before it would be read again.
* ``PinPolicy`` admits until full and then never evicts (CoorDL's MinIO). Under uniform
  reshuffles every block's next access is equally far away, so a stable subset is optimal.
* ``HistoryPolicy`` is the default for unknown futures: frequency with aging plus an
  admission gate. A missed block enters only if it was read strictly more often than every
  block it would displace. Under epoch reshuffles all blocks tie, nothing is admitted once
  the cache is full, and the policy becomes pin (the optimum there); under skewed access
  (Zipf) it keeps the most frequent blocks, which recency alone does not.
"""
from __future__ import annotations

import copy
import heapq
from collections import OrderedDict
from typing import Callable, Dict, Hashable, List, Optional, Sequence

from .specs import check_positive_float, check_positive_int


def pop_victims(
    heap: list, live: Dict[Hashable, int], sizes: Dict[Hashable, int], need: int,
    evictable: Callable[[tuple], bool],
) -> Optional[List[Hashable]]:
    """Pop the best victims off a lazy heap until their sizes add up to ``need`` bytes.

    Heap entries are ``(score, seq, key)``; an entry is live iff ``live[key] == seq`` (stale
    ones are dropped as met). Every victim must pass ``evictable(entry)``; if one does not,
    or the heap runs out, all popped live entries go back and the answer is None (nothing is
    evicted). The caller removes the returned keys from its cache.
    """
    taken = []
    while need > 0 and heap:
        entry = heapq.heappop(heap)
        if live.get(entry[2]) != entry[1]:
            continue  # stale: the block was read again or dropped since this entry
        if not evictable(entry):
            heap_push_all(heap, taken + [entry])
            return None
        taken.append(entry)
        need -= sizes[entry[2]]
    if need > 0:
        heap_push_all(heap, taken)
        return None
    return [entry[2] for entry in taken]


def heap_push_all(heap: list, entries: list) -> None:
    for entry in entries:
        heapq.heappush(heap, entry)


class Policy:
    """Base class: a byte-bounded cache with a replacement rule.

    Subclasses implement :meth:`access` and :meth:`discard` and keep ``self.sizes`` (the
    cached keys and their sizes) and ``self.used`` exact.
    """

    name = "policy"
    #: True for policies that must be given the future (Belady); the simulator feeds it.
    needs_future = False
    #: True for policies that use an announced order if there is one (clairvoyant).
    uses_announced = False

    def __init__(self) -> None:
        self.capacity = 0
        self.used = 0
        self.sizes: Dict[Hashable, int] = {}
        self.evicted: List[Hashable] = []

    def reset(self, capacity: int) -> None:
        """Empty the cache and set its capacity in bytes."""
        self.capacity = check_positive_int("capacity_bytes", capacity, allow_zero=True)
        self.used = 0
        self.sizes = {}
        self.evicted = []

    def spawn(self) -> "Policy":
        """A fresh, independent copy (one per node in multi-node simulations)."""
        return copy.deepcopy(self)

    def prepare(self, keys: Sequence[Hashable], sizes: Sequence[int]) -> None:
        """Receive the whole future (offline policies only); online policies ignore it."""

    def announce(self, keys: Sequence[Hashable]) -> None:
        """Receive the next part of the announced access order (clairvoyant only)."""

    def access(self, key: Hashable, size: int) -> bool:
        """Record one read of ``key``; return True on a hit. May admit and evict."""
        raise NotImplementedError

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` as cached (the executor dropped it, e.g. a failed checksum)."""
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used -= size
            self._forget(key)

    def _forget(self, key: Hashable) -> None:
        """Drop per-key bookkeeping of a block that left the cache (subclass hook)."""

    def _evict_all(self, victims: List[Hashable] | None) -> bool:
        """Evict the victims pop_victims chose; False if it found no way to make room."""
        if victims is None:
            return False
        for victim in victims:
            self.discard(victim)
            self.evicted.append(victim)
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self.sizes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, used={self.used})"


class LRUPolicy(Policy):
    """Least recently used: admit every miss, evict the block read longest ago."""

    name = "lru"

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self.sizes = OrderedDict()

    def access(self, key: Hashable, size: int) -> bool:
        sizes = self.sizes
        if key in sizes:
            sizes.move_to_end(key)
            return True
        if size > self.capacity:
            return False
        used = self.used + size
        while used > self.capacity:
            victim, vsize = sizes.popitem(last=False)
            used -= vsize
            self.evicted.append(victim)
        sizes[key] = size
        self.used = used
        return False


class PinPolicy(Policy):
    """Admit until full, then never evict (CoorDL's MinIO)."""

    name = "pin"

    def access(self, key: Hashable, size: int) -> bool:
        if key in self.sizes:
            return True
        if self.used + size <= self.capacity:
            self.sizes[key] = size
            self.used += size
        return False


class HistoryPolicy(Policy):
    """Frequency with aging and a strict admission gate (for unknown futures).

    State: a read count per key (exact, not a sketch: deterministic and the key set of a
    training dataset fits in memory), halved every ``aging_window`` reads so the policy
    follows popularity shifts; halving keeps equal counts equal, which is what makes epoch
    reshuffles degrade to pin rather than to churn. Victim order: lowest count, then least
    recently read. Admission of a missed block when space is short: only if its count before
    this read is greater than ``admit_ratio`` times each victim's count.

    Why a ratio and not plain ``>`` (TinyLFU's rule): under shuffled epochs counts differ by
    one or two only because of where in the current pass each block happens to be (and a
    block already read this pass is the one *least* likely to be read soon); real skew, as in
    Zipf, differs by multiples. With two jobs reading one dataset, plain ``>`` churns and
    gets 0.32 where pin gets 0.45; with ``admit_ratio=2`` history gets pin's 0.45 and loses
    nothing on Zipf (see docs/benchmarks-placement.md).

    ``aging_window=None`` picks ``20 x`` the number of cached blocks (at least 1,024), of the
    order TinyLFU uses for its reset period.
    """

    name = "history"

    def __init__(self, aging_window: Optional[int] = None, admit_ratio: float = 2.0) -> None:
        super().__init__()
        if aging_window is not None:
            check_positive_int("aging_window", aging_window)
        self.aging_window = aging_window
        self.admit_ratio = check_positive_float("admit_ratio", admit_ratio)
        self.reset(0)

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self.counts: Dict[Hashable, int] = {}
        self._stamp: Dict[Hashable, int] = {}  # cached key -> seq of its live heap entry
        self._heap: list = []  # (count, seq, key); seq is unique so keys are never compared
        self._seq = 0
        self._reads = 0

    def _window(self) -> int:
        if self.aging_window is not None:
            return self.aging_window
        return max(1024, 20 * len(self.sizes))

    def _age(self) -> None:
        counts = self.counts
        for key in list(counts):
            c = counts[key] >> 1
            if c or key in self.sizes:
                counts[key] = c
            else:
                del counts[key]
        self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        stamp = self._stamp
        heap = [(self.counts.get(k, 0), stamp[k], k) for k in self.sizes]
        heapq.heapify(heap)
        self._heap = heap

    def _push(self, key: Hashable, count: int) -> None:
        self._seq += 1
        self._stamp[key] = self._seq
        heapq.heappush(self._heap, (count, self._seq, key))
        if len(self._heap) > 4 * len(self.sizes) + 64:
            self._rebuild_heap()

    def access(self, key: Hashable, size: int) -> bool:
        self._reads += 1
        if self._reads >= self._window():
            self._reads = 0
            self._age()
        counts = self.counts
        prior = counts.get(key, 0)
        counts[key] = prior + 1
        if key in self.sizes:
            self._push(key, prior + 1)
            return True
        if size > self.capacity:
            return False
        need = self.used + size - self.capacity
        if need > 0 and not self._make_room(need, prior):
            return False
        self.sizes[key] = size
        self.used += size
        self._push(key, prior + 1)
        return False

    def _make_room(self, need: int, prior: int) -> bool:
        """Evict lowest-count blocks worth ``need`` bytes if ``prior`` beats each of them."""
        bar = prior / self.admit_ratio
        return self._evict_all(
            pop_victims(self._heap, self._stamp, self.sizes, need, lambda e: e[0] < bar))

    def _forget(self, key: Hashable) -> None:
        self._stamp.pop(key, None)
