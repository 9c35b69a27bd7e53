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


class _Directory:
    """Stands in for the reader's daemon client: the ring op and the counters."""

    def __init__(self, servers: dict) -> None:
        self.servers = servers
        self.counted: dict[str, int] = {}

    def _call(self, op):
        members = ["reader", *self.servers]
        return ("ok", {"self": "reader", "members": members, "vnodes": 64,
                       "blocks": {n: list(s.address) for n, s in self.servers.items()},
                       "secret": SECRET.hex()})

    def count(self, name: str, n: int = 1) -> None:
        self.counted[name] = self.counted.get(name, 0) + n


RING_NODES = ("reader", "a", "b")


@pytest.fixture
def two_owners(tmp_path):
    """Owners a and b hold the blocks the ring gives them; the reader owns the rest."""
    from cachemw.ring import HashRing

    ring = HashRing(RING_NODES, 64)
    nodes = {name: NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / name / "rt"),
                                                dram_dir=str(tmp_path / name / "dram"),
                                                dram_capacity="64MiB"))
             for name in ("a", "b")}
    blocks = {}
    for i in range(60):
        key = block_key("file:///x", "v1", i, L)
        data = blocks[key] = os.urandom(L)
        node = nodes.get(ring.owner(key))
        if node is not None:
            conn = object()
            kind, tier = node.lease(key, L, "file:///x", conn)
            node.filled(key, tier, node.tier(tier).put(key, data), conn)
    servers = {name: BlockServer(node, "127.0.0.1", SECRET) for name, node in nodes.items()}
    yield ring, nodes, servers, blocks
    for s in servers.values():
        s.close()


@pytest.mark.timeout(60)
def test_reads_from_several_owners_at_once(two_owners):
    from cachemw.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    directory = _Directory(servers)
    reads = DirectReads(directory, timeout=5)
    held = {k for k in blocks if ring.owner(k) in nodes}
    assert 0 < len(held) < len(blocks)
    items = [(k, L) for k in blocks]
    for _ in range(3):  # connections carry request after request
        got = reads.fetch(items)
        assert set(got) == held
        assert all(got[k] == blocks[k] for k in got)
    only_a = [(k, L) for k in held if ring.owner(k) == "a"]
    assert reads.fetch(only_a) == {k: blocks[k] for k, _ in only_a}  # one owner: no poll
    assert not directory.counted
    assert sum(n.counters["served_direct"] for n in nodes.values()) == 3 * len(held) + len(only_a)


@pytest.mark.timeout(60)
def test_a_damaged_block_from_an_owner_is_left_out_and_counted(two_owners):
    from cachemw.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    held = [k for k in blocks if ring.owner(k) in nodes]
    bad = held[0]
    with open(nodes[ring.owner(bad)].block_path(bad), "r+b") as f:
        f.seek(L // 2)
        f.write(bytes([f.read(1)[0] ^ 0x01]))
    directory = _Directory(servers)
    got = DirectReads(directory, timeout=5).fetch([(k, L) for k in blocks])
    assert set(got) == set(held) - {bad}  # the reader fetches it again through its daemon
    assert all(got[k] == blocks[k] for k in got)
    assert directory.counted == {"corrupt_repaired": 1}


class _Hung:
    """A block server that proves the secret, then never answers (a stopped process)."""

    def __init__(self) -> None:
        import socket
        import threading

        from cachemw.blockserver import authenticate_server

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.conns = []

        def accept():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.conns.append(conn)
                authenticate_server(conn, SECRET)

        threading.Thread(target=accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.timeout(60)
def test_a_hung_owner_costs_one_bounded_timeout(two_owners):
    import time

    from cachemw.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    hung = _Hung()
    try:
        directory = _Directory({"a": servers["a"], "b": hung})
        reads = DirectReads(directory, timeout=1.0)
        t = time.monotonic()
        got = reads.fetch([(k, L) for k in blocks])
        assert time.monotonic() - t < 3.0  # one timeout, not one per block
        assert set(got) == {k for k in blocks if ring.owner(k) == "a"}
        assert all(got[k] == blocks[k] for k in got)
        t = time.monotonic()  # the hung owner alone: the socket's own receive timeout
        assert reads.fetch([(k, L) for k in blocks if ring.owner(k) == "b"]) == {}
        assert time.monotonic() - t < 3.0
    finally:
        hung.close()


@pytest.mark.timeout(30)
def test_a_header_announcing_another_length_breaks_the_connection():
    """A broken owner cannot make the reader allocate what a header says (1 TiB here)."""
    import socket
    import struct
    import threading

    from cachemw.blockserver import authenticate_server

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            authenticate_server(conn, SECRET)
            (count,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            conn.recv(count * 24, socket.MSG_WAITALL)
            conn.sendall(struct.pack("<BQQ", 1, 1 << 40, 0) * count)
            conn.recv(1)  # until the reader hangs up

    threading.Thread(target=serve, daemon=True).start()
    client = BlockClient(server.getsockname(), SECRET, timeout=5)
    key = block_key("file:///x", "v1", 0, L)
    client.request([(key, L)])
    with pytest.raises(ConnectionError):
        client.receive([(key, L)])
    client.close()
    server.close()
