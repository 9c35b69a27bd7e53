"""Regressions found in review: leases that waited on themselves or leaked, drift between
the node's index and the placement engine, indexed-but-missing blocks, owner-side version
checks, and per-thread connections that outlived their threads."""
from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from cachemw import blockfile
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from conftest import published

L = 64 << 10
STORED = blockfile.stored_size(L)


def _node(tmp_path, blocks=3.2, placement="lru"):
    cap = int(blocks * STORED / 0.95)  # the engine fills up to the high watermark
    return NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"), dram_dir=str(tmp_path / "dram"),
                                        dram_capacity=cap, placement=placement))


KEYS = [block_key("file:///x", "v", i, L) for i in range(20)]


def _fill(nc, key, conn, byte=b"x"):
    reply = nc.lease(key, L, "file:///x", conn)
    if reply[0] == "fill":
        nc.filled(key, reply[1], nc.tier(reply[1]).stage(key, byte * L, reply[2]), conn,
                  reply[2])
    return reply


def _engine_keys(nc):
    return set(nc.placer._engine.placement())


def test_a_late_hit_report_after_eviction_does_not_block_recaching(tmp_path):
    nc, conn = _node(tmp_path), object()
    for k in KEYS[:3]:
        assert _fill(nc, k, conn)[0] == "fill"
    assert _fill(nc, KEYS[3], conn)[0] == "fill"  # evicts KEYS[0] (LRU)
    assert KEYS[0] not in nc._index
    nc.report({"hits": 1}, [(KEYS[0], "dram")])  # the hit on KEYS[0], reported late
    nc.run_moves(nc._pending)
    assert KEYS[0] not in _engine_keys(nc)
    assert _fill(nc, KEYS[0], conn)[0] == "fill"  # it can be cached again
    assert _engine_keys(nc) == set(nc._index)


def test_a_fill_evicted_while_in_flight_is_not_indexed_and_admission_goes_on(tmp_path):
    nc, slow, fast = _node(tmp_path), object(), object()
    kind, _, lease = nc.lease(KEYS[0], L, "file:///x", slow)
    assert kind == "fill"  # in flight
    for k in KEYS[1:4]:  # the third evicts the in-flight KEYS[0] (whose bytes are
        _fill(nc, k, fast)  # still reserved, so the tier may refuse it until they land)
    stored = nc.tier("dram").stage(KEYS[0], b"s" * L, lease)
    nc.filled(KEYS[0], "dram", stored, slow, lease)  # lands late
    assert KEYS[0] not in nc._index and not nc.tier("dram").contains(KEYS[0])
    assert _engine_keys(nc) == set(nc._index)
    for k in KEYS[4:10]:  # admission never wedges
        assert _fill(nc, k, fast)[0] == "fill"
    ts = nc._tiers["dram"]
    assert ts.used == ts.blocks * STORED <= ts.config.capacity
    assert _engine_keys(nc) == set(nc._index)


def test_invalidate_cancels_fills_in_flight(tmp_path):
    nc, conn = _node(tmp_path), object()
    kind, _, lease = nc.lease(KEYS[0], L, "file:///x", conn)
    assert kind == "fill"
    nc.invalidate("file:///x")  # written meanwhile: the fill read the old bytes
    stored = nc.tier("dram").stage(KEYS[0], b"old" * (L // 3) + b"o", lease)
    nc.filled(KEYS[0], "dram", stored, conn, lease)
    assert KEYS[0] not in nc._index and not nc.tier("dram").contains(KEYS[0])
    assert not os.path.exists(nc.tier("dram").staged_path(KEYS[0], lease))


@pytest.mark.timeout(60)
def test_a_batch_naming_one_block_twice_does_not_wait_on_itself(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=L)
    path = str(tmp_path / "f.bin")
    data = os.urandom(3 * L)
    with open(path, "wb") as f:
        f.write(data)
    t = time.monotonic()
    got = fs.cat_ranges([path, path, path], [0, 100, L + 5], [10, 110, L + 50])
    assert got == [data[0:10], data[100:110], data[L + 5:L + 50]]
    assert time.monotonic() - t < 5
    s = fs.stats()
    assert s["misses"] == 2 and s["bypassed"] == 0  # one fill per block, not per range


@pytest.mark.timeout(60)
def test_a_failing_piece_does_not_leak_the_other_fill_leases(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=L, validate="ttl", ttl=3600)
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    for p in (a, b):
        with open(p, "wb") as f:
            f.write(os.urandom(L))
    fs.info(a), fs.info(b)  # metadata cached; then a disappears from the source
    os.unlink(a)
    with pytest.raises(FileNotFoundError):
        fs.cat([a, b])
    assert fs.client.daemon_stats()["inflight"] == 0
    other = make_cache_fs(block_size=L, validate="ttl", ttl=3600)
    t = time.monotonic()
    assert other.cat_file(b) == open(b, "rb").read()
    assert time.monotonic() - t < 5


@pytest.mark.timeout(60)
def test_an_indexed_block_whose_file_vanished_is_filled_again(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=L)
    path = str(tmp_path / "f.bin")
    data = os.urandom(L)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)  # its block file written (behind the read) and published
    meta = fs.meta.file(path)
    dram = fs.client.tiers()[0]
    os.unlink(dram.block_path(block_key(meta.url, meta.version, 0, L)))  # /dev/shm cleaned
    for _ in range(3):
        assert fs.cat_file(path) == data
        published(fs)  # (a re-read before the fill has landed is served from memory)
    s = fs.stats()
    assert s["misses"] == 2 and s["bypassed"] <= 1  # refilled, not bypassed for ever


@pytest.mark.timeout(60)
def test_connections_of_finished_threads_are_closed(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=L)
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(100))
    fs.cat_file(path)

    def reader():
        fs.client.lease_many([])  # opens this thread's connection

    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        t = threading.Thread(target=reader)
        t.start()
        t.join()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds + 2
    assert len(fs.client._conns) <= 2


def test_owner_refuses_a_block_of_another_version(tmp_path):
    from cachemw.cluster.owner import serve_blocks
    from fsspec.implementations.local import LocalFileSystem

    nc = _node(tmp_path, blocks=8)
    path = str(tmp_path / "s.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(L))
    src = LocalFileSystem()
    key = block_key(f"file://{path}", "stale-version", 0, L)
    request = (key, L, f"file://{path}", (src.to_json(), path, 0, L, L, "stale-version"))
    assert serve_blocks(nc, [request]) == [None]
    assert key not in nc._index


@pytest.mark.timeout(60)
def test_an_autostarted_daemon_frees_the_dram_tier_when_its_process_ends(tmp_path):
    """/dev/shm is the node's RAM, shared with other jobs: a daemon autostarted by a
    trainer frees its DRAM tier when that trainer exits (only its own block files)."""
    import subprocess
    import sys

    rt = tmp_path / "rt"
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(5000))
    code = ("import fsspec, sys\n"
            f"fs = fsspec.filesystem('cachemw', runtime_dir={str(rt)!r}, skip_instance_cache=True)\n"
            f"fs.cat_file({str(src)!r})\n"
            "print(fs.client.daemon_stats()['tiers']['dram']['path'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dram = out.stdout.strip().splitlines()[-1]
    (tmp_path / "rt" / "dram" / "not-ours.txt").write_text("keep me")
    from conftest import wait_for
    from cachemw.protocol import lock_holder, lookup

    wait_for(lambda: lookup(str(rt)) is None, 20, what="the daemon to exit with its trainer")
    # it frees the tier (blocks, then metadata records) before it lets go of its lock:
    # what is there once the lock is free is the end state (not between the two)
    wait_for(lambda: lock_holder(str(rt)) is None, 20, what="the daemon to let go of its lock")
    assert os.listdir(dram) == ["not-ours.txt"]


def test_blocks_dropped_as_bad_are_all_logged_within_a_minute_or_at_stop(tmp_path, caplog):
    """The daemon logs blocks readers found corrupt or unreadable at most once a minute; the
    drops after a logged one are said once that minute has passed, or when it stops, not
    only if yet another block is dropped later."""
    import logging
    caplog.set_level(logging.WARNING, logger="cachemw.node.cache")
    nc, conn = _node(tmp_path, blocks=6), object()
    for k in KEYS[:4]:
        _fill(nc, k, conn)

    def said():
        return [r.getMessage() for r in caplog.records if "found by readers" in r.getMessage()]

    nc.drop(KEYS[0], "corrupt")
    assert len(said()) == 1 and "1 corrupt" in said()[0]
    nc.drop(KEYS[1], "corrupt")
    nc.drop(KEYS[2], "unreadable")
    nc.say_dropped()
    assert len(said()) == 1  # within the minute: held
    nc._bad_logged_at -= 61  # the minute passes: the next maintenance pass says them
    nc.say_dropped()
    assert len(said()) == 2 and "1 corrupt, 1 unreadable" in said()[1] and KEYS[2] in said()[1]
    nc.drop(KEYS[3], "corrupt")  # held again: within the minute of the last
    assert len(said()) == 2
    nc.close()
    assert len(said()) == 3 and "1 corrupt" in said()[2]
