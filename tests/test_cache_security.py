"""Security: the runtime dir, socket, registry and cached blocks are the job user's alone;
a connection without the daemon's secret is rejected and the daemon keeps serving."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
from multiprocessing.connection import Connection, answer_challenge

import pytest

from cachemw.protocol import LOCK, REGISTRY, SOCKET, lookup
from conftest import daemon_stats


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_runtime_dir_socket_and_blocks_are_private(make_cache_fs, runtime_dir, dataset):
    root, files = dataset
    fs = make_cache_fs()
    for p, data in files.items():
        assert fs.cat_file(p) == data
    assert mode(runtime_dir) == 0o700
    assert stat.S_ISSOCK(os.stat(os.path.join(runtime_dir, SOCKET)).st_mode)
    assert mode(os.path.join(runtime_dir, SOCKET)) == 0o600
    assert mode(os.path.join(runtime_dir, REGISTRY)) == 0o600
    assert mode(os.path.join(runtime_dir, LOCK)) == 0o600
    dram = daemon_stats(runtime_dir)["tiers"]["dram"]["path"]
    assert mode(dram) == 0o700
    blocks = 0
    for sub in os.listdir(dram):
        if len(sub) == 2:
            assert mode(os.path.join(dram, sub)) == 0o700
            for entry in os.scandir(os.path.join(dram, sub)):
                assert mode(entry.path) == 0o600, entry.path
                blocks += 1
    assert blocks == sum(max(1, -(-len(d) // fs.options.block_size)) for d in files.values())
    assert mode(os.path.join(dram, "meta")) == 0o700


def test_preexisting_open_runtime_dir_is_made_private(runtime_dir, spawn_daemon):
    os.makedirs(runtime_dir, mode=0o755)
    os.chmod(runtime_dir, 0o755)
    spawn_daemon(runtime_dir)
    assert mode(runtime_dir) == 0o700


def _connect(path) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    assert conn.poll(10), "the daemon sent no challenge"
    return conn


@pytest.mark.timeout(60)
def test_wrong_secret_rejected_daemon_keeps_serving(make_cache_fs, runtime_dir, tmp_path):
    fs = make_cache_fs()
    (tmp_path / "f").write_bytes(b"payload")
    assert fs.cat_file(str(tmp_path / "f")) == b"payload"
    address = lookup(runtime_dir)
    import multiprocessing

    # a wrong secret: the challenge fails and the connection is dropped
    conn = _connect(address.socket)
    with pytest.raises(multiprocessing.AuthenticationError):
        answer_challenge(conn, os.urandom(32))
    conn.close()
    # no handshake at all: requests are not answered
    conn = _connect(address.socket)
    assert conn.recv_bytes().startswith(b"#CHALLENGE#")
    conn.send(("stats",))  # taken as a (wrong) answer to the challenge
    assert conn.recv_bytes() == b"#FAILURE#"
    with pytest.raises((EOFError, OSError)):
        conn.recv_bytes()  # and the daemon hung up
    conn.close()
    # garbage bytes, and a connection closed at once
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address.socket)
    s.sendall(os.urandom(300))
    s.close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address.socket)
    s.close()

    # the daemon still serves: the existing client, and a new one
    (tmp_path / "g").write_bytes(b"second")
    assert fs.cat_file(str(tmp_path / "g")) == b"second"
    assert fs.stats()["fallbacks"] == 0
    stats = daemon_stats(runtime_dir)
    assert stats["pid"] == address.pid
    assert stats["counters"]["leases"] == 2
    conn = _connect(address.socket)
    answer_challenge(conn, address.authkey)
    conn.send(("ping",))
    assert conn.recv() == ("pong",)
    conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.timeout(60)
def test_other_user_cannot_reach_socket_or_secret(make_cache_fs, runtime_dir, tmp_path):
    fs = make_cache_fs()
    (tmp_path / "f").write_bytes(b"x")
    fs.cat_file(str(tmp_path / "f"))
    probe = (
        "import socket, sys\n"
        "rt = sys.argv[1]\n"
        "for what in ('daemon.json',):\n"
        "    try:\n"
        "        open(rt + '/' + what).read(); print('read', what)\n"
        "    except PermissionError: print('denied', what)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(rt + '/daemon.sock'); print('connected')\n"
        "except PermissionError: print('denied socket')\n"
    )
    r = subprocess.run(["/usr/bin/python3", "-c", probe, runtime_dir], capture_output=True,
                       text=True, timeout=30, user=65534, group=65534, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["denied daemon.json", "denied socket"]
