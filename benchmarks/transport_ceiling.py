"""What this machine can move between processes, for the remote-hit target of issue 3.

    python benchmarks/transport_ceiling.py

Two "owner" processes serve 32 blocks of 128 KiB each per request from /dev/shm files; one
reader asks both at once and splits what it receives into per-block bytes, as a remote
read must. Three transports: multiprocessing.connection over TCP (pickle-free raw bytes,
the owner reads the files in Python), and raw TCP with the owner's kernel sending the files
(os.sendfile), read either into one preallocated buffer (recv_into) or block by block
straight into bytes (recv with MSG_WAITALL, as cachemw's reader does). Ray's own figure is
in benchmarks/cache_cluster.py, which also runs SendfileOwners next to cachemw.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener

from cache_node import make_files  # this folder is on sys.path when run as a script

BLOCK = 128 << 10
PER_REQUEST = 32
ROUNDS = 20


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, BLOCK)
    finally:
        os.close(fd)


def _owner_connection(listener, paths):
    conn = listener.accept()
    while True:
        try:
            conn.recv()
        except EOFError:
            return
        conn.send_bytes(b"".join(_read(p) for p in paths))


def _owner_sendfile(port_queue, paths):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    while conn.recv(4):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            sent = 0
            while sent < BLOCK:
                sent += os.sendfile(conn.fileno(), fd, sent, BLOCK - sent)
            os.close(fd)


def connection_transport(paths) -> float:
    owners, conns = [], []
    for _ in range(2):
        listener = Listener(("127.0.0.1", 0), authkey=b"bench")
        proc = mp.Process(target=_owner_connection, args=(listener, paths))
        proc.start()
        owners.append(proc)
        conns.append(Client(listener.address, authkey=b"bench"))
    best = 0.0
    for _ in range(3):
        t, total = time.perf_counter(), 0
        for _ in range(ROUNDS):
            for c in conns:
                c.send("blocks")
            for c in conns:
                data = c.recv_bytes()
                blocks = [data[i * BLOCK:(i + 1) * BLOCK] for i in range(PER_REQUEST)]
                total += sum(map(len, blocks))
        best = max(best, total / (time.perf_counter() - t))
    for c in conns:
        c.close()
    for proc in owners:
        proc.join(10)
    return best


class SendfileOwners:
    """Two owner processes that sendfile PER_REQUEST blocks per request into a TCP socket
    (4 MiB socket buffers, as cachemw's block servers and readers use), for measuring the
    machine's ceiling next to cachemw in the same run (benchmarks/cache_cluster.py)."""

    def __init__(self, paths) -> None:
        self.owners, self.socks = [], []
        ctx = mp.get_context("spawn")  # the caller may run Ray's threads: do not fork it
        for _ in range(2):
            q = ctx.Queue()
            proc = ctx.Process(target=_owner_sendfile, args=(q, paths), daemon=True)
            proc.start()
            self.owners.append(proc)
            sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            self.socks.append(sock)
        self.buffers = [memoryview(bytearray(PER_REQUEST * BLOCK)) for _ in self.socks]

    def measure(self, per_block: bool, rounds: int = ROUNDS) -> float:
        """GB/s into this process: both owners asked at once, then each reply read either
        block by block (one recv(MSG_WAITALL) into a new bytes each, as cachemw reads) or
        into one buffer (recv_into) and cut into bytes per block."""
        t, total = time.perf_counter(), 0
        for _ in range(rounds):
            for s in self.socks:
                s.sendall(struct.pack("<I", PER_REQUEST))
            for s, view in zip(self.socks, self.buffers):
                if per_block:
                    blocks = [s.recv(BLOCK, socket.MSG_WAITALL) for _ in range(PER_REQUEST)]
                else:
                    got = 0
                    while got < len(view):
                        got += s.recv_into(view[got:])
                    blocks = [bytes(view[i * BLOCK:(i + 1) * BLOCK]) for i in range(PER_REQUEST)]
                total += sum(map(len, blocks))
        return total / (time.perf_counter() - t) / 1e9

    def close(self) -> None:
        for s in self.socks:
            s.close()
        for proc in self.owners:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main() -> int:
    work = tempfile.mkdtemp(prefix="cmw-tc-", dir="/dev/shm")
    try:
        paths = make_files(work, PER_REQUEST, BLOCK)
        print("| transport (2 owners, 32 x 128 KiB each per request) | GB/s |\n|---|---|")
        print(f"| multiprocessing.connection over TCP, owner reads in Python | "
              f"{connection_transport(paths) / 1e9:.2f} |")
        owners = SendfileOwners(paths)
        try:
            for per_block, what in ((False, "reader recv_into one buffer, cut into bytes"),
                                    (True, "reader recv(MSG_WAITALL) per block")):
                best = max(owners.measure(per_block) for _ in range(3))
                print(f"| raw TCP, owner os.sendfile, {what} | {best:.2f} |")
        finally:
            owners.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
