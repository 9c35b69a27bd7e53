"""A process's connection to its node daemon: one per thread, opened on first use, and what
happens when the daemon does not answer. ``DaemonConnection`` is the base of
``link.DaemonClient``, whose calls (leases, announcements, reports) go over it.

Never imports Ray (a forked DataLoader worker cannot use its parent's Ray connection).
Fork-safe: a child process opens its own connection instead of sharing its parent's, and
only once it needs the daemon (a miss, a report, a write): the tier directories hits are
read from come from the daemon's registry, so a worker over a warm cache reads its first
hit without a handshake.
Never hangs: every wait on the daemon is bounded (a daemon silent for ``daemon_timeout``
seconds is taken as hung; one at work on a request says "busy" meanwhile), and so are a
read call's waits together (silence.py: one ``daemon_timeout`` in all); an unreachable
daemon turns misses into direct reads from the source, counted as ``fallbacks`` and logged
once, not per read, and the link is retried every few seconds.

A dead daemon (its lock free: see protocol.py) is replaced at once by the first process
that needs it, if autostart is on (launch.py); a daemon that cannot start says why, once
per process, and reads go on from the source.

Apart from link.py because this is the part that holds state across calls (per-thread
connections, the back-off, which daemon failed) and decides when a message is sent again;
the calls themselves are one message each and know none of it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

from ..config import DaemonConfig, daemon_environment
from .. import ops
from . import finding, reporting, silence, wire
from .wire import DaemonUnavailable
from ..processes import process_state
from ..protocol import DaemonAddress, lock_holder, lookup
from ..tiers.directory import DirectoryTier
from ..launch import FAILURE_MEMORY, DaemonStartError

# the link's logger: what a connection says is the daemon link's news, under the name users
# (and `cachemw status`, cli.py) set the level of
log = logging.getLogger("cachemw.client.link")

RETRY_SECONDS = 2.0
MAX_RETRY_SECONDS = 30.0  # the back-off after repeated timeouts (a hung daemon)

_connections: "weakref.WeakSet[DaemonConnection]" = weakref.WeakSet()


_said: set[str] = set()  # start-up failures already logged by this process


def _reset_all_in_child() -> None:
    _said.clear()
    for connection in list(_connections):
        connection._reset_after_fork()


os.register_at_fork(after_in_child=_reset_all_in_child)


class DaemonConnection:
    """``timeout``: how long the daemon may stay silent (the ``daemon_timeout`` option).
    With ``autostart``, the settings of the daemon it would start (``daemon_config``
    and CACHEMW_*) are checked here: a bad one is a ValueError now, not a daemon that
    fails in the background."""

    def __init__(self, runtime_dir: str, *, autostart: bool = True, timeout: float = 5.0,
                 daemon_config: dict | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.autostart = autostart
        self.timeout = timeout
        self.daemon_config = daemon_config or {}
        if autostart:
            DaemonConfig.build(runtime_dir=runtime_dir, **self.daemon_config)
        self._lock = threading.RLock()
        self._reset_after_fork()
        _connections.add(self)

    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()  # one connection per thread (leases are per connection)
        # weak: a thread that ends drops its connection (closed when collected)
        self._conns: "weakref.WeakSet[Connection]" = weakref.WeakSet()
        # the daemon's address and tier dirs are the node's: a forked child keeps them
        self._address: DaemonAddress | None = getattr(self, "_address", None)
        self._tiers: list[DirectoryTier] = getattr(self, "_tiers", [])
        self._next_try = 0.0
        self._timeouts = 0  # consecutive timeouts: the back-off grows while a daemon hangs
        self._warned = False
        self._untold: str | None = None  # why a quiet call found the daemon unreachable
        self._failed_pid: int | None = None  # the daemon whose failure began the back-off
        self._features: frozenset = getattr(self, "_features", frozenset())  # ops.FEATURES
        self._lock = threading.RLock()

    def tiers(self) -> list[DirectoryTier]:
        """Tier directories to read hits from, fastest first (known even if the daemon died).

        Found in the daemon's registry, without a connection: a process that only hits (a
        DataLoader worker over a warm cache) never pays for one. Only when no daemon has
        published one is the daemon reached (and, with autostart, started) here."""
        if not self._tiers:
            self._discover()
        return self._tiers

    def _discover(self) -> None:
        if os.getpid() != self._pid:
            self._reset_after_fork()
        if time.monotonic() < self._next_try:
            return
        address = lookup(self.runtime_dir)  # None as well for a runtime dir not safely ours
        # a dead daemon's tiers still serve hits, but with autostart the first process to
        # find it dead replaces it (its DRAM tier wants an owner, its readers a reporter)
        if address is not None and (not self.autostart or address.kind == "ray"
                                    or lock_holder(self.runtime_dir) is not None):
            with self._lock:
                self._set_tiers(address)
        else:
            self._connect()

    def backing_off(self) -> bool:
        """The daemon failed to answer a moment ago (hung, gone): until the back-off ends,
        misses read the source without asking it."""
        return time.monotonic() < self._next_try

    def connected(self) -> bool:
        """This thread has a connection; while another thread backs off from a failure,
        one that answers (a daemon back from a hang answers on its old connections)."""
        conn = self._connect()
        if conn is not None and self._next_try > time.monotonic():
            return self.ping()
        return conn is not None

    def meta_dir(self) -> str | None:
        """The node-shared metadata records' directory of the daemon (None: none known)."""
        self.tiers()
        return None if self._address is None else self._address.meta_dir

    def started(self) -> float:
        """When the daemon started (0: not known): node-shared metadata fetched before is
        not fresh (DaemonAddress.started)."""
        return 0.0 if self._address is None else self._address.started

    def ping(self) -> bool:
        """A round trip on this thread's connection: True once the daemon has read every
        message this thread sent before it (it reads each connection in order)."""
        return self._call(ops.PING) == ("pong",)

    def settle(self) -> bool:
        """``ping`` on this thread's connection as it is: never a new connection, nor a new
        daemon (a drain at close or exit must not start one just to be answered). False,
        the connection dropped, if it failed."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            return False
        try:
            with self._local.send_lock:
                wire.send(conn, (ops.PING,), self.timeout)
            return wire.receive(conn, self.timeout) == ("pong",)
        except (OSError, EOFError, ValueError, DaemonUnavailable):
            self._drop_connection()
            return False

    def _connect(self) -> Connection | None:
        """This thread's connection to the daemon, opened on first use (None: unreachable).

        Each thread has its own, so one thread waiting on a lease never holds up another
        thread's messages (such as the 'filled' that ends that wait).
        """
        if os.getpid() != self._pid:
            self._reset_after_fork()
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        now = time.monotonic()
        if now < self._next_try and not self._replaced_since_failure():
            return None
        left = silence.silence_left(self.timeout)
        if left <= 0:  # this read call waited a daemon_timeout already (silence.py)
            return None
        for attempt in (1, 2):
            with self._lock:
                try:
                    address = finding.find(self.runtime_dir, may_start=self._may_start(),
                                           daemon_config=self.daemon_config, timeout=self.timeout)
                except (DaemonStartError, OSError, ValueError) as exc:
                    self._cannot_start(exc)
                    return None
                if address is None:
                    self._unreachable(finding.why_none(self.runtime_dir, may_start=self._may_start()))
                    return None
                self._set_tiers(address)
            waited = time.monotonic()
            if not finding.running(address.pid, left):  # stopped for longer than it may be silent
                silence.waited_silent(time.monotonic() - waited)
                self._unreachable(f"the daemon (pid {address.pid}) is stopped", pid=address.pid)
                return None
            try:
                conn, features = wire.dial(address, self.timeout)
                break
            except (OSError, EOFError, AuthenticationError, DaemonUnavailable) as exc:
                # it died, or was stopping: the second attempt replaces it
                if attempt == 1 and self._may_start() and self._gone_or_going(address, exc):
                    continue
                self._unreachable(f"{address.socket}: {exc}",
                                  timed_out=isinstance(exc, DaemonUnavailable), pid=address.pid)
                return None
        with self._lock:
            self._local.conn = conn
            self._features = features
            self._local.daemon_pid = address.pid  # to tell a replaced daemon (_replaced)
            # sends on this connection come from its thread and from the fill writer
            self._local.send_lock = threading.Lock()
            self._conns.add(conn)
            self._timeouts = 0
            self._next_try = 0.0  # reachable: no other thread waits out the back-off
            if self._warned:
                log.warning("cachemw daemon reachable again at %s", address.socket)
                self._warned = False
            self._untold = None
        return conn

    def _gone_or_going(self, address: DaemonAddress, exc: Exception) -> bool:
        """Whether the daemon that failed a dial with ``exc`` is dead (its lock free) or
        stopping, and frees its lock within what this call may still wait on silence
        (finding.released). A daemon stopping withdraws its address before it closes its
        socket (node/service.py close); one that refused with its address still published
        (its socket removed by hand, its listen backlog full: EAGAIN) or stayed silent
        (hung, busy) is waited on no longer: each read call waited out the budget on it
        (diffrev-6)."""
        if lock_holder(self.runtime_dir) is None:
            return True
        if isinstance(exc, (DaemonUnavailable, BlockingIOError, TimeoutError)):
            return False
        published = lookup(self.runtime_dir)
        if published is not None and published.pid == address.pid:
            return False
        waited = time.monotonic()
        gone = finding.released(self.runtime_dir, address.pid, silence.silence_left(self.timeout))
        silence.waited_silent(time.monotonic() - waited)
        return gone

    def _may_start(self) -> bool:
        """Whether a dead daemon may be replaced now: not by the last report of a closing
        client or an exiting process (a daemon stopped before them is no news)."""
        return (self.autostart and not reporting.exiting
                and not getattr(self._local, "closing", False))

    def _cannot_start(self, exc: Exception) -> None:
        """No daemon can be had (it cannot start, or the runtime dir is not safely ours):
        said once per process, not per worker per read; not retried for a while."""
        why = finding.why_not_started(self.runtime_dir, exc)
        with self._lock:
            self._next_try = time.monotonic() + FAILURE_MEMORY
            self._warned = True
            if why not in _said:
                _said.add(why)
                log.error("%s; misses read the source directly, counted as fallbacks", why)

    def _set_tiers(self, address: DaemonAddress) -> None:
        if address != self._address:
            self._address = address
            self._tiers = [DirectoryTier(t["name"], t["path"]) for t in address.tiers]
            self._say_ignored(address)

    def _say_ignored(self, address: DaemonAddress) -> None:
        """Say once (per daemon) which of this process's tier settings the running daemon
        does not have: they would apply only to a daemon it started. By a main process
        only: its DataLoader workers have its settings, and each said it again, every
        epoch (diffrev-6)."""
        if not finding.is_main_process():
            return
        try:
            asked = {**daemon_environment(), **(self.daemon_config or {})}
        except ValueError:  # a bad variable: said where the filesystem was made
            return
        ignored = finding.ignored_settings(address, asked)
        why = (f"the node's daemon (pid {address.pid}, {self.runtime_dir}) runs with other "
               f"tiers than this process asks for: {'; '.join(ignored)}. Settings apply to "
               f"a daemon a process starts; to have them, stop this one first (`cachemw "
               f"stop`; one autostarted by a DataLoader worker exits once idle)")
        if ignored and why not in _said:
            _said.add(why)
            log.warning("%s", why)

    def _drop_connection(self):
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:  # set with its send lock (_connect)
            with self._local.send_lock:  # not under the fill writer's send on this connection
                try:
                    conn.close()
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(conn)

    def _unreachable(self, why: str, *, timed_out: bool = False, pid: int | None = None) -> None:
        """Drop this thread's connection, back off, and say so once (not per read).
        ``pid``: the daemon that failed (default: this thread's), whose replacement by
        another ends the back-off at once (_replaced_since_failure)."""
        self._failed_pid = pid if pid is not None else getattr(self._local, "daemon_pid", None)
        self._drop_connection()
        with self._lock:
            # a refused or missing daemon is retried soon; a silent one costs a timeout
            # per try, so the pause doubles while it stays silent
            self._timeouts = self._timeouts + 1 if timed_out else 0
            pause = min(RETRY_SECONDS * 2 ** max(0, self._timeouts - 1), MAX_RETRY_SECONDS)
            self._next_try = time.monotonic() + pause
            if getattr(self._local, "quiet", False):
                self._untold = why  # a fill's lease, behind the reads: said at the next miss
            elif not self._warned:
                self._say_unreachable(why)

    def _say_unreachable(self, why: str) -> None:
        if reporting.exiting or getattr(self._local, "closing", False):  # no read follows
            log.debug("cachemw daemon unreachable at the last report (%s)", why)
            return
        log.warning("cachemw daemon unreachable (%s); misses read the source directly, "
                    "counted as fallbacks", why)
        self._warned = True
        self._untold = None

    def tell_unreachable(self) -> None:
        """A miss is being read: say now that the daemon is unreachable if a fill writer's
        lease found it so (those fail after the reads that fetched their blocks, and a
        process that reads nothing more, such as one exiting, has nothing to be told)."""
        if self._untold is not None:
            with self._lock:
                if self._untold is not None and not self._warned:
                    self._say_unreachable(self._untold)

    def _replaced_since_failure(self) -> bool:
        """During a back-off: a daemon other than the one that failed is registered now (a
        restarted daemon, found by this thread before the pause is over: a thread that
        only sends now and then, such as the fill writer, must not outwait it)."""
        address = lookup(self.runtime_dir)
        return address is not None and address.pid != self._failed_pid \
            and process_state(address.pid) not in (None, "Z", "T", "t")

    def _replaced(self) -> bool:
        """This thread's connection is to a daemon another has replaced since (another
        thread of this process, the fill writer's reader, reconnected already): True, with
        the old connection dropped, so that the caller tries the new daemon at once."""
        try:
            address = lookup(self.runtime_dir)
        except (OSError, ValueError):
            return False
        if address is None or address.pid == getattr(self._local, "daemon_pid", None):
            return False
        self._drop_connection()
        self._next_try = 0.0
        return True

    def _still_serving(self) -> bool:
        """The daemon this thread's connection was to is still the registered one and
        alive: a connection it closed (or that broke) says nothing about the daemon, so it
        is reopened once at once rather than sending the process into a back-off."""
        pid = getattr(self._local, "daemon_pid", None)
        try:
            address = lookup(self.runtime_dir)
        except (OSError, ValueError):
            return False
        return (pid is not None and address is not None and address.pid == pid
                and process_state(pid) not in (None, "Z", "T", "t"))

    def _lost(self, exc: Exception, unsent: bool = False) -> bool:
        """The connection failed under a message: True if the daemon died and this process
        may start the next one, or if it lives, only the connection was lost and the message
        never left (``unsent``): the caller tries again at once, on a new connection. Else
        the daemon is unreachable (the back-off)."""
        hung = isinstance(exc, DaemonUnavailable)
        if not hung and self._may_start() and lock_holder(self.runtime_dir) is None:
            self._drop_connection()
            log.info("cachemw daemon gone (%s): starting another", exc)
            self._next_try = 0.0
            return True
        if unsent and not hung and self._still_serving():  # only the connection was lost
            self._drop_connection()
            log.info("cachemw daemon connection lost (%s): reconnecting", exc)
            return True
        self._unreachable(str(exc) or type(exc).__name__, timed_out=hung)
        return False

    def _call(self, *msg):
        """Send a request and return the reply; None if the daemon is unreachable."""
        return self._exchange(msg, answered=True)

    def _send(self, *msg) -> bool:
        """Send a one-way note (cachemw.ops); False if the daemon is unreachable."""
        return self._exchange(msg, answered=False) is not None

    def _exchange(self, msg: tuple, answered: bool):
        """Send ``msg`` on this thread's connection; once more on a new one if the daemon
        was replaced or restarted meanwhile, or if it still runs and this connection broke
        before the message left (a message that reached it, such as a lease with a claim,
        is not sent twice). The reply (True for a one-way note), or None."""
        for attempt in (1, 2):
            conn = self._connect()
            if conn is None:
                return None
            left = silence.silence_left(self.timeout) if answered else self.timeout
            if left <= 0:  # this read call waited a daemon_timeout already (silence.py)
                return None
            sent = False
            waited = time.monotonic()
            try:
                with self._local.send_lock:
                    wire.send(conn, msg, self.timeout)
                sent = True
                reply = wire.receive(conn, left) if answered else True
                if answered and self._next_try:  # it answers: no thread need back off now
                    self._next_try, self._timeouts = 0.0, 0
                return reply
            except (OSError, EOFError, DaemonUnavailable) as exc:
                if isinstance(exc, DaemonUnavailable):
                    silence.waited_silent(time.monotonic() - waited)
                if attempt == 1 and (self._replaced() or self._lost(exc, unsent=not sent)):
                    continue
                if attempt == 2:
                    self._unreachable(str(exc) or type(exc).__name__,
                                      timed_out=isinstance(exc, DaemonUnavailable))
                return None
        return None

    def link(self) -> tuple | None:
        """This thread's connection, for another thread to end a lease taken on it
        (note_via); None if this thread has none."""
        conn = getattr(self._local, "conn", None)
        return None if conn is None else (conn, self._local.send_lock)

    @staticmethod
    def note_via(link: tuple | None, *msg) -> bool:
        """A one-way message over another thread's connection (see link); False if that
        connection is gone, and with it (daemon side) every lease taken on it."""
        if link is None:
            return False
        conn, send_lock = link
        try:
            with send_lock:
                conn.send(msg)
            return True
        except BlockingIOError:  # the daemon took nothing for its timeout (wire.send): part
            conn.close()         # of the message may have left, so the connection is done
            return False
        except (OSError, ValueError, TypeError):  # closed by its thread meanwhile
            return False

    def _close_connections(self) -> None:
        """Close every thread's connection; used again after, it connects anew, with no
        back-off left."""
        with self._lock:
            self._next_try, self._timeouts = 0.0, 0
            conns, self._conns = list(self._conns), weakref.WeakSet()
        self._local = threading.local()
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
