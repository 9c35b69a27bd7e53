"""The stateful engine a node daemon drives: access events and announced orders in, plans out.

Why a separate object from the policies: a policy only knows "cached or not" over one
capacity; a node has a tier set (e.g. DRAM then NVMe), and the daemon needs to know *where*
each block goes and which copy operations to run. The engine keeps one policy over the total
capacity of the tiers (what to keep) and an exclusive LRU split over the tiers (where):
a block lives in exactly one tier, the most recently read ones in the fastest tier, older
ones demoted down the chain, and a block read from a slower tier is promoted.

The engine never performs I/O: it returns :class:`~cachemw.placement.moves.Plan` objects and
assumes the executor carries them out. If the executor cannot (a failed write, a bad
checksum), it reports the block gone with :meth:`Engine.drop`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

from .future import ClairvoyantPolicy
from .moves import Admit, Demote, Evict, Move, Plan, Prefetch, Promote
from .policies import Policy
from .registry import make_policy
from .specs import TierSpec, check_positive_int


class Engine:
    """Placement over one node's tiers (fastest first). See the package docstring."""

    #: groups of ranks' orders remembered (see :meth:`announce`): the latest epochs'
    GROUPS = 64

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        policy: Union[str, Policy, None] = None,
        *,
        announced: bool = False,
        placement: Optional[Mapping[Hashable, Tuple[str, int]]] = None,
    ) -> None:
        tiers = tuple(tiers)
        if not tiers or not all(isinstance(t, TierSpec) for t in tiers):
            raise ValueError(f"tiers must be a non-empty sequence of TierSpec, got {tiers!r}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers must have distinct names, got {names!r}")
        self.tiers = tiers
        self._index = {t.name: i for i, t in enumerate(tiers)}
        self.policy = make_policy(policy, announced=announced)
        self.policy.reset(sum(t.capacity for t in tiers))
        if self.policy.needs_future:
            raise ValueError(f"policy {self.policy.name!r} needs the whole future; it is for scoring only")
        self._lru: List["OrderedDict[Hashable, int]"] = [OrderedDict() for _ in tiers]
        self._used = [0] * len(tiers)
        self._where: Dict[Hashable, int] = {}
        # the announced order by the policy's position of each read: positions start at the
        # policy's cursor when an order comes after reads it was not told of (a restart's
        # blocks loaded below count as reads), so the order is kept by position, not index
        # each place's (key, size, owner: who announced it, for a withdrawal); several orders
        # may share a place (two jobs reading at once, each its own order). Sizes live with
        # their places, so they are forgotten with them: a dict of every key ever announced
        # would grow with each new version of each file for the daemon's lifetime
        self._order: Dict[int, List[Tuple[Hashable, int, Hashable]]] = {}
        self._order_start = 0  # positions below it are read and forgotten
        self._order_end = 0
        self._scan = 0
        # a group of ranks' orders -> its first position, the ranks that began their order
        self._groups: Dict[Hashable, Tuple[int, set]] = {}
        for key, (tier, size) in (placement or {}).items():
            self._load(key, tier, size)

    # ---- state -------------------------------------------------------------------------
    def placement(self) -> Dict[Hashable, str]:
        """Where each cached block is, by tier name (a copy)."""
        return {k: self.tiers[i].name for k, i in self._where.items()}

    def used(self) -> Dict[str, int]:
        """Bytes in use per tier."""
        return {t.name: u for t, u in zip(self.tiers, self._used)}

    def _load(self, key: Hashable, tier: str, size: int) -> None:
        """Register a block that is already cached (daemon restart)."""
        i = self._index.get(tier)
        if i is None:
            raise ValueError(f"placement names tier {tier!r}, not one of {list(self._index)}")
        check_positive_int("placement size", size)
        if self._used[i] + size > self.tiers[i].capacity:
            raise ValueError(f"placement overfills tier {tier!r} (capacity {self.tiers[i].capacity})")
        self.policy.access(key, size)
        if key not in self.policy:
            raise ValueError(f"placement holds {key!r}, which policy {self.policy.name!r} would not keep")
        self._put(key, size, i)

    # ---- daemon entry points -----------------------------------------------------------
    def announce(self, order: Sequence[Tuple[Hashable, int]], *, group: Hashable = None,
                 rank: int = 0, ranks: int = 1, first: int = 0, replace: bool = False,
                 owner: Hashable = None) -> None:
        """Append ``(key, size)`` reads the sampler will make next, in order.

        Several ranks of one node each announcing its own order (DDP: one process per
        device, each with its shard of the epoch) read them at the same time, step by step.
        Appended one after another, the second rank's reads would be expected only once the
        first rank's were done, and the node's reads would match neither. Given ``group``
        (the same for the ranks' orders of one epoch), ``rank`` and ``ranks``, item ``j`` of
        rank ``rank``'s order (``first``: the index of this call's first item in that
        order, for orders announced in windows) is laid at position ``base + j * ranks +
        rank``, ``base`` being where the group's first announcement started: the ranks'
        orders interleaved, as they will be read. A rank beginning its order a second time
        in a group (``first`` 0 again: the same name from a later run) begins the group
        anew. An order laid where another's places are still to come (a group's later
        windows; two jobs reading at once) shares those places.

        ``replace``: the reader stopped its last order early (a training loop that ends its
        epochs after some steps): the reads still ahead that ``owner`` announced (one
        sampler's orders, on every rank; None: anyone's) are withdrawn first, so
        that this order starts at the reader, not after the unread rest. In a group, only
        its first announcement withdraws (the other ranks' come after it)."""
        if not self.policy.uses_announced:
            raise ValueError(
                f"policy {self.policy.name!r} ignores announced orders; build the Engine "
                "with announced=True or policy='clairvoyant'"
            )
        keys, sizes = [], []
        for i, item in enumerate(order):
            if not isinstance(item, tuple) or len(item) != 2:
                raise ValueError(f"order[{i}] must be a (key, size) tuple, got {item!r}")
            key, size = item
            check_positive_int(f"order[{i}] size", size)
            keys.append(key)
            sizes.append(size)
        if group is not None and ranks != 1:  # checked before anything changes
            check_positive_int("ranks", ranks)
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
                raise ValueError(f"rank must be an int in [0, {ranks}), got {rank!r}")
            check_positive_int("first", first, allow_zero=True)
        if replace and (group is None or ranks == 1 or group not in self._groups
                        or (first == 0 and rank in self._groups[group][1])):
            self._withdraw(owner)
        start = max(self.policy.announced_until, self.policy.cursor)  # as the policy places it
        if group is None or ranks == 1:
            positions = range(start, start + len(keys))
            self.policy.announce(keys)
        else:
            base, began = self._groups.get(group, (None, set()))
            if base is None or (first == 0 and rank in began):  # new, or a new run's
                base, began = start, set()
                self._groups.pop(group, None)
                self._groups[group] = (base, began)
                while len(self._groups) > self.GROUPS:  # the oldest epochs' groups
                    del self._groups[next(iter(self._groups))]
            if first == 0:
                began.add(rank)
            positions = range(base + first * ranks + rank,
                              base + (first + len(keys)) * ranks + rank, ranks)
            self.policy.announce(keys, positions)
            self._scan = min(self._scan, positions[0]) if keys else self._scan
        for pos, key, size in zip(positions, keys, sizes):
            if pos >= self._order_start:  # (a late rank's places long passed: none)
                self._order.setdefault(pos, []).append((key, size, owner))
        self._order_end = max(self._order_end, positions[-1] + 1) if keys else self._order_end

    def ranks_begun(self, group: Hashable) -> frozenset:
        """The ranks that have begun their order in ``group`` (its latest run), if any."""
        return frozenset(self._groups[group][1]) if group in self._groups else frozenset()

    def withdraw(self, owner: Hashable) -> None:
        """Take the places still ahead that ``owner`` announced out of the order: its reader
        is gone (the node tells, cachemw/node/placer.py). A new order was laid after the
        dead one's unread rest, further from the reads than they ever caught up, and
        prefetch served the dead order first (review announce2)."""
        if owner is not None:
            self._withdraw(owner)

    def _withdraw(self, owner: Hashable) -> None:
        """Take ``owner``'s places at or after the cursor out of the order (anyone's if
        None); the next order is laid after the places left."""
        cursor, gone = self.policy.cursor, []
        end = cursor
        for pos in sorted(p for p in self._order if p >= cursor):
            entries = self._order[pos]
            kept = [e for e in entries if owner is not None and e[2] != owner]
            gone.extend((key, pos) for key, _, who in entries if owner is None or who == owner)
            if kept:
                self._order[pos] = kept
                end = pos + 1
            else:
                del self._order[pos]
        self.policy.withdraw(gone, end)
        self._order_end = end
        self._scan = min(self._scan, end)

    def access(self, key: Hashable, size: int) -> Plan:
        """One read of ``key`` happened (hit or miss); return the moves it calls for.

        A miss the policy keeps yields ``Admit`` (the executor stores the bytes it just read
        from the source); a hit in a slower tier yields ``Promote``. Either may be preceded by
        ``Evict`` (the policy's victims) and ``Demote`` moves that make room.
        """
        check_positive_int("size", size)
        policy = self.policy
        was = self._where.get(key)
        policy.access(key, size)
        moves: List[Move] = self._drain_evictions()
        if key not in policy:  # bypassed, or dropped again at once
            if was is not None:
                moves.append(Evict(key, self._forget(key), self.tiers[was].name))
            return Plan(tuple(moves))
        home = self._home(size)
        if home is None:  # fits in no single tier: do not keep it
            self.policy.discard(key)
            if was is not None:
                moves.append(Evict(key, self._forget(key), self.tiers[was].name))
            return Plan(tuple(moves))
        if was == home:
            self._lru[home].move_to_end(key)
        elif was is None:
            self._make_room(home, size, moves)
            self._put(key, size, home)
            moves.append(Admit(key, size, self.tiers[home].name))
        else:
            self._forget(key)
            self._make_room(home, size, moves)
            self._put(key, size, home)
            moves.append(Promote(key, size, self.tiers[was].name, self.tiers[home].name))
        return Plan(tuple(moves))

    def _home(self, size: int) -> Optional[int]:
        """The fastest tier a block of ``size`` bytes fits in (policy capacity is the sum)."""
        for i, tier in enumerate(self.tiers):
            if size <= tier.capacity:
                return i
        return None

    def prefetch(self, budget_bytes: int) -> Plan:
        """Prefetch moves for announced reads not cached, in announced order, up to
        ``budget_bytes``. A block is prefetched only by evicting blocks needed later than it
        (never one needed sooner). Empty unless the policy is clairvoyant."""
        check_positive_int("budget_bytes", budget_bytes, allow_zero=True)
        policy = self.policy
        if not isinstance(policy, ClairvoyantPolicy):
            return Plan()
        moves: List[Move] = []
        cursor = policy.cursor
        pos = max(self._scan, cursor)
        # places read (or skipped) are forgotten once they are ``slack`` behind the cursor:
        # a read that comes late (DataLoader workers out of order, hits reported late) still
        # belongs to the order until then, and moves the cursor (ClairvoyantPolicy.access)
        horizon = cursor - policy.slack
        while self._order_start < horizon:
            for key, _, _ in self._order.pop(self._order_start, ()):
                policy.forget_before(key, horizon)
            self._order_start += 1
        while pos < self._order_end and budget_bytes > 0:
            full = False
            for key, size, _ in self._order.get(pos, ()):  # none: a place counted before any order
                if key in policy:
                    continue
                home = self._home(size)
                if home is None or size > budget_bytes or not policy.admit_ahead(key, size, pos):
                    full = True
                    break
                moves.extend(self._drain_evictions())
                self._make_room(home, size, moves)
                self._put(key, size, home)
                moves.append(Prefetch(key, size, self.tiers[home].name, pos - cursor))
                budget_bytes -= size
            if full:
                break
            pos += 1
        self._scan = pos
        return Plan(tuple(moves))

    def kept_in(self, key: Hashable, tier: str) -> Plan:
        """The executor could not carry out a move of ``key`` (a promotion into a tier that
        takes nothing now: full, broken): it is still in ``tier``. It is counted there
        again, with room made for it as for any block put there (that tier's least recently
        read blocks demoted or evicted), so that the tier never holds more than its
        capacity: counted in the tier it never reached, its bytes were room the engine
        handed out again in ``tier``, which grew past its capacity."""
        i = self._index.get(tier)
        if i is None:
            raise ValueError(f"no tier {tier!r}, not one of {list(self._index)}")
        was = self._where.get(key)
        if was is None or was == i:  # dropped meanwhile, or where it is
            return Plan()
        size = self._forget(key)
        moves: List[Move] = []
        self._make_room(i, size, moves)
        self._put(key, size, i)
        return Plan(tuple(moves))

    def drop(self, key: Hashable) -> None:
        """The executor lost or discarded ``key`` (bad checksum, failed write)."""
        if key in self._where:
            self._forget(key)
        self.policy.discard(key)

    # ---- tier bookkeeping --------------------------------------------------------------
    def _put(self, key: Hashable, size: int, i: int) -> None:
        self._lru[i][key] = size
        self._used[i] += size
        self._where[key] = i

    def _forget(self, key: Hashable) -> int:
        i = self._where.pop(key)
        size = self._lru[i].pop(key)
        self._used[i] -= size
        return size

    def _drain_evictions(self) -> List[Move]:
        moves: List[Move] = []
        for victim in self.policy.evicted:
            if victim in self._where:
                tier = self.tiers[self._where[victim]].name
                moves.append(Evict(victim, self._forget(victim), tier))
        self.policy.evicted.clear()
        return moves

    def _make_room(self, i: int, size: int, moves: List[Move]) -> None:
        """Free ``size`` bytes in tier ``i`` by demoting its least recently read blocks down
        the chain (the slowest tier evicts). Deeper moves come first in ``moves``."""
        lru = self._lru[i]
        while self._used[i] + size > self.tiers[i].capacity and lru:
            victim, vsize = next(iter(lru.items()))
            if i + 1 < len(self.tiers) and vsize <= self.tiers[i + 1].capacity:
                self._make_room(i + 1, vsize, moves)
                self._forget(victim)
                self._put(victim, vsize, i + 1)
                moves.append(Demote(victim, vsize, self.tiers[i].name, self.tiers[i + 1].name))
            else:
                self._forget(victim)
                self.policy.discard(victim)
                moves.append(Evict(victim, vsize, self.tiers[i].name))
