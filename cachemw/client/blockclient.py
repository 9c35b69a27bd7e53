"""A reader's connection to another node's block server, for hits on blocks that node owns
(wire format and handshake: cachemw.blockwire)."""
from __future__ import annotations

import select
import socket
import struct
import time

from .. import blockfile
from ..blockwire import COUNT, ITEM, RCVTIMEO_SLACK, REPLY, authenticate_client, fetch_deadline


class BlockClient:
    """A reader's connection to one owner's block server.

    The socket is blocking: one ``recv(n, MSG_WAITALL)`` lands a whole block in the bytes
    handed to the caller (in Python's timeout mode the socket is non-blocking underneath,
    MSG_WAITALL is ignored and blocks arrive in pieces that must be joined). Time is bounded
    by the caller's deadline: before each receive, a poll waits at most the time left and
    the kernel's receive timeout is set to it.

    ``busy`` is set from a request until its whole reply is read (the headers say how many
    blocks follow): a connection found busy by its next user was interrupted mid-exchange
    and is closed, not reused.
    """

    def __init__(self, address: tuple[str, int], secret: bytes, timeout: float) -> None:
        self.timeout = timeout
        self.busy = False
        self._unread = 0  # blocks of the pending reply still on the wire
        self.sock = socket.create_connection(tuple(address), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # owners run ahead
            authenticate_client(self.sock, secret)
            self.sock.settimeout(None)
            self._set_timeout(socket.SO_SNDTIMEO, timeout)
        except BaseException:  # no socket left open, whatever failed; re-raised
            self.sock.close()
            raise
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)
        self._rcv_timeout = 0.0  # the SO_RCVTIMEO set now, in seconds (0: none yet)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _set_timeout(self, option: int, seconds: float) -> None:
        seconds = max(seconds, 0.001)
        tv = struct.pack("@ll", int(seconds), int((seconds - int(seconds)) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, option, tv)

    def request(self, items: list[tuple[str, int]]) -> None:
        body = b"".join(ITEM.pack(bytes.fromhex(k), n) for k, n in items)
        self.busy = True  # until the whole reply is read
        self.sock.sendall(COUNT.pack(len(items)) + body)

    def deadline_for(self, items: list[tuple[str, int]]) -> float:
        return fetch_deadline(self.timeout, items)

    def _recv(self, n: int, deadline: float) -> bytes:
        parts, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poller.poll(max(1, int(left * 1000))):
                raise TimeoutError("the block server did not send in time")
            if not left <= self._rcv_timeout <= left + RCVTIMEO_SLACK:
                # a receive may then end at most RCVTIMEO_SLACK past the deadline: set once
                # per RCVTIMEO_SLACK of a fetch, not per block (a system call each)
                self._set_timeout(socket.SO_RCVTIMEO, left)
                self._rcv_timeout = left
            data = self.sock.recv(n - got, socket.MSG_WAITALL)  # whole, unless cut short
            if not data:
                raise ConnectionError("the block server closed the connection")
            parts.append(data)
            got += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def headers(self, items: list[tuple[str, int]], deadline: float) -> list[tuple[int, int, int]]:
        """(status, length, data checksum) of each block of the pending reply, each header
        checked against the key asked for (anything else is a broken stream)."""
        raw = self._recv(len(items) * REPLY.size, deadline)
        out = []
        for (key, _), (echo, status, n, data_hash) in zip(items, REPLY.iter_unpack(raw)):
            if echo != bytes.fromhex(key) or status not in (0, 1):
                raise ConnectionError("block server reply out of step with the request")
            out.append((status, n, data_hash))
        self._unread = sum(h[0] for h in out)
        self.busy = self._unread > 0
        return out

    def block(self, length: int, header: tuple[int, int, int], deadline: float) -> bytes | None:
        """The next block of the reply, verified; None if it came damaged. An owner always
        announces the length asked for: any other is a broken stream (ConnectionError),
        never an allocation of whatever size a header says."""
        _, n, data_hash = header
        if n != length:
            raise ConnectionError(f"block server announced {n} bytes for a block of {length}")
        data = self._recv(n, deadline)
        self._unread -= 1
        self.busy = self._unread > 0
        return data if blockfile.hash_of(data) == data_hash else None

    def receive(self, items: list[tuple[str, int]], deadline: float | None = None) -> list[bytes | None]:
        """The blocks of the last request, verified; None for one the owner does not hold."""
        deadline = self.deadline_for(items) if deadline is None else deadline
        return [self.block(length, h, deadline) if h[0] == 1 else None
                for (_, length), h in zip(items, self.headers(items, deadline))]

    def close(self) -> None:
        self.sock.close()

