"""What a node daemon knows of the checkpoints its trainers save: the record behind the
``cachemw_checkpoint_*`` metrics and the checkpoints in flight of ``cachemw top``.

Trainer processes tell their node's daemon over its socket (one-way ``checkpoint`` notes:
cachemw.node_daemon.note_checkpoint) when a save begins and how it ended, so the metrics
of every rank on a node come out of the endpoint the daemon already serves. Why not
prometheus_client's multiprocess mode: it needs PROMETHEUS_MULTIPROC_DIR set before each
trainer starts, leaves a file per process to clean up, and cannot hold the daemon's own
metrics, which are read from its counters at scrape time by a custom collector (a thing
multiprocess mode does not support); and a trainer would need an endpoint of its own.

Counted per trainer process (rank): each rank's saves, the bytes it wrote, how long its
training loop was blocked (``stall``), and how long until its save was durable at the
root. A rank that dies mid-save leaves no note: a save in flight whose process is gone is
dropped from the in-flight list (not counted as saved or failed).
"""
from __future__ import annotations

import threading
import time

from ..processes import process_alive
from ..readtime import Histogram

STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURABLE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                   1800.0, 3600.0)


class CheckpointLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.saves = {"ok": 0, "failed": 0}
        self.bytes = 0
        self.last_step = -1  # the newest step a rank here saw durable
        self.stall = Histogram(STALL_BUCKETS)
        self.durable = Histogram(DURABLE_BUCKETS)
        self._inflight: dict[tuple[int, int], dict] = {}  # (pid, step) -> what began

    def note(self, record: dict) -> None:
        """``{"event": "begin"|"end", "pid", "start", "step", ...}``: a save began (with
        ``stall`` seconds, the time ``save()`` blocked), or ended (``ok``, ``bytes``,
        ``durable`` seconds from ``save()`` to durable). Anything malformed is ignored:
        a note is information, never a reason for the daemon to fail."""
        try:
            event, pid, step = record["event"], int(record["pid"]), int(record["step"])
        except (KeyError, TypeError, ValueError):
            return
        with self._lock:
            if event == "begin":
                self._inflight[(pid, step)] = {
                    "pid": pid, "start": record.get("start"), "step": step,
                    "since": time.time(), "root": str(record.get("root", ""))}
                stall = record.get("stall")
                if isinstance(stall, (int, float)) and stall >= 0:
                    self.stall.observe(float(stall))
            elif event == "end":
                self._inflight.pop((pid, step), None)
                ok = bool(record.get("ok"))
                self.saves["ok" if ok else "failed"] += 1
                nbytes = record.get("bytes")
                if isinstance(nbytes, int) and nbytes > 0:
                    self.bytes += nbytes
                durable = record.get("durable")
                if ok and isinstance(durable, (int, float)) and durable >= 0:
                    self.durable.observe(float(durable))
                    self.last_step = max(self.last_step, step)

    def stats(self) -> dict:
        with self._lock:
            gone = [k for k, v in self._inflight.items()
                    if not process_alive(v["pid"], v.get("start"))]
            for k in gone:
                del self._inflight[k]
            now = time.time()
            return {
                "saves": dict(self.saves), "bytes": self.bytes, "last_step": self.last_step,
                "stall_seconds": self.stall.to_dict(), "durable_seconds": self.durable.to_dict(),
                "in_flight": [dict(v, seconds=now - v["since"]) for v in self._inflight.values()],
            }
