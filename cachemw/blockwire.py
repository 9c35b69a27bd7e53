"""Direct block transfer between nodes, for hits on blocks another node owns: the wire
format and handshake both ends share (the server in cachemw.cluster.blockserver, the reader's
client in cachemw.client.blockclient).

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
import os
import socket
import struct
import time

COUNT = struct.Struct("<I")
ITEM = struct.Struct("<16sQ")
REPLY = struct.Struct("<16sBQQ")
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



def fetch_deadline(timeout: float, items: list[tuple[str, int]]) -> float:
    """A fetch's whole budget: the timeout, plus its bytes at a floor rate of 50 MB/s."""
    return time.monotonic() + timeout + sum(n for _, n in items) / 50e6

