"""Fills written by the daemon: a client hands a leased block's bytes over ("put") and goes
on; the daemon's fill writer writes the tier file. The lease holds until the block is
written (single flight stays), the client that handed it over waits for it instead of
reading the source again, a failed write ends the lease, and a client that exits right
after its read still leaves the block cached."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from cachemw import blockfile
from cachemw.config import DaemonConfig
from cachemw.fills import FillWriter
from cachemw.keys import block_key
from cachemw.node import NodeCache
from conftest import daemon_stats, wait_for

L = 64 << 10
KEYS = [block_key("file:///x", "v", i, L) for i in range(8)]


def _node(tmp_path) -> NodeCache:
    return NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity="64MiB"))


def _gated_writer(nc: NodeCache) -> threading.Event:
    """Make the node's fill writer wait for the returned event before each write."""
    gate = threading.Event()

    def put(*args):
        gate.wait(10)
        return nc.put(*args)

    nc.fills.close()
    nc.fills = FillWriter(put)
    return gate


@pytest.mark.timeout(30)
def test_the_filler_rereading_a_block_being_written_waits_for_it(tmp_path):
    nc, me, other = _node(tmp_path), object(), object()
    gate = _gated_writer(nc)
    assert nc.lease(KEYS[0], L, "file:///x", me) == ("fill", "dram")
    nc.hand_over(KEYS[0], "dram", b"a" * L, None, me)
    replies = {}
    waiters = [threading.Thread(target=lambda c=c: replies.__setitem__(c, nc.lease(KEYS[0], L, "file:///x", c)))
               for c in (me, other)]
    for t in waiters:
        t.start()
    time.sleep(0.2)
    assert not replies  # both wait for the write: no second fetch, no "busy"
    gate.set()
    for t in waiters:
        t.join(10)
    assert replies == {me: ("present", "dram"), other: ("present", "dram")}
    assert blockfile.read_block(nc.tier("dram").block_path(KEYS[0]), L) == b"a" * L
    assert nc.counters["fills"] == 1 and nc.stats()["inflight"] == 0
    nc.close()


@pytest.mark.timeout(30)
def test_a_client_going_away_keeps_its_handed_over_fills_and_ends_the_others(tmp_path):
    nc, gone = _node(tmp_path), object()
    gate = _gated_writer(nc)
    assert nc.lease(KEYS[0], L, "file:///x", gone)[0] == "fill"
    assert nc.lease(KEYS[1], L, "file:///x", gone)[0] == "fill"
    nc.hand_over(KEYS[0], "dram", b"b" * L, None, gone)
    nc.release(gone)  # its connection closed: KEYS[1] was never handed over
    assert set(nc._inflight) == {KEYS[0]}
    gate.set()
    assert nc.fills.drain(10)
    assert KEYS[0] in nc._index and KEYS[1] not in nc._index
    assert nc.lease(KEYS[1], L, "file:///x", object())[0] == "fill"  # free for anyone
    nc.close()


@pytest.mark.timeout(30)
def test_a_failed_write_ends_the_lease_counted_and_a_full_tier_stops_admitting(tmp_path):
    nc, me = _node(tmp_path), object()
    tier = nc.tier("dram")

    def full(key, data, tag=b""):
        raise OSError(errno.ENOSPC, "No space left on device")

    tier.put = full
    assert nc.lease(KEYS[0], L, "file:///x", me)[0] == "fill"
    nc.hand_over(KEYS[0], "dram", b"c" * L, None, me)
    assert nc.fills.drain(10)
    s = nc.stats()
    assert s["inflight"] == 0 and s["counters"]["fill_errors"] == 1 and s["counters"]["fills"] == 0
    assert s["tiers"]["dram"]["admitting"] is False
    assert nc.lease(KEYS[1], L, "file:///x", me) == ("nofill", "full")
    nc.close()


@pytest.mark.timeout(30)
def test_fill_writer_bounds_the_bytes_waiting_and_drain_waits_for_them():
    gate, written = threading.Event(), []

    def write(key, tier, data, tag, conn):
        gate.wait(10)
        written.append(key)

    w = FillWriter(write, max_pending=100)
    assert w.submit("a", "dram", b"x" * 80, None, None)
    assert w.submit("b", "dram", b"x" * 80, None, None)  # "a" may be taken already
    third = threading.Thread(target=lambda: w.submit("c", "dram", b"x" * 80, None, None))
    third.start()
    time.sleep(0.2)
    assert third.is_alive() and w.pending_bytes <= 160  # the sender waits: backpressure
    gate.set()
    third.join(10)
    assert w.drain(10) and written == ["a", "b", "c"] and w.pending_bytes == 0
    w.close()
    assert not w.submit("d", "dram", b"x", None, None)  # closed: the caller ends the lease


@pytest.mark.timeout(60)
def test_a_reader_exiting_right_after_its_read_leaves_the_block_cached(runtime_dir, spawn_daemon,
                                                                     tmp_path):
    spawn_daemon(runtime_dir)
    path = tmp_path / "f.bin"
    data = os.urandom(300_000)
    path.write_bytes(data)
    code = ("import fsspec, os, sys\n"
            f"fs = fsspec.filesystem('cachemw', target_protocol='file', autostart=False, "
            f"runtime_dir={runtime_dir!r}, block_size={L})\n"
            f"assert fs.cat_file({str(path)!r}) == open({str(path)!r}, 'rb').read()\n"
            "os._exit(0)  # no flush, no goodbye: the fills were handed over already\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    nblocks = -(-len(data) // L)
    stats = wait_for(lambda: (s := daemon_stats(runtime_dir))["tiers"]["dram"]["blocks"] == nblocks
                     and s, 10, what="the exited reader's fills to be written")
    assert stats["inflight"] == 0
    import fsspec

    fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=False,
                           runtime_dir=runtime_dir, block_size=L, skip_instance_cache=True)
    assert fs.cat_file(str(path)) == data
    assert fs.stats()["misses"] == 0 and fs.stats()["hits"] == nblocks
