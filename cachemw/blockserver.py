"""Direct block transfer between nodes, for hits on blocks another node owns.

Ray moves a 128 KiB object in milliseconds here and tops out near 0.3-0.4 GB/s between
nodes; a node's cached blocks are plain files, so the owner's kernel can send them
(sendfile) straight into the reader's buffer: ~1.7 GB/s on the same machine
(benchmarks/transport_ceiling.py). Ray stays the control plane (membership, who owns
what, fetching a missing block from the source); this is the data plane for hits.

The reader connects to the owner's block server over TCP and proves it holds the cluster
secret (HMAC of a fresh nonce); the reader's own daemon gave it the secret over its 0600
socket. Each block comes with the whole-data checksum from the owner's block file, and the
reader verifies the bytes against it, so a damaged or racing file is never returned.

Wire format: request = u32 count, then count x (16-byte key, u64 length); reply = count x
(16-byte key, u8 status (1 sent, 0 absent), u64 length, u64 xxh3 of the data), then the
data of every sent block in order (headers first: one read for all of them, not one per
block). Each header names its block, and the reader checks it: a connection left behind by
an interrupted exchange can never pass one block's bytes off as another's.

Time: every exchange runs against one absolute deadline the caller gives (a fetch's whole
budget), checked before each receive; a poll with the remaining time precedes every recv,
so neither a signal (EINTR restarts a kernel timeout) nor an owner dripping bytes can
stretch it.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import select
import struct
import threading
import time

from . import blockfile

log = logging.getLogger("cachemw.blockserver")

_COUNT = struct.Struct("<I")
_ITEM = struct.Struct("<16sQ")
_REPLY = struct.Struct("<16sBQQ")
RCVTIMEO_SLACK = 0.02
NONCE = 32


def recv_exact(sock: socket.socket, n: int) -> memoryview:
    view = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return view


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def authenticate_server(sock: socket.socket, secret: bytes) -> bool:
    nonce = os.urandom(NONCE)
    sock.sendall(nonce)
    ok = hmac.compare_digest(bytes(recv_exact(sock, 32)), _mac(secret, nonce))
    sock.sendall(b"\x01" if ok else b"\x00")
    return ok


def authenticate_client(sock: socket.socket, secret: bytes) -> None:
    nonce = bytes(recv_exact(sock, NONCE))
    sock.sendall(_mac(secret, nonce))
    if bytes(recv_exact(sock, 1)) != b"\x01":
        raise PermissionError("the block server refused our cluster secret")


class BlockServer:
    """Sends this node's cached blocks to readers on other nodes."""

    def __init__(self, node, host: str, secret: bytes) -> None:
        self.node = node
        self.secret = secret
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.address = (host, self._sock.getsockname()[1])
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="cachemw-blocks", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            try:
                conn.settimeout(10.0)
                if not authenticate_server(conn, self.secret):
                    log.warning("rejected a block request with a wrong cluster secret")
                    return
                conn.settimeout(None)
                while True:
                    (count,) = _COUNT.unpack(recv_exact(conn, _COUNT.size))
                    body = recv_exact(conn, count * _ITEM.size)
                    items = [_ITEM.unpack_from(body, i * _ITEM.size) for i in range(count)]
                    self._send_blocks(conn, [(key.hex(), length) for key, length in items])
            except (ConnectionError, OSError, struct.error):
                return

    def _open(self, key: str, length: int) -> tuple[int, int] | None:
        """(open fd, recorded data checksum) of a block held here; None if not held."""
        path = self.node.block_path(key)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return fd, blockfile.data_hash(fd, length)
        except (OSError, blockfile.CorruptBlock):
            os.close(fd)
            return None

    def _send_blocks(self, conn: socket.socket, items: list[tuple[str, int]]) -> None:
        opened = [self._open(key, length) for key, length in items]
        try:
            conn.sendall(b"".join(
                _REPLY.pack(bytes.fromhex(key), 0, length, 0) if o is None
                else _REPLY.pack(bytes.fromhex(key), 1, length, o[1])
                for (key, length), o in zip(items, opened)))
            for (_, length), o in zip(items, opened):
                if o is None:
                    continue
                sent = 0
                while sent < length:  # the kernel copies the file into the socket
                    n = os.sendfile(conn.fileno(), o[0], sent, length - sent)
                    if n == 0:
                        raise ConnectionError("block file shorter than its trailer says")
                    sent += n
            self.node.count("served_direct", sum(o is not None for o in opened))
        finally:
            for o in opened:
                if o is not None:
                    os.close(o[0])


def fetch_deadline(timeout: float, items: list[tuple[str, int]]) -> float:
    """A fetch's whole budget: the timeout, plus its bytes at a floor rate of 50 MB/s."""
    return time.monotonic() + timeout + sum(n for _, n in items) / 50e6


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
        except BaseException:
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
        body = b"".join(_ITEM.pack(bytes.fromhex(k), n) for k, n in items)
        self.busy = True  # until the whole reply is read
        self.sock.sendall(_COUNT.pack(len(items)) + body)

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
        raw = self._recv(len(items) * _REPLY.size, deadline)
        out = []
        for (key, _), (echo, status, n, data_hash) in zip(items, _REPLY.iter_unpack(raw)):
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
