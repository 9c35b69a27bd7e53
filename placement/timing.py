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

The lower bound on stall for a trace and capacity (see :func:`stall_lower_bound`): the bytes
that must come from the source (Belady's misses; with blocks of different sizes Belady's MIN
is a reference, not the least a policy can miss, so this "bound" is approximate), minus what compute time can hide -- and compute
cannot hide a first read it has not reached yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List

from .future import FurthestFirst, next_uses
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
    """Least possible stall, given the fewest misses/bytes any policy has on this trace.

    Two bounds, the larger wins. Total: the source works at most during stalls and the first
    ``n_batches - 1`` steps, so ``stall >= source_time(min_misses, min_bytes) - (n_batches -
    1) * compute``. Prefix: batch ``j`` cannot start before every block first read in
    batches ``0..j`` has come from the source, so ``stall >= source_time(those first reads)
    - j * compute`` for every ``j`` (compute cannot hide fetches it has not yet reached).
    """
    src, B, tc = model.source, model.batch_size, model.compute_per_batch
    n_batches = -(-len(keys) // B)
    total = min_bytes / src.bandwidth + min_misses * src.latency / src.concurrency
    best = total - (n_batches - 1) * tc
    seen = set()
    first_reads = 0.0
    for j, lo in enumerate(range(0, len(keys), B)):
        for key, size in zip(keys[lo : lo + B], sizes[lo : lo + B]):
            if key not in seen:
                seen.add(key)
                first_reads += src.service_time(size)
        best = max(best, first_reads - j * tc)
    return max(best, 0.0)


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


class _PrefetchCache(FurthestFirst):
    """The clairvoyant cache state (next use per block) plus when each block's fetch ends."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.reset(capacity)
        self.ready: Dict[Hashable, float] = {}

    def _forget(self, key: Hashable) -> None:
        super()._forget(key)
        self.ready.pop(key, None)


def _prefetch_replay(keys: List[Hashable], sizes: List[int], capacity: int, model: TimeModel) -> TimeStats:
    src_cost, cache_cost = model.source.service_time, model.cache.service_time
    B, D, tc = model.batch_size, model.prefetch_depth, model.compute_per_batch
    n = len(keys)
    nxt = next_uses(keys)
    cache = _PrefetchCache(capacity)
    fetches = from_source = 0
    src_free = cache_free = end_prev = stall = last_event = 0.0
    starts: List[float] = []
    budget = model.prefetch_budget(capacity)
    pending: Dict[int, int] = {}  # position -> size of blocks fetched for it, not yet read
    pending_bytes = 0
    p = 0  # next position the prefetcher looks at
    for b, lo in enumerate(range(0, n, B)):
        hi = min(n, lo + B)
        issue = starts[b - D] if b >= D else 0.0
        t_batch = None  # when the trainer can start batch b, once all its blocks are fetched
        while True:
            if p < n and keys[p] in cache.sizes:
                p += 1
                continue
            if t_batch is None and p >= hi:  # blocks of batch b stay cached until read
                ready = issue
                for key, size in zip(keys[lo:hi], sizes[lo:hi]):
                    cache_free = max(cache_free, issue, cache.ready[key]) + cache_cost(size)
                    ready = max(ready, cache_free)
                t_batch = max(ready, end_prev)
            start = max(src_free, last_event)
            if (
                p < n
                and (t_batch is None or start <= t_batch)
                and (p < hi or pending_bytes + sizes[p] <= budget)
                and cache.admit_ahead(keys[p], sizes[p], p)
            ):
                key, size = keys[p], sizes[p]
                src_free = start + src_cost(size)
                cache.ready[key] = src_free
                fetches += 1
                from_source += size
                pending[p] = size
                pending_bytes += size
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
            if i in pending:
                pending_bytes -= pending.pop(i)
            if cache.next.get(key) == i:
                cache.set_next_use(key, nxt[i])
    compute = len(starts) * tc
    hits = n - fetches
    bytes_hit = sum(sizes) - from_source
    return TimeStats(hits, bytes_hit, fetches, from_source, len(cache.evicted), stall, compute, end_prev)
