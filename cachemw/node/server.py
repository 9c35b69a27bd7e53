"""The daemon's local socket: serves one NodeCache to the processes of its node.

One thread accepts, one thread serves each client connection (clients are the few
processes of one node: trainer ranks, DataLoader workers, the CLI). Every connection must
answer an HMAC challenge with the daemon's secret before anything else is read.

A request may rightly take a while (a lease waits for another process's fill, a batch goes
to owner nodes), and a client must still tell a daemon at work from a hung one (stopped,
swapped out) within its ``daemon_timeout``: while a request is being served, a ticker
thread sends ``("busy",)`` on its connection every interval the client asked for in its
``hello``, so only silence counts.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, deliver_challenge

from .cache import NodeCache
from .. import ops

log = logging.getLogger(__name__)


class SocketServer:
    def __init__(self, node: NodeCache, path: str, authkey: bytes, *, on_shutdown=None) -> None:
        self.node = node
        self.path = path
        self.authkey = authkey
        self.on_shutdown = on_shutdown
        self._dispatch = self._handlers()
        self._sock: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (dev, inode) of the socket file we made
        self._closing = threading.Event()
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_activity = time.monotonic()
        # connection -> [send lock, keepalive interval, last send, request being served]
        self._links: dict[Connection, list] = {}
        self._ticker: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def idle_seconds(self) -> float:
        """How long no client has been connected (0 while any is)."""
        with self._lock:
            if self._conns:
                return 0.0
            return time.monotonic() - self._last_activity

    def start(self) -> None:
        if len(os.fsencode(self.path)) > 107:
            raise ValueError(f"runtime_dir: the socket path {self.path} is longer than a Unix "
                             f"socket allows (107 bytes); choose a shorter runtime dir")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        st = os.stat(self.path)
        self._bound = (st.st_dev, st.st_ino)  # the socket file ours, as long as it is this one
        sock.listen(128)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="cachemw-accept", daemon=True)
        self._thread.start()
        self._ticker = threading.Thread(target=self._keepalive_loop, name="cachemw-keepalive",
                                        daemon=True)
        self._ticker.start()

    def _keepalive_loop(self) -> None:
        """Say "busy" on every connection whose request has gone unanswered for its
        client's keepalive interval (see the module docstring)."""
        while not self._closing.wait(0.05):
            now = time.monotonic()
            with self._lock:
                due = [(conn, link) for conn, link in self._links.items()
                       if link[3] and link[1] and now - link[2] >= link[1]]
            for conn, link in due:
                with link[0]:
                    if not link[3]:  # answered meanwhile
                        continue
                    try:
                        conn.send((ops.BUSY,))
                    except (OSError, ValueError):
                        continue
                    link[2] = time.monotonic()

    def _after_fork_in_child(self) -> None:
        # A forked DataLoader worker must not keep our listening socket alive after we die.
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        try:  # only our own socket file: one made since in its place is a successor's
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._bound:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="cachemw-conn",
                             daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        conn = None
        try:
            conn = Connection(client.detach())
            deliver_challenge(conn, self.authkey)
        except (AuthenticationError, EOFError, OSError, ValueError) as exc:  # a bad handshake
            log.warning("rejected a connection on %s: %s", self.path, exc)
            if conn is not None:
                conn.close()
            return
        with self._lock:
            self._conns.add(conn)
            self._links[conn] = [threading.Lock(), 0.0, 0.0, False]
        try:
            self._loop(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._links.pop(conn, None)
                self._last_activity = time.monotonic()
            # leases end before the connection closes: a client that finds it closed asks
            # again on a new one (client/connection.py), and must find its old leases over
            self.node.release(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _handlers(self) -> dict:
        """What each op of the protocol (cachemw.ops) does here: ``handler(conn, link,
        *args)`` returns the reply of an answered op (ignored for one-way ones)."""
        node = self.node

        def hello(conn, link, pid, keepalive=None):
            if isinstance(keepalive, (int, float)) and keepalive > 0:
                link[1] = max(0.05, float(keepalive))
            return ("ok", node.config.node_id, os.getpid(), list(ops.FEATURES))

        def filled_many(conn, link, items):
            failed = None
            for item in items:  # each lease ends, whatever one raises
                try:
                    key, tier, stored, lease = item
                    node.filled(key, tier, stored, conn, lease)
                except Exception as exc:
                    failed = failed or exc
            if failed is not None:
                raise failed

        return {
            ops.HELLO: hello,
            ops.LEASE: lambda conn, link, key, length, url: node.lease(key, length, url, conn),
            ops.LEASE_MANY: lambda conn, link, items: ("ok", node.lease_many(items, conn)),
            ops.LEASE_FETCHED: lambda conn, link, items, claimed:
                ("ok", node.lease_fetched(items, conn, bool(claimed),
                                          claimed if isinstance(claimed, str) else None)),
            ops.FILLED: lambda conn, link, key, tier, stored, lease:
                node.filled(key, tier, stored, conn, lease),
            ops.FILLED_MANY: filled_many,
            ops.ABORT: lambda conn, link, key, reason: node.abort(key, reason, conn),
            ops.REPORT: lambda conn, link, counters, accesses: node.report(counters, accesses),
            ops.ANNOUNCE: lambda conn, link, items, stream=None:
                node.announce(items, stream, peer_pid(conn)),
            ops.DROP: lambda conn, link, key, reason, tier=None: node.drop(key, reason, tier),
            ops.SUPERSEDED: lambda conn, link, url, version, size, block_size:
                node.superseded(url, version, size, block_size),
            ops.INVALIDATE: lambda conn, link, url: ("ok", node.invalidate(url)),
            ops.RING: lambda conn, link: (
                "ok", node.remote.directory() if node.remote is not None else None),
            ops.STATS: lambda conn, link: ("ok", node.stats()),
            ops.PING: lambda conn, link: ("pong",),
            ops.SHUTDOWN: lambda conn, link: ("ok",),
            ops.CHECKPOINT: lambda conn, link, record: node.checkpoints.note(record),
            ops.PEER_SILENT: lambda conn, link, owner: node.peer_silent(owner),
            ops.PEER_REFUSED: lambda conn, link, owner: (
                node.remote is not None and node.remote.router.refused(owner)),
        }

    def _loop(self, conn: Connection) -> None:
        link = self._links[conn]
        while True:
            try:
                msg = conn.recv()
            except Exception:  # EOF, reset, closed under us, unpickling (raises anything): gone
                return
            op, args = (msg[0], msg[1:]) if type(msg) is tuple and msg else (None, ())
            answered = op in ops.ANSWERED or op not in ops.OPS  # an unknown op: an error
            if answered:
                link[2], link[3] = time.monotonic(), True  # the ticker may say "busy" now
            handler = self._dispatch.get(op)
            try:
                if handler is None:
                    raise ValueError(f"unknown op {op!r}")
                reply = handler(conn, link, *args)
            except Exception as exc:  # a bad request or a bug: said, never fatal to the daemon
                log.exception("request %r failed", op)
                reply = ("error", f"{type(exc).__name__}: {exc}")
            if not answered:
                continue
            try:
                with link[0]:  # never interleaved with a "busy" from the ticker
                    link[3] = False
                    conn.send(reply)
            except (OSError, ValueError):
                return
            if op == ops.SHUTDOWN and self.on_shutdown is not None:  # once it is answered
                threading.Thread(target=self.on_shutdown, daemon=True).start()


def peer_pid(conn: Connection) -> int | None:
    """The pid of the process at the other end of ``conn`` (a Unix socket), as this
    process's pid namespace sees it: 0 or None where it cannot (another container's)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno())) as s:
            pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    except (OSError, AttributeError):  # (no SO_PEERCRED off Linux)
        return None
    return pid or None
