"""Traces of what cachemw does, in DFTracer's file format (``.pfw``), for Perfetto's UI and
DFTracer's analysis tools.

On when ``CACHEMW_TRACE=DIR`` is set (read once, when this module is imported: every
process of a job inherits it, DataLoader workers and an autostarted daemon included), or
after ``start(DIR)`` (the filesystem's ``trace`` option, a daemon's ``trace_dir``). Each
process writes ``DIR/cachemw-<host>-<pid>.pfw``: a ``[`` line, a ``"ph":"M"`` metadata line
naming the process (no ``ts``/``dur``: Perfetto shows the name), then one Chrome trace event
per line (``{"id","name","cat","pid","tid","ts","dur","ph":"X","args"}``, ``ts``/``dur``
in microseconds, ``ts`` since the epoch), as DFTracer writes them, and ``]`` at exit.

Why not pydftracer: without DFTracer's native library it is a no-op, and with it the
writer is configured by DFTRACER_* variables read at import and installs SIGINT/SIGTERM
handlers that call ``sys.exit`` (a daemon's clean stop, a Ray actor's, depend on their
own). The file format is the contract; writing it takes the small writer below.

Cost: off, a caller checks ``ENABLED`` (a module attribute) once per read and allocates
nothing. On, the hit path's events (``block_event``: ``hit``, ``source_fetch``, ``map``) are
formatted by _blocktrace.c straight into a buffer, about 1.3k instructions against a 4 KiB
hit's ~70k; the same events made in Python cost ~8k (docs/benchmarks.md, "Tracing"), and
that is the writer where the extension could not be built, or where the thread is inside a
span. The other events are made in their final shape where they happen (a msgspec Struct:
its id, microseconds and thread id filled in then, the thread id kept per thread instead of
a system call per event) and appended to a deque (no lock). Lines are written in batches
(every 512 events, or at the first event a second after the last batch, or by a thread of
the process's own within a second of the last event: a process that went idle, or was
killed, after its last reads lost them): the deque's by one msgspec call, then the C
buffer, in one ``write``, so a killed process leaves a file whose lines all parse and lacks
at most its last second. Ids (one count for both writers) are given as events happen, so a span's
(made when it ends) is above its children's though it is written before them.

A process writes one file per ``start``: after ``stop`` (or a failed write), a ``start``
opens ``cachemw-<host>-<pid>.<n>.pfw``, never truncating what it wrote before. A ``start``
into another directory finishes the current file (``]``) first: every file a process leaves
is finished, as DFTracer writes its files (``[``, one JSON value per line, ``]``).

Nesting: Perfetto's JSON importer needs the X events of a thread properly nested, and
reads a parent before its children when both start in the same microsecond only if it
comes first. A ``span`` holds the events of its thread until the outermost span ends,
then emits them sorted by start (longer first on a tie, the enclosing one first when both
ends fall in the same microseconds); ``ts`` and the end are both floored to the
microsecond, which keeps containment and order.
"""
from __future__ import annotations

import atexit
import collections
import importlib
import itertools
import json
import logging
import multiprocessing.util
import os
import socket
import threading
import time

from .config import trace_dir
from .config_values import check_trace_dir

try:  # the hit path's events formatted in C (_blocktrace.c), built at install when a compiler
    _native = importlib.import_module(f"{__package__}._blocktrace")  # is there (by name: a C
except ImportError:  # module imports nothing of cachemw, which import-linter cannot see)
    _native = None  # the Python writer

log = logging.getLogger(__name__)

ENABLED = False  # set by start()/stop(); callers check it before making an event

READ = "cachemw.read"  # categories (the ``cat`` field)
PLACEMENT = "cachemw.placement"
CHECKPOINT = "cachemw.checkpoint"

FLUSH_EVENTS = 512
FLUSH_SECONDS = 1.0

_OFFSET_US = int((time.time() - time.perf_counter()) * 1e6)  # perf_counter -> epoch
_now = time.perf_counter
_thread_id = threading.get_native_id  # a system call: kept per thread in _tls

_lock = threading.Lock()  # the file, and whoever writes a batch into it
_dir: str | None = None
_fd: int | None = None
_buffer: collections.deque = collections.deque()  # appended without a lock (atomic)
_pending: dict[int, list] = {}  # thread -> the events of its open outermost span
_tls = threading.local()  # .tid: this thread's native id
# event ids of this process (0: the file's process_name line), one count with C's writer
_next_id = _native.new_id if _native is not None else itertools.count(1).__next__
_encoder = None  # msgspec's, made by _encoding() when tracing starts
_Block = _BlockArgs = _Event = _to_builtins = None
_pid = os.getpid()  # this process (kept by the fork hook: no system call per event)
_flush_at = 0.0  # perf_counter time of the next flush by time (0: at the next event)
_closed = False
_hooked_pid = 0
_flusher_pid = 0  # the process whose flushing thread runs (a forked child starts its own)
_warned = False


def start(directory: str) -> None:
    """Trace this process (and the processes it forks) into ``directory`` (made if missing,
    0700). Again with the same directory: nothing changes; with another: the file of the
    directory before is finished (what is buffered, then ``]``), and
    later events go to a file in the new one (a process traces into one file at a time)."""
    global ENABLED, _dir, _closed
    directory = check_trace_dir(directory, "trace")
    if directory is None:
        return
    try:
        _encoding()  # imported now: a first batch at exit could not import it any more
    except ImportError as exc:  # a broken install must not break the reads: no traces
        log.warning("cannot trace (%s): not tracing", exc)
        return
    with _lock:
        if _dir != directory:
            _flush_locked()
            _finish_file_locked()
            _dir = directory
        _closed = False
    _ensure_exit_hook()
    ENABLED = True
    _ensure_flusher()


def stop() -> None:
    """Write what is buffered, close the file with ``]``, and stop tracing this process."""
    global ENABLED, _closed
    ENABLED = False
    with _lock:
        _flush_locked()
        _finish_file_locked()
        _closed = True


def flush() -> None:
    with _lock:
        _flush_locked()


def open_now() -> None:
    """Make this process's trace file now, not at its first event (a daemon: its file is
    there from its start, however few its events)."""
    with _lock:
        if ENABLED and _fd is None:
            _open_locked()


def event(name: str, cat: str, start: float, end: float | None = None,
          args: dict | None = None) -> None:
    """A complete event of this thread from ``start`` to ``end`` (``time.perf_counter()``
    values; ``end`` None: now). Call it only when ENABLED (its caller checks)."""
    if end is None:
        end = _now()
    tid = _tid()
    record = _general(name, cat, tid, start, end, args)
    pending = _pending.get(tid) if _pending else None
    if pending is not None:  # inside a span of this thread: emitted with its outermost one
        pending.append(record)
        return
    _buffer.append(record)
    if len(_buffer) >= FLUSH_EVENTS or end > _flush_at:
        _due()


def _block_event_py(name: str, start: float, end: float, tier: str, path: str, block: int,
                    nbytes: int) -> None:
    """A read of one block (``hit``, ``source_fetch``): the events of the hit path, their
    args (``tier``, ``file``, ``block``, ``bytes``) a fixed shape (a dict per event cost as
    much as the rest of the event). Call it only when ENABLED. Never the parent of another
    event."""
    try:  # _tid() inline: a call is a measurable part of a traced hit
        tid = _tls.tid
    except AttributeError:
        tid = _tls.tid = _thread_id()
    ts = int(start * 1e6)
    record = _Block(_next_id(), name, READ, _pid, tid, ts + _OFFSET_US, int(end * 1e6) - ts, "X",
                    _BlockArgs(tier, path, block, nbytes))
    pending = _pending.get(tid) if _pending else None
    if pending is not None:
        pending.append(record)
        return
    _buffer.append(record)
    if len(_buffer) >= FLUSH_EVENTS or end > _flush_at:
        _due()


block_event = _block_event_py
"""``block_event(name, start, end, tier, path, block, nbytes)``: a read of one block (``hit``,
``source_fetch``, ``map``), args ``tier``, ``file``, ``block``, ``bytes``. Call it only when
ENABLED. Written in C where built (the same line); a thread inside a span, and arguments
the C writer does not take (times not finite, booleans), go to the Python writer."""


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
            tid = _tid()
            if tid not in _pending:
                _pending[tid] = []
                self.outermost = True
                if _native is not None:  # its block events to _pending too, to be sorted
                    _native.span_open()
            self.start = _now()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.start is None:
            return
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        end = _now()
        tid = _tid()
        record = _general(self.name, self.cat, tid, self.start, end, self.args)
        pending = _pending.get(tid)
        if pending is None:  # the process forked inside the span: emit it alone
            _buffer.append(record)
        else:
            pending.append(record)
            if not self.outermost:
                return
            del _pending[tid]
            if _native is not None:
                _native.span_closed()
            # reversed first: on an exact tie (both ends in the same microseconds) the
            # stable sort keeps the one recorded later first, which is the enclosing one (a
            # span is recorded after everything inside it)
            pending.reverse()
            pending.sort(key=_start_first)
            _buffer.extend(pending)
        if len(_buffer) >= FLUSH_EVENTS or end > _flush_at:
            _due()


def _start_first(record) -> tuple:
    """Sort key: by start, the longer first (a parent before the children it starts with);
    times as written (floored microseconds), so ties are seen as the file shows them."""
    return record.ts, -record.dur


def _tid() -> int:
    try:
        return _tls.tid
    except AttributeError:
        tid = _tls.tid = _thread_id()
        return tid


def _general(name: str, cat: str, tid: int, start: float, end: float, args: dict | None):
    """An event's record, as it will be written: ``ts`` and the end both floored to the
    microsecond, which keeps containment and order."""
    ts = int(start * 1e6)
    return _Event(_next_id(), name, cat, _pid, tid, ts + _OFFSET_US, int(end * 1e6) - ts, "X",
                  args or {})


def _due() -> None:
    if _hooked_pid != _pid:  # a child's first event (a DataLoader worker): its exit hook
        _ensure_exit_hook()
        _ensure_flusher()
    with _lock:
        _flush_locked()


def _ensure_flusher() -> None:
    """A thread that writes what is buffered within FLUSH_SECONDS of its making, whether
    or not another event comes: a batch was written only at an event, so a reader's last
    events were lost when it went idle, or was killed at its time limit (review ops5)."""
    global _flusher_pid
    if _flusher_pid != _pid:
        _flusher_pid = _pid
        threading.Thread(target=_flush_loop, args=(_pid,), name="cachemw-trace",
                         daemon=True).start()


def _flush_loop(pid: int) -> None:
    while _pid == pid:  # (in a forked child this thread is not running: its own is)
        time.sleep(FLUSH_SECONDS / 4)  # (a batch written by an event moves the next due)
        if ENABLED and _now() >= _flush_at:
            with _lock:
                _flush_locked()


def _encoding() -> None:
    """Make msgspec's encoder and the event shapes it writes, from ``start`` (msgspec is
    imported only by a process that traces: a reader's import stays small). Field order is
    the line's key order."""
    global _encoder, _Block, _BlockArgs, _Event, _to_builtins
    if _encoder is None:
        import msgspec

        class BlockArgs(msgspec.Struct, gc=False):
            tier: str
            file: str
            block: int
            bytes: int

        class Event(msgspec.Struct, gc=False):
            id: int
            name: str
            cat: str
            pid: int
            tid: int
            ts: int
            dur: int
            ph: str
            args: dict

        class Block(Event, gc=False):  # the same keys in the same order; flat args
            args: BlockArgs

        _Block, _BlockArgs, _Event = Block, BlockArgs, Event
        _to_builtins = msgspec.to_builtins
        _encoder = msgspec.json.Encoder(enc_hook=str)  # args of any other type: str(value)


def _flush_locked() -> None:
    global _flush_at
    _flush_at = _now() + FLUSH_SECONDS
    native = b""
    if _native is not None:
        _native.set_flush_at(_flush_at)
        native = _native.take()  # the lines C wrote (all GIL-held: none is half written)
    if _closed:
        _buffer.clear()
        return
    if not (_buffer or native) or (_fd is None and not _open_locked()):
        return
    pop = _buffer.popleft  # what other threads append meanwhile is written next time
    events = [pop() for _ in range(len(_buffer))]
    data = b""
    if events:
        try:
            data = _encoder.encode_lines(events)
        except Exception:  # a name msgspec cannot write (a lone surrogate: an undecodable
            data = b"".join(map(_line_alone, events))  # file name), an args key: one by one
    _write(data + native)


def _line_alone(event) -> bytes:
    """One event's line when the batch's encoding failed: msgspec if it can, else the json
    module (which escapes lone surrogates, as Python's own file names can hold them)."""
    try:
        return _encoder.encode(event) + b"\n"
    except Exception:
        pass
    try:
        plain = _to_builtins(event, enc_hook=str)
        return (json.dumps(plain, separators=(",", ":"), default=str, skipkeys=True)
                + "\n").encode()
    except Exception as exc:  # never fail the read that made the event: drop it, said
        log.warning("trace event %r not written: %s", event.name, exc)
        return b""


def _open_locked() -> bool:
    """Open this process's trace file; on failure tracing stops here, said once."""
    global _fd, ENABLED, _warned
    stem = os.path.join(_dir, f"cachemw-{socket.gethostname()}-{_pid}")
    path = stem + ".pfw"
    try:
        if not os.path.isdir(_dir):
            os.makedirs(_dir, mode=0o700, exist_ok=True)
        for n in range(1, 1000):  # a new file: never what this process (or one of the same
            try:                  # pid before it) wrote before
                _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                              | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                path = f"{stem}.{n}.pfw"
        else:
            raise FileExistsError(f"{stem}.pfw and {stem}.1-998.pfw all exist")
    except OSError as exc:
        ENABLED = False
        _buffer.clear()
        if not _warned:
            _warned = True
            log.warning("cannot write the trace file %s (%s): not tracing this process",
                        path, exc)
        return False
    name = json.dumps(f"cachemw {multiprocessing.current_process().name} ({_pid})")
    _write(f'[\n{{"id":0,"name":"process_name","cat":"dftracer","pid":{_pid},'
           f'"tid":{_thread_id()},"ph":"M","args":{{"name":{name}}}}}\n'.encode())
    return True


def _write(data: bytes) -> None:
    global ENABLED
    try:
        while data:
            data = data[os.write(_fd, data):]
    except OSError as exc:  # a full disk, say: stop tracing rather than fail the reads
        log.warning("writing the trace file failed (%s): not tracing this process", exc)
        ENABLED = False
        _close_file_locked()


def _finish_file_locked() -> None:
    """End the file with ``]`` (its events flushed before) and close it."""
    if _fd is not None:
        _write(b"]\n")
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
    if _hooked_pid != _pid:
        _hooked_pid = _pid
        atexit.register(_at_exit)
        multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)


def _at_exit() -> None:
    if ENABLED or _fd is not None:
        stop()


def _after_fork_in_child() -> None:
    """A forked child traces into a file of its own; the parent's buffered events stay the
    parent's to write."""
    global _lock, _buffer, _fd, _pending, _pid, _closed, _flush_at, _tls, _next_id
    _pid = os.getpid()
    _tls = threading.local()  # the forking thread's id is the parent's
    if _native is not None:
        _native.after_fork(_pid)  # its lines, ids, cached thread ids and span mark reset
    else:
        _next_id = itertools.count(1).__next__
    _flush_at = 0.0  # its first event flushes: its exit hook is made there
    _lock = threading.Lock()
    _buffer = collections.deque()
    _fd = None  # the parent's descriptor (inherited) is not ours to write or close
    _pending = {}
    if ENABLED:
        _closed = False


os.register_at_fork(after_in_child=_after_fork_in_child)
if _native is not None:
    _native.configure(_block_event_py, _due, _pid, _OFFSET_US, FLUSH_EVENTS)
    block_event = _native.block_event

try:
    _from_env = trace_dir()
except ValueError as _exc:  # a bad CACHEMW_TRACE must not break every import of cachemw
    log.warning("%s: not tracing", _exc)
    _from_env = None
if _from_env is not None:
    start(_from_env)
