"""Writing fills on the daemon's own core.

A client that fetched a leased block from the source hands its bytes over ("put") and goes
on with them at once; the daemon writes the tier file here, on a writer thread, so no
tmpfs/NVMe write sits on the reader's critical path (on this machine kind writing 128 KiB
into tmpfs costs twice reading it from the page cache). Puts are written in arrival order;
the bytes waiting are bounded, so a client that outruns the writer waits in its send
(backpressure through the socket) instead of growing the daemon's heap. ``drain`` waits for
everything submitted before it: a client's "sync" (tests, ``cachemw warm``).
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

log = logging.getLogger("cachemw.fills")


class FillWriter:
    def __init__(self, write: Callable[[str, str, bytes, bytes | None, object], object], *,
                 max_pending: int = 64 << 20) -> None:
        self._write = write
        self.max_pending = max_pending
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cachemw-fill", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def submit(self, key: str, tier: str, data: bytes, tag: bytes | None, conn: object) -> bool:
        """Queue a block for writing; waits while too many bytes are queued. False once
        closed (the caller ends the lease)."""
        return self.submit_task(self._write, (key, tier, data, tag, conn), len(data))

    def submit_task(self, fn: Callable, args: tuple, nbytes: int) -> bool:
        """Queue any other write (e.g. node-shared metadata records), in the same order."""
        with self._cond:
            while self._pending >= self.max_pending and self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._queue.append((fn, args, nbytes))
            self._pending += nbytes
            self._cond.notify_all()
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every block submitted before this call is written (or has failed)."""
        marker = threading.Event()
        with self._cond:
            if self._closed:
                return not self._thread.is_alive()
            self._queue.append(marker)
            self._cond.notify_all()
        return marker.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed, and everything queued is written
                item = self._queue.popleft()
            if isinstance(item, threading.Event):
                item.set()
                continue
            fn, args, nbytes = item
            try:
                fn(*args)
            except Exception:  # never lose the writer; a block's lease ends in its caller
                log.exception("a queued write failed")
            finally:
                with self._cond:
                    self._pending -= nbytes
                    self._cond.notify_all()
