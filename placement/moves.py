"""The engine's output: moves and plans, as frozen dataclasses.

Why frozen and plain: the engine decides, something else (the node daemon, a test, the
simulator) executes. A plan must be safe to hand across threads, log, compare in tests and
replay, so it holds only keys, tier names, node ids and byte counts -- never handles, paths or
callbacks. Two runs of the engine on the same input produce equal plans.

Every move names a block by its key (the daemon's stable blake2b block key) and its size in
bytes, so the executor can check capacity before it acts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Tuple, Union


@dataclass(frozen=True)
class Admit:
    """Store a block just fetched from the source (on a demand miss) in ``tier``."""

    key: Hashable
    size: int
    tier: str


@dataclass(frozen=True)
class Evict:
    """Drop the block from ``tier``; the next read of it goes to the source (or a peer)."""

    key: Hashable
    size: int
    tier: str


@dataclass(frozen=True)
class Promote:
    """Move the block from a slower tier ``src`` to a faster tier ``dst`` (it just got hot)."""

    key: Hashable
    size: int
    src: str
    dst: str


@dataclass(frozen=True)
class Demote:
    """Move the block from a faster tier ``src`` to a slower tier ``dst`` to make room."""

    key: Hashable
    size: int
    src: str
    dst: str


@dataclass(frozen=True)
class Prefetch:
    """Fetch the block from the source into ``tier`` before it is read (announced order).

    ``needed_at`` is the block's position in the announced order (0 = the next access), so an
    executor with limited source bandwidth can issue prefetches in this order.
    """

    key: Hashable
    size: int
    tier: str
    needed_at: int


@dataclass(frozen=True)
class Replicate:
    """Copy the block from node ``src_node`` to node ``dst_node`` (multi-node placement)."""

    key: Hashable
    size: int
    src_node: str
    dst_node: str


Move = Union[Admit, Evict, Promote, Demote, Prefetch, Replicate]


@dataclass(frozen=True)
class Plan:
    """An ordered tuple of moves. Execute them in order: evictions and demotions that make
    room always come before the admission, promotion or prefetch that needs the room."""

    moves: Tuple[Move, ...] = ()

    def __iter__(self):
        return iter(self.moves)

    def __len__(self) -> int:
        return len(self.moves)

    def __bool__(self) -> bool:
        return bool(self.moves)

    def of_type(self, kind: type) -> Tuple[Move, ...]:
        """The moves of one kind, in plan order (e.g. ``plan.of_type(Prefetch)``)."""
        return tuple(m for m in self.moves if isinstance(m, kind))
