"""Claims (cachemw/claims.py): single flight among the processes of a node, decided by an
``O_EXCL`` file instead of a round trip to the daemon before each fetch.

What must hold: of several processes that miss the same blocks at once, one fetches each
block, whichever way each asks (its own claim, or a lease the daemon grants with the claim);
a lease asked while another process holds the claim waits for that process's fill; a claim
whose holder died holds nobody up; every lease's end releases its claim, and a process whose
fetch failed leaves no claim behind. Every test that spawns processes has a timeout and
kills them.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import fsspec
import pytest

from cachemw.claims import Claims, claims_dir, holder_name
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from conftest import CountingLocalFileSystem, daemon_stats, published, wait_for

BS = 1 << 16
L = 4096


class SlowCountingFileSystem(CountingLocalFileSystem):
    """Counted local files whose reads take ``latency`` seconds (a remote store's)."""

    def __init__(self, log_path: str, latency: float = 0.3, **kwargs):
        super().__init__(log_path, **kwargs)
        self.latency = latency

    def cat_file(self, path, *args, **kwargs):
        time.sleep(self.latency)
        return super().cat_file(path, *args, **kwargs)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_claim_is_taken_once_until_released(tmp_path):
    claims = Claims(str(tmp_path / "claims"))
    with pytest.raises(FileNotFoundError):  # no directory: no daemon made one
        claims.take("k")
    claims.make()
    assert claims.take("k") and not claims.take("k")
    assert claims.held("k")
    pid, start = (int(x) for x in (tmp_path / "claims" / "k").read_text().split())
    assert pid == os.getpid() and start > 0
    claims.release("k")
    claims.release("k")  # twice: nothing to do
    assert not claims.held("k") and claims.take("k")
    assert claims.clear() == 1 and not os.listdir(tmp_path / "claims")


def test_a_claim_whose_holder_died_is_stale_and_removed(tmp_path):
    claims = Claims(str(tmp_path))
    (tmp_path / "dead").write_text(f"{_dead_pid()} 1")
    (tmp_path / "junk").write_text("not a pid")
    (tmp_path / "young").write_bytes(b"")  # being written by its holder
    (tmp_path / "old").write_bytes(b"")  # its holder died between creating and writing it
    os.utime(tmp_path / "old", (time.time() - 60, time.time() - 60))
    assert not claims.held("dead") and not (tmp_path / "dead").exists()
    assert not claims.held("junk") and not claims.held("old")
    assert claims.held("young")
    assert claims.take("dead")


def _node(tmp_path) -> NodeCache:
    return NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity=1 << 24),
                     lease_wait=10.0)


def _land(nc, key, reply, conn):
    assert reply[0] == "fill", reply
    stored = nc.tier(reply[1]).stage(key, b"x" * L, reply[2])
    assert nc.filled(key, reply[1], stored, conn, reply[2])


def test_the_daemon_leases_with_the_claim_and_waits_while_another_holds_it(tmp_path):
    nc = _node(tmp_path)
    claim_file = os.path.join(claims_dir(str(tmp_path / "rt")), "")
    keys = [block_key("file:///x", "v", i, L) for i in range(4)]
    reader = Claims(claims_dir(str(tmp_path / "rt")))  # a client process's view

    # a lease asked without a claim takes it; its end releases it
    reply = nc.lease(keys[0], L, "file:///x", "conn-a")
    assert os.path.exists(claim_file + keys[0]) and not reader.take(keys[0])
    _land(nc, keys[0], reply, "conn-a")
    assert not os.path.exists(claim_file + keys[0])
    assert nc.lease(keys[0], L, "file:///x", "conn-b") == ("present", "dram")

    # a client holds the claim (fetching): a block fetched elsewhere gets no lease, and a
    # lease waits until the holder's fill, asked with its claim, has landed
    assert reader.take(keys[1])
    assert nc.lease_fetched([(keys[1], L, "file:///x", None)], "conn-b", False) == [("nofill", "busy")]
    got = {}
    waiter = threading.Thread(target=lambda: got.update(r=nc.lease(keys[1], L, "file:///x", "conn-b")))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and nc.stats()["counters"]["waits"] == 1
    (reply,) = nc.lease_fetched([(keys[1], L, "file:///x", None)], "conn-a", True)
    _land(nc, keys[1], reply, "conn-a")
    waiter.join(10)
    assert got["r"] == ("present", "dram")
    assert not os.path.exists(claim_file + keys[1])

    # a holder that gives up (its claim released without a lease): the waiter fills
    assert reader.take(keys[2])
    waiter = threading.Thread(target=lambda: got.update(r=nc.lease(keys[2], L, "file:///x", "conn-b")))
    waiter.start()
    time.sleep(0.1)
    reader.release(keys[2])
    waiter.join(10)
    assert got["r"][0] == "fill" and os.path.exists(claim_file + keys[2])
    nc.abort(keys[2], "source-error", "conn-b")  # an aborted lease releases it too
    assert not os.path.exists(claim_file + keys[2])

    # a dead holder's claim holds nobody up
    with open(claim_file + keys[3], "w") as f:
        f.write(f"{_dead_pid()} 1")
    started = time.monotonic()
    assert nc.lease(keys[3], L, "file:///x", "conn-b")[0] == "fill"
    assert time.monotonic() - started < 1.0


def test_a_lease_ended_by_its_client_leaving_removes_only_that_clients_claim(tmp_path):
    """A client that got no answer to its lease request (a timeout, a broken connection)
    releases the claims it brought; when the daemon then ends the leases it granted on that
    connection, a claim may be another process's by then: it stays, whether the lease ends
    with a fill staged (adopted) or without. A claim that still names the client (killed
    before its note) is removed; the daemon's own claims are removed whatever they name."""
    nc = _node(tmp_path)
    claim_file = os.path.join(claims_dir(str(tmp_path / "rt")), "")
    keys = [block_key("file:///x", "v", i, L) for i in range(4)]
    me = holder_name()
    other = f"{os.getppid()} 0"  # a live process, not this one
    reader = Claims(claims_dir(str(tmp_path / "rt")))
    for key in keys:
        assert reader.take(key)
    replies = nc.lease_fetched([(k, L, "file:///x", None) for k in keys], "conn-a", True, me)
    assert [r[0] for r in replies] == ["fill"] * 4
    for key, reply in zip(keys[:2], replies):  # staged, not noted: adopted on disconnect
        nc.tier(reply[1]).stage(key, b"x" * L, reply[2])

    for key in (keys[0], keys[2]):  # the client gave up; another live process claims it
        reader.release(key, me)
        with open(claim_file + key, "w") as f:
            f.write(other)
        reader.release(key, me)  # the client's own release leaves it too
    nc.release("conn-a")
    assert nc.stats()["inflight"] == 0
    assert nc.lease(keys[0], L, "file:///x", "conn-b") == ("present", "dram")  # adopted
    for key in (keys[0], keys[2]):  # the other process's, untouched
        with open(claim_file + key) as f:
            assert f.read() == other
    assert not os.path.exists(claim_file + keys[1])  # still the client's: removed
    assert not os.path.exists(claim_file + keys[3])

    # the daemon's own claim (a lease asked without one) is released whatever it names
    key = block_key("file:///x", "v", 9, L)
    reply = nc.lease(key, L, "file:///x", "conn-c")
    assert reply[0] == "fill" and os.path.exists(claim_file + key)
    with open(claim_file + key, "w") as f:
        f.write(other)
    nc.release("conn-c")
    assert not os.path.exists(claim_file + key)


def test_a_daemon_starts_with_no_claims(tmp_path):
    directory = claims_dir(str(tmp_path / "rt"))
    os.makedirs(directory)
    with open(os.path.join(directory, "leftover"), "w") as f:
        f.write(f"{os.getpid()} 1")
    _node(tmp_path)
    assert os.listdir(directory) == []


def _read_all(runtime_dir, target, paths, barrier, out):
    fs = fsspec.filesystem("cachemw", fs=target, runtime_dir=runtime_dir, autostart=False,
                           block_size=BS, skip_instance_cache=True)
    barrier.wait(30)
    with open(out, "wb") as f:
        for p in paths:
            f.write(fs.cat_file(p))


@pytest.mark.timeout(120)
def test_processes_missing_the_same_blocks_at_once_fetch_each_block_once(make_cache_fs, tmp_path):
    """Three processes read the same three 2-block files at once, in different orders,
    against a store taking 0.3 s a read: each block is read from the store exactly once
    (by its claim's holder, or under a lease the daemon gave with the claim), and every
    process gets every byte right."""
    target = SlowCountingFileSystem(str(tmp_path / "calls.log"), latency=0.3)
    fs = make_cache_fs(fs=target, block_size=BS)
    files = {str(tmp_path / f"f{i}.bin"): os.urandom(2 * BS) for i in range(3)}
    for p, data in files.items():
        with open(p, "wb") as f:
            f.write(data)
    for p in files:
        fs.info(p)  # known to the node: the processes miss blocks, not files
    target.reset()
    paths = list(files)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    orders = [paths[i:] + paths[:i] for i in range(3)]
    outs = [str(tmp_path / f"out{i}") for i in range(3)]
    procs = [ctx.Process(target=_read_all, args=(fs.options.runtime_dir, target, order, barrier, out))
             for order, out in zip(orders, outs)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for order, out in zip(orders, outs):
        with open(out, "rb") as f:
            assert f.read() == b"".join(files[p] for p in order)
    reads = target.calls("cat_file")
    assert len(reads) == 6, reads  # 3 files x 2 blocks, once each
    stats = daemon_stats(fs.options.runtime_dir)
    assert stats["counters"]["claimed_duplicates"] == 0
    # the readers' last "filled" notes, which end the daemon's claims, may still be read on
    # their connections after this one's stats: the daemon orders each connection alone
    directory = claims_dir(fs.options.runtime_dir)
    wait_for(lambda: not os.listdir(directory), 10, what="the claims to end with their leases")


def _read_and_hang(runtime_dir, target, path):
    fs = fsspec.filesystem("cachemw", fs=target, runtime_dir=runtime_dir, autostart=False,
                           block_size=BS, skip_instance_cache=True)
    fs.cat_file(path)


@pytest.mark.timeout(90)
def test_a_reader_killed_while_holding_a_claim_holds_nobody_up(make_cache_fs, tmp_path):
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    with open(path, "wb") as f:
        f.write(data)
    fs = make_cache_fs(block_size=BS)
    fs.info(path)
    directory = claims_dir(fs.options.runtime_dir)
    hanging = SlowCountingFileSystem(str(tmp_path / "calls.log"), latency=120)
    child = multiprocessing.get_context("spawn").Process(
        target=_read_and_hang, args=(fs.options.runtime_dir, hanging, path))
    child.start()
    try:
        wait_for(lambda: os.listdir(directory), 30, what="the child to claim the block")
        child.kill()
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    started = time.monotonic()
    assert fs.cat_file(path) == data
    assert time.monotonic() - started < 5.0
    assert fs.stats()["misses"] == 1 and fs.stats()["fallbacks"] == 0
    wait_for(lambda: not os.listdir(directory), 10, what="the fill's claim to end")


def test_a_failed_fetch_leaves_no_claim(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(BS))
    fs.info(path)
    os.remove(path)  # the store lost it after its info was taken
    with pytest.raises(FileNotFoundError):
        fs.cat_file(path)
    assert os.listdir(claims_dir(fs.options.runtime_dir)) == []


def test_a_claim_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """A full tmpfs can create the claim's file and fail its write: the empty file would hold
    every other process up until found stale, so it goes, and the error is raised."""
    import errno

    claims = Claims(str(tmp_path / "claims"))
    claims.make()

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as err:
        claims.take("k")
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path / "claims") == []
    assert claims.take("k")


def test_reads_go_on_through_leases_when_no_claim_can_be_made(make_cache_fs, tmp_path, caplog):
    """Claims refused (a full tmpfs, say): every miss asks the daemon for its lease first, as
    with several nodes; right bytes, each block fetched once and cached, said once."""
    import errno
    import logging

    fs = make_cache_fs(block_size=BS)
    files = {}
    for i in range(3):
        path = str(tmp_path / f"f{i}.bin")
        files[path] = os.urandom(2 * BS + 100)
        with open(path, "wb") as f:
            f.write(files[path])

    def refused(key):
        raise OSError(errno.ENOSPC, "No space left on device")

    fs.reader.claims.take = refused
    before = dict(fs.stats())
    with caplog.at_level(logging.WARNING, logger="cachemw.client.misses"):
        for path, data in files.items():
            assert fs.cat_file(path) == data
    after = fs.stats()
    assert after["misses"] - before["misses"] == 9
    assert after["lease_requests"] - before["lease_requests"] == 3  # one batch per file
    assert after["claimed_duplicates"] == before["claimed_duplicates"]
    assert sum("cannot make a claim" in r.getMessage() for r in caplog.records) == 1
    # the daemon releases a claim when it reads the lease's "filled", sent on the reading
    # thread's connection by the fill writer: a round trip there orders this look after it
    published(fs)
    assert os.listdir(claims_dir(fs.options.runtime_dir)) == []
    before = dict(fs.stats())
    for path, data in files.items():
        assert fs.cat_file(path) == data
    assert fs.stats()["hits"] - before["hits"] == 9


def test_a_batch_waits_on_a_holder_that_makes_no_progress_once_not_per_block(tmp_path):
    """A process holding a file's claims that never fetches (stopped): a batch of leases
    for its blocks waits lease_wait in all, then fetches them itself."""
    nc = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                      dram_dir=str(tmp_path / "dram"), dram_capacity=1 << 24),
                   lease_wait=0.5)
    holder = Claims(claims_dir(str(tmp_path / "rt")))
    keys = [block_key("file:///x", "v", i, L) for i in range(5)]
    for key in keys:
        assert holder.take(key)
    started = time.monotonic()
    replies = nc.lease_many([(key, L, "file:///x", None) for key in keys], "conn-b")
    took = time.monotonic() - started
    assert replies == [("nofill", "busy")] * len(keys)
    assert took < 1.8, took  # per block, this was 5 x 0.5 s
