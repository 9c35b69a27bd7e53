"""Write-behind fills: a reader hands a block it fetched to a writer thread and returns.

Writing a block file costs about as much as reading the block from a fast source: on tmpfs
a 128 KiB fill pays first-touch page allocation, page checksums, a create and a rename,
0.2-0.3 ms on the reader's path for every miss. One writer thread per process takes that
off the path; the write releases the GIL, so it overlaps the reader's next source request.

Nothing is lost or read stale on the way:

* the block's bytes stay in memory (``pending``) until its file has landed, so this process
  reads them back meanwhile; other processes wait on the daemon's lease as for any fill in
  flight, and get "present" once it ends;
* the lease is ended ("filled", or "abort" with the reason) over the connection of the thread
  that took it: the daemon matches a lease to its connection. If that connection is gone
  (the daemon died or dropped it), the daemon has already aborted the lease, so the file
  just written is deleted rather than left unaccounted;
* the queue is bounded (``max_bytes``): past it the reader writes the block itself;
* it is drained before a process exits, before stats are read and before a write to the
  target invalidates cached blocks (so a stale block cannot land after the invalidation).
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import weakref
from typing import NamedTuple

log = logging.getLogger("cachemw.fills")

_writers: "weakref.WeakSet[FillWriter]" = weakref.WeakSet()


class Fill(NamedTuple):
    key: str
    tier: object  # the DirectoryTier the daemon leased
    data: bytes
    tag: bytes
    link: object  # the leasing thread's connection (DaemonClient.link())


class FillWriter:
    def __init__(self, client, max_bytes: int) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self._warned = False
        self._reset()
        _writers.add(self)

    def _reset(self) -> None:
        """Fresh state: at start and in a forked child (whose parent's thread did not come
        along; the parent writes its own queue)."""
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[Fill] = collections.deque()
        self.pending: dict[str, bytes] = {}  # key -> bytes, until its file has landed
        self._queued_bytes = 0
        self._busy = 0  # fills taken off the queue and not yet ended
        self._thread: threading.Thread | None = None

    def submit(self, fill: Fill) -> None:
        """Queue the fill; when the queue is full (or no writer is wanted), write it now."""
        n = len(fill.data)
        with self._cv:
            queued = self.max_bytes > 0 and self._queued_bytes + n <= self.max_bytes
            if queued:
                self._queue.append(fill)
                self.pending[fill.key] = fill.data
                self._queued_bytes += n
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="cachemw-fills",
                                                    daemon=True)
                    self._thread.start()
                self._cv.notify()
        if not queued:
            self.store(fill)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued fill has ended; False if that took longer than ``timeout``."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                fill = self._queue.popleft()
                self._busy += 1
            try:
                self.store(fill)
            except BaseException:  # store() ends the lease itself; never kill the writer
                log.exception("cachemw fill writer: unexpected error on block %s", fill.key)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._queued_bytes -= len(fill.data)
                    if self.pending.get(fill.key) is fill.data:
                        del self.pending[fill.key]
                    self._cv.notify_all()

    def store(self, fill: Fill) -> None:
        """Write the block file and end its lease; counted as a fill or a fill error."""
        client = self.client
        try:
            stored = fill.tier.put(fill.key, fill.data, tag=fill.tag)
        except OSError as exc:
            reason = "nospace" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "error"
            client.note_via(fill.link, "abort", fill.key, reason)
            client.count("fill_errors")
            if not self._warned:
                log.warning("could not fill the %s tier (%s); reading on from the source",
                            fill.tier.name, exc)
                self._warned = True
            return
        if client.note_via(fill.link, "filled", fill.key, fill.tier.name, stored):
            client.count("fills")
        else:  # the daemon dropped the lease with the connection: nobody accounts this file
            fill.tier.delete(fill.key)


def drain_all(client=None, timeout: float = 60.0) -> None:
    """Drain every writer of this process, or those ending leases of ``client``."""
    for writer in list(_writers):
        if client is None or writer.client is client:
            writer.drain(timeout)


def _reset_all_in_child() -> None:
    for writer in list(_writers):
        writer._reset()


os.register_at_fork(after_in_child=_reset_all_in_child)
