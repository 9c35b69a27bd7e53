"""Trace simulator: replay accesses through a policy and count hits, bytes and (optionally) time.

``simulate(trace, policy, capacity_bytes)`` is how every policy is scored: run it and
Belady's MIN on the same trace and compare. MIN is the optimum for blocks of equal size;
with sizes that vary it is a reference, which another policy can beat slightly. A trace is a sequence of ``(key, size_bytes)``
or ``(key, size_bytes, node)``; with nodes, each node has its own cache of
``capacity_bytes`` and its own policy instance, and sees only its own accesses (as a node
daemon does). The hot loop is a plain call per access, so a 1M-access trace replays in a
few seconds.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

from .policies import Policy
from .registry import make_policy
from .specs import TimeModel, check_positive_int
from .timing import TimeStats, stall_lower_bound, time_replay


@dataclass(frozen=True)
class SimResult:
    """Counts of one replay. Bytes are of the accesses (a hit of a 1 MiB block counts 1 MiB).

    ``bytes_from_source`` is what the source store served: the misses' bytes, plus the
    prefetches' bytes when a time model lets the clairvoyant policy prefetch (then each
    prefetch is counted as the miss it replaces). Time fields are None without a time model.
    """

    policy: str
    capacity_bytes: int
    nodes: int
    accesses: int
    hits: int
    misses: int
    bytes_total: int
    bytes_hit: int
    bytes_from_source: int
    evictions: int
    stall_s: Optional[float] = None
    compute_s: Optional[float] = None
    total_s: Optional[float] = None
    stall_lower_bound_s: Optional[float] = None

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def byte_hit_ratio(self) -> float:
        return self.bytes_hit / self.bytes_total if self.bytes_total else 0.0

    @property
    def miss_ratio(self) -> float:
        return 1.0 - self.hit_ratio if self.accesses else 0.0


TraceItem = Union[Tuple[Hashable, int], Tuple[Hashable, int, Hashable]]


def _as_size(i: int, size: object) -> int:
    """Accept numpy integers and other ``__index__`` types; reject bools, floats, strings."""
    if isinstance(size, bool):
        raise ValueError(f"trace[{i}] size must be a positive int, got {size!r}")
    try:
        return operator.index(size)
    except TypeError:
        raise ValueError(f"trace[{i}] size must be a positive int, got {size!r}") from None


def split_trace(trace: Sequence[TraceItem]) -> Dict[Hashable, Tuple[List, List[int]]]:
    """Check a trace and split it per node: ``{node: (keys, sizes)}`` in first-seen order.

    Raises ValueError naming ``trace`` for a malformed item or a size that is not a
    positive int.
    """
    if isinstance(trace, (str, bytes)) or not hasattr(trace, "__iter__"):
        raise ValueError(f"trace must be a sequence of (key, size[, node]) tuples, got {trace!r}")
    per_node: Dict[Hashable, Tuple[List, List[int]]] = {}
    current = None
    ck = cs = None
    for i, item in enumerate(trace):
        n = len(item) if isinstance(item, tuple) else -1
        if n == 2:
            key, size = item
            node = None
        elif n == 3:
            key, size, node = item
        else:
            raise ValueError(f"trace[{i}] must be a (key, size) or (key, size, node) tuple, got {item!r}")
        if size.__class__ is not int:
            size = _as_size(i, size)
        if size <= 0:
            raise ValueError(f"trace[{i}] size must be a positive int, got {size!r}")
        if node != current or ck is None:
            pair = per_node.get(node)
            if pair is None:
                pair = per_node[node] = ([], [])
            ck, cs = pair
            current = node
        ck.append(key)
        cs.append(size)
    return per_node


def _replay(policy: Policy, keys: List, sizes: List[int], horizon: Optional[int]) -> Tuple[int, int, int]:
    """Hits, hit bytes, evictions of one node's accesses."""
    access = policy.access
    evicted = policy.evicted
    hits = bytes_hit = evictions = 0
    if policy.uses_announced:
        step = horizon or len(keys) or 1
    else:
        step = len(keys) or 1
    for lo in range(0, len(keys), step):
        hi = lo + step
        if policy.uses_announced:
            policy.announce(keys[lo:hi])
        for key, size in zip(keys[lo:hi], sizes[lo:hi]):
            if access(key, size):
                hits += 1
                bytes_hit += size
            elif evicted:
                evictions += len(evicted)
                evicted.clear()
    return hits, bytes_hit, evictions


def simulate(
    trace: Sequence[TraceItem],
    policy: Union[str, Policy, None],
    capacity_bytes: int,
    *,
    announced: bool = False,
    horizon: Optional[int] = None,
    time_model: Optional[TimeModel] = None,
) -> SimResult:
    """Replay ``trace`` through ``policy`` with a cache of ``capacity_bytes`` per node.

    ``policy``: "lru", "history", "pin", "clairvoyant", "belady", a Policy object (copied per
    node, never mutated) or None for the default ("clairvoyant" if ``announced`` else
    "history"). A clairvoyant policy is told the order ``horizon`` accesses at a time (None:
    all of it at the start; an epoch's length models a sampler that announces each epoch);
    Belady always sees the whole trace.

    ``time_model`` (single-node traces only) also computes stall and compute time, and the
    stall lower bound set by the source's bandwidth for this trace and capacity.
    """
    capacity_bytes = check_positive_int("capacity_bytes", capacity_bytes, allow_zero=True)
    if horizon is not None:
        check_positive_int("horizon", horizon)
    if time_model is not None and not isinstance(time_model, TimeModel):
        raise ValueError(f"time_model must be a TimeModel or None, got {time_model!r}")
    template = make_policy(policy, announced=announced)
    per_node = split_trace(trace)
    if time_model is not None:
        if len(per_node) > 1:
            raise ValueError("trace must be single-node when a time_model is given")
        if horizon is not None:
            raise ValueError("horizon is not supported with a time_model (the order is all announced)")
    hits = bytes_hit = evictions = accesses = bytes_total = misses = from_source = 0
    stats: Optional[TimeStats] = None
    for keys, sizes in per_node.values():
        pol = template.spawn()
        pol.reset(capacity_bytes)
        if pol.needs_future:
            pol.prepare(keys, sizes)
        total = sum(sizes)
        if time_model is None:
            h, bh, ev = _replay(pol, keys, sizes, horizon)
            src = total - bh
            m = len(keys) - h
        else:
            stats = time_replay(pol, keys, sizes, capacity_bytes, time_model)
            h, bh, ev, src = stats.hits, stats.bytes_hit, stats.evictions, stats.bytes_from_source
            m = stats.fetches
        hits += h
        bytes_hit += bh
        evictions += ev
        accesses += len(keys)
        bytes_total += total
        from_source += src
        misses += m
    extra = {}
    if stats is not None:
        keys, sizes = next(iter(per_node.values()))
        best = simulate(list(zip(keys, sizes)), "belady", capacity_bytes)
        extra = dict(
            stall_s=stats.stall_s,
            compute_s=stats.compute_s,
            total_s=stats.total_s,
            stall_lower_bound_s=stall_lower_bound(
                keys, sizes, best.misses, best.bytes_from_source, time_model
            ),
        )
    return SimResult(
        policy=template.name,
        capacity_bytes=capacity_bytes,
        nodes=len(per_node),
        accesses=accesses,
        hits=hits,
        misses=misses,
        bytes_total=bytes_total,
        bytes_hit=bytes_hit,
        bytes_from_source=from_source,
        evictions=evictions,
        **extra,
    )
