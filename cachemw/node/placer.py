"""The node's placement decisions: the pure placement engine (cachemw.placement) behind a
lock, fed by the daemon with misses, hits and announced orders.

The engine decides what to keep and where (admit, evict, demote, promote, prefetch); the
node cache executes the moves on its tiers. Without an announced order the engine runs
its history policy (frequency with an admission gate: under epoch reshuffles it keeps a
stable subset instead of churning, where LRU would hit almost never); once a sampler
announces its order, it switches to the clairvoyant policy, keeping what it has.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from ..config import TierConfig
from ..placement import Admit, Engine, Evict, Plan, Prefetch, TierSpec, nominal_bandwidth


log = logging.getLogger(__name__)


class Placer:
    #: seconds prefetch waits for the rest of a group's ranks to announce (see _hold_for)
    HOLD = 5.0

    def __init__(self, tiers: tuple[TierConfig, ...], policy: str | None = None) -> None:
        # The engine fills a tier up to its high watermark; the rest is headroom for fills
        # in flight, so the tier's hard capacity holds.
        self._specs = [TierSpec(t.name, max(1, t.high_bytes), nominal_bandwidth(t.name))
                       for t in tiers]
        self.policy = policy
        self.announced = policy == "clairvoyant"
        self._engine = Engine(self._specs, policy, announced=self.announced)
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        # group -> until when prefetch waits for the rest of its ranks (None: all came, or
        # given up); which ranks came is the engine's (Engine.ranks_begun); see _hold_for
        self._holds: dict = {}
        # owner -> the pids (as this daemon sees them) of the processes that announced its
        # orders: an owner whose processes have all exited is withdrawn (_withdraw_gone)
        self._announcers: dict = {}

    @property
    def policy_name(self) -> str:
        return self._engine.policy.name

    def load(self, blocks: list[tuple[str, str, int]]) -> dict[str, str]:
        """Blocks found on disk at start, oldest first: (key, tier, size). Returns where the
        engine keeps each one it keeps (a key absent from the result is to be deleted)."""
        with self._lock:
            try:  # keep every block where it is, if the engine accepts that placement
                self._engine = Engine(self._specs, self.policy, announced=self.announced,
                                      placement={k: (t, size) for k, t, size in blocks})
                self._sizes.update((k, size) for k, _, size in blocks)
                return self._engine.placement()
            except ValueError:  # over a tier's share, or more than the policy would keep
                self._engine = Engine(self._specs, self.policy, announced=self.announced)
            for key, _, size in blocks:
                self._engine.access(key, size)
                self._sizes[key] = size
            where = self._engine.placement()
            for key in [k for k in self._sizes if k not in where]:
                del self._sizes[key]
            return where

    def miss(self, key: str, size: int) -> tuple[str | None, list]:
        """A block is missing: (tier to admit it into or None, moves to run first)."""
        with self._lock:
            plan = self._engine.access(key, size)
            tier, moves = self._split(key, plan)
            if tier is not None:  # sizes of what is cached only: never every key ever read
                self._sizes[key] = size
            self._forget_evicted(moves)
            return tier, moves

    def admit(self, key: str, size: int) -> tuple[str | None, list]:
        """Like miss, for a block offered from elsewhere (a replica of a remote block)."""
        return self.miss(key, size)

    def hit(self, key: str) -> list:
        """A cached block was read: moves it calls for (promote, and room for it)."""
        with self._lock:
            size = self._sizes.get(key)
            if size is None:
                return []
            moves = list(self._engine.access(key, size).moves)
            self._forget_evicted(moves)
            return moves

    def kept_in(self, key: str, tier: str) -> list:
        """A move of ``key`` was not carried out: it is still in ``tier``; the moves that
        make room for it there (Engine.kept_in)."""
        with self._lock:
            moves = list(self._engine.kept_in(key, tier).moves)
            self._forget_evicted(moves)
            return moves

    def drop(self, key: str) -> None:
        with self._lock:
            self._sizes.pop(key, None)
            self._engine.drop(key)

    def announce(self, order: list[tuple[str, int]], stream: tuple | None = None,
                 pid: int | None = None) -> None:
        """A sampler's next reads, in order; switches to the clairvoyant policy. ``stream``:
        (group, rank, ranks, first[, replace, owner]) of a rank's order among the node's
        ranks, and whether it replaces what its owner announced ahead (Engine.announce).
        ``pid``: the announcing process, as this daemon sees it (None: not known)."""
        group, rank, ranks, first, *rest = stream if stream is not None else (None, 0, 1, 0)
        replace = bool(rest[0]) if rest else False
        owner = rest[1] if len(rest) > 1 else None
        with self._lock:
            if not self._engine.policy.uses_announced:
                current = self._engine.placement()
                self._engine = Engine(
                    self._specs, "clairvoyant", announced=True,
                    placement={k: (t, self._sizes[k]) for k, t in current.items()})
                self.announced = True
            self._withdraw_gone()
            self._engine.announce(order, group=group, rank=rank, ranks=ranks, first=first,
                                  replace=replace, owner=owner)
            if owner is not None and pid:  # (the latest last: the oldest go first)
                self._announcers[owner] = self._announcers.pop(owner, set()) | {pid}
                while len(self._announcers) > self.OWNERS:
                    del self._announcers[next(iter(self._announcers))]
            if group is not None and ranks > 1:  # (once the engine took it as valid)
                self._hold_for(group, rank, ranks, first)

    #: owners whose announcing processes are remembered (the latest ones)
    OWNERS = 256

    def _withdraw_gone(self) -> None:
        """Withdraw the orders of owners whose announcing processes have all exited (a
        trainer killed mid-epoch: its order's unread rest stayed ahead of every later
        order, which a restarted trainer, a new pid and so another owner, could not
        replace: the next trainer's order was never reached, and prefetch served the dead
        one's, 0 hits in 14 epochs, review announce2). The announcing owner's own too:
        a job killed and run again keeps its name (torchrun's default rendezvous address,
        a requeued Slurm job) in new processes (diffrev-12). A pid reused since is taken
        as alive (the order stays, as it did)."""
        for owner, pids in list(self._announcers.items()):
            if not any(map(_alive, pids)):
                del self._announcers[owner]
                log.info("the processes that announced order %s have exited: its unread "
                         "places are withdrawn", owner)
                self._engine.withdraw(owner)

    def _hold_for(self, group, rank: int, ranks: int, first: int) -> None:
        """Prefetch waits while a group's ranks are still announcing (at most HOLD s from
        the group's first announcement; the whole node's prefetch, as it is one plan).

        Why: until the last rank's order is in, the blocks only it will read look dead
        (cached, no announced read), and prefetch would evict them for the other ranks'
        next blocks, to fetch them again moments later: with 2 ranks and a cache of half
        the dataset, a quarter more source reads each epoch."""
        begun = self._engine.ranks_begun(group)
        if len(begun) >= ranks:
            self._holds[group] = None  # complete: holds nothing
        elif group not in self._holds or (first == 0 and begun == {rank}):  # new, or a new run
            self._holds.pop(group, None)  # one deadline per group, from its first order
            self._holds[group] = time.monotonic() + self.HOLD
            while len(self._holds) > 16:  # the latest epochs' groups
                del self._holds[next(iter(self._holds))]

    def _held(self) -> bool:
        """A group still waits for ranks; one past its deadline is given up for good (a
        rank that never announces holds prefetch back once, for HOLD s)."""
        now, held = time.monotonic(), False
        for group, until in self._holds.items():
            if until is not None:
                if now < until:
                    held = True
                else:
                    self._holds[group] = None
                    log.warning("prefetch waited %s s for the ranks of %r: only ranks %s "
                                "announced in it (every rank of the node must, with the same "
                                "samplers in the same order; an AnnouncingSampler is named "
                                "by its length, so ranks whose shards differ in length "
                                "announce in groups of their own)", self.HOLD, group,
                                sorted(self._engine.ranks_begun(group)))
        return held

    def prefetch(self, budget: int) -> list:
        """Prefetch moves, at most ``budget`` bytes, and never more than the cache can take
        without evicting a block whose next read is announced (see _reclaimable); none
        while a group's ranks are still announcing (see _hold_for)."""
        with self._lock:
            if self._held():
                return []
            cursor = getattr(self._engine.policy, "cursor", 0)
            moves, stale = [], True
            while stale and budget > 0:  # the room a stale plan took is planned again
                stale = False
                for move in self._engine.prefetch(min(budget, self._reclaimable())).moves:
                    if isinstance(move, Prefetch) and self._already_read(move, cursor):
                        self._engine.drop(move.key)
                        stale = True
                        continue
                    if isinstance(move, Prefetch):
                        budget -= move.size
                    if isinstance(move, Evict):
                        self._sizes.pop(move.key, None)
                    else:
                        self._sizes.setdefault(move.key, move.size)
                    moves.append(move)
            return moves

    def _already_read(self, move: Prefetch, cursor: int) -> bool:
        """The read a prefetch is for has happened (a miss the reader served itself).

        The engine's cursor counts the reads it has heard of; hits reach the daemon in
        access reports up to ``report_interval`` late while misses arrive at once, so the
        cursor lags the reader and the engine may plan a block the reader has just read:
        fetching it again would cost a source read, and the block would sit in the cache
        with a next read in the past, out of the eviction order, until its next epoch.
        """
        next_use = getattr(self._engine.policy, "next_use", None)
        return next_use is not None and next_use(move.key) != cursor + move.needed_at

    def _reclaimable(self) -> int:
        """Bytes prefetch may fill: free space plus blocks with no announced next read.

        Why: the engine prefetches a block by evicting any block needed later than it, but
        the evicted block must then be fetched again, so a prefetch that displaces a block
        with an announced read costs one extra source read (with a cache of half the
        dataset and per-epoch announcements, that undoes half the hits). Bounding prefetch
        by what is free or dead (already read, not announced again) keeps the source reads
        those of the clairvoyant policy without prefetch, just earlier. O(tiers): the
        policy keeps the dead bytes as a running sum.
        """
        free = sum(t.capacity for t in self._specs) - sum(self._engine.used().values())
        return free + getattr(self._engine.policy, "dead_bytes", 0)

    def _forget_evicted(self, moves) -> None:
        for move in moves:
            if isinstance(move, Evict):
                self._sizes.pop(move.key, None)

    @staticmethod
    def _split(key: str, plan: Plan) -> tuple[str | None, list]:
        tier, before = None, []
        for move in plan.moves:
            if isinstance(move, Admit) and move.key == key:
                tier = move.tier
            else:
                before.append(move)
        return tier, before


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: another user's process, alive)
        return True
    return True
