"""Remote hits read from several owners at once, without Ray: what a reader does with
owners that hold the blocks, send a damaged one, hang, drip their bytes or cut an exchange
short (each costs at most one bounded wait, never another block's bytes), and the daemon's
side of an owner named silent."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from cachemw.client.blockclient import BlockClient
from cachemw.cluster.blockserver import BlockServer
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from conftest import wait_for
from test_blockserver import L, SECRET, flip_byte


class _Directory:
    """Stands in for the reader's daemon client: the ring op and the counters."""

    def __init__(self, servers: dict, timeout: float | None = None) -> None:
        self.servers = servers
        self.peer_timeout = timeout  # the daemon's peer_timeout, if it says
        self.timeout = 5.0  # the client's daemon_timeout
        self.counted: dict[str, int] = {}
        self.silent: list[str] = []  # owners named to the daemon as silent (peer_silent)
        self.refused: list[str] = []  # owners whose block server refused (peer_refused)

    def ring(self):
        members = ["reader", *self.servers]
        d = {"self": "reader", "members": members, "vnodes": 64,
             "blocks": {n: list(s.address) for n, s in self.servers.items()},
             "secret": SECRET.hex()}
        if self.peer_timeout is not None:
            d["timeout"] = self.peer_timeout
        return d

    def count(self, name: str, n: int = 1) -> None:
        self.counted[name] = self.counted.get(name, 0) + n

    def peer_silent(self, owner: str) -> bool:
        self.silent.append(owner)
        return True

    def peer_refused(self, owner: str) -> bool:
        self.refused.append(owner)
        return True


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
            kind, tier, lease = node.lease(key, L, "file:///x", conn)
            node.filled(key, tier, node.tier(tier).stage(key, data, lease), conn, lease)
    servers = {name: BlockServer(node, "127.0.0.1", SECRET) for name, node in nodes.items()}
    yield ring, nodes, servers, blocks
    for s in servers.values():
        s.close()


@pytest.mark.timeout(60)
def test_reads_from_several_owners_at_once(two_owners):
    from cachemw.client.direct import DirectReads

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
    served = 3 * len(held) + len(only_a)  # counted after their last byte is sent
    wait_for(lambda: sum(n.counters["served_direct"] for n in nodes.values()) == served, 10,
             what=f"{served} blocks counted as served")


@pytest.mark.timeout(60)
def test_a_damaged_block_from_an_owner_is_left_out_and_counted(two_owners):
    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    held = [k for k in blocks if ring.owner(k) in nodes]
    bad = held[0]
    flip_byte(nodes[ring.owner(bad)].block_path(bad), L // 2, 0x01)
    directory = _Directory(servers)
    got = DirectReads(directory, timeout=5).fetch([(k, L) for k in blocks])
    assert set(got) == set(held) - {bad}  # the reader fetches it again through its daemon
    assert all(got[k] == blocks[k] for k in got)
    assert directory.counted == {"corrupt_repaired": 1}


class _FakeOwner:
    """A stand-in block server: accepts, proves the secret, then runs ``serve(conn)``."""

    def __init__(self, serve) -> None:
        import socket
        import threading

        from cachemw.blockwire import authenticate_server

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.conns = []

        def run(conn):
            try:
                if authenticate_server(conn, SECRET):
                    serve(conn)
            except OSError:
                pass

        def accept():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.conns.append(conn)
                threading.Thread(target=run, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _hung_owner():
    """A block server that proves the secret, then never answers (a stopped process)."""
    return _FakeOwner(lambda conn: None)


@pytest.mark.timeout(60)
def test_a_hung_owner_costs_one_bounded_timeout(two_owners):
    import time

    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    hung = _hung_owner()
    try:
        directory = _Directory({"a": servers["a"], "b": hung})
        reads = DirectReads(directory, timeout=1.0)
        t = time.monotonic()
        got = reads.fetch([(k, L) for k in blocks])
        assert time.monotonic() - t < 3.0  # one timeout, not one per block
        assert set(got) == {k for k in blocks if ring.owner(k) == "a"}
        assert all(got[k] == blocks[k] for k in got)
        # the hung owner alone: the socket's own receive timeout (a reader that has not
        # found it silent yet: one that has asks it no more for a while, see below)
        t = time.monotonic()
        assert DirectReads(directory, timeout=1.0).fetch(
            [(k, L) for k in blocks if ring.owner(k) == "b"]) == {}
        assert time.monotonic() - t < 3.0
        assert directory.counted["direct_failures"] == 2  # counted, not only logged
    finally:
        hung.close()


@pytest.mark.timeout(60)
def test_a_hung_owner_is_named_to_the_daemon_and_not_asked_again_at_once(two_owners):
    """A hung owner costs one timeout, not two (found by a black-box review: a read of a
    block owned by a stopped daemon took twice peer_timeout, the direct transfer's and then
    the one of the lease's call through Ray). The reader names the owner to its daemon,
    whose calls to it then fail at once (test_multinode), and asks it directly no more for
    a timeout's length: the daemon's ring it was told may still list it meanwhile."""
    import socket
    import time

    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    hung = _hung_owner()
    items = [(k, L) for k in blocks]
    a_keys = {k for k in blocks if ring.owner(k) == "a"}
    timeout = 1.5
    try:
        directory = _Directory({"a": servers["a"], "b": hung})
        reads = DirectReads(directory, timeout=timeout)
        assert set(reads.fetch(items)) == a_keys
        assert directory.silent == ["b"]  # told once, before the lease of its blocks
        t = time.monotonic()
        got = reads.fetch(items)  # the hung owner is not asked: no second wait
        assert time.monotonic() - t < timeout  # (asked, it would wait the timeout again)
        assert set(got) == a_keys and all(got[k] == blocks[k] for k in got)
        assert directory.counted["direct_failures"] == 1 and directory.silent == ["b"]
        time.sleep(timeout + 0.1)  # a timeout later it is asked again (it may be back)
        assert set(reads.fetch(items)) == a_keys
        assert directory.silent == ["b", "b"]
        # a failure that is no timeout (refused: a daemon restarted elsewhere) is not named
        # silent; it is named refused, and the daemon asks that owner where it listens now
        assert directory.refused == []
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        directory.servers["b"] = SimpleNamespace(address=closed.getsockname())
        closed.close()
        reads = DirectReads(directory, timeout=timeout)
        assert set(reads.fetch(items)) == a_keys
        assert directory.silent == ["b", "b"] and directory.counted["direct_failures"] == 3
        assert directory.refused == ["b"]
    finally:
        hung.close()


@pytest.mark.timeout(60)
def test_threads_wait_for_the_first_directory_rather_than_read_alone():
    """The threads of a reader (a warm's eight) that met their first misses while one of
    them asked the daemon for the ring took "no answer yet" for "no ring": they read as a
    lone node does, fetching blocks other nodes own from the source and filling them here
    (found by a black-box review: a warm alone on a warm 3-node cache fetched 69 of its 104
    blocks from the source again). They wait for that first answer now."""
    import threading
    import time

    from cachemw.client.direct import DirectReads

    class SlowDirectory(_Directory):
        asked = 0  # before the first answer (a thread scheduled late may ask again after)
        answered = False

        def ring(self):
            if not SlowDirectory.answered:
                SlowDirectory.asked += 1
            time.sleep(0.3)  # a first connection to the daemon, a busy daemon
            d = super().ring()
            # every member's block server up (the reader's too): no refresh asked a
            # moment later, as for a peer still starting (DirectReads._ask)
            d["blocks"]["reader"] = ["127.0.0.1", 9]
            SlowDirectory.answered = True
            return d

    nowhere = SimpleNamespace(address=("127.0.0.1", 9))
    reads = DirectReads(SlowDirectory({"a": nowhere, "b": nowhere}), timeout=1.0)
    results = []
    start = threading.Barrier(8)

    def reader():
        start.wait()
        results.append(reads.alone())

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [False] * 8  # a ring of three: none of them alone
    assert SlowDirectory.asked == 1  # asked once for all of them


@pytest.mark.timeout(60)
def test_the_daemons_peer_timeout_bounds_direct_reads(two_owners):
    """The reader takes its bound from the daemon's directory (``peer_timeout``): one
    setting for a peer's Ray calls and for direct transfers from it."""
    import time

    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    hung = _hung_owner()
    try:
        reads = DirectReads(_Directory({"a": servers["a"], "b": hung}, timeout=0.5),
                            timeout=30.0)
        t = time.monotonic()
        got = reads.fetch([(k, L) for k in blocks])
        assert time.monotonic() - t < 2.5
        assert reads.timeout == 0.5
        assert set(got) == {k for k in blocks if ring.owner(k) == "a"}
    finally:
        hung.close()


def _dripping_owner(blocks: dict, chunk: int, period: float) -> _FakeOwner:
    """A block server that answers right, but ``chunk`` bytes every ``period`` seconds."""
    import socket
    import struct
    import time

    from cachemw.blockfile import hash_of

    def serve(conn):
        (count,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
        body = conn.recv(count * 24, socket.MSG_WAITALL)
        keys = [body[i * 24:i * 24 + 16] for i in range(count)]
        reply = b"".join(struct.pack("<16sBQQ", k, 1, L, hash_of(blocks[k.hex()]))
                         for k in keys) + b"".join(blocks[k.hex()] for k in keys)
        for i in range(0, len(reply), chunk):
            conn.sendall(reply[i:i + chunk])
            time.sleep(period)

    return _FakeOwner(serve)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk,period", [(1, 0.2), (L // 2, 0.6), (L + 41, 0.5)],
                         ids=["a byte at a time", "half blocks", "a block at a time"])
def test_a_dripping_owner_costs_at_most_the_fetch_budget(two_owners, chunk, period):
    """However an owner dribbles its reply (and with a periodic signal interrupting every
    receive), one fetch takes at most its budget; what came whole and verified is kept,
    the rest goes the usual way. (A healthy owner's blocks may be left to the usual way too
    while the reader sits in the slow owner's receive: speed, not correctness.)"""
    import signal
    import time

    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    slow = _dripping_owner(blocks, chunk, period)
    old = signal.signal(signal.SIGALRM, lambda *a: None)  # EINTR on every blocked receive
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    try:
        directory = _Directory({"a": servers["a"], "b": slow})
        reads = DirectReads(directory, timeout=1.0)
        items = [(k, L) for k in blocks if ring.owner(k) in ("a", "b")]
        budget = 1.0 + len(items) * L / 50e6
        for batch in (items, [it for it in items if ring.owner(it[0]) == "b"]):
            t = time.monotonic()
            got = reads.fetch(batch)
            assert time.monotonic() - t < budget + 1.0
            assert all(got[k] == blocks[k] for k in got)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        slow.close()


@pytest.mark.timeout(60)
def test_an_owner_that_answered_then_stalled_is_not_named_to_the_daemon(two_owners):
    """An owner that sent its reply's headers, then no block within the fetch's budget, is
    alive (slow, a disk or a link crawling), not silent: named to the daemon, it would be
    suspected (out of the ring for seconds, counted as a peer failure). Its blocks go the
    usual way, counted; it is not named, alone or beside another owner (whose reply may
    wait unread meanwhile: not named either)."""
    import socket
    import struct

    from cachemw.blockfile import hash_of
    from cachemw.client.direct import DirectReads

    def serve(conn):  # headers for every block, then nothing until the reader hangs up
        (count,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
        body = conn.recv(count * 24, socket.MSG_WAITALL)
        keys = [body[i * 24:i * 24 + 16] for i in range(count)]
        conn.sendall(b"".join(struct.pack("<16sBQQ", k, 1, L, hash_of(blocks[k.hex()]))
                              for k in keys))
        conn.recv(1)

    ring, nodes, servers, blocks = two_owners
    stalled = _FakeOwner(serve)
    try:
        directory = _Directory({"a": servers["a"], "b": stalled})
        b_items = [(k, L) for k in blocks if ring.owner(k) == "b"]
        # alone (the single reply's path), then beside a healthy owner (several replies')
        assert DirectReads(directory, timeout=0.5).fetch(b_items) == {}
        assert directory.counted["direct_failures"] == 1 and directory.silent == []
        got = DirectReads(directory, timeout=0.5).fetch([(k, L) for k in blocks])
        assert {ring.owner(k) for k in got} <= {"a"} and all(got[k] == blocks[k] for k in got)
        assert directory.counted["direct_failures"] >= 2 and directory.silent == []
    finally:
        stalled.close()


@pytest.mark.timeout(60)
def test_an_exchange_cut_short_never_passes_one_blocks_bytes_off_as_anothers(two_owners,
                                                                              monkeypatch):
    """A fetch interrupted between its request and its reply (a signal handler raising, as
    Ctrl-C does) leaves a reply unread on the connection: the next fetches still return
    each key's own bytes, and a reply read for the wrong request is refused."""
    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    a_keys = [k for k in blocks if ring.owner(k) == "a"]
    reads = DirectReads(_Directory(servers), timeout=5)
    original = BlockClient.request
    calls = []

    def request_then_interrupt(self, items):
        original(self, items)
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt  # after the request went out, before its reply is read

    monkeypatch.setattr(BlockClient, "request", request_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        reads.fetch([(a_keys[0], L)])
    for key in a_keys[1:6]:  # same owner, same sizes: a stream one reply behind would pass
        assert reads.fetch([(key, L)]) == {key: blocks[key]}
    monkeypatch.setattr(BlockClient, "request", original)

    client = BlockClient(servers["a"].address, SECRET, timeout=5)
    client.request([(a_keys[0], L)])  # never read: the stream is now one reply behind
    client.request([(a_keys[1], L)])
    with pytest.raises(ConnectionError):
        client.receive([(a_keys[1], L)])
    client.close()


@pytest.mark.ray
@pytest.mark.timeout(60)
def test_a_daemon_told_an_owner_is_silent_fails_its_calls_at_once():
    """The daemon's side of one timeout, not two: once a reader of the node names an
    owner whose block server kept it waiting the whole timeout, the lease of those blocks
    does not call that owner through Ray and wait as long again: the call fails at once,
    as a timed-out one does (the owner suspected and out of the ring, counted), for a
    timeout's length."""
    import time

    from cachemw.cluster.peers import PeerSet

    class GetTimeoutError(Exception):
        pass

    class HungRay:  # ray.get on a stopped peer: the whole timeout, then GetTimeoutError
        def get(self, ref, timeout):
            time.sleep(timeout)
            raise GetTimeoutError()

        def cancel(self, ref):
            pass

    timeout = 1.0  # the margins are the timeout: a loaded machine's delays stay below it

    def peer_set():
        calls = []
        remote = SimpleNamespace(remote=lambda requests: calls.append(requests) or [object()])
        handle = SimpleNamespace(serve_blocks=SimpleNamespace(options=lambda **_: remote))
        peers = PeerSet("me", timeout=timeout, vnodes=64)
        peers._ray = HungRay()
        peers._names = {"me": "me", "x": "x"}
        peers._handles["x"] = handle
        peers._set_members(["me", "x"])
        return peers, calls

    request = {"x": [("k" * 32, 10, "file:///f", None)]}
    peers, calls = peer_set()  # not told: the call waits its timeout
    t = time.monotonic()
    assert peers.fetch_many(request) == {"x": None}
    assert time.monotonic() - t >= timeout and len(calls) == 1
    peers, calls = peer_set()
    peers.silent("me")  # itself, or a name not in the ring: nothing to do
    peers.silent("nobody")
    assert peers.members == ("me", "x")
    peers.silent("x")
    t = time.monotonic()
    assert peers.fetch_many(request) == {"x": None}
    assert time.monotonic() - t < timeout and calls == []  # no call, no second wait
    assert peers.members == ("me",) and peers.counters["peer_failures"] == 1
    peers, calls = peer_set()
    peers.silent("x")
    time.sleep(timeout + 0.1)  # a timeout later, calls are made again (it may answer by then)
    assert peers.fetch_many(request) == {"x": None} and len(calls) == 1


@pytest.mark.timeout(60)
def test_a_thread_waiting_for_another_s_first_ring_ask_spends_its_read_call_s_silence():
    """One thread's first ask for the ring goes unanswered (a daemon stopped): another
    thread's read call waited for it outside its budget of silence (one daemon_timeout in
    all, silence.py), then waited on the daemon again. It waits at most what is left of
    its budget now, and that wait is spent."""
    import threading
    import time

    from cachemw.client.direct import DirectReads
    from cachemw.client.silence import ReadCall, silence_left

    answer = threading.Event()

    class Silent(_Directory):
        def ring(self):
            answer.wait(30)  # the daemon is stopped
            return None

    reads = DirectReads(Silent({}), timeout=1.0)
    reads.client.timeout = 1.0
    first = threading.Thread(target=reads.alone)
    first.start()
    try:
        time.sleep(0.2)  # the first thread asks
        left = {}

        def second():
            with ReadCall(1.0):
                began = time.monotonic()
                reads.alone()
                left["waited"] = time.monotonic() - began
                left["left"] = silence_left(1.0)

        t = threading.Thread(target=second)
        t.start()
        t.join(20)
        assert not t.is_alive()
        assert left["waited"] < 5  # before: until the first ask was answered (30 s here)
        assert left["left"] <= 0.05  # its budget spent: the rest of the call reads the source
    finally:
        answer.set()
        first.join(10)


def test_a_peer_s_block_server_is_asked_again_where_it_listens_once_a_reader_is_refused():
    """Ray restarts a killed daemon actor in place, its block server on a new port. The
    other daemons learned a peer's address once, so their readers were refused there and
    every remote hit on that node went through Ray for the rest of the job (review ops6).
    A reader refused says so (ops PEER_REFUSED), and the daemon asks the peer again."""
    from cachemw.cluster.peers import PeerSet

    port = [7001]
    handle = SimpleNamespace(address=SimpleNamespace(remote=lambda: {"blocks": ["10.0.0.2", port[0]]}),
                             ping=SimpleNamespace(remote=lambda: "x"))

    class Ray:
        def nodes(self):
            return [{"NodeID": n, "Alive": True, "NodeManagerHostname": h}
                    for n, h in (("me", "host-a"), ("x", "host-b"))]

        def get_actor(self, name, namespace):
            return handle

        def get(self, ref, timeout):
            return ref

    peers = PeerSet("me", timeout=1.0, vnodes=64, secret="00" * 32)
    peers._ray = Ray()
    peers.refresh()
    assert peers.directory()["blocks"]["host-b"] == ["10.0.0.2", 7001]
    port[0] = 7002  # its daemon restarted
    peers.refresh()
    assert peers.directory()["blocks"]["host-b"] == ["10.0.0.2", 7001]  # learned once
    peers.refused("host-a")  # itself, or a name not in the ring: nothing to do
    peers.refused("nobody")
    peers.refused("host-b")
    assert "host-b" not in peers.directory()["blocks"]  # readers go through the daemon
    peers.refresh()
    assert peers.directory()["blocks"]["host-b"] == ["10.0.0.2", 7002]


@pytest.mark.timeout(60)
def test_a_refresh_waits_one_timeout_for_all_its_silent_peers_together():
    """A peer whose daemon is down (Ray restarting it, or its node hung) was asked where
    its block server listens, or pinged as a suspect, one at a time, each call given 5 s:
    every membership refresh took 5 s per such peer (diffrev-10). The refresh asks them
    all at once, under one deadline; what answered in time counts as before."""
    import time

    import ray

    from cachemw.cluster.peers import PeerSet

    down = {"x", "y", "z"}

    class Ray:
        def nodes(self):
            return [{"NodeID": n, "Alive": True, "NodeManagerHostname": f"host-{n}"}
                    for n in ("me", "w", "x", "y", "z")]

        def get_actor(self, name, namespace):
            node = name.rsplit("-", 1)[-1]
            return SimpleNamespace(
                address=SimpleNamespace(remote=lambda: (node, {"blocks": [f"10.0.0.{ord(node)}", 7000]})),
                ping=SimpleNamespace(remote=lambda: (node, "pong")))

        def get(self, ref, timeout):
            node, answer = ref
            if node in down:  # a call to a stopped actor: its whole timeout, then this
                time.sleep(timeout)
                raise ray.exceptions.GetTimeoutError("timed out")
            return answer

    timeout = 1.5
    peers = PeerSet("me", timeout=timeout, vnodes=64, secret="00" * 32)
    peers._ray = Ray()
    began = time.monotonic()
    peers.refresh()
    assert time.monotonic() - began < 2 * timeout  # one wait, not one per peer (3 of them)
    assert set(peers.directory()["blocks"]) == {"host-w"}
    assert set(peers.members) == {"me", "w", "x", "y", "z"}  # not suspected: only not learned
    for node in ("x", "y"):
        peers._suspect(node, "a call timed out")
    peers._suspect_until = {n: 0.0 for n in peers._suspect_until}  # their time is up
    down.discard("x")  # x answers again, y still does not
    began = time.monotonic()
    peers.refresh()
    assert time.monotonic() - began < 2 * timeout
    assert set(peers.members) == {"me", "w", "x", "z"}
    assert set(peers.directory()["blocks"]) == {"host-w", "host-x"}
