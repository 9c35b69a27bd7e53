"""Time model: turn a replay into trainer stall time.

Why: hit ratio is not what users pay for; idle accelerators are. Two pipelines are modelled
(parameters in :class:`~cachemw.placement.specs.TimeModel`):

* Demand loading (every policy but clairvoyant): a DataLoader-like loader starts batch ``b``
  when the trainer takes batch ``b - prefetch_depth``; each access asks the policy, a hit is
  read from the cache channel and a miss from the source channel (FIFO channels, one
  request costs ``TierSpec.service_time``). The trainer starts a batch when it is loaded and
  the previous step is done.
* Clairvoyant prefetch (the order is announced): the source channel never waits for the
  trainer. It walks the announced order and fetches every block not cached, as far ahead as
  the cache allows, never evicting a block needed no later than the one it brings in (the
  victim is the block needed furthest in the future). The trainer reads from the cache.

The lower bound on stall for a trace and capacity: the trainer cannot start its last step
before every byte it needs has come from the source, and the source can only work during
stalls and the first ``n_batches - 1`` steps. The least source time is that of Belady's
misses, so ``stall >= source_time(Belady) - (n_batches - 1) * compute_per_batch``; and no
step starts before the first batch is read: ``stall >= source_time(first batch)``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable, List

from .future import next_uses
from .policies import Policy
from .specs import TimeModel


@dataclass(frozen=True)
class TimeStats:
    """What a timed replay measured (seconds, counts, bytes)."""

    hits: int
    bytes_hit: int
    fetches: int
    bytes_from_source: int
    evictions: int
    stall_s: float
    compute_s: float
    total_s: float


def stall_lower_bound(
    keys: List[Hashable], sizes: List[int], min_misses: int, min_bytes: int, model: TimeModel
) -> float:
    """Least possible stall, given the fewest misses/bytes any policy has on this trace."""
    src = model.source
    n_batches = -(-len(keys) // model.batch_size)
    source_time = min_bytes / src.bandwidth + min_misses * src.latency / src.concurrency
    first = {}
    for key, size in zip(keys[: model.batch_size], sizes[: model.batch_size]):
        first[key] = size
    first_time = sum(src.service_time(s) for s in first.values())
    return max(first_time, source_time - (n_batches - 1) * model.compute_per_batch, 0.0)


def time_replay(
    policy: Policy, keys: List[Hashable], sizes: List[int], capacity: int, model: TimeModel
) -> TimeStats:
    """Replay one node's accesses through ``policy`` under ``model`` (policy already reset)."""
    if policy.uses_announced:
        return _prefetch_replay(keys, sizes, capacity, model)
    return _demand_replay(policy, keys, sizes, model)


def _demand_replay(policy: Policy, keys: List[Hashable], sizes: List[int], model: TimeModel) -> TimeStats:
    src_cost, cache_cost = model.source.service_time, model.cache.service_time
    B, D, tc = model.batch_size, model.prefetch_depth, model.compute_per_batch
    access, evicted = policy.access, policy.evicted
    hits = bytes_hit = fetches = from_source = evictions = 0
    src_free = cache_free = end_prev = stall = 0.0
    starts: List[float] = []
    for b, lo in enumerate(range(0, len(keys), B)):
        issue = starts[b - D] if b >= D else 0.0
        ready = issue
        for key, size in zip(keys[lo : lo + B], sizes[lo : lo + B]):
            if access(key, size):
                hits += 1
                bytes_hit += size
                cache_free = max(cache_free, issue) + cache_cost(size)
                ready = max(ready, cache_free)
            else:
                fetches += 1
                from_source += size
                src_free = max(src_free, issue) + src_cost(size)
                ready = max(ready, src_free)
                if evicted:
                    evictions += len(evicted)
                    evicted.clear()
        start = max(ready, end_prev)
        stall += start - end_prev
        starts.append(start)
        end_prev = start + tc
    compute = len(starts) * tc
    return TimeStats(hits, bytes_hit, fetches, from_source, evictions, stall, compute, end_prev)


class _PrefetchCache:
    """Cached key -> next needed position, with a lazy max-heap to find the furthest one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.size = {}
        self.next = {}
        self.ready = {}  # key -> time its fetch completes
        self.heap: list = []  # (-next use, seq, key); seq keeps ties in insertion order
        self.seq = 0
        self.seqs = {}  # key -> seq of its live heap entry
        self.evictions = 0

    def set_next(self, key: Hashable, nu: int) -> None:
        self.next[key] = nu
        self.seq += 1
        self.seqs[key] = self.seq
        heapq.heappush(self.heap, (-nu, self.seq, key))
        if len(self.heap) > 4 * len(self.size) + 64:
            self.heap = [(-self.next[k], self.seqs[k], k) for k in self.size]
            heapq.heapify(self.heap)

    def room_for(self, size: int, pos: int) -> bool:
        """Evict blocks needed after ``pos`` (furthest first) until ``size`` fits; False if
        the blocks needed no later than ``pos`` alone leave too little room."""
        heap, seqs = self.heap, self.seqs
        need = self.used + size - self.capacity
        taken = []
        while need > 0:
            while heap and seqs.get(heap[0][2]) != heap[0][1]:
                heapq.heappop(heap)  # stale entry
            if not heap or -heap[0][0] <= pos:
                for entry in taken:
                    heapq.heappush(heap, entry)
                return False
            entry = heapq.heappop(heap)
            taken.append(entry)
            need -= self.size[entry[2]]
        for _, _, victim in taken:
            del self.next[victim], self.ready[victim], seqs[victim]
            self.used -= self.size.pop(victim)
            self.evictions += 1
        return True


def _prefetch_replay(keys: List[Hashable], sizes: List[int], capacity: int, model: TimeModel) -> TimeStats:
    src_cost, cache_cost = model.source.service_time, model.cache.service_time
    B, D, tc = model.batch_size, model.prefetch_depth, model.compute_per_batch
    n = len(keys)
    nxt = next_uses(keys)
    cache = _PrefetchCache(capacity)
    fetches = from_source = 0
    src_free = cache_free = end_prev = stall = last_event = 0.0
    starts: List[float] = []
    p = 0  # next position the prefetcher looks at
    for b, lo in enumerate(range(0, n, B)):
        hi = min(n, lo + B)
        issue = starts[b - D] if b >= D else 0.0
        while True:
            if p < n and keys[p] in cache.size:
                p += 1
                continue
            t_batch = None
            if p >= hi:  # every block of batch b is cached or on its way
                ready = issue
                for key, size in zip(keys[lo:hi], sizes[lo:hi]):
                    cache_free = max(cache_free, issue, cache.ready[key]) + cache_cost(size)
                    ready = max(ready, cache_free)
                t_batch = max(ready, end_prev)
            start = max(src_free, last_event)
            if p < n and (t_batch is None or start <= t_batch) and cache.room_for(sizes[p], p):
                key, size = keys[p], sizes[p]
                src_free = start + src_cost(size)
                cache.size[key] = size
                cache.used += size
                cache.ready[key] = src_free
                cache.set_next(key, p)
                fetches += 1
                from_source += size
                p += 1
                continue
            if t_batch is None:
                raise ValueError(
                    f"capacity_bytes ({capacity}) cannot hold one batch of {B} accesses; "
                    "raise capacity_bytes or lower batch_size"
                )
            break
        stall += t_batch - end_prev
        starts.append(t_batch)
        end_prev = t_batch + tc
        last_event = t_batch
        for i in range(lo, hi):  # the trainer has read batch b: next uses move on
            key = keys[i]
            if cache.next.get(key) == i:
                cache.set_next(key, nxt[i])
    compute = len(starts) * tc
    hits = n - fetches
    bytes_hit = sum(sizes) - from_source
    return TimeStats(hits, bytes_hit, fetches, from_source, cache.evictions, stall, compute, end_prev)
