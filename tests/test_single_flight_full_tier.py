"""Single flight when the DRAM tier is full: of the processes that miss one block at once,
one fetches it, and the placement engine decides whether to keep it on every read waiting
on it, not on the fetching process's alone (node/demand.py).

Before: a full tier's admission gate (history) refused a block read once; the holder's
claim ended with nothing cached and each waiter in turn took the claim and read the source:
8 processes reading one cold 24 MB file through a full 64 MiB tier fetched it 4 times, the
extra reads counted `bypassed`. Every test that spawns processes has a timeout and kills
them.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pytest

from cachemw.claims import Claims, claims_dir
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from conftest import CountingLocalFileSystem, daemon_stats, wait_for

L = 4096
URL = "file:///x"


def _full_node(tmp_path) -> NodeCache:
    """A node whose DRAM tier the engine holds full of blocks read once each."""
    nc = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                      dram_dir=str(tmp_path / "dram"), dram_capacity=64 * L),
                   lease_wait=20.0)
    for i in range(200):
        key = block_key(URL, "v", 1000 + i, L)
        reply = nc.lease(key, L, URL, "filler")
        if reply[0] != "fill":
            assert reply == ("nofill", "policy"), reply
            return nc
        stored = nc.tier(reply[1]).stage(key, b"f" * L, reply[2])
        assert nc.filled(key, reply[1], stored, "filler", reply[2])
    pytest.fail("the tier never filled")


def _seven_waiting(nc: NodeCache, key: str, tmp_path) -> tuple[Claims, list, dict]:
    """Another process holds ``key``'s claim, and 7 readers wait on it (threads, each
    with its own connection): (the claims holding it, the threads, their replies by n)."""
    holder = Claims(claims_dir(str(tmp_path / "rt")))
    assert holder.take(key)
    got: dict[int, list] = {}
    waiters = [threading.Thread(target=lambda n=n: got.update({n: nc.lease_many(
        [(key, L, URL, None)], f"conn-{n}")})) for n in range(7)]
    for t in waiters:
        t.start()
    try:
        wait_for(lambda: nc.stats()["counters"]["waits"] >= 7, 10, what="the 7 waiters")
    except BaseException:
        holder.release(key)
        for t in waiters:
            t.join(30)
        raise
    return holder, waiters, got


def test_a_full_tier_refuses_a_block_read_once(tmp_path):
    """The policy holds: one read of a new block displaces nothing read as often."""
    nc = _full_node(tmp_path)
    key = block_key(URL, "v", 1, L)
    assert nc.lease_fetched([(key, L, URL, None)], "conn-a", False) == [("nofill", "policy")]


@pytest.mark.timeout(60)
def test_reads_waiting_on_a_claimed_block_count_when_a_full_tier_decides(tmp_path):
    """7 readers wait on a block another process claimed and fetched: the holder's lease
    is decided on 8 reads, so the block is cached and every waiter finds it there (none
    reads the source). Their hits, told ahead, are not told the engine again."""
    nc = _full_node(tmp_path)
    key = block_key(URL, "v", 2, L)
    holder, waiters, got = _seven_waiting(nc, key, tmp_path)
    try:
        (reply,) = nc.lease_fetched([(key, L, URL, None)], "holder", True)
        assert reply[0] == "fill", reply  # before: ("nofill", "policy")
        stored = nc.tier(reply[1]).stage(key, b"k" * L, reply[2])
        assert nc.filled(key, reply[1], stored, "holder", reply[2])
    finally:
        holder.release(key)
        for t in waiters:
            t.join(20)
    assert all(got[n] == [("present", "dram")] for n in range(7)), got
    # the waiters' hits: the engine heard of (some of) them when it decided
    told = nc._told_ahead.get(key, (0, 0))[0]
    assert 1 <= told <= 7
    nc.report({}, [(key, "dram")] * 7)
    assert key not in nc._told_ahead


@pytest.mark.timeout(90)
def test_waiters_told_ahead_are_not_refused_when_the_admitted_fill_fails(tmp_path):
    """The engine admitted the block on the waiters' reads told ahead; the holder's fill
    then failed (aborted). The waiters told ahead were refused ("policy") without the
    engine being asked, each then reading the source, although the engine had admitted
    it: the first to take the claim now gets the fill."""
    nc = _full_node(tmp_path)
    nc.lease_wait = 3.0
    key = block_key(URL, "v", 3, L)
    holder, waiters, got = _seven_waiting(nc, key, tmp_path)
    try:
        (reply,) = nc.lease_fetched([(key, L, URL, None)], "holder", True)
        assert reply[0] == "fill", reply
        assert nc._told_ahead[key][2]  # admitted on reads told ahead
        nc.abort(key, "error", "holder")  # its fill failed
    finally:
        holder.release(key)
        for t in waiters:
            t.join(30)
    replies = [r for n in range(7) for r in got[n]]
    assert ("nofill", "policy") not in replies, replies
    assert any(r[0] == "fill" for r in replies), replies


def _read(runtime_dir, target, path, barrier, out):
    fs = fsspec.filesystem("cachemw", fs=target, runtime_dir=runtime_dir, autostart=False,
                           block_size=1 << 16, skip_instance_cache=True)
    barrier.wait(60)
    data = fs.cat_file(path)
    with open(out, "wb") as f:
        f.write(data)


class SlowCounting(CountingLocalFileSystem):
    """Counted local reads that take 0.3 s (a remote store's): the readers that do not
    hold a block's claim are waiting on it by the time its holder asks for its lease."""

    def cat_file(self, path, *args, **kwargs):
        time.sleep(0.3)
        return super().cat_file(path, *args, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_processes_missing_one_cold_file_through_a_full_tier_fetch_it_once(
        runtime_dir, spawn_daemon, tmp_path):
    """6 processes read one cold 4-block file at once through a DRAM tier full of blocks
    read once: each block is read from the store once, cached, and every byte is right."""
    spawn_daemon(runtime_dir, dram_capacity=1 << 20)
    target = SlowCounting(str(tmp_path / "calls.log"))
    fs = fsspec.filesystem("cachemw", fs=target, runtime_dir=runtime_dir, autostart=False,
                           block_size=1 << 16, skip_instance_cache=True)
    for i in range(3):  # 1.5 MiB through a 1 MiB tier: full, and evicting
        path = str(tmp_path / f"fill{i}.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 19))
        fs.cat_file(path)
    cold = str(tmp_path / "cold.bin")
    data = os.urandom(4 << 16)
    with open(cold, "wb") as f:
        f.write(data)
    fs.info(cold)  # known to the node: the processes miss its blocks, not the file
    daemon_stats(runtime_dir)  # this process's fills written behind its reads: ended,
    fs.client.flush()  # and its counters (the blocks refused: `bypassed`) told
    before = daemon_stats(runtime_dir)
    assert before["tiers"]["dram"]["used_bytes"] > 0.9 * (1 << 20)
    target.reset()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(6)
    outs = [str(tmp_path / f"out{n}") for n in range(6)]
    procs = [ctx.Process(target=_read, args=(runtime_dir, target, cold, barrier, out))
             for out in outs]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * 6
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    for out in outs:
        with open(out, "rb") as f:
            assert f.read() == data
    reads = target.calls("cat_file")
    assert len(reads) == 4, reads  # before: up to 4 reads a block, the extra `bypassed`
    after = daemon_stats(runtime_dir)
    assert after["counters"]["bypassed"] == before["counters"]["bypassed"]


class Gated(LocalFileSystem):
    """Local reads that wait for the test to open a gate (a store slow to answer)."""

    cachable = False

    def __init__(self, gate: threading.Event, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate
        self.reads = 0

    def cat_file(self, path, *args, **kwargs):
        self.reads += 1
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        return super().cat_file(path, *args, **kwargs)


@pytest.mark.timeout(90)
def test_a_read_holding_some_claims_waits_on_the_others_beside_its_own_fetches(
        runtime_dir, spawn_daemon, tmp_path):
    """A read of blocks 0 and 1 finds block 0's claim held by another reader and takes
    block 1's: the daemon hears it waits on block 0 while its fetch of block 1 is still
    out, so that block 0's holder is decided on both reads (before, it asked for block 0
    only once its own fetch had ended: a full tier refused the block on fewer reads than
    were made of it, and those read it again; CI: 5 reads of a 4-block file by 6
    processes)."""
    spawn_daemon(runtime_dir)
    gate = threading.Event()
    target = Gated(gate)
    fs = fsspec.filesystem("cachemw", fs=target, runtime_dir=runtime_dir, autostart=False,
                           block_size=1 << 16, skip_instance_cache=True)
    path = str(tmp_path / "two.bin")
    data = os.urandom(2 << 16)
    with open(path, "wb") as f:
        f.write(data)
    fs.info(path)
    waits = daemon_stats(runtime_dir, drain=False)["counters"]["waits"]
    got: dict[str, bytes] = {}
    first = threading.Thread(target=lambda: got.update(a=fs.cat_file(path, 0, 1 << 16)))
    both = threading.Thread(target=lambda: got.update(b=fs.cat_file(path)))
    first.start()
    try:
        wait_for(lambda: target.reads >= 1, 10, what="block 0's fetch")
        both.start()
        wait_for(lambda: target.reads >= 2, 10, what="block 1's fetch")
        wait_for(lambda: daemon_stats(runtime_dir, drain=False)["counters"]["waits"] > waits,
                 10, what="the wait on block 0 told the daemon while block 1 is fetched")
        assert not gate.is_set()
    finally:
        gate.set()
        first.join(30)
        both.join(30)
    assert got == {"a": data[:1 << 16], "b": data}
    assert target.reads == 2
