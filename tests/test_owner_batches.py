"""Calls to owners stay bounded, and replicas are asked of the placement engine before
they are fetched (found by a diff review of 8a09e19):

- a prefetch pass asked an owner for all its planned blocks in one call, which the owner
  served one after another (reading the source serially for those it lacked) under one flat
  ``peer_timeout``: on a cold owner over a store with latency the call timed out, the
  healthy owner was taken out of the ring and every block read from the source again (800
  blocks: 13.3 s and 1,400 source reads);
- the replica copier fetched every block that reached ``replicate_after`` before the engine
  decided, and reset its count: on a full tier every remote block was sent again every
  other epoch and thrown away (400 transfers, 0 replicas kept).
"""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from cachemw.cluster import owner
from cachemw.cluster.owner import BATCH_BLOCKS, RemoteReads
from cachemw.cluster.peers import PeerSet, pack, pieces_for
from cachemw.config import DaemonConfig, TierConfig
from cachemw.keys import url_tag
from cachemw.node import prefetch
from cachemw.node.cache import NodeCache
from cachemw.reports import remote_hit_tier
from test_multinode_prefetch import BS, URL, _Router, _counting_source, _node, _source


def _remote_keys(n: int) -> list[str]:
    return [f"a{i:031x}" for i in range(n)]


@pytest.mark.timeout(60)
def test_a_prefetch_pass_asks_an_owner_in_bounded_calls(tmp_path, monkeypatch):
    keys = _remote_keys(5 * BATCH_BLOCKS + 3)
    blocks = {i: os.urandom(BS) for i in range(len(keys))}
    router = _Router({k: blocks[i] for i, k in enumerate(keys)})
    node = _node(tmp_path)
    node.remote = RemoteReads(node, router)
    read = _counting_source(monkeypatch, blocks)
    node.announce([(k, BS, URL, _source(i % 16)) for i, k in enumerate(keys)])
    prefetch.run_prefetch(node, 1 << 30)
    sizes = [len(call["a"]) for call in router.calls]
    assert max(sizes) <= BATCH_BLOCKS and sum(sizes) == len(keys)  # was one call of 83
    assert sorted(item[0] for call in router.calls for item in call["a"]) == sorted(keys)
    assert read == [] and node.counters["prefetched_from_owners"] == len(keys)
    assert all(node.read_local(k, BS) == blocks[i] for i, k in enumerate(keys))
    assert not node._inflight and node._tiers["dram"].reserved == 0


@pytest.mark.timeout(60)
def test_an_owner_reads_the_blocks_it_lacks_side_by_side(tmp_path, monkeypatch):
    """Each read waits at a barrier until all of the call's reads have started: served one
    after another, the first read waits out the barrier and every block fails."""
    n = 8
    barrier = threading.Barrier(n, timeout=10)
    read = []

    class Source:
        concurrent = True

        @staticmethod
        def read_block(path, index, block_size, file_size, version):
            barrier.wait()
            read.append(index)
            return bytes([index]) * BS

    monkeypatch.setattr(owner, "source_for", lambda _target: Source)
    node = _node(tmp_path)
    requests = [(f"a{i:031x}", BS, URL, _source(i)) for i in range(n)]
    out = owner.serve_blocks(node, requests)
    assert out == [bytes([i]) * BS for i in range(n)]
    assert sorted(read) == list(range(n))  # each once, and kept: asked again, no read
    assert owner.serve_blocks(node, requests) == out and len(read) == n


def test_a_call_to_an_owner_is_given_time_for_its_bytes():
    """A call's deadline is peer_timeout plus its bytes at TRANSFER_RATE (a bounded batch
    of big blocks is not taken for a dead owner)."""
    asked, answers = [], []

    class Ray:
        def get(self, refs, timeout):
            asked.append(timeout)
            return answers.pop(0)

    peers = PeerSet("me", timeout=1.0, vnodes=64)
    peers._ray = Ray()
    peers._handles["x"] = SimpleNamespace(serve_blocks=_Method(lambda r: [object()]))
    big = 100_000_000  # 2 s at 50 MB/s
    request = [("k" * 32, big, None, None)]
    answers.append(pack([None], request))  # (not given: no 100 MB made here)
    assert peers.fetch_many({"x": request}) == {"x": [None]}
    assert 2.5 < asked[0] <= 3.0
    request = [("k" * 32, 10, None, None)]
    answers.append(pack([b"0123456789"], request))
    assert peers.fetch_many({"x": request}) == {"x": [b"0123456789"]}
    assert asked[1] <= 1.0


class _Method:
    """An actor method's handle, as a test's stand-in: options() then remote()."""

    def __init__(self, remote) -> None:
        self.remote = remote
        self.returns = []

    def options(self, num_returns: int = 1):
        self.returns.append(num_returns)
        return self


def test_an_owner_s_blocks_come_back_in_pieces_ray_sends_inline():
    """An owner's answer is its lengths and then its blocks' bytes in pieces of at most
    PIECE bytes, as many as the caller counts from what it asked (Ray needs the number of
    returns when the call is made): Ray sends such returns inline in its reply, where a
    reply of one array went through its object store, whose pulls across nodes stalled
    about 1 s now and then (review nodes6). An answer that does not fit what was asked
    (lengths, bytes) is not taken."""
    from cachemw.cluster.peers import PIECE, pieces_for, unpack

    blocks = [os.urandom(PIECE + 5), None, b"", os.urandom(3 * PIECE), os.urandom(7)]
    requests = [(f"{i:032x}", len(b) if b is not None else 100, None, None)
                for i, b in enumerate(blocks)]
    answer = pack(blocks, requests)
    assert len(answer) == 1 + pieces_for(requests) == 1 + 5
    assert all(len(piece) <= PIECE for piece in answer[1:])
    assert unpack(answer[0], list(answer[1:]), requests) == blocks
    # a block of another length than asked (another version at the owner): not given
    assert pack([b"abc"], [("k" * 32, 4, None, None)])[0] == [-1]
    assert unpack([-1, 0], [b""], [("a" * 32, 0, None, None), ("b" * 32, 0, None, None)]) \
        == [None, b""]
    with pytest.raises(ValueError):
        unpack([4], [b"abc"], [("k" * 32, 4, None, None)])  # fewer bytes than said
    with pytest.raises(ValueError):
        unpack([3], [b"abc"], [("k" * 32, 4, None, None)])  # not the length asked
    with pytest.raises(ValueError):
        unpack([3, 3], [b"abcdef"], [("k" * 32, 3, None, None)])  # more blocks than asked

    class Ray:
        def get(self, refs, timeout):
            return answer

    peers = PeerSet("me", timeout=5.0, vnodes=64)
    peers._ray = Ray()
    method = _Method(lambda r: [object()] * len(answer))
    peers._handles["x"] = SimpleNamespace(serve_blocks=method)
    assert peers.fetch_many({"x": requests}) == {"x": blocks}
    assert method.returns == [len(answer)]
    answer = pack(blocks[:2], requests[:2])  # an answer to another call
    assert peers.fetch_many({"x": requests}) == {"x": None}
    assert peers.counters["peer_failures"] == 1
    from cachemw.cluster.peers import INLINE_MOST
    big = [("k" * 32, INLINE_MOST + 1, None, None)]  # past Ray's inline share: one piece
    assert pieces_for(big) == 1 and pieces_for([("k" * 32, INLINE_MOST, None, None)]) > 1
    block = os.urandom(INLINE_MOST + 1)  # the one piece holds all of it (diffrev-11)
    answer = pack([block], big)
    assert len(answer) == 2 and unpack(answer[0], list(answer[1:]), big) == [block]


def _full_node(tmp_path) -> NodeCache:
    """A 2 MiB DRAM tier full of the node's own blocks, each read a few times (the history
    policy keeps them over a remote block read twice)."""
    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 2 << 20),),
                                  runtime_dir=str(tmp_path / "rt")))
    conn = object()
    mine = [f"b{i:031x}" for i in range(40)]
    for k in mine:
        reply = node.lease(k, BS, "file:///d/own", conn)
        if reply[0] == "fill":
            stored = node.tier(reply[1]).stage(k, os.urandom(BS), reply[2])
            node.filled(k, reply[1], stored, conn, reply[2])
    for _ in range(4):
        node.report({}, [(k, "dram") for k in mine])
    return node


@pytest.mark.timeout(60)
def test_the_copier_fetches_nothing_the_engine_refuses_and_backs_off(tmp_path):
    node = _full_node(tmp_path)
    keys = _remote_keys(50)
    router = _Router({k: os.urandom(BS) for k in keys})
    remote = node.remote = RemoteReads(node, router, replicate_after=2)
    remote.close()  # no copier thread: copy is called here
    tag = url_tag(URL)
    try:
        assert remote.copy({k: (BS, tag) for k in keys}) == 0
        assert router.calls == []  # was one call of 50 blocks, all thrown away
        assert node.counters["replicas"] == 0 and not node._inflight
        assert node._tiers["dram"].reserved == 0
        hit = remote_hit_tier(BS, tag)
        for _ in range(3):  # refused once: 4 reads before it is asked for again
            node.report({"remote_hits": 1}, [(keys[0], hit)])
            assert keys[0] not in remote._wanted
        node.report({"remote_hits": 1}, [(keys[0], hit)])
        assert keys[0] in remote._wanted
    finally:
        node.close()


def test_every_return_of_an_owner_call_that_failed_is_collected():
    """A failed call's error is in each of its returns (1 + pieces), and ray.get of them
    all raises at the first: Ray then logged an "unhandled error" with its traceback for
    every other one when it was dropped, up to 86 for one failure (diffrev-11; seen with
    a real actor: 5 of a 6-return call). Each is got, and the call counts once."""
    class Failed(Exception):
        pass

    got_one = []

    class Ray:
        def get(self, refs, timeout):
            if not isinstance(refs, list):
                got_one.append(refs)
            raise Failed("the owner's task raised")

    requests = [("k" * 32, 300_000, None, None)]
    peers = PeerSet("me", timeout=5.0, vnodes=64)
    peers._ray = Ray()
    returns = [object() for _ in range(1 + pieces_for(requests))]
    peers._handles["x"] = SimpleNamespace(serve_blocks=_Method(lambda r: returns))
    assert peers.fetch_many({"x": requests}) == {"x": None}
    assert len(returns) == 5 and got_one == returns
    assert peers.counters["peer_failures"] == 1


@pytest.mark.timeout(60)
def test_the_copier_fetches_what_the_engine_admits_in_bounded_calls(tmp_path):
    node = _node(tmp_path)
    keys = _remote_keys(3 * BATCH_BLOCKS + 1)
    blocks = {k: os.urandom(BS) for k in keys}
    router = _Router(blocks)
    remote = node.remote = RemoteReads(node, router, replicate_after=2)
    remote.close()
    try:
        assert remote.copy({k: (BS, url_tag(URL)) for k in keys}) == len(keys)
        sizes = [len(call["a"]) for call in router.calls]
        assert max(sizes) <= BATCH_BLOCKS and sum(sizes) == len(keys)
        assert all(node.read_local(k, BS) == blocks[k] for k in keys)
        assert node.invalidate(URL) == len(keys)  # tagged with its URL
        router.down = True  # reserved, then not given: the room is given back
        assert remote.copy({k: (BS, url_tag(URL)) for k in keys}) == 0
        assert not node._inflight and node._tiers["dram"].reserved == 0
    finally:
        node.close()
