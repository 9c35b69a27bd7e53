"""The OS priority of a save's background threads (write, commit, drain).

A save returns after its snapshot; the rest runs in threads of the trainer's process while
training goes on. At the same priority they take their share of the cores from the
DataLoader's workers and the trainer's own threads, which then deliver batches late: the
accelerator waits, the AU lost to checkpoints grows. Niced, they run on the cycles the
training leaves idle (an accelerator step frees the cores it waits on) and yield them when
the loader needs them (a nice of +10 still gets about a tenth of a contended core). On
Linux a nice value is per thread, and threads started by a niced thread inherit it;
elsewhere a nice value would be the whole process's, so nothing is done. The cost: a
trainer that waits for a save (``wait``, ``close``, a save finding the previous one busy)
waits for work running at the lower priority.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

PER_THREAD = sys.platform.startswith("linux") and hasattr(os, "setpriority")


def niceness(nice: int) -> int | None:
    """The nice value ``nice`` above the calling thread's (which a background thread is
    given by ``run_at``); None where nothing is to be done."""
    if nice <= 0 or not PER_THREAD:
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)
    except OSError as exc:
        log.debug("could not read this thread's priority: %s", exc)
        return None


def run_at(value: int | None) -> None:
    """Give the calling thread the nice value ``value`` unless it runs lower already (a
    thread started by a niced one inherits its value): a pool's ``initializer``."""
    if value is None:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < value:
            os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as exc:  # a sandbox refusing it: the save runs at the trainer's priority
        log.debug("could not lower the priority of a checkpoint thread: %s", exc)
