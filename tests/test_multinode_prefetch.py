"""Blocks owned by other nodes, as a node's prefetch and its hot reads meet them (found by a
black-box review of several nodes): a prefetch of an announced block another node owns is
fetched from its owner, which reads the source once cluster-wide (it read the source on
every node that announced it: an announced epoch on 3 nodes of a warmed dataset sent 96
GETs, where a plain one sent 0); hits at an owner's block server, which the local daemon
never sees, are reported by the readers, so a block a node keeps reading is replicated
there as the README says (``replicas`` stayed 0); a damaged block from an owner is logged
once per process, every one counted (16 lines for 16 blocks from one reader)."""
from __future__ import annotations

import logging
import os
import threading

import pytest

from cachemw.client import direct as direct_module
from cachemw.cluster import owner
from cachemw.cluster.owner import RemoteReads
from cachemw.config import DaemonConfig, TierConfig
from cachemw.keys import url_tag
from cachemw.node import prefetch
from cachemw.node.cache import NodeCache
from cachemw.reports import remote_hit, remote_hit_tier
from conftest import wait_for
from test_direct_owners import _Directory, two_owners  # noqa: F401 - a fixture
from test_blockserver import L, flip_byte
from test_multinode import BLOCK, _fs, _node_stats, _ring_of_three, _start, _wait

BS = 65536
URL = "file:///data/f.bin"


def _node(tmp_path):
    return NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),),
                                  runtime_dir=str(tmp_path / "rt")))


class _Router:
    """Stands in for PeerSet: keys starting with "a" are owned by peer "a", the rest here;
    ``fetch_many`` answers from ``held`` (None for an owner that is ``down``)."""

    self_id = "me"

    def __init__(self, held: dict[str, bytes], down: bool = False) -> None:
        self.held, self.down = held, down
        self.calls: list[dict] = []
        self._lock = threading.Lock()

    def owner(self, key: str) -> str:
        return "a" if key.startswith("a") else "me"

    def fetch_many(self, by_owner):
        with self._lock:
            self.calls.append({o: list(items) for o, items in by_owner.items()})
        return {o: None if self.down else [self.held.get(item[0]) for item in items]
                for o, items in by_owner.items()}


def _source(i: int) -> tuple:
    return ("{}", "/data/f.bin", i, BS, 16 * BS, "v")


def _keys():
    return [("a" if i % 3 else "b") + f"{i:031x}" for i in range(9)]  # 6 at peer a, 3 here


def _counting_source(monkeypatch, blocks: dict[int, bytes]) -> list[int]:
    read = []

    class Source:
        @staticmethod
        def read_block(path, index, block_size, file_size, version):
            read.append(index)
            return blocks[index]

    monkeypatch.setattr(prefetch, "source_for", lambda _target: Source)
    return read


@pytest.mark.timeout(30)
def test_a_prefetch_fetches_blocks_owned_elsewhere_from_their_owners(tmp_path, monkeypatch):
    """One call to the owner for the pass's blocks it owns, kept here too (their reads
    here are hits); only the node's own blocks are read from the source."""
    keys = _keys()
    blocks = {i: os.urandom(BS) for i in range(len(keys))}
    router = _Router({k: blocks[i] for i, k in enumerate(keys)})
    node = _node(tmp_path)
    node.remote = RemoteReads(node, router)
    read = _counting_source(monkeypatch, blocks)
    node.announce([(k, BS, URL, _source(i)) for i, k in enumerate(keys)])
    prefetch.run_prefetch(node, 1 << 30)
    mine = [i for i, k in enumerate(keys) if router.owner(k) == "me"]
    assert sorted(read) == mine  # not one block owned by the peer from the source
    assert len(router.calls) == 1 and list(router.calls[0]) == ["a"]
    assert sorted(item[0] for item in router.calls[0]["a"]) == sorted(
        k for k in keys if router.owner(k) == "a")
    assert all(node.read_local(k, BS) == blocks[i] for i, k in enumerate(keys))
    c = node.counters
    assert c["prefetched"] == len(keys) and c["prefetched_from_owners"] == len(keys) - len(mine)
    assert c["bytes_from_source"] == len(mine) * BS and c["replicas"] == 0
    assert not node._inflight and node._tiers["dram"].reserved == 0


@pytest.mark.timeout(30)
def test_a_prefetch_reads_the_source_for_what_an_owner_down_cannot_give(tmp_path, monkeypatch):
    keys = _keys()
    blocks = {i: os.urandom(BS) for i in range(len(keys))}
    router = _Router({}, down=True)
    node = _node(tmp_path)
    node.remote = RemoteReads(node, router)
    read = _counting_source(monkeypatch, blocks)
    node.announce([(k, BS, URL, _source(i)) for i, k in enumerate(keys)])
    prefetch.run_prefetch(node, 1 << 30)
    assert sorted(read) == list(range(len(keys)))  # each once, the owner's from the source
    assert node.counters["peer_fallbacks"] == 6 and node.counters["prefetched"] == len(keys)
    assert all(node.read_local(k, BS) == blocks[i] for i, k in enumerate(keys))
    assert not node._inflight and node._tiers["dram"].reserved == 0


@pytest.mark.timeout(30)
def test_hits_at_an_owner_reported_by_readers_get_the_block_replicated(tmp_path):
    """Reads of a block sent straight from its owner's block server reach the daemon only
    in its readers' reports: at ``replicate_after`` of them it copies the block from its
    owner, tagged with its file's URL (a write through the cache here drops it)."""
    key, other = "a" + "1" * 31, "a" + "2" * 31
    data = os.urandom(BS)
    router = _Router({key: data, other: os.urandom(BS)})
    node = _node(tmp_path)
    node.remote = RemoteReads(node, router, replicate_after=2)
    try:
        hit = remote_hit_tier(BS, url_tag(URL))
        assert remote_hit(hit) == (BS, url_tag(URL))
        assert [remote_hit(t) for t in ("dram", "remote:-1:00", "remote:1:", "remote:x:00")] \
            == [None] * 4
        node.report({"remote_hits": 1}, [(key, hit), (other, hit)])
        node.report({"remote_hits": 1}, [(key, hit)])  # key: twice, other: once
        wait_for(lambda: node.counters["replicas"] == 1, 10, what="a replica")
        assert node.read_local(key, BS) == data and node.block_path(other) is None
        assert [list(c["a"]) for c in router.calls] == [[(key, BS, None, None)]]
        assert node.invalidate(URL) == 1  # tagged with its URL
    finally:
        node.remote.close()


def test_an_owner_asked_for_a_copy_serves_only_what_it_holds(tmp_path):
    node = _node(tmp_path)
    held = "c" * 32
    conn = object()
    kind, tier, lease = node.lease(held, BS, URL, conn)
    data = os.urandom(BS)
    node.filled(held, tier, node.tier(tier).stage(held, data, lease), conn, lease)
    out = owner.serve_blocks(node, [(held, BS, None, None), ("d" * 32, BS, None, None)])
    assert out == [data, None]
    assert not node._inflight and node.counters["leases"] == 1  # no fill asked for


@pytest.mark.timeout(60)
def test_damaged_blocks_from_owners_are_logged_once_per_process(  # noqa: F811 - the fixture
        two_owners, monkeypatch, caplog):
    from cachemw.client.direct import DirectReads

    ring, nodes, servers, blocks = two_owners
    monkeypatch.setattr(direct_module, "_damage_said", 0, raising=False)  # as in a new process
    bad = [k for k in blocks if ring.owner(k) in nodes][:4]
    for k in bad:
        flip_byte(nodes[ring.owner(k)].block_path(k), L // 2, 0x01)
    directory = _Directory(servers)
    with caplog.at_level(logging.WARNING, logger="cachemw.client.direct"):
        for _ in range(2):  # two readers of one process
            got = DirectReads(directory, timeout=5).fetch([(k, L) for k in blocks])
            assert not set(bad) & set(got) and all(got[k] == blocks[k] for k in got)
    said = [r for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert directory.counted == {"corrupt_repaired": 2 * len(bad)}


# -- on a simulated cluster ---------------------------------------------------------------


def _settled(fs, node_id):
    """The daemon counters of ``node_id`` once the reader ``fs``'s reports reached it."""
    fs.client.flush()
    return _node_stats()[node_id]["counters"]


@pytest.mark.multinode
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_announced_epoch_of_a_cached_dataset_reads_nothing_from_the_source(cluster, tmp_path):
    """3 nodes, an HTTP store counting its GETs. A plain epoch on the head caches each block
    at its owner (one GET each); the head then announces the epoch: its prefetch fetches the
    blocks its peers own from them, not from the store, and the epoch reads only hits."""
    import fsspec
    import ray

    from test_cold_reads import _Server

    c, _ = cluster
    root = tmp_path / "www"
    root.mkdir()
    server = _Server(root)
    try:
        template = _start(tmp_path, c.address)
        head = ray.get_runtime_context().get_node_id()
        files = {}
        for i in range(30):
            data = os.urandom(BLOCK // 2 + 97 * i)
            (root / f"f{i:03d}.bin").write_bytes(data)
            files[f"{server.url}/f{i:03d}.bin"] = data
        urls = sorted(files)
        fs = fsspec.filesystem("cachemw", runtime_dir=template.format(node_id=head),
                               autostart=False, block_size=BLOCK, skip_instance_cache=True,
                               validate="immutable", target_protocol="http")
        assert _wait(lambda: _ring_of_three(fs.client), 60)
        got = fs.cat(urls)
        assert all(got[u] == files[u] for u in urls)
        first = fs.stats()
        at_peers = first["remote_reads"]
        assert at_peers > 0 and first["misses"] + at_peers == len(urls), first
        gets = len(server.requests("GET"))
        assert gets == len(urls)  # each block once, cluster-wide
        before = _settled(fs, head)
        assert fs.announce(urls) == len(urls)
        assert _wait(lambda: _node_stats()[head]["counters"].get("prefetched", 0)
                     - before.get("prefetched", 0) >= at_peers, 60)
        assert len(server.requests("GET")) == gets  # nothing from the store again
        after = _node_stats()[head]["counters"]
        assert after["prefetched_from_owners"] - before.get("prefetched_from_owners", 0) \
            == at_peers
        read = fs.stats()
        for u in urls:
            assert fs.cat_file(u) == files[u]
        now = fs.stats()
        assert now["hits"] - read["hits"] == len(urls)  # prefetched here: every read a hit
        assert now["remote_hits"] == read["remote_hits"]
        assert len(server.requests("GET")) == gets
    finally:
        server.close()


@pytest.mark.multinode
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_blocks_a_node_keeps_reading_from_their_owners_are_replicated(cluster, tmp_path,
                                                                     make_tree):
    """Reads of blocks an owner holds go straight to its block server; reported by the
    reader, they get each block copied to the reading node at its second read there
    (replicate_after=2), after which its reads are local hits."""
    import ray

    c, _ = cluster
    template = _start(tmp_path, c.address, replicate_after=2)
    head = ray.get_runtime_context().get_node_id()
    files = make_tree([BLOCK] * 30, name="hot", seed=3, fmt="h{i:04d}")
    paths = sorted(files)
    fs = _fs(template, head)
    assert _wait(lambda: _ring_of_three(fs.client), 60)  # peers' block servers known
    for p in paths:  # cold: each block fetched by its owner, and kept there
        assert fs.cat_file(p) == files[p]
    cold = fs.stats()
    at_peers = cold["remote_reads"]
    assert at_peers > 0 and cold["remote_hits"] == 0
    for _ in range(2):  # hits at the owners, straight from their block servers
        for p in paths:
            assert fs.cat_file(p) == files[p]
    hot = fs.stats()
    assert hot["remote_hits"] > 0, hot
    fs.client.flush()
    assert _wait(lambda: _node_stats()[head]["counters"]["replicas"] == at_peers, 30), \
        _node_stats()[head]["counters"]
    for p in paths:  # now local copies
        assert fs.cat_file(p) == files[p]
    last = fs.stats()
    assert last["remote_hits"] == hot["remote_hits"]
    assert last["hits"] - hot["hits"] == len(paths)
