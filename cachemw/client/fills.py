"""Write-behind fills: a reader hands a block it fetched to a writer thread and returns.

Writing a block file costs about as much as reading the block from a fast source: on tmpfs
a 128 KiB fill pays first-touch page allocation, page checksums, a create and a rename,
0.2-0.3 ms on the reader's path for every miss. One writer thread per process takes that
off the path: it writes while the reader waits for its next lease and source request.

Nothing is lost or read stale on the way:

* the block's bytes stay in memory (``pending``) until its file has landed, so this process
  reads them back meanwhile, through any of its filesystems (``pending`` is the process's,
  shared by every writer: a second instance made with other options, by pandas or HF
  datasets, reads them too rather than fetching the block again); other processes wait on
  the daemon's lease as for any fill in flight, and get "present" once it ends;
* a reader never waits for the writer thread to land a block it re-reads: the writer runs
  whatever a garbage collection on it finalizes, and a finalizer may need a lock the reader
  holds (h5py's global lock, held while h5py reads through a file object): both would wait
  for each other. The pending bytes are served instead (``pending_fill``), unless the file
  was written through the cache since they were fetched (then the daemon cancels the fill,
  and the read goes to the source, pinned to the version: a rewrite that kept the version
  token is not served stale from here either);
* the block file is staged, and only the daemon publishes it under its key (tiers/
  directory.py): a fill written behind a write through the cache (which cancels its
  lease) is dropped, never seen by a hit;
* the lease is ended ("filled", or "abort" with the reason) over the connection of the thread
  that took it: the daemon matches a lease to its connection. If that connection is gone
  (the daemon died or dropped it), the daemon has already ended the lease, so what is still
  staged is deleted rather than left unaccounted;
* a block fetched before its lease (a cold read learns the block's key, so the file's
  version, from the very response that brought it: reader.read_cold) is leased here too,
  then written (``adopt``): the lease's round trip to the daemon leaves the reader's path
  as the write does, and the bytes stay in ``pending`` until it has ended;
* the queue is bounded (``max_bytes``): past it the reader writes the block itself;
* it is drained before a process exits, before stats are read and before a write to the
  target invalidates cached blocks.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
import weakref
from typing import Callable, NamedTuple

from .. import ops, trace

log = logging.getLogger(__name__)

_writers: "weakref.WeakSet[FillWriter]" = weakref.WeakSet()

# The fills of every writer of the process not ended yet (written and noted, or aborted):
# key -> bytes, the writer holding each, and the bytes with what tells whether the file was
# written through the cache since they were fetched (``dropped()``; None: cannot tell, not
# served: see pending_fill)
_pending: dict[str, bytes] = {}  # (never rebound: every writer's ``pending``)
_holders: dict[str, "FillWriter"] = {}
_servable: dict[str, tuple[bytes, Callable[[], bool] | None]] = {}
_pending_lock = threading.Lock()  # taken inside a writer's _cv, never the other way


class _NoWriter(RuntimeError):
    """No writer thread can start (interpreter shutdown): the caller does the work itself."""


class Fill(NamedTuple):
    key: str
    tier: object  # the DirectoryTier the daemon leased
    data: bytes
    tag: bytes
    link: object  # the leasing thread's connection (DaemonClient.link())
    lease: int  # the lease's number: names the staged file the daemon will publish
    # was the file written through the cache since the block was asked for? (None: cannot
    # tell: a re-read meanwhile goes to the source rather than to the pending bytes)
    dropped: Callable[[], bool] | None = None


class _Adopt(NamedTuple):
    """A block fetched before its lease: ``runner([entry, ...])`` leases the blocks of a
    batch of them together (adopt.py) and fills each (or not)."""

    key: str
    data: bytes
    entry: object
    runner: object
    dropped: Callable[[], bool] | None  # as Fill.dropped


class FillWriter:
    """When to write matters as much as where. On a GIL runtime two busy threads hand the
    GIL over at every system call, and on these VMs each hand-over is a thread wake-up
    (30-50 us): a writer woken right after each miss doubled the reader's metadata and lease
    times. So a fill waits until the reader blocks anyway: ``kick()`` when its next miss is
    about to wait on the source (with the GIL released), a ``drain()``, or at the latest
    ``LINGER`` after it was queued. Idle for ``IDLE`` the
    thread ends, so a process that stopped missing costs no wake-ups.

    Small blocks go in batches: a kick wakes the writer once ``BATCH`` fills or
    ``BATCH_BYTES`` are queued, and it takes about that much off the queue at once (see
    _take_batch: the block that reaches the bytes comes along): the adopted blocks'
    leases in one request per claim state (adopt.py), their "filled" notes in one message
    per connection. Each request wakes the daemon (a process switch on a busy node), and
    per 128 KiB miss the two of them cost more CPU, client and daemon together, than
    writing the block file.
    """

    LINGER = 0.02
    IDLE = 1.0
    BATCH = 16
    # each batch wakes the writer and the daemon once: for 128 KiB blocks, 512 KiB batches
    # cost about the CPU per miss of 1 MiB ones, 256 KiB ones a third more; the smaller
    # of the two cheap ones keeps a batch's burst of writes short (docs/benchmarks.md)
    BATCH_BYTES = 512 << 10

    def __init__(self, client, max_bytes: int) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self._warned = False
        self._write_cost = 0.0  # seconds per byte to write a block file (moving average)
        self._reset()
        _writers.add(self)

    def _reset(self) -> None:
        """Fresh state: at start and in a forked child (whose parent's thread did not come
        along; the parent writes its own queue)."""
        self._cv = threading.Condition(threading.Lock())
        # (queued at, a Fill or a deferred (fn, arg) such as a node-shared metadata record)
        self._queue: collections.deque[tuple[float, object]] = collections.deque()
        self.pending = _pending  # key -> bytes until its file has landed: the process's
        self._queued_bytes = 0  # of fills not ended yet (queued or being written)
        # fills in the queue (not taken by the writer yet), and their bytes: a batch's size
        self._waiting, self._waiting_bytes = 0, 0
        self._busy = 0  # fills taken off the queue and not yet ended
        self._urgent = False  # write what is queued now (kick or drain)
        self._thread: threading.Thread | None = None
        # notes sent on the writer's own connection (an adopted block's lease and fill)
        # that no round trip on it has followed yet: see drain
        self._unsynced = False
        # the connections (by id) of reading threads on which this writer ended leases
        # since their thread's last drain: see drain
        self._noted: set[int] = set()

    def submit(self, fill: Fill, waited: float = float("inf")) -> None:
        """Queue the fill; write it now when the queue is full, when no writer is wanted, or
        when the reader's source answered (``waited`` seconds) faster than writing this
        block takes: with no wait to hide the write in, the writer would only compete with
        the reader for the GIL (a hot page cache: 1.25x slower written behind)."""
        n = len(fill.data)
        with self._cv:
            queued = (self._has_room(n) and waited >= self._write_cost * n
                      and self._hold(fill))
        if not queued:
            self.store(fill)

    def adopt(self, key: str, data: bytes, entry, runner,
              dropped: Callable[[], bool] | None = None) -> None:
        """Have ``runner([entry])`` (lease block ``key``, fetched before its lease, and fill
        it with ``data``) done on the writer, batched with the other adopted blocks queued
        with the same ``runner``; ``data`` served from ``pending`` until it has ended
        (unless ``dropped()``, as Fill.dropped). Done now, on this thread, when the queue
        is full or no writer can start."""
        with self._cv:
            queued = self._has_room(len(data)) and self._hold(
                _Adopt(key, data, entry, runner, dropped))
        if not queued:
            runner([entry])

    def _has_room(self, n: int) -> bool:
        """Under _cv: is a writer wanted, with room in its queue for ``n`` more bytes?"""
        return self.max_bytes > 0 and self._queued_bytes + n <= self.max_bytes

    def _hold(self, item: Fill | _Adopt) -> bool:
        """Under _cv: queue ``item`` for the writer, its bytes served from ``pending``
        until it has ended; False if no writer can start (the caller does the work)."""
        try:
            self._enqueue(item)
        except _NoWriter:
            return False
        n = len(item.data)
        with _pending_lock:
            _pending[item.key] = item.data
            _holders[item.key] = self
            _servable[item.key] = (item.data, item.dropped)
        self._queued_bytes += n
        self._waiting += 1
        self._waiting_bytes += n
        return True

    def on_writer(self) -> bool:
        """True on the writer thread itself."""
        return threading.current_thread() is self._thread

    def defer(self, fn, arg) -> None:
        """Run ``fn(arg)`` on the writer, in order with the fills (or now, if no writer)."""
        if self.max_bytes > 0:
            with self._cv:
                try:
                    self._enqueue((fn, arg))
                    return
                except _NoWriter:
                    pass
        fn(arg)

    def _enqueue(self, item) -> None:
        """Under _cv. The writer thread exits when idle (so a dropped filesystem, its
        client and connections are not pinned by it) and is started again here."""
        self._queue.append((time.monotonic(), item))
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="cachemw-fills", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # at interpreter shutdown (Python 3.12+): no new threads
                self._queue.pop()
                raise _NoWriter from None
            self._thread = thread

    def kick(self) -> None:
        """The reader is about to wait on its source: write now, if a batch is queued."""
        if self._waiting >= self.BATCH or self._waiting_bytes >= self.BATCH_BYTES:
            with self._cv:
                if self._queue:
                    self._urgent = True
                    self._cv.notify()

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued fill has ended and the daemon has read its notes; False
        if that took longer than ``timeout`` (or if called from the writer thread itself,
        which cannot wait on its own work).

        The daemon reads each connection in order, not connections in order: a note the
        writer sent on its own connection (an adopted block's "filled") could be read after
        a request the caller sends next on its own (stats, a lease). So when the writer sent
        any, it makes one round trip on its connection before the drain returns. Likewise a
        "filled" it sent on the caller's connection is only in the daemon's socket buffer:
        a request on a third connection (another client asking for stats, a process
        looking at the claims directory) could be served first, so the caller makes one
        round trip on its own connection too. Another reading thread's notes are its own
        drain's to see read."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if threading.current_thread() is self._thread:
                return not self._queue
            if self._queue:
                self._urgent = True
                self._cv.notify()
            idle = lambda: not self._queue and not self._busy  # noqa: E731
            if not self._cv.wait_for(idle, timeout):
                return False
            mine = self.client.link()
            noted_here = mine is not None and id(mine[0]) in self._noted
            self._noted.discard(id(mine[0]) if mine is not None else None)
            drained = True
            if self._unsynced:
                self._unsynced = False
                try:
                    self._enqueue((self._sync, None))
                except _NoWriter:  # at shutdown: its connection is going with it
                    pass
                else:
                    self._urgent = True
                    self._cv.notify()
                    drained = self._cv.wait_for(idle, max(0.0, deadline - time.monotonic()))
        if noted_here and drained:
            self.client.settle()  # on this thread's connection, past the notes sent on it
        return drained

    def _sync(self, _) -> None:
        self.client.settle()

    @staticmethod
    def pending_fill(key: str) -> tuple[bytes, bool] | None:
        """The bytes of the pending fill of ``key`` (by any writer of the process) and
        whether they may be served (the file was not written through the cache since they
        were fetched, as far as the node's metadata table tells); None if none is pending.
        Never waits on a writer (see the module docstring) and takes no lock a writer holds:
        one read of a dict (atomic under the GIL); a fill that ends meanwhile leaves bytes
        that are still its version's."""
        found = _servable.get(key)
        if found is None:
            return None
        data, dropped = found
        return data, dropped is not None and not dropped()

    def _next(self):
        """The next item to run, once it is time (see the class docstring), or None after
        IDLE with nothing queued (the thread then ends); under _cv."""
        idle_since = time.monotonic()
        while True:
            now = time.monotonic()
            if self._queue:
                age = now - self._queue[0][0]
                if self._urgent or age >= self.LINGER:
                    _, item = self._queue.popleft()
                    if not self._queue:
                        self._urgent = False
                    return item
                self._cv.wait(self.LINGER - age)
            elif now - idle_since >= self.IDLE:
                self._thread = None
                return None
            else:  # a submit does not wake the thread (see the class docstring): look again
                self._cv.wait(min(self.LINGER, self.IDLE - (now - idle_since)))

    def _take_batch(self, first) -> list:
        """``first`` and what is queued behind it, until the batch holds ``BATCH`` fills
        or ``BATCH_BYTES`` (a block of that size comes alone when it is first, after the
        small ones otherwise); under _cv."""
        batch, item, fills, nbytes = [], first, 0, 0
        while True:
            batch.append(item)
            if isinstance(item, (Fill, _Adopt)):
                fills += 1
                nbytes += len(item.data)
                self._waiting -= 1
                self._waiting_bytes -= len(item.data)
            if not self._queue or fills >= self.BATCH or nbytes >= self.BATCH_BYTES:
                break
            item = self._queue.popleft()[1]
        self._urgent = self._urgent and bool(self._queue)
        return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                item = self._next()
                if item is None:
                    return
                batch = self._take_batch(item)
                self._busy += len(batch)
            try:
                self._run_batch(batch)
            finally:
                with self._cv:
                    self._busy -= len(batch)
                    for item in batch:
                        if isinstance(item, _Adopt):
                            self._unsynced = True
                        if isinstance(item, (Fill, _Adopt)):
                            self._queued_bytes -= len(item.data)
                            self._ended(item)
                    self._cv.notify_all()

    def _ended(self, item: Fill | _Adopt) -> None:
        """Under _cv: ``item``'s bytes leave ``pending`` (unless the key was queued again
        since, here or by another writer)."""
        with _pending_lock:
            if _holders.get(item.key) is self and _pending.get(item.key) is item.data:
                del _pending[item.key]
                del _holders[item.key]
                _servable.pop(item.key, None)

    def _run_batch(self, batch: list) -> None:
        """The adopted blocks first, handed to their runner together (adopt.py: a lease
        request per claim state and round; leasing a block before
        the items queued ahead of it is never later than it would have been: a metadata
        record shared after the fill is in flight is what read_cold does anyway), then the
        fills in one go, then the deferred calls in their order (a drain's round trip
        among them comes after every note of the batch)."""
        runners: dict = {}  # by runner (a reader's Adoptions)
        for item in batch:
            if isinstance(item, _Adopt):
                runners.setdefault(item.runner, []).append(item.entry)
        for runner, entries in runners.items():
            self._guarded(runner, entries)
        fills = [item for item in batch if isinstance(item, Fill)]
        if fills:
            self._guarded(self.store_many, fills)
        for item in batch:
            if not isinstance(item, (Fill, _Adopt)):
                self._guarded(item[0], item[1])

    @staticmethod
    def _guarded(fn, arg) -> None:
        try:
            fn(arg)
        except BaseException:  # store_many() ends the leases itself; never kill the writer
            log.exception("cachemw fill writer: unexpected error in %r", fn)

    def store(self, fill: Fill) -> None:
        """Write the block file and end its lease; counted as a fill or a fill error."""
        self.store_many([fill])

    def store_many(self, fills: list[Fill]) -> None:
        """Write the block files, then end their leases: one "filled" note per connection
        that holds them; each counted as a fill or a fill error."""
        staged: dict[int, list[tuple[Fill, int]]] = {}
        client = self.client
        interrupted = None
        for i, fill in enumerate(fills):
            try:
                stored = self._stage(fill)
            except BaseException as exc:  # Ctrl-C: the other leases end all the same
                interrupted = exc
                for rest in fills[i + 1:]:
                    if client.note_via(rest.link, ops.ABORT, rest.key, "error"):
                        self._noted_on(rest.link)
                break
            if stored is not None:
                conn = None if fill.link is None else id(fill.link[0])  # by connection
                staged.setdefault(conn, []).append((fill, stored))
        for group in staged.values():
            link = group[0][0].link
            if len(group) == 1:
                fill, stored = group[0]
                sent = client.note_via(link, ops.FILLED, fill.key, fill.tier.name, stored,
                                       fill.lease)
            else:
                sent = client.note_via(link, ops.FILLED_MANY, [
                    (fill.key, fill.tier.name, stored, fill.lease) for fill, stored in group])
            if sent:  # the daemon publishes them (or drops them: see node.land)
                client.count("fills", len(group))
                self._noted_on(link)
            else:  # the daemon ended the leases with the connection (and adopted the staged
                for fill, _ in group:  # files, or not): the rest is no one's
                    fill.tier.unstage(fill.key, fill.lease)
        if interrupted is not None:
            raise interrupted

    def _stage(self, fill: Fill) -> int | None:
        """Write the block file of ``fill``: the bytes it occupies, or None if that failed
        (its lease ended here then, counted as a fill error)."""
        client = self.client
        started = time.perf_counter()
        try:
            stored = fill.tier.stage(fill.key, fill.data, fill.lease, tag=fill.tag)
            if trace.ENABLED:
                trace.event("fill", trace.READ, started, None,
                            {"tier": fill.tier.name, "bytes": len(fill.data)})
            per_byte = (time.perf_counter() - started) / max(len(fill.data), 1)
            self._write_cost += 0.1 * (per_byte - self._write_cost)
            return stored
        except BaseException as exc:  # whatever failed, the lease ends here: no one waits on it
            errno_ = getattr(exc, "errno", None)
            reason = "nospace" if errno_ in (errno.ENOSPC, errno.EDQUOT) else "error"
            if client.note_via(fill.link, ops.ABORT, fill.key, reason):
                self._noted_on(fill.link)
            client.count("fill_errors")
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like, on the reader's path
            if not self._warned:
                log.warning("could not fill the %s tier (%s); reading on from the source",
                            fill.tier.name, exc)
                self._warned = True
            return None

    def _noted_on(self, link: tuple) -> None:
        """A lease taken on ``link`` was ended by a note there (see drain)."""
        if link is None:
            return
        with self._cv:
            if len(self._noted) > 256:  # threads that never drain: forget them (ids recur)
                self._noted.clear()
            self._noted.add(id(link[0]))


def drain_all(client=None, timeout: float = 60.0) -> bool:
    """Drain every writer of this process, or those ending leases of ``client``, all
    within ``timeout`` together; False if one of them was not drained in time."""
    deadline = time.monotonic() + timeout
    drained = True
    for writer in list(_writers):
        if client is None or writer.client is client:
            drained = writer.drain(max(0.0, deadline - time.monotonic())) and drained
    return drained


def _reset_all_in_child() -> None:
    """The parent's fills are the parent's to write (its threads did not come along)."""
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()
    _holders.clear()
    _servable.clear()
    for writer in list(_writers):
        writer._reset()


os.register_at_fork(after_in_child=_reset_all_in_child)
