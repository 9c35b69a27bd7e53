"""Single flight: 8 processes that read one uncached file at the same moment all get the
right bytes, and the node fetches each block from the target exactly once."""
from __future__ import annotations

import multiprocessing
import os
import random
import time

import fsspec
import fsspec.implementations.local
import pytest

from conftest import daemon_stats, wait_for

BS = 65536
NPROC = 8


def _reader(fs, paths, barrier, out_dir, rank):
    barrier.wait(timeout=60)
    for i, path in enumerate(paths):
        data = fs.cat_file(path)
        with open(f"{out_dir}/{rank}-{i}", "wb") as f:
            f.write(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_eight_processes_one_fetch_per_block(runtime_dir, spawn_daemon, counting_target,
                                             tmp_path, method):
    spawn_daemon(runtime_dir)
    rng = random.Random(3)
    src = tmp_path / "src"
    src.mkdir()
    files = {str(src / "small.bin"): rng.randbytes(5000),         # one block, cached whole
             str(src / "big.bin"): rng.randbytes(3 * BS + 1234)}  # four blocks
    for path, data in files.items():
        with open(path, "wb") as f:
            f.write(data)
    out = tmp_path / "out"
    out.mkdir()
    fs = fsspec.filesystem("cachemw", fs=counting_target, block_size=BS, autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    counting_target.reset()

    ctx = multiprocessing.get_context(method)
    barrier = ctx.Barrier(NPROC)
    paths = list(files)
    procs = [ctx.Process(target=_reader, args=(fs, paths, barrier, str(out), r))
             for r in range(NPROC)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=90)
        assert [p.exitcode for p in procs] == [0] * NPROC
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    for rank in range(NPROC):
        for i, path in enumerate(paths):
            assert (out / f"{rank}-{i}").read_bytes() == files[path], (rank, path)

    fetched = counting_target.calls("cat_file")
    assert sorted(fetched) == sorted([f"cat_file {paths[0]}"] + [f"cat_file {paths[1]}"] * 4)
    assert counting_target.calls("_open") == []  # nothing read around the cache

    nblocks = 5
    # the workers' access reports arrive when they exit: wait until all 8 are in
    stats = wait_for(lambda: (s := daemon_stats(runtime_dir))["counters"]["hits"]
                     + s["counters"]["misses"] >= NPROC * nblocks and s, 10,
                     what="the readers' access reports")
    c = stats["counters"]
    assert c["leases"] == nblocks
    assert c["misses"] == nblocks
    assert c["fills"] == nblocks
    assert c["bytes_from_source"] == sum(len(d) for d in files.values())
    assert c["hits"] == NPROC * nblocks - nblocks
    assert c["fallbacks"] == c["bypassed"] == c["fill_errors"] == 0
    assert stats["tiers"]["dram"]["blocks"] == nblocks
    assert stats["inflight"] == 0


class SlowLocalFileSystem(fsspec.implementations.local.LocalFileSystem):
    """A target whose reads take a while (a PFS under load), counting them."""

    cachable = False
    reads = 0
    delay = 0.3

    def cat_file(self, path, start=None, end=None, **kwargs):
        SlowLocalFileSystem.reads += 1
        time.sleep(SlowLocalFileSystem.delay)
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_threads_of_one_process_missing_one_block(make_cache_fs, tmp_path, runtime_dir):
    import threading

    data = random.Random(9).randbytes(BS)
    path = str(tmp_path / "one.bin")
    with open(path, "wb") as f:
        f.write(data)
    SlowLocalFileSystem.reads, SlowLocalFileSystem.delay = 0, 0.3
    fs = make_cache_fs(fs=SlowLocalFileSystem(), block_size=BS)
    assert fs.client.connected()
    barrier = threading.Barrier(2)
    results = []

    def read():
        barrier.wait(10)
        results.append(fs.cat_file(path))

    threads = [threading.Thread(target=read, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [data, data]
    c = daemon_stats(runtime_dir)["counters"]
    assert (c["busy"], fs.stats()["bypassed"], SlowLocalFileSystem.reads) == (0, 0, 1)


def _slow_reader(fs, path, out):
    with open(out, "wb") as f:
        f.write(fs.cat_file(path))


@pytest.mark.timeout(60)
def test_filler_killed_mid_fill_hands_the_lease_to_a_waiter(runtime_dir, spawn_daemon, tmp_path):
    """The process that fetches a block (holding its claim: cachemw/claims.py) dies while
    fetching it: a process waiting on that block gets the lease at once (not after
    lease_wait) and fills it."""
    spawn_daemon(runtime_dir)
    data = random.Random(4).randbytes(BS)
    path = str(tmp_path / "one.bin")
    with open(path, "wb") as f:
        f.write(data)

    fs = fsspec.filesystem("cachemw", fs=SlowLocalFileSystem(), block_size=BS, autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    ctx = multiprocessing.get_context("fork")
    out_a, out_b = str(tmp_path / "a"), str(tmp_path / "b")
    SlowLocalFileSystem.delay = 5.0  # the filler hangs in the target...
    filler = ctx.Process(target=_slow_reader, args=(fs, path, out_a))
    waiter = None
    filler.start()
    try:
        claims = os.path.join(runtime_dir, "claims")
        wait_for(lambda: os.listdir(claims), 10, what="the filler's claim")
        SlowLocalFileSystem.delay = 0.0  # ...the waiter's own fetch is quick
        waiter = ctx.Process(target=_slow_reader, args=(fs, path, out_b))
        waiter.start()
        wait_for(lambda: daemon_stats(runtime_dir)["counters"]["waits"] >= 1, 10,
                 what="the waiter to wait on the lease")
        filler.kill()
        filler.join(10)
        waiter.join(20)
        assert waiter.exitcode == 0
    finally:
        SlowLocalFileSystem.delay = 0.3
        for p in (filler, waiter):
            if p is not None and p.is_alive():
                p.kill()
                p.join(5)
    with open(out_b, "rb") as f:
        assert f.read() == data
    stats = wait_for(lambda: (s := daemon_stats(runtime_dir))["counters"]["fills"] == 1 and s, 5,
                     what="the waiter's fill report")
    c = stats["counters"]
    # the filler never asked for its lease (it comes after the fetch): the waiter's only
    assert (c["leases"], c["busy"], c["bypassed"]) == (1, 0, 0)
    assert stats["inflight"] == 0
    assert stats["tiers"]["dram"]["blocks"] == 1
