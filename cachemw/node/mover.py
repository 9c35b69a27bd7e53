"""Carrying out the placement engine's moves on a node's tiers: evictions, demotions to a
slower tier, promotions, and the prefetch pass, on the node cache's maintenance thread
(never on a client's connection thread: moves copy data); that thread also checks, every
second, that the tier directories are still there and private, drops superseded versions
(superseded.py) and removes the fill files of writers that died (leftovers.py).

A mixin of NodeCache (node.py): it works on the node's index, tiers and locks.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

from .. import blockfile, trace
from ..placement import Admit, Demote, Evict, Promote
from .prefetch import run_prefetch

log = logging.getLogger(__name__)

DESTINATION_FAILED = "destination failed"  # _move_tier: the tier moved to could not take it
# _move_tier: the block's own file failed its checksum, or could not be read (ELOOP, EIO):
# dropped under that reason, counted and logged as readers' finds are (NodeCache.drop)
SOURCE_CORRUPT, SOURCE_UNREADABLE = "corrupt", "unreadable"
MOVE_DEFER = 30.0  # seconds a move of a block whose fill is in flight is tried again
KEEP_ON_STOP = 10.0  # seconds a clean stop may spend copying DRAM's blocks down to NVMe


class MoveRunner:
    def _maintain_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.check_tiers()
                self.say_dropped()
                self.take_reports()
                self.drop_superseded()
                self.sweep_leftovers()
                with self._lock:
                    moves, self._pending = self._pending, []
                self.run_moves(moves)
                if self.placer.announced:
                    self._prefetch()
                if trace.ENABLED:  # a daemon's events are few: written within a second, not at exit
                    trace.flush()
            except Exception:  # never let the maintenance thread die silently
                log.exception("placement pass failed")

    def check_tiers(self) -> None:
        """A tier directory removed, replaced or opened up under the running daemon (a
        cleaner of /dev/shm, an epilogue, a makedirs with the default mode): make it again,
        0700, forget the blocks that went with it, and admit fills again. One that cannot
        be made again admits nothing, and stats say so, until it can."""
        meta = os.path.join(self._tiers[self._order[-1]].tier.path, "meta")
        try:  # the metadata records' directory, in the last tier: made again by its
            st = os.lstat(meta)  # writers with makedirs (default mode) if it went
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
                os.chmod(meta, 0o700, follow_symlinks=False)
        except OSError:
            pass
        for name in self._order:
            ts = self._tiers[name]
            if ts.tier.intact():
                continue
            try:
                ts.tier.repair()
            except OSError as exc:
                if ts.broken is None:
                    lost = self._forget_lost(name)  # not listed, nor sent readers' way
                    log.warning("%s tier directory %s is gone and cannot be made again (%s): "
                                "not admitting into it; %d cached blocks went with it",
                                name, ts.tier.path, exc, len(lost))
                ts.broken = str(exc)
                continue
            lost = self._forget_lost(name)
            ts.broken = None
            log.warning("%s tier directory %s was removed or changed under the daemon: made "
                        "again (0700); %d cached blocks went with it", name, ts.tier.path,
                        len(lost))

    def _forget_lost(self, name: str) -> list[str]:
        """Forget the blocks indexed in tier ``name`` whose files are gone; return their keys."""
        ts = self._tiers[name]
        with self._lock:
            keys = [k for k, e in self._index.items() if e.tier == name]
        lost = [k for k in keys if not os.path.exists(ts.tier.block_path(k))]
        with self._lock:
            for key in lost:
                entry = self._index.get(key)
                if entry is not None and entry.tier == name:
                    self._remove_locked(key)
        for key in lost:
            self.placer.drop(key)
        return lost

    def run_moves(self, moves: list) -> None:
        """Carry out the engine's moves in order; a move that cannot be done is reported
        back to the engine (drop), never retried blindly."""
        with self._moves_lock:
            moves = list(moves)
            for move in moves:  # (grows: the room a block kept where it was needs)
                started = time.perf_counter()
                try:
                    moves.extend(self._run_one(move))
                except OSError as exc:  # a failing tier: forget the block, never stop
                    log.warning("placement move %s failed: %s", type(move).__name__, exc)
                    self.placer.drop(move.key)
                    with self._lock:
                        self._remove_locked(move.key)
                if trace.ENABLED:
                    trace.event(type(move).__name__.lower(), trace.PLACEMENT, started, None,
                                {k: v for k, v in vars(move).items() if k != "key"})

    def _run_one(self, move) -> list:
        """Carry out ``move``; the moves it calls for in turn (room in the tier a block
        stays in when its promotion cannot be done)."""
        if isinstance(move, Evict):
            with self._lock:
                entry = self._remove_locked(move.key)
                if entry is not None:
                    self._tiers[entry.tier].evictions += 1
                fill = self._inflight.get(move.key)
                if fill is not None:
                    fill.cancelled = True  # evicted before its fill landed
            if entry is not None:
                self._tiers[entry.tier].tier.delete(move.key)
        elif isinstance(move, (Demote, Promote)):
            if isinstance(move, Promote) and not self._admitting(move.dst):
                # kept where it is (a broken or full faster tier), and counted there again:
                # counted in the faster one, its room in the slower one was handed out
                # again and that tier grew past its capacity (review epochs4)
                return self._kept(move)
            moved = self._move_tier(move.key, move.dst)
            with self._lock:
                first = self._deferred.pop(move.key, None) or time.monotonic()
                if moved is None and time.monotonic() - first < MOVE_DEFER:
                    self._deferred[move.key] = first  # its fill in flight: again next pass
                    self._pending.append(move)
                    return []
            if moved is DESTINATION_FAILED and isinstance(move, Promote):
                return self._kept(move)  # its copy in the slower tier stays, and serves
            if moved is not True:  # a demotion must make room all the same: the block goes
                self.placer.drop(move.key)
                self.drop(move.key, moved if moved in (SOURCE_CORRUPT, SOURCE_UNREADABLE)
                          else "move failed")
        elif isinstance(move, Admit):  # re-admitted by a late hit report: not cached here
            with self._lock:
                present = move.key in self._index or move.key in self._inflight
            if not present:
                self.placer.drop(move.key)
        return []

    def _kept(self, move: Promote) -> list:
        """A promotion not carried out: the block is counted where it still is, and the
        moves that make room for it there are run next."""
        with self._lock:
            entry = self._index.get(move.key)
        if entry is None:  # gone meanwhile: nothing is kept anywhere
            self.placer.drop(move.key)
            return []
        return self.placer.kept_in(move.key, entry.tier)

    def _admitting(self, name: str) -> bool:
        ts = self._tiers[name]
        return ts.broken is None and ts.full_until <= time.monotonic()

    def _move_tier(self, key: str, dst: str) -> bool | str | None:
        """Move ``key``'s block to tier ``dst``: True once it is there, False if it cannot
        be (gone, or its copy fails), SOURCE_CORRUPT or SOURCE_UNREADABLE if its file failed
        its checksum or could not be read (counted here as readers' finds are:
        ``corrupt_repaired``, ``tier_read_errors``; the caller drops it under that reason,
        logged with the others at most once a minute), DESTINATION_FAILED if ``dst`` could
        not take it (the copy stays where it is, sound), None if its fill is still in flight (planned while
        a fill written behind the read had not landed): the move waits for no fill, as it runs under the moves'
        lock, which the lease of that very fill may need to make its room (a wait here
        held every reader of the node for its length); it is tried again later."""
        with self._lock:
            entry = self._index.get(key)
            inflight = self._inflight.get(key) if entry is None else None
        if inflight is not None:
            self._land_if_staged(key, inflight)
            with self._lock:
                entry = self._index.get(key)
                if entry is None and self._inflight.get(key) is inflight \
                        and not inflight.cancelled:
                    return None
        if entry is None:
            return False
        if entry.tier == dst:
            return True
        src, lower = self._tiers[entry.tier], self._tiers[dst]
        lease = next(self._lease_numbers)  # staged, published below (see NodeCache.land)
        try:
            data = _read_whole(src.tier.block_path(key))
        except OSError as exc:  # the copy itself fails (corrupt, unreadable): it goes
            return self._bad_source(key, entry.tier, dst, exc)
        if data is None:
            return False
        try:
            stored = lower.tier.stage(key, data, lease, tag=entry.tag or b"")
        except OSError as exc:  # the destination fails: the copy where it is is sound
            lower.tier.unstage(key, lease)
            if exc.errno == errno.ENOSPC:  # as a fill meeting it: said once while it lasts
                if lower.full_until <= time.monotonic():
                    log.warning("%s tier %s is out of space; not admitting for 5 s",
                                lower.config.name, lower.tier.path)
                lower.full_until = time.monotonic() + 5.0
            elif time.monotonic() >= self._move_warned.get(dst, -60.0) + 60:
                self._move_warned[dst] = time.monotonic()
                log.warning("moving %s from %s to %s failed: %s (moves into %s logged at most "
                            "once a minute)", key, entry.tier, dst, exc, dst)
            return DESTINATION_FAILED
        with self._lock:  # dropped or invalidated meanwhile: the copy must not appear
            moved = self._index.get(key) is entry and lower.tier.publish(key, lease)
            if moved:
                self._remove_locked(key)
                self._add(key, dst, stored, entry.tag)
                if self._order.index(dst) > self._order.index(entry.tier):
                    src.demotions += 1
        if not moved:
            lower.tier.unstage(key, lease)
            return self._index.get(key) is not entry  # gone meanwhile: nothing left to move
        src.tier.delete(key)
        return True

    def _bad_source(self, key: str, tier: str, dst: str, exc: OSError) -> str | bool:
        """What a move does with a block whose own file failed (see _move_tier)."""
        if isinstance(exc, blockfile.CorruptBlock):
            reason, counter = SOURCE_CORRUPT, "corrupt_repaired"
        elif exc.errno in blockfile.TIER_FAULTS:
            reason, counter = SOURCE_UNREADABLE, "tier_read_errors"
        else:  # not the block's fault (EMFILE, ENOMEM): it goes all the same, said rarely
            if time.monotonic() >= self._move_warned.get(f"{tier}:read", -60.0) + 60:
                self._move_warned[f"{tier}:read"] = time.monotonic()
                log.warning("moving %s from %s to %s failed: %s (reads for moves out of %s "
                            "logged at most once a minute)", key, tier, dst, exc, tier)
            return False
        with self._lock:
            self.counters[counter] += 1
        return reason

    def keep_on_stop(self, budget: float = KEEP_ON_STOP) -> int:
        """On a clean stop: copy the blocks the faster tiers hold into the last one (NVMe
        outlives the daemon and the job; DRAM, a job's /dev/shm, does not), most recently
        cached first, while the last tier has room under its high watermark and for at most
        ``budget`` seconds. Each copy is read verified and written atomically; the original
        stays, so a successor that finds the DRAM tier again keeps it and drops the copy
        (NodeCache._reindex keeps the faster one). Returns the blocks copied."""
        if len(self._order) < 2:
            return 0
        lower = self._tiers[self._order[-1]]
        deadline = time.monotonic() + budget
        with self._lock:
            upper = [(k, e) for k, e in self._index.items() if e.tier != self._order[-1]]
            room = lower.config.high_bytes - lower.used - lower.reserved
        copied, failed, first_failure = 0, 0, ""
        for key, entry in reversed(upper):  # the index keeps insertion order: newest last
            if time.monotonic() > deadline:
                log.info("clean stop: %d blocks not copied to %s (out of time)",
                         len(upper) - copied, lower.config.name)
                break
            if entry.stored > room:
                continue
            try:
                data = _read_whole(self._tiers[entry.tier].tier.block_path(key))
                if data is None:
                    continue
                room -= lower.tier.put(key, data, tag=entry.tag or b"")
            except OSError as exc:  # a corrupt block, a full disk: not kept, never fatal
                failed += 1
                first_failure = first_failure or f"{key}: {exc}"
                continue
            copied += 1
        if failed:  # one line, not one per block (a failing disk fails them all)
            log.warning("clean stop: %d block(s) not copied to %s (the first: %s)", failed,
                        lower.config.name, first_failure)
        if copied:
            log.info("clean stop: copied %d blocks to %s for the next daemon", copied,
                     lower.config.name)
        return copied

    def _prefetch(self, budget: int = 256 << 20) -> None:
        run_prefetch(self, budget)


def _read_whole(path: str) -> bytes | None:
    """A block file's data (verified), its length derived from the file's size."""
    try:
        size = os.stat(path).st_size
    except blockfile.ABSENT:  # gone, or its directory is no directory (as a reader takes it)
        return None
    return blockfile.read_block(path, blockfile.data_length(size, path))
