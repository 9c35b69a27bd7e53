"""The client's side of one connection to the node daemon (cachemw.ops: the messages;
cachemw.protocol: where the socket is and its key): entering it, and waiting for a reply
without ever waiting on a hung daemon. The policy around connections (one per thread,
back-off, replacing a dead daemon) is connection.py's."""
from __future__ import annotations

import os
import socket
import struct
import time
from multiprocessing.connection import Connection, answer_challenge

from .. import ops
from ..protocol import DaemonAddress

BUSY_CAP_SECONDS = 300.0  # a backstop: the daemon bounds its own waits well below this


class DaemonUnavailable(ConnectionError):
    """The node daemon could not be reached (the caller falls back to the source)."""


def dial(address: DaemonAddress, timeout: float) -> tuple[Connection, frozenset]:
    """An authenticated connection to the daemon at ``address``, its HELLO answered, and
    the features its answer names (ops.FEATURES; none from a daemon of the first release).
    The daemon says BUSY every ``timeout / 3`` seconds while it works on one of our
    requests."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(address.socket)
        sock.setblocking(True)
        # a daemon that takes no bytes for ``timeout`` s (stopped, hung, its buffer full)
        # fails the send (see send) instead of holding the sender for as long as it lasts.
        # The kernel's timeout is per write(), and a message that fills the buffer costs
        # two (the first returns what fitted when it runs out): half each
        half = timeout / 2
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(half), int(half % 1 * 1e6)))
    except OSError:
        sock.close()
        raise
    conn = Connection(sock.detach())
    try:
        if not conn.poll(timeout):
            raise DaemonUnavailable(f"daemon did not answer the handshake within {timeout} s")
        answer_challenge(conn, address.authkey)
        send(conn, (ops.HELLO, os.getpid(), timeout / 3), timeout)
        reply = receive(conn, timeout)
    except BaseException:  # no half-open connection left, whatever failed; re-raised
        conn.close()
        raise
    features = reply[3] if len(reply) > 3 and isinstance(reply[3], (list, tuple)) else ()
    return conn, frozenset(features)


def send(conn: Connection, msg: tuple, timeout: float) -> None:
    """Send ``msg``; DaemonUnavailable if the daemon took none of its bytes for ``timeout``
    seconds (the socket's send timeout, set by dial). Part of it may have left: the
    connection is then of no further use (the caller drops it)."""
    try:
        conn.send(msg)
    except BlockingIOError as exc:  # EAGAIN after SO_SNDTIMEO
        raise DaemonUnavailable(f"daemon took no bytes for {timeout} s") from exc


def receive(conn: Connection, timeout: float):
    """The reply to the request just sent; DaemonUnavailable if the daemon is silent (no
    reply, no BUSY) for ``timeout`` seconds, or busy past BUSY_CAP_SECONDS."""
    cap = time.monotonic() + BUSY_CAP_SECONDS
    while True:
        if not conn.poll(timeout):
            raise DaemonUnavailable(f"daemon silent for {timeout} s")
        reply = conn.recv()
        if reply[0] == ops.BUSY:  # at work on it
            if time.monotonic() > cap:
                raise DaemonUnavailable(f"no reply within {BUSY_CAP_SECONDS} s")
            continue
        if reply[0] == "error":
            raise DaemonUnavailable(f"daemon error: {reply[1]}")
        return reply
