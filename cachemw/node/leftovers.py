"""Fill files whose writer died while the daemon runs: removed by the daemon, a little at a time.

A reader or fill writer killed between creating a block's temp file and renaming it (or
between staging a fill and the daemon publishing it, when the daemon that granted the
lease died too) leaves a file in a tier that no index counts: on /dev/shm, RAM nobody sees
(review loaders5). A daemon's start removes such files (DirectoryTier.scan), but one whose
writer was still alive then and died later stayed until the daemon stopped. So the
maintenance thread goes through one sub-directory of each tier every SUB_EVERY seconds
(a tier's 256 in about eight and a half minutes, a few milliseconds each however full the
tier) and removes what was last written ORPHAN_AGE seconds ago or more: a writer writes a
block in milliseconds and renames it at once, and a staged fill of a lease still held is
left alone. A writer that had stalled that long finds its file gone, and its fill fails as
any failed fill does (counted; the block is read again on its next miss).
"""
from __future__ import annotations

import logging
import time

from ..tiers.directory import FANOUT

log = logging.getLogger(__name__)

ORPHAN_AGE = 300.0  # seconds since its last write before a fill file counts as left over
SUB_EVERY = 2.0  # seconds between two sub-directories of a tier


class LeftoverSweep:
    """Where the sweep is in the tiers' sub-directories, and what it removed this round."""

    def __init__(self) -> None:
        self.next_sub = 0
        self.due = 0.0  # time.monotonic() of the next sub-directory
        self.files = self.bytes = 0  # removed since the round began (logged at its end)


class LeftoverSweeping:
    """The part of NodeCache (node/cache.py) that removes left-over fill files."""

    def sweep_leftovers(self) -> int:
        """One step: the next sub-directory of every tier, if it is due. Returns the files
        removed."""
        sweep = self._leftovers
        clock = time.monotonic()
        if clock < sweep.due:
            return 0
        sweep.due = clock + SUB_EVERY
        sub = FANOUT[sweep.next_sub]
        sweep.next_sub = (sweep.next_sub + 1) % len(FANOUT)
        before = time.time() - ORPHAN_AGE
        removed = 0
        for name in self._order:
            ts = self._tiers[name]
            if ts.broken is not None:
                continue
            files, freed = ts.tier.sweep_leftovers(sub, before, self._lease_held)
            removed += files
            sweep.files += files
            sweep.bytes += freed
        if removed:
            with self._lock:
                self.counters["leftovers_removed"] += removed
        if sweep.next_sub == 0 and sweep.files:
            log.warning("removed %d fill file(s) of %d bytes whose writers died before "
                        "finishing them (counted as leftovers_removed)", sweep.files, sweep.bytes)
            sweep.files = sweep.bytes = 0
        return removed

    def _lease_held(self, key: str, lease: int) -> bool:
        with self._lock:
            inflight = self._inflight.get(key)
            return inflight is not None and inflight.lease == lease
