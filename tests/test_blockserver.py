"""Direct block transfer (the data plane for remote hits), without Ray: a node's block
server sends cached blocks to a reader that proves the cluster secret; the reader verifies
every block against its checksum."""
from __future__ import annotations

import os

import pytest

from cachemw.client.blockclient import BlockClient
from cachemw.cluster.blockserver import BlockServer
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from conftest import wait_for

L = 100_000
SECRET = os.urandom(32)


def flip_byte(path: str, pos: int, mask: int) -> None:
    """Change the byte at ``pos`` (read it, then write it back changed at the same place:
    the read moves the position on, and a write there changed the next byte, or nothing at
    all when that byte already held the value written: one time in 256)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ mask]))


@pytest.fixture
def served(tmp_path):
    node = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity="64MiB"))
    conn, blocks = object(), {}
    for i in range(3):
        key = block_key("file:///x", "v1", i, L)
        data = os.urandom(L)
        kind, tier, lease = node.lease(key, L, "file:///x", conn)
        assert kind == "fill"
        node.filled(key, tier, node.tier(tier).stage(key, data, lease), conn, lease)
        blocks[key] = data
    server = BlockServer(node, "127.0.0.1", SECRET)
    yield node, server, blocks
    server.close()


@pytest.mark.timeout(30)
def test_blocks_come_verified_and_absent_ones_are_none(served):
    node, server, blocks = served
    client = BlockClient(server.address, SECRET, timeout=5)
    items = [(k, L) for k in blocks] + [(block_key("file:///x", "v1", 99, L), L)]
    client.request(items)
    got = client.receive(items)
    assert got[:3] == list(blocks.values()) and got[3] is None
    client.request(items[:1])  # the connection serves request after request
    assert client.receive(items[:1]) == [blocks[items[0][0]]]
    client.close()
    # the server counts a batch once its last byte is sent: the reader may see it first
    wait_for(lambda: node.counters["served_direct"] == 4, 10, what="4 blocks counted as served")


@pytest.mark.timeout(30)
def test_a_damaged_block_is_never_returned(served):
    node, server, blocks = served
    key = next(iter(blocks))
    path = node.block_path(key)
    flip_byte(path, 10, 0xFF)
    client = BlockClient(server.address, SECRET, timeout=5)
    client.request([(key, L)])
    assert client.receive([(key, L)]) == [None]  # the reader goes the usual way instead


@pytest.mark.timeout(30)
def test_a_wrong_secret_is_refused_and_the_server_keeps_serving(served):
    node, server, blocks = served
    with pytest.raises(PermissionError):
        BlockClient(server.address, os.urandom(32), timeout=5)
    client = BlockClient(server.address, SECRET, timeout=5)
    key = next(iter(blocks))
    client.request([(key, L)])
    assert client.receive([(key, L)]) == [blocks[key]]


@pytest.mark.timeout(30)
def test_a_header_announcing_another_length_breaks_the_connection():
    """A broken owner cannot make the reader allocate what a header says (1 TiB here)."""
    import socket
    import struct
    import threading

    from cachemw.blockwire import authenticate_server

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            authenticate_server(conn, SECRET)
            (count,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            body = conn.recv(count * 24, socket.MSG_WAITALL)
            conn.sendall(b"".join(struct.pack("<16sBQQ", body[i * 24:i * 24 + 16], 1, 1 << 40, 0)
                                  for i in range(count)))
            conn.recv(1)  # until the reader hangs up

    threading.Thread(target=serve, daemon=True).start()
    client = BlockClient(server.getsockname(), SECRET, timeout=5)
    key = block_key("file:///x", "v1", 0, L)
    client.request([(key, L)])
    with pytest.raises(ConnectionError):
        client.receive([(key, L)])
    client.close()
    server.close()
