"""The block server: sends this node's cached blocks to readers on other nodes (its kernel
sends the block files, sendfile), after they prove the cluster secret. Wire format and
handshake: cachemw.blockwire.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading

from .. import blockfile
from ..blockwire import COUNT, ITEM, REPLY, authenticate_server, recv_exact

log = logging.getLogger(__name__)


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
                    (count,) = COUNT.unpack(recv_exact(conn, COUNT.size))
                    body = recv_exact(conn, count * ITEM.size)
                    items = [ITEM.unpack_from(body, i * ITEM.size) for i in range(count)]
                    self._send_blocks(conn, [(key.hex(), length) for key, length in items])
            except (ConnectionError, OSError, struct.error):
                return

    def _open(self, key: str, length: int) -> tuple[int, int] | None:
        """(open fd, recorded data checksum) of a block held here; None if not held."""
        path = self.node.block_path(key)
        if path is None:
            return None
        try:
            fd = os.open(path, blockfile.READ_FLAGS)
        except OSError:
            return None
        try:
            return fd, blockfile.data_hash(fd, key, length)
        except (OSError, blockfile.CorruptBlock):
            os.close(fd)
            return None

    def _send_blocks(self, conn: socket.socket, items: list[tuple[str, int]]) -> None:
        opened = [self._open(key, length) for key, length in items]
        try:
            conn.sendall(b"".join(
                REPLY.pack(bytes.fromhex(key), 0, length, 0) if o is None
                else REPLY.pack(bytes.fromhex(key), 1, length, o[1])
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

