"""What this machine can move between processes, for the remote-hit target of issue 3.

    python benchmarks/transport_ceiling.py

Two "owner" processes serve 32 blocks of 128 KiB each per request from /dev/shm files; one
reader asks both at once and splits what it receives into per-block bytes, as a remote
read must. Three transports: multiprocessing.connection over TCP (pickle-free raw bytes,
the owner reads the files in Python), and raw TCP with the owner's kernel sending the files
(os.sendfile) into the reader's preallocated buffer (recv_into). Ray's own figure is in
benchmarks/cache_cluster.py.
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


def sendfile_transport(paths) -> float:
    owners, socks = [], []
    for _ in range(2):
        q = mp.Queue()
        proc = mp.Process(target=_owner_sendfile, args=(q, paths))
        proc.start()
        owners.append(proc)
        socks.append(socket.create_connection(("127.0.0.1", q.get(timeout=30))))
    buffers = [bytearray(PER_REQUEST * BLOCK) for _ in socks]
    best = 0.0
    for _ in range(3):
        t, total = time.perf_counter(), 0
        for _ in range(ROUNDS):
            for s in socks:
                s.sendall(struct.pack("<I", PER_REQUEST))
            for s, buf in zip(socks, buffers):
                view, got = memoryview(buf), 0
                while got < len(buf):
                    got += s.recv_into(view[got:])
                blocks = [bytes(view[i * BLOCK:(i + 1) * BLOCK]) for i in range(PER_REQUEST)]
                total += sum(map(len, blocks))
        best = max(best, total / (time.perf_counter() - t))
    for s in socks:
        s.close()
    for proc in owners:
        proc.join(10)
    return best


def main() -> int:
    work = tempfile.mkdtemp(prefix="cmw-tc-", dir="/dev/shm")
    try:
        paths = make_files(work, PER_REQUEST, BLOCK)
        print("| transport (2 owners, 32 x 128 KiB each per request) | GB/s |\n|---|---|")
        print(f"| multiprocessing.connection over TCP, owner reads in Python | "
              f"{connection_transport(paths) / 1e9:.2f} |")
        print(f"| raw TCP, owner os.sendfile, reader recv_into | {sendfile_transport(paths) / 1e9:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
