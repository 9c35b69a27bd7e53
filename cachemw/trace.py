"""Traces of what cachemw does, in DFTracer's file format (``.pfw``), for Perfetto's UI and
DFTracer's analysis tools.

On when ``CACHEMW_TRACE=DIR`` is set (read once, when this module is imported: every
process of a job inherits it, DataLoader workers and an autostarted daemon included), or
after ``start(DIR)`` (the filesystem's ``trace`` option, a daemon's ``trace_dir``). Each
process writes ``DIR/cachemw-<host>-<pid>.pfw``: a ``[`` line, then one Chrome trace event
per line (``{"id","name","cat","pid","tid","ts","dur","ph":"X","args"}``, ``ts``/``dur``
in microseconds, ``ts`` since the epoch), as DFTracer writes them, and ``]`` at exit.

Why not pydftracer: without DFTracer's native library it is a no-op, and with it the
writer is configured by DFTRACER_* variables read at import and installs SIGINT/SIGTERM
handlers that call ``sys.exit`` (a daemon's clean stop, a Ray actor's, depend on their
own). The file format is the contract; writing it takes the small writer below.

Cost: off, a caller checks ``ENABLED`` (a module attribute) once per read and allocates
nothing. On, an event is a tuple appended under a lock; lines are formatted and written
in batches (every 512 events or second), each batch whole lines with one ``write``, so a
killed process leaves a file that still parses.

Nesting: Perfetto's JSON importer needs the X events of a thread properly nested, and
reads a parent before its children when both start in the same microsecond only if it
comes first. A ``span`` holds the events of its thread until the outermost span ends,
then emits them sorted by start (longer first on a tie); ``ts`` and the end are both
floored to the microsecond, which keeps containment and order.
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import socket
import threading
import time

from .config import check_trace_dir, trace_dir

log = logging.getLogger(__name__)

ENABLED = False  # checked by callers before they build an event: off costs one lookup

READ = "cachemw.read"  # categories (the ``cat`` field)
PLACEMENT = "cachemw.placement"
CHECKPOINT = "cachemw.checkpoint"

FLUSH_EVENTS = 512
FLUSH_SECONDS = 1.0

_OFFSET_US = int((time.time() - time.perf_counter()) * 1e6)  # perf_counter -> epoch

_lock = threading.Lock()
_dir: str | None = None
_fd: int | None = None
_pid = 0
_buffer: list[tuple] = []
_next_id = 1
_last_flush = 0.0
_closed = False
_local = threading.local()
_hooked_pid = 0
_warned = False


def start(directory: str) -> None:
    """Trace this process (and the processes it forks) into ``directory`` (made if missing,
    0700). Again with the same directory: nothing changes; with another: later events go
    there."""
    global ENABLED, _dir, _closed
    directory = check_trace_dir(directory, "trace")
    if directory is None:
        return
    with _lock:
        if _dir != directory:
            _flush_locked()
            _close_file_locked()
            _dir = directory
        _closed = False
    _ensure_exit_hook()
    ENABLED = True


def stop() -> None:
    """Write what is buffered, close the file with ``]``, and stop tracing this process."""
    global ENABLED, _closed
    ENABLED = False
    with _lock:
        _flush_locked()
        if _fd is not None:
            _write(b"]\n")
        _close_file_locked()
        _closed = True


def flush() -> None:
    with _lock:
        _flush_locked()


def event(name: str, cat: str, start: float, end: float | None = None,
          args: dict | None = None) -> None:
    """A complete event of this thread from ``start`` to ``end`` (``time.perf_counter()``
    values; ``end`` None: now). Call it only when ENABLED (its caller checks)."""
    if end is None:
        end = time.perf_counter()
    ts = int(start * 1e6)
    record = (name, cat, threading.get_native_id(), ts + _OFFSET_US, int(end * 1e6) - ts, args)
    pending = getattr(_local, "pending", None)
    if pending is not None:  # inside a span of this thread: emitted with its outermost one
        pending.append(record)
    else:
        _emit((record,))


class span:
    """``with trace.span(name, cat, **args) as s: ... s.args[k] = v``: an event around the
    block, the events inside it nested under it. Disabled, it only stores its arguments;
    callers on a hot path check ENABLED first and do not make one."""

    __slots__ = ("name", "cat", "args", "start", "outermost")

    def __init__(self, name: str, cat: str, **args) -> None:
        self.name, self.cat, self.args = name, cat, args
        self.start = None
        self.outermost = False

    def __enter__(self) -> "span":
        if ENABLED:
            if getattr(_local, "pending", None) is None:
                _local.pending = []
                self.outermost = True
            self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.start is None:
            return
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        end = time.perf_counter()
        ts = int(self.start * 1e6)
        record = (self.name, self.cat, threading.get_native_id(), ts + _OFFSET_US,
                  int(end * 1e6) - ts, self.args)
        pending = getattr(_local, "pending", None)
        if pending is None:  # tracing was turned on/off inside the span: emit it alone
            _emit((record,))
            return
        pending.append(record)
        if self.outermost:
            _local.pending = None
            pending.sort(key=lambda r: (r[3], -r[4]))
            _emit(pending)


def _emit(records) -> None:
    if _closed:
        return
    if _hooked_pid != os.getpid():  # a child (DataLoader worker): its exit hook, now
        _ensure_exit_hook()
    with _lock:
        _buffer.extend(records)
        due = len(_buffer) >= FLUSH_EVENTS or time.perf_counter() - _last_flush > FLUSH_SECONDS
        if due:
            _flush_locked()


def _flush_locked() -> None:
    global _buffer, _next_id, _last_flush
    _last_flush = time.perf_counter()
    if not _buffer:
        return
    records, _buffer = _buffer, []
    if _fd is None and not _open_locked():
        return
    pid, first = _pid, _next_id
    _next_id += len(records)
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    lines = [f'{{"id":{first + i},"name":"{name}","cat":"{cat}","pid":{pid},"tid":{tid},'
             f'"ts":{ts},"dur":{dur},"ph":"X","args":{dumps(args) if args else "{}"}}}\n'
             for i, (name, cat, tid, ts, dur, args) in enumerate(records)]
    _write("".join(lines).encode())


def _open_locked() -> bool:
    """Open this process's trace file; on failure tracing stops here, said once."""
    global _fd, _pid, ENABLED, _warned, _next_id
    _pid = os.getpid()
    path = os.path.join(_dir, f"cachemw-{socket.gethostname()}-{_pid}.pfw")
    try:
        if not os.path.isdir(_dir):
            os.makedirs(_dir, mode=0o700, exist_ok=True)
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                      0o600)
    except OSError as exc:
        ENABLED = False
        if not _warned:
            _warned = True
            log.warning("cannot write the trace file %s (%s): not tracing this process",
                        path, exc)
        return False
    _next_id = 1
    name = json.dumps(f"cachemw {multiprocessing.current_process().name} ({_pid})")
    _write(f'[\n{{"id":0,"name":"process_name","cat":"dftracer","pid":{_pid},'
           f'"tid":{threading.get_native_id()},"ph":"M","args":{{"name":{name}}}}}\n'.encode())
    return True


def _write(data: bytes) -> None:
    global _fd, ENABLED
    try:
        while data:
            data = data[os.write(_fd, data):]
    except OSError as exc:  # a full disk, say: stop tracing rather than fail the reads
        log.warning("writing the trace file failed (%s): not tracing this process", exc)
        ENABLED = False
        _close_file_locked()


def _close_file_locked() -> None:
    global _fd
    if _fd is not None:
        try:
            os.close(_fd)
        except OSError:
            pass
        _fd = None


def _ensure_exit_hook() -> None:
    """Close the file at exit, in every kind of process: multiprocessing children
    (DataLoader workers) skip atexit, so they get a multiprocessing finalizer too, made
    on their first event (a child clears the finalizers it inherited once it runs, after
    any fork hook: registering at fork would be undone)."""
    global _hooked_pid
    if _hooked_pid != os.getpid():
        _hooked_pid = os.getpid()
        atexit.register(_at_exit)
        multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)


def _at_exit() -> None:
    if ENABLED or _fd is not None:
        stop()


def _after_fork_in_child() -> None:
    """A forked child traces into a file of its own; the parent's buffered events stay the
    parent's to write."""
    global _lock, _buffer, _fd, _local, _closed
    _lock = threading.Lock()
    _buffer = []
    _fd = None  # the parent's descriptor (inherited) is not ours to write or close
    _local = threading.local()
    if ENABLED:
        _closed = False


os.register_at_fork(after_in_child=_after_fork_in_child)

try:
    _from_env = trace_dir()
except ValueError as _exc:  # a bad CACHEMW_TRACE must not break every import of cachemw
    log.warning("%s: not tracing", _exc)
    _from_env = None
if _from_env is not None:
    start(_from_env)
