"""Where a cachemw epoch's I/O wait went: the node daemon's read-time counters
(cachemw/readtime.py), summed over every process of the node, diffed around the epoch.

Each process reports its counters to the daemon every ``report_interval`` (0.5 s) while it
reads, and at exit. The job's DataLoader workers are persistent: idle between epochs,
they would keep their last half second of counts until the next epoch's reads. So each
worker runs a small thread that, when the trainer asks (``WorkerFlush.flush``, after the
epoch's last batch), sends its counts and asks the daemon for its stats on the same
connection (the daemon handles a connection's messages in order: the answer means the
report is applied), then says it is done. The trainer waits for every worker's answer,
not for a guessed time; a worker that does not answer within ``timeout`` leaves the
epoch's breakdown marked incomplete.

Reader seconds are summed over processes and threads reading at once: not wall time.
The table shows them as shares of the readers' time.
"""
from __future__ import annotations

import multiprocessing
import threading

# (kind in the breakdown, daemon counter of its seconds, daemon counter of its reads)
KINDS = (
    ("hit", "hit_seconds", "hits"),
    ("remote", "remote_hit_seconds", "remote_hits"),
    ("source", "source_seconds", "source_reads"),
    ("lease_wait", "lease_seconds", "lease_waits"),
)


def breakdown(before: dict | None, after: dict | None, complete: bool) -> dict | None:
    """Seconds and reads per kind between two snapshots of a daemon's counters, the
    readers' total seconds, and whether every reader's counts were in (``complete``)."""
    if before is None or after is None:
        return None
    out = {}
    for kind, seconds, reads in KINDS:
        out[f"{kind}_s"] = after.get(seconds, 0) - before.get(seconds, 0)
        out[f"{kind}_reads"] = after.get(reads, 0) - before.get(reads, 0)
    out["readers_s"] = sum(out[f"{kind}_s"] for kind, _, _ in KINDS)
    out["complete"] = complete
    return out


def shares(b: dict | None) -> dict | None:
    """Each kind's share of the readers' seconds (None without any)."""
    if not b or not b.get("readers_s"):
        return None
    return {kind: b[f"{kind}_s"] / b["readers_s"] for kind, _, _ in KINDS}


class WorkerFlush:
    """Makes every DataLoader worker's counts reach its daemon at a point the trainer
    chooses. Built in the trainer from the loader's multiprocessing context (its
    semaphores must be of the kind the workers are started with), carried to each worker
    in the dataset; ``start_in_worker`` runs in the worker (training.worker_init, the loader's
    worker_init_fn)."""

    def __init__(self, context: str, workers: int) -> None:
        ctx = multiprocessing.get_context(context)
        self.workers = workers
        self._cond = ctx.Condition()
        self._asked = ctx.Value("l", 0, lock=False)  # guarded by _cond
        self._served = ctx.Array("l", workers, lock=False)  # the last round each worker served

    def start_in_worker(self, worker_id: int, fs_of) -> None:
        """``fs_of()``: this worker's filesystem (a cachemw one, with its daemon link)."""
        threading.Thread(target=self._serve, args=(worker_id, fs_of), daemon=True,
                         name="cachemw-job-flush").start()

    def _serve(self, worker_id: int, fs_of) -> None:
        served = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked.value > served)
                wanted = self._asked.value
            client = getattr(fs_of(), "client", None)
            if client is not None:
                client.daemon_stats()  # report, then a round trip: the report is applied
            served = wanted
            with self._cond:
                self._served[worker_id] = served
                self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Every worker's counts are at the daemon (True), or some worker did not answer
        within ``timeout`` seconds (False)."""
        if not self._cond.acquire(timeout=timeout):
            return False
        try:
            self._asked.value += 1
            wanted = self._asked.value
            self._cond.notify_all()
            return self._cond.wait_for(lambda: min(self._served[:]) >= wanted, timeout)
        finally:
            self._cond.release()

