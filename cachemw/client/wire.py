"""The client's side of one connection to the node daemon (cachemw.ops: the messages;
cachemw.protocol: where the socket is and its key): entering it, and waiting for a reply
without ever waiting on a hung daemon. The policy around connections (one per thread,
back-off, replacing a dead daemon) is link.py's."""
from __future__ import annotations

import os
import socket
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
    except OSError:
        sock.close()
        raise
    conn = Connection(sock.detach())
    try:
        if not conn.poll(timeout):
            raise DaemonUnavailable(f"daemon did not answer the handshake within {timeout} s")
        answer_challenge(conn, address.authkey)
        conn.send((ops.HELLO, os.getpid(), timeout / 3))
        reply = receive(conn, timeout)
    except BaseException:  # no half-open connection left, whatever failed; re-raised
        conn.close()
        raise
    features = reply[3] if len(reply) > 3 and isinstance(reply[3], (list, tuple)) else ()
    return conn, frozenset(features)


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
