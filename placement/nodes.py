"""Multi-node placement: which node keeps which blocks, from per-node future frequency.

Why per-node future frequency: with a DistributedSampler each rank reads a different share
of the dataset every epoch, and the announced orders say exactly which node will read which
block how often. A block is worth most on the node that reads it most; a block read by
several nodes is worth a copy on each that has room (a local hit costs microseconds, a peer
read a network round trip). Everything here is a pure function of its arguments; ties are
broken by the blake2b digest of the key's repr, never by Python's salted ``hash()``, so every
daemon computes the same assignment.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Dict, FrozenSet, Hashable, List, Mapping, Sequence, Union

from .moves import Evict, Move, Plan, Prefetch, Replicate
from .specs import check_positive_int


def stable_digest(key: Hashable) -> bytes:
    """A process-independent tie-breaker for a key (blake2b of its repr)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=8).digest()


def assign_blocks(
    future: Mapping[str, Sequence[Hashable]],
    sizes: Mapping[Hashable, int],
    capacity: Union[int, Mapping[str, int]],
) -> Dict[str, FrozenSet[Hashable]]:
    """For each node, the blocks it should hold: the ones it will read most often in its
    announced ``future`` order, then the soonest, filling its ``capacity`` bytes.

    ``future`` maps node -> the keys that node will read, in order; ``sizes`` gives every
    key's size; ``capacity`` is bytes per node (one int for all, or per node).
    """
    result: Dict[str, FrozenSet[Hashable]] = {}
    for node in sorted(future):
        cap = capacity.get(node) if isinstance(capacity, Mapping) else capacity
        if cap is None:
            raise ValueError(f"capacity has no entry for node {node!r}")
        check_positive_int(f"capacity[{node!r}]", cap, allow_zero=True)
        freq: Counter = Counter()
        first: Dict[Hashable, int] = {}
        for pos, key in enumerate(future[node]):
            freq[key] += 1
            first.setdefault(key, pos)
        ranked = sorted(freq, key=lambda k: (-freq[k], first[k], stable_digest(k)))
        chosen: List[Hashable] = []
        used = 0
        for key in ranked:
            size = sizes.get(key)
            if size is None:
                raise ValueError(f"sizes has no entry for key {key!r}")
            if used + size <= cap:
                chosen.append(key)
                used += size
        result[node] = frozenset(chosen)
    return result


def rebalance_plans(
    current: Mapping[str, FrozenSet[Hashable]],
    target: Mapping[str, FrozenSet[Hashable]],
    sizes: Mapping[Hashable, int],
    tier: str = "dram",
) -> Dict[str, Plan]:
    """Per-node plans that turn ``current`` (node -> blocks held) into ``target``.

    Each node's plan is executed by that node's daemon: evictions first (they make room),
    then for each block it lacks a ``Replicate`` from a peer that holds the block now and
    keeps it in ``target`` (a peer read is cheaper than the source), else a ``Prefetch``
    from the source into ``tier``.
    """
    keepers: Dict[Hashable, List[str]] = {}
    for node in sorted(current):
        for key in current[node] & target.get(node, frozenset()):
            keepers.setdefault(key, []).append(node)
    plans: Dict[str, Plan] = {}
    for node in sorted(set(current) | set(target)):
        have = current.get(node, frozenset())
        want = target.get(node, frozenset())
        moves: List[Move] = [Evict(k, sizes[k], tier) for k in sorted(have - want, key=stable_digest)]
        for key in sorted(want - have, key=stable_digest):
            peers = keepers.get(key)
            if peers:
                moves.append(Replicate(key, sizes[key], peers[0], node))
            else:
                moves.append(Prefetch(key, sizes[key], tier, 0))
        plans[node] = Plan(tuple(moves))
    return plans
