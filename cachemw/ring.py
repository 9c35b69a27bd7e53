"""Which node owns a block: a consistent-hash ring with virtual nodes.

Block keys are already blake2b digests, so a key's position on the ring is its first 64
bits: no hashing on the lookup path, one bisect (about a microsecond). Node positions are
blake2b of ``name#i``, stable across processes and machines (never Python's ``hash()``);
a node's name is its hostname (``ring_names``), so it keeps its share from one job to the
next. When a node leaves, only its share moves, spread over the others; when it comes back
it takes the same share again.
"""
from __future__ import annotations

import bisect
import hashlib
from typing import Iterable


class HashRing:
    def __init__(self, nodes: Iterable[str], vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes: must be >= 1, got {vnodes}")
        self.nodes = tuple(sorted(set(nodes)))
        points = []
        for node in self.nodes:
            for i in range(vnodes):
                h = hashlib.blake2b(f"{node}#{i}".encode(), digest_size=8).digest()
                points.append((int.from_bytes(h, "big"), node))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def __len__(self) -> int:
        return len(self.nodes)

    def owner(self, key: str) -> str:
        """The node owning ``key`` (a hex block key). Raises LookupError on an empty ring."""
        if not self._points:
            raise LookupError("no nodes in the ring")
        i = bisect.bisect(self._points, int(key[:16], 16))
        return self._owners[i if i < len(self._owners) else 0]

    def shares(self) -> dict[str, float]:
        """Each node's fraction of the key space (for status and tests)."""
        out = dict.fromkeys(self.nodes, 0.0)
        if not self._points:
            return out
        span = 1 << 64
        prev = self._points[-1] - span
        for point, node in zip(self._points, self._owners):
            out[node] += (point - prev) / span
            prev = point
        return out


def ring_names(hosts: dict[str, str]) -> dict[str, str]:
    """Each node's name on the ring, from ``{node_id: hostname}`` of the alive nodes.

    The hostname, so that a node keeps its place (and so the blocks it owns) from one job
    to the next, when Ray gives it a new node id: a daemon that adopts its NVMe tier from
    an earlier job then owns what the tier holds. Nodes sharing a hostname (several Ray
    nodes on one machine) are named by their node id instead, as they keep no tier across
    runs anyway (their directories name the node id).
    """
    counts: dict[str, int] = {}
    for host in hosts.values():
        counts[host] = counts.get(host, 0) + 1
    return {node: host if host and counts[host] == 1 else node
            for node, host in hosts.items()}
