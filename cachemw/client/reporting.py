"""What a process tells its node daemon without waiting for an answer: its counters (reads,
hits, bytes, the readers' seconds: cachemw.protocol.CLIENT_COUNTERS) and the keys of the
blocks it hit, per tier (recency for the placement engine), gathered here and reported
every ``report_interval`` seconds or 4,096 hits, and when the process exits. A reading
thread reports when it reads; what a process counted before it went idle (a trainer between
epochs, a worker waiting on its queue) is reported by one thread per process that wakes
every ``report_interval`` (``_tick``), so ``cachemw stats`` and the metrics are never more
than that behind.

``Reporter`` is the gathering half of ``link.DaemonClient``, which delivers each report
(``_deliver``: on the socket, or left in the runtime dir) and provides ``_lock``,
``_pid`` and ``report_interval``. Counting is on every read's path: a lock and a few
additions, no I/O; keys wait as strings (no object per hit for the garbage collector).
"""
from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading
import time
import weakref

from ..protocol import CLIENT_COUNTERS
from . import heap
from .fills import drain_all

_reporters: "weakref.WeakSet[Reporter]" = weakref.WeakSet()
_exit_hook_pid = 0
exiting = False  # in the exit flush: a daemon stopped before this process is no news
# held by the idle reporter's thread while it reports, and by the exit flush, which so never
# ends (and the process with it) while that thread holds counters it took out
_ticking = threading.Lock()


def _reset_in_child() -> None:
    global _ticking
    _ticking = threading.Lock()  # a fork while the parent's thread held it: free here


os.register_at_fork(after_in_child=_reset_in_child)


def _flush_all() -> None:
    global exiting
    exiting = True
    drain_all(timeout=30.0)  # fills written behind end their leases before the last report
    with _ticking:
        for reporter in list(_reporters):
            reporter.flush()


def first_use_in_process() -> int:
    """Once in each process, at its first read or count: flush reports when the process
    exits, whatever kind of process it is, and in a DataLoader worker keep the heap between
    batches (heap.py). Returns the pid it ran in.

    multiprocessing children (DataLoader workers) skip atexit and clear the finalizer
    registry when they start, so the hook is registered on first use in each process.
    """
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        atexit.register(_flush_all)
        multiprocessing.util.Finalize(None, _flush_all, exitpriority=10)
        heap.keep_in_worker()
        threading.Thread(target=_tick, args=(_exit_hook_pid,), name="cachemw-reports", daemon=True).start()
    return _exit_hook_pid


def _tick(pid: int) -> None:
    """Report what idle reporters counted (see the module's docstring); ends with exit or
    in a forked child (this thread is not in it: the child starts its own)."""
    interval = 0.5
    while not exiting and os.getpid() == pid:
        time.sleep(interval)
        try:
            interval = _report_idle()
        except Exception:  # noqa: BLE001 - reported with the next pass; reads go on
            pass


def _report_idle() -> float:
    """One pass of ``_tick``: flush each reporter idle past its interval; return the next
    pause (no reporter is kept alive between passes)."""
    with _ticking:
        if exiting:
            return 0.5
        reporters = list(_reporters)  # taken as a whole: no iteration while one is added
        for reporter in reporters:
            reporter.maybe_flush(connect=False)
        return max(0.05, min((r.report_interval for r in reporters), default=0.5))


class HitTally:
    """Hits an open file counts itself (its reads of the blocks it holds open), with no lock per read:
    a lock per 4 KiB read costs more than the read. Only the file adds to ``reads`` and
    ``nbytes``; only the client moves ``folded_*`` up to them when it folds them into its
    counters (stats, flush, the file's close), so a read racing with a fold is counted at
    the next one, never lost."""

    __slots__ = ("reads", "nbytes", "folded_reads", "folded_bytes", "__weakref__")

    def __init__(self) -> None:
        self.reads = self.nbytes = self.folded_reads = self.folded_bytes = 0


class Reporter:
    """Counters and recency gathered between reports (see the module's docstring)."""

    # hits at other nodes told the daemon (which copies a block read again and again here);
    # off for a warm, whose reads of other nodes' blocks are not this node's
    report_remote_hits = True

    def _reset_reports(self) -> None:
        """Fresh at start and in a forked child (the parent reports its own)."""
        self._hook_pid = 0
        # the hit tallies of open files (HitTally), folded in on flush and stats
        self._tallies: "weakref.WeakSet[HitTally]" = weakref.WeakSet()
        self.counters = dict.fromkeys(CLIENT_COUNTERS, 0)
        self._unsent = dict.fromkeys(CLIENT_COUNTERS, 0)
        self._tier_hit_bytes: dict[str, int] = {}
        # keys of the hits since the last report, per tier (strings: no object per hit for
        # the garbage collector to track while they wait)
        self._accesses: dict[str, list[str]] = {}
        self._naccesses = 0
        self._last_flush = time.monotonic()
        _reporters.add(self)

    def _deliver(self, counters: dict, accesses: dict[str, list[str]], connect: bool = True) -> bool:
        raise NotImplementedError

    def count(self, name: str, n: int = 1) -> None:
        if self._hook_pid != self._pid:
            self._hook_pid = first_use_in_process()
        with self._lock:
            self.counters[name] += n
            self._unsent[name] += n

    def hit(self, key: str, tier: str, nbytes: int, seconds: float = 0.0) -> None:
        if self._hook_pid != self._pid:
            self._hook_pid = first_use_in_process()
        with self._lock:
            self.counters["hits"] += 1
            self.counters["hit_bytes"] += nbytes
            self.counters["hit_seconds"] += seconds
            self._unsent["hits"] += 1
            self._unsent["hit_bytes"] += nbytes
            self._unsent["hit_seconds"] += seconds
            self._tier_hit_bytes[tier] = self._tier_hit_bytes.get(tier, 0) + nbytes
            keys = self._accesses.get(tier)
            if keys is None:
                keys = self._accesses[tier] = []
            keys.append(key)
            self._naccesses += 1
            due = self._naccesses >= 4096
        if due or time.monotonic() - self._last_flush > self.report_interval:
            self.flush()

    def hit_tally(self) -> HitTally:
        """A tally for an open file's own hits (see HitTally), folded in on stats and flush
        while the file lives, and by fold() when it closes."""
        tally = HitTally()
        with self._lock:
            self._tallies.add(tally)
        return tally

    def fold(self, tally: HitTally) -> None:
        """Add what ``tally`` counted since its last fold to the counters to report."""
        reads, nbytes = tally.reads, tally.nbytes  # the file may be adding meanwhile
        with self._lock:
            new_reads, new_bytes = reads - tally.folded_reads, nbytes - tally.folded_bytes
            tally.folded_reads, tally.folded_bytes = reads, nbytes
            self.counters["hits"] += new_reads
            self.counters["hit_bytes"] += new_bytes
            self._unsent["hits"] += new_reads
            self._unsent["hit_bytes"] += new_bytes

    def accessed(self, key: str, tier: str) -> None:
        """Recency only (the reads themselves are counted by the caller, with count())."""
        with self._lock:
            self._accesses.setdefault(tier, []).append(key)
            self._naccesses += 1

    def maybe_flush(self, connect: bool = True) -> None:
        if time.monotonic() - self._last_flush > self.report_interval:
            self.flush(connect)

    def fold_tallies(self) -> None:
        with self._lock:
            tallies = list(self._tallies)
        for tally in tallies:
            self.fold(tally)

    def flush(self, connect: bool = True) -> None:
        """Report the counters and recency gathered since the last report (``_deliver``);
        if the daemon is unreachable, keep the counters for the next one. ``connect=False``
        (the idle reporter's thread): only if it can be done without connecting or starting
        a daemon, else left for the reading threads' next report."""
        if os.getpid() != self._pid:
            return
        self.fold_tallies()
        self._last_flush = time.monotonic()
        with self._lock:
            if not self._naccesses and not any(self._unsent.values()):
                return
            unsent, tier_bytes, accesses = self._unsent, self._tier_hit_bytes, self._accesses
            naccesses = self._naccesses
            self._unsent = dict.fromkeys(CLIENT_COUNTERS, 0)
            self._tier_hit_bytes, self._accesses, self._naccesses = {}, {}, 0
        counters = {k: v for k, v in unsent.items() if v}
        counters["tier_hit_bytes"] = tier_bytes
        if self._deliver(counters, accesses, connect):
            return
        with self._lock:  # daemon unreachable: keep the counters for later, drop old recency
            for k, v in unsent.items():
                self._unsent[k] += v
            for k, v in tier_bytes.items():
                self._tier_hit_bytes[k] = self._tier_hit_bytes.get(k, 0) + v
            if naccesses + self._naccesses <= 65536:
                for tier, keys in accesses.items():
                    self._accesses[tier] = keys + self._accesses.get(tier, [])
                self._naccesses += naccesses
