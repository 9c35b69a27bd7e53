"""The node cache: the logic a node daemon runs, as a plain class testable without Ray.

It owns the node's tier accounting: which blocks are where, how full each tier is, who is
filling what. Clients read hits straight from the tier files; on a miss they ask for a
*lease*: the node cache answers "present in tier T" (someone filled it meanwhile), "fill it
into tier T" (the caller fetches from the source and writes the block file, then reports
"filled"), or "do not cache" (tiers full, or the filler is stuck). So a block is fetched
once per node however many processes miss it at once (single flight), fills run in the
clients' processes in parallel, and the daemon stays a light coordinator.

Placement: what to keep and where is decided by the placement engine (placer.py): a miss
is admitted into the tier it names, after the evictions and demotions it plans to make
room; hits reported by clients may promote a block; an announced access order drives
prefetch. A tier never holds more than its capacity.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import defaultdict

from ..config import DaemonConfig
from .. import blockfile
from ..claims import Claims, claims_dir
from ..keys import url_tag
from .checkpoints import CheckpointLog
from .demand import WaitingReads
from .mover import MoveRunner
from .waits import LeaseWaits
from .lease_ends import LeaseEnds
from .leftovers import LeftoverSweep, LeftoverSweeping
from ..placement import Demote, Prefetch
from .placer import Placer
from .records import Entry, Inflight, TierState
from .superseded import SupersededVersions
from ..protocol import CLIENT_COUNTERS
from .. import reports
from . import replicas
from ..tiers.directory import DirectoryTier

log = logging.getLogger(__name__)


class NodeCache(LeaseEnds, LeaseWaits, WaitingReads, MoveRunner, SupersededVersions,
                LeftoverSweeping):
    BATCH_SHARE = 4  # a batch of fetched blocks stops being granted at 1/4 of a tier

    def __init__(self, config: DaemonConfig, *, lease_wait: float = 30.0) -> None:
        self.config = config
        self.placer = Placer(config.tiers, config.placement)
        self.lease_wait = lease_wait
        self._lock = threading.Lock()
        self._tiers: dict[str, TierState] = {}
        for tc in config.tiers:
            self._tiers[tc.name] = TierState(tc, DirectoryTier(tc.name, tc.path, create=True))
        self._order = [tc.name for tc in config.tiers]
        self._index: dict[str, Entry] = {}
        self._by_tag: dict[bytes, set[str]] = defaultdict(set)
        self._inflight: dict[str, Inflight] = {}
        self._lease_numbers = itertools.count(1)
        self.counters = dict.fromkeys(CLIENT_COUNTERS, 0)
        self.counters.update(leases=0, waits=0, busy=0, adopted=0, reindexed=0, served_remote=0,
                             peer_fallbacks=0, replicas=0, claim_errors=0, leftovers_removed=0)
        self.remote = None  # RemoteReads, set by a daemon that has peers
        self.checkpoints = CheckpointLog()  # what trainers here note of their saves
        # who fetches which block (claims.py): a lease comes with its block's claim
        self.claims = Claims(claims_dir(config.runtime_dir))
        self.claims.make()
        self.claims.clear()  # no lease outlives a daemon, nor the claims that came with them
        self.metrics_url: str | None = None  # the daemon's Prometheus endpoint, if any
        self._pending: list = []  # moves for the maintenance thread (promotions)
        self._superseded: list = []  # versions whose blocks it drops (superseded.py)
        self._leftovers = LeftoverSweep()  # fill files of writers that died (leftovers.py)
        self._deferred: dict[str, float] = {}  # key -> since when its move waits for its fill
        self._move_warned: dict[str, float] = {}  # tier -> when a failed move into it was last logged
        # blocks readers found corrupt or unreadable, by reason, since they were last logged
        self._dropped_bad: dict[str, int] = {}
        self._dropped_last, self._bad_logged_at = "", -60.0
        self._sources: dict[str, tuple] = {}  # announced key -> (length, url, source)
        self._moves_lock = threading.Lock()  # moves run one at a time, in order
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._maintainer: threading.Thread | None = None
        self._init_waiting_reads()
        self._reindex()
        reports.clear_stale(config.runtime_dir)

    # -- lifecycle -----------------------------------------------------------------

    def _reindex(self) -> None:
        """Adopt the blocks already in the tier directories (NVMe survives restarts); the
        placement engine decides which to keep and where, oldest first."""
        found: dict[str, tuple] = {}
        for name in self._order:
            ts = self._tiers[name]
            for entry in ts.tier.scan():
                if entry.key in found:  # in a faster tier already: drop the copy
                    try:
                        ts.tier.delete(entry.key)
                    except OSError:  # (EIO) a copy the index does not hold: harmless
                        pass
                    continue
                found[entry.key] = (name, entry)
            self.counters["tier_read_errors"] += getattr(ts.tier, "unreadable", 0)
        oldest_first = sorted(found.items(), key=lambda kv: kv[1][1].last_used)
        where = self.placer.load([(k, t, e.stored_bytes) for k, (t, e) in oldest_first])
        for key, (tier, entry) in oldest_first:
            target = where.get(key)
            if target is None:
                try:
                    self._tiers[tier].tier.delete(key)
                except OSError:
                    pass
                continue
            self._add(key, tier, entry.stored_bytes, entry.tag or None)
            if target != tier:
                self.run_moves([Demote(key, entry.stored_bytes, tier, target)])
            self.counters["reindexed"] += 1
        if self.counters["reindexed"]:
            log.info("re-indexed %d cached blocks", self.counters["reindexed"])

    def start_maintenance(self) -> None:
        if self._maintainer is None:
            self._maintainer = threading.Thread(target=self._maintain_loop, name="cachemw-evict",
                                                daemon=True)
            self._maintainer.start()

    def close(self, wait: float = 30.0) -> None:
        """Stop admitting (fills, promotions, prefetch, replicas) and the maintenance
        thread. Its moves left to run go quickly then (a promotion not admitted is skipped),
        so it is waited for (at most ``wait`` s): a move still running after the DRAM tier
        is freed published into it (seal() is the backstop for one that outlives this)."""
        with self._lock:
            self._closed.set()
            self._pending.clear()
            for ts in self._tiers.values():
                ts.full_until = math.inf
        self._wake.set()
        if self._maintainer is not None:
            self._maintainer.join(timeout=wait)
            if self._maintainer.is_alive():
                log.warning("the maintenance thread did not stop within %.0f s", wait)
        self.say_dropped(now=True)

    def seal(self) -> None:
        """Nothing lands in a tier from now on (the daemon's stop, before it frees its
        DRAM tier): the fills in flight are cancelled, so one that lands deletes its staged
        file (LeaseEnds.land), and the index is emptied, so a move still running publishes
        nothing (MoveRunner._move_tier publishes only a block still indexed as it was)."""
        with self._lock:
            self._closed.set()
            for fill in self._inflight.values():
                fill.cancelled = True
            for key in list(self._index):
                self._remove_locked(key)

    def tier_dirs(self) -> list[dict]:
        return [{"name": n, "path": self._tiers[n].tier.path,
                 "capacity": self._tiers[n].config.capacity} for n in self._order]

    # -- leases: single-flight fills ---------------------------------------------

    def lease(self, key: str, length: int, url: str | None, conn: object,
              wait: float | None = None, claimed: bool = False,
              claimant: str | None = None, wanted: bool = False) -> tuple:
        """("present", tier) | ("fill", tier, lease number) | ("nofill", reason). Never blocks
        past lease_wait (``wait``: another bound; 0 for a block fetched already).

        ``length`` is the block's data length; the tier is charged what the block file
        will occupy (data + checksums + trailer). A lease comes with the block's claim
        (claims.py): ``claimed``, the caller holds it already (it fetched the block first;
        ``claimant``, the name its claims hold, if known); else it is taken here, and while
        another process holds it this waits as for a fill in flight. The lease's end
        releases the claim (see _release_claim). ``wanted``: counted among the reads
        waiting on the block (demand.py).
        """
        nbytes = blockfile.stored_size(length)
        deadline = time.monotonic() + (self.lease_wait if wait is None else wait)
        counted = wait == 0  # a fetched block's lease: no wait to count, nor giving up
        while True:
            claim_held = False
            with self._lock:
                entry = self._index.get(key)
                if entry is not None:
                    return ("present", entry.tier)
                inflight = self._inflight.get(key)
                if inflight is None and not claimed and not self._claim(key):
                    claim_held = True
                    self.counters["waits"] += not counted
                    counted = True
                elif inflight is None:
                    tier, moves = self._decide_miss(key, nbytes, wanted)
                    refused = None
                    if tier is None:
                        refused = ("nofill", "policy")
                    elif self._tiers[tier].full_until > time.monotonic():
                        self.placer.drop(key)
                        refused = ("nofill", "full")
                    elif self._tiers[tier].broken is not None:
                        self.placer.drop(key)
                        refused = ("nofill", "unusable")
                    if refused is not None:
                        if not claimed:
                            self.claims.release(key)
                        break
                    inflight = self._inflight[key] = Inflight(
                        conn, tier, nbytes, url_tag(url) if url else None,
                        next(self._lease_numbers), claimant=claimant if claimed else None)
                    self._tiers[tier].reserved += nbytes
                    self.counters["leases"] += 1
                    break
                elif inflight.conn is conn:  # our own fill (a batch naming a block twice)
                    return ("nofill", "busy")
                else:
                    self.counters["waits"] += not counted
                    counted = True
            if claim_held:  # another process fetches it, its lease to come
                if self._wait_for_claim(key, deadline):
                    continue
                with self._lock:
                    self.counters["busy"] += wait != 0
                return ("nofill", "busy")
            landed = self._wait_for_fill(key, inflight, deadline)
            if landed is not None:
                return landed
            if not inflight.done.is_set():
                with self._lock:
                    self.counters["busy"] += wait != 0
                return ("nofill", "busy")
        self.run_moves(moves)  # make room first: the tier never holds more than its capacity
        if refused is not None:  # the engine applied its moves even so: they ran above
            return refused
        with self._lock:
            ts = self._tiers[tier]
            if ts.used + ts.reserved <= ts.config.capacity:
                return ("fill", tier, inflight.lease)
        # a claim the caller brought stays the caller's to release (as with a refusal above)
        self.end_unfilled(key, inflight, "full", keep_claim=claimed)
        return ("nofill", "full")

    def lease_fetched(self, items: list[tuple], conn: object, claimed: bool,
                      claimant: str | None = None) -> list[tuple]:
        """Leases for blocks the caller fetched already (with their claims if ``claimed``):
        never waits, since the bytes are in hand; another process's fill in flight or claim
        makes it ("nofill", "busy"). A batch stops being granted once its grants reach
        ``1/BATCH_SHARE`` of a tier's capacity (the one granted last may pass it; never
        none): its fills reserve room until they land, and room made for one of them must
        not be made by evicting another in flight. The rest, whichever tier the placer
        would have chosen, are answered ("nofill", "later"): the client asks again once
        the fills granted are noted, claims kept (client/adopt.py). ``claimant``: the
        name the caller's claims hold (see _release_claim)."""
        replies: list[tuple] = []
        granted: dict[str, int] = {}
        for key, length, url, _source in items:
            if any(n * self.BATCH_SHARE > self._tiers[t].config.capacity
                   for t, n in granted.items()):
                replies.append(("nofill", "later"))
                continue
            reply = self.lease(key, length, url, conn, wait=0, claimed=claimed,
                               claimant=claimant)
            if reply[0] == "fill":
                granted[reply[1]] = granted.get(reply[1], 0) + blockfile.stored_size(length)
            replies.append(reply)
        return replies

    def peer_silent(self, owner: str) -> None:
        """A reader of this node waited the peer timeout on ``owner``'s block server (a
        name on the ring) in vain: the calls the leases that follow make to it fail at
        once (cluster/peers.py ``silent``) rather than wait that long again."""
        if self.remote is not None:
            self.remote.peer_silent(owner)

    def read_local(self, key: str, length: int) -> bytes | None:
        """A block from this node's tiers, verified; a corrupt copy is dropped (None)."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return None
        try:
            return self._tiers[entry.tier].tier.get(key, length)
        except blockfile.CorruptBlock:
            self.counters["corrupt_repaired"] += 1
            self.drop(key, "corrupt")
            return None

    def block_path(self, key: str) -> str | None:
        """Where the block file of an indexed block is (None if not cached here)."""
        with self._lock:
            entry = self._index.get(key)
        return None if entry is None else self._tiers[entry.tier].tier.block_path(key)

    def tier(self, name: str):
        return self._tiers[name].tier

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def reserve_prefetches(self, budget: int) -> tuple[list, list]:
        """The engine's prefetch plan for at most ``budget`` bytes, each planned block put in
        flight as a fill (under the lock a lease decides under too: a reader that gets there
        first waits for it instead of reading the source again). Returns the moves that make
        room, to run first, and ``(Prefetch, (length, url, source), fill)`` per block; the
        caller ends every fill (land or end_unfilled), whatever happens."""
        planned, room = [], []
        with self._lock:
            if self._closed.is_set():  # stopping: nothing new lands (close)
                return [], []
            for move in self.placer.prefetch(budget):
                if not isinstance(move, Prefetch):
                    room.append(move)
                    continue
                known = self._sources.pop(move.key, None)
                if move.key in self._index or move.key in self._inflight:
                    continue
                if known is None or not self._claim(move.key):  # (claimed: a reader fetches it)
                    self.placer.drop(move.key)
                    continue
                url = known[1]
                fill = Inflight(self, move.tier, move.size, url_tag(url) if url else None,
                                 next(self._lease_numbers))
                self._inflight[move.key] = fill
                self._tiers[move.tier].reserved += move.size
                planned.append((move, known, fill))
        return room, planned

    def admit_replica(self, key: str, data: bytes, url: str | None,
                      tag: bytes | None = None) -> bool:
        """Keep a local copy of a remote block fetched already, if the engine wants it."""
        fill = self.reserve_replica(key, len(data), url_tag(url) if url else tag)
        return fill is not None and replicas.land(self, key, fill, data)

    def reserve_replica(self, key: str, length: int, tag: bytes | None):
        """The fill (ended by replicas.land) of a replica of a remote block, tagged ``tag``,
        if the placement engine wants it here (else None): asked before the block is
        fetched, so a copy the engine refuses is never sent (cluster/owner.py copy)."""
        nbytes = blockfile.stored_size(length)
        with self._lock:
            if self._closed.is_set() or key in self._index or key in self._inflight \
                    or not self._claim(key):
                return None
            tier, moves = self.placer.admit(key, nbytes)
            if tier is None:
                self.claims.release(key)
                return None
            # in flight like any fill: a write through the cache meanwhile cancels it
            fill = self._inflight[key] = Inflight(self, tier, nbytes, tag,
                                                  next(self._lease_numbers))
            self._tiers[tier].reserved += nbytes
        try:
            self.run_moves(moves)
        except BaseException:  # the fill ends whatever failed; re-raised
            self.end_unfilled(key, fill, "error")
            raise
        return fill

    # -- index ---------------------------------------------------------------------

    def _add(self, key: str, tier: str, stored: int, tag: bytes | None) -> None:
        old = self._index.get(key)
        if old is not None:
            self._remove_locked(key)
        ts = self._tiers[tier]
        self._index[key] = Entry(tier, stored, tag)
        ts.used += stored
        ts.blocks += 1
        if tag is not None:
            self._by_tag[tag].add(key)

    def _remove_locked(self, key: str) -> Entry | None:
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        ts = self._tiers[entry.tier]
        ts.used -= entry.stored
        ts.blocks -= 1
        if entry.tag is not None:
            keys = self._by_tag.get(entry.tag)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_tag[entry.tag]
        return entry

    def drop(self, key: str, reason: str, tier: str | None = None) -> None:
        """Forget and delete a block (a client found it corrupt, it was invalidated, a move
        of it failed); a fill of it in flight is not indexed when it lands (the placement
        engine has forgotten it too: indexed, it would hold room the engine does not see).
        With ``tier`` (a client could not read the copy there): only if that tier holds it;
        else at most that tier's stray file goes."""
        with self._lock:
            entry = self._index.get(key)
            # held in another tier (or nowhere): that copy and any fill stay
            elsewhere = tier is not None and (entry is None or entry.tier != tier)
            if not elsewhere:
                entry = self._remove_locked(key)
                fill = self._inflight.get(key)
                if fill is not None:
                    fill.cancelled = True
                if reason in ("corrupt", "unreadable"):  # counted for the log (say_dropped)
                    self._dropped_bad[reason] = self._dropped_bad.get(reason, 0) + 1
                    self._dropped_last = key
        if elsewhere:  # at most a stray file in that tier goes
            where = [self._tiers[tier]] if tier in self._tiers else []
        else:  # not indexed (e.g. a stray file): deleted wherever it is
            self.placer.drop(key)
            where = [self._tiers[entry.tier]] if entry is not None else list(self._tiers.values())
        for ts in where:
            try:
                ts.tier.delete(key)
            except OSError as exc:  # an unreadable tier (EACCES, EIO): forgotten all the same
                log.debug("could not delete block %s from %s: %s", key, ts.tier.name, exc)
        if not elsewhere and reason in ("corrupt", "unreadable"):
            self.say_dropped()

    def say_dropped(self, now: bool = False) -> None:
        """Log the blocks readers found corrupt or unreadable, at most once a minute (a
        failing disk would log every block); those of the last minute are said by the next
        maintenance pass after it, or ``now`` (the daemon's stop), never left untold."""
        with self._lock:
            if not self._dropped_bad or not now and time.monotonic() < self._bad_logged_at + 60:
                return
            counts, last = self._dropped_bad, self._dropped_last
            self._dropped_bad, self._bad_logged_at = {}, time.monotonic()
        log.warning("dropped %s block(s) found by readers or moves (the last: %s; logged at most once "
                    "a minute)", ", ".join(f"{n} {why}" for why, n in sorted(counts.items())),
                    last)

    def report(self, counters: dict, accesses: list[tuple[str, str]]) -> None:
        """An access report from a client: counters to add, (key, tier) hits for recency."""
        with self._lock:
            for name, value in counters.items():
                if name in self.counters:
                    self.counters[name] += value
            for key, tier in accesses:
                ts = self._tiers.get(tier)
                if ts is not None:
                    ts.hits += 1
            for tier, nbytes in counters.get("tier_hit_bytes", {}).items():
                if tier in self._tiers:
                    self._tiers[tier].hit_bytes += nbytes
        if self.remote is not None:  # hits at owner nodes: one read again and again is copied
            self.remote.note_hits(accesses)
        moves = []
        with self._lock:  # a hit reported late, after an eviction, is no hit for the engine
            hit = [key for key, _ in accesses if key in self._index]
        for key in self._hits_to_tell(hit):  # the engine learns of each hit once (recency,
            moves.extend(self.placer.hit(key))
        if moves:  # promotions copy data: not on the client's connection thread
            with self._lock:
                self._pending.extend(moves)
            self._wake.set()
        elif accesses and self.placer.announced:  # plan prefetch while the engine's
            self._wake.set()  # view of the reader is freshest (hits arrive only in reports)

    def take_reports(self) -> None:
        """The reports clients left in the runtime dir (cachemw.reports): taken every
        second by the maintenance thread, and before stats are given."""
        for counters, accesses in reports.take_all(self.config.runtime_dir):
            self.report(counters, accesses)

    def announce(self, items: list[tuple], stream: tuple | None = None,
                 pid: int | None = None) -> None:
        """A sampler's next reads in order, (key, length, url, source) each: the engine
        plans prefetch from them; the maintenance thread fetches ahead of the reader.
        ``stream``: one rank's order among the node's ranks; ``pid``: the announcing
        process, as this daemon sees it (Placer.announce)."""
        order = []
        with self._lock:
            for key, length, url, source in items:
                if source is not None:  # else its reader fetches it (nothing to prefetch by)
                    self._sources[key] = (length, url, source)
                order.append((key, blockfile.stored_size(length)))
        self.placer.announce(order, stream, pid)
        self._wake.set()

    # -- stats ---------------------------------------------------------------------

    def stats(self) -> dict:
        self.take_reports()
        with self._lock:
            tiers = {}
            for name in self._order:
                ts = self._tiers[name]
                tiers[name] = {
                    "path": ts.tier.path, "used_bytes": ts.used, "capacity_bytes": ts.config.capacity,
                    "blocks": ts.blocks, "hits": ts.hits, "hit_bytes": ts.hit_bytes,
                    "evictions": ts.evictions, "demotions": ts.demotions,
                    "admitting": ts.full_until <= time.monotonic() and ts.broken is None,
                    "unusable": ts.broken,
                }
            stats = {"node_id": self.config.node_id, "pid": os.getpid(), "tiers": tiers,
                     "counters": dict(self.counters), "inflight": len(self._inflight)}
        stats["checkpoints"] = self.checkpoints.stats()
        stats["metrics"] = self.metrics_url
        return stats
