"""Direct block transfer (the data plane for remote hits), without Ray: a node's block
server sends cached blocks to a reader that proves the cluster secret; the reader verifies
every block against its checksum."""
from __future__ import annotations

import os

import pytest

from cachemw.blockserver import BlockClient, BlockServer
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node import NodeCache

L = 100_000
SECRET = os.urandom(32)


@pytest.fixture
def served(tmp_path):
    node = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity="64MiB"))
    conn, blocks = object(), {}
    for i in range(3):
        key = block_key("file:///x", "v1", i, L)
        data = os.urandom(L)
        kind, tier = node.lease(key, L, "file:///x", conn)
        assert kind == "fill"
        node.filled(key, tier, node.tier(tier).put(key, data), conn)
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
    assert node.counters["served_direct"] == 4


@pytest.mark.timeout(30)
def test_a_damaged_block_is_never_returned(served):
    node, server, blocks = served
    key = next(iter(blocks))
    path = node.block_path(key)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
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
