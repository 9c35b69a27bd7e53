"""A batch's misses are fetched side by side (cachemw/client/fanout.py): ``cat`` of many
files, ``cat_ranges``, a read spanning blocks, cold files of a store whose GET names the
version. What must hold besides: every byte right, a failed fetch fails its own path only
(and ends its claim: the next read fetches it), a nested batch never waits on the pool its
caller fills, and a forked child gets a pool of its own."""
from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from cachemw.client import fanout
from conftest import published

BS = 64 * 1024


class SlowTarget(LocalFileSystem):
    """A local filesystem whose data requests each take ``delay`` s and count how many
    run at once; a path in ``failing`` fails its reads."""

    cachable = False

    def __init__(self, delay: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.failing: set[str] = set()

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.delay)
            if self._strip_protocol(path) in self.failing:
                raise OSError(5, f"{path}: injected failure")
            return super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            with self.lock:
                self.now -= 1


def files(tmp_path, n: int, size: int) -> dict[str, bytes]:
    rng = random.Random(n * size)
    out = {}
    (tmp_path / "src").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        p = tmp_path / "src" / f"f{i:03d}"
        p.write_bytes(rng.randbytes(size))
        out[str(p)] = p.read_bytes()
    return out


def test_run_all_keeps_order_hands_back_errors_and_runs_nested_batches_inline():
    def nested(i):  # a batch made inside the pool's thread: no wait on the pool
        return sum(fanout.run_all([lambda j=j: i * 100 + j for j in range(fanout.LIMIT * 2)]))

    def fails():
        raise ValueError("boom")

    calls = [lambda i=i: nested(i) for i in range(fanout.LIMIT * 2)] + [fails]
    out = fanout.run_all(calls)
    assert out[:-1] == [sum(i * 100 + j for j in range(fanout.LIMIT * 2))
                        for i in range(fanout.LIMIT * 2)]
    assert isinstance(out[-1], ValueError)


def _in_child(queue):
    queue.put(fanout.run_all([lambda i=i: (i, os.getpid()) for i in range(4)]))


@pytest.mark.timeout(60)
def test_a_forked_child_gets_a_pool_of_its_own():
    fanout.run_all([lambda: 1, lambda: 2])  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    got = queue.get(timeout=30)  # with the parent's pool (no threads in the child): a hang
    child.join(30)
    assert [i for i, _ in got] == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_cat_of_many_cold_files_fetches_them_side_by_side(make_cache_fs, tmp_path):
    data = files(tmp_path, 12, 3000)
    target = SlowTarget()
    fs = make_cache_fs(fs=target, block_size=BS)
    got = fs.cat(sorted(data))
    assert got == data
    assert target.most >= 2  # one after another, this would be 1
    published(fs)
    target.most = 0
    assert fs.cat(sorted(data)) == data and target.most == 0  # hits


@pytest.mark.timeout(120)
def test_a_read_spanning_blocks_fetches_them_side_by_side(make_cache_fs, tmp_path):
    data = files(tmp_path, 1, 6 * BS + 100)
    (path, content), = data.items()
    target = SlowTarget()
    fs = make_cache_fs(fs=target, block_size=BS)
    assert fs.cat_file(path, start=10, end=5 * BS + 7) == content[10:5 * BS + 7]
    assert target.most >= 2
    published(fs)
    assert fs.cat_file(path) == content


@pytest.mark.timeout(120)
def test_a_failed_fetch_fails_its_path_only_and_ends_its_claim(make_cache_fs, tmp_path):
    data = files(tmp_path, 6, 5000)
    paths = sorted(data)
    target = SlowTarget()
    target.failing.add(paths[2])
    fs = make_cache_fs(fs=target, block_size=BS, daemon_timeout=30)
    out = fs.cat_ranges(paths, [None] * len(paths), [None] * len(paths))
    assert isinstance(out[2], OSError) and "injected" in str(out[2])
    assert [out[i] for i in (0, 1, 3, 4, 5)] == [data[paths[i]] for i in (0, 1, 3, 4, 5)]
    with pytest.raises(OSError, match="injected"):  # fsspec's: "omit" raises here too
        fs.cat_ranges([paths[2]], [None], [None], on_error="omit")
    target.failing.clear()
    started = time.monotonic()
    assert fs.cat_file(paths[2]) == data[paths[2]]  # its claim ended: no wait on it
    assert time.monotonic() - started < 10
    published(fs)
    assert fs.cat(paths) == data


@pytest.mark.timeout(120)
def test_cold_s3_files_of_a_cat_are_fetched_side_by_side(make_cache_fs, s3_server, tmp_path):
    import s3fs

    s3 = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server["target_options"])
    rng = random.Random(7)
    data = {}
    for i in range(8):
        key = f"{s3_server['bucket']}/fanout/{os.getpid()}-{i}"
        body = rng.randbytes(2000 + i)
        s3.pipe_file(key, body)
        data[key] = body
    fs = make_cache_fs(fs=s3, block_size=BS)
    first = fs.reader.source._first
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def counted(*args, **kwargs):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            time.sleep(0.05)
            return first(*args, **kwargs)
        finally:
            with lock:
                state["now"] -= 1

    fs.reader.source._first = counted
    assert fs.cat(sorted(data)) == data
    assert fs.stats()["cold_gets"] == len(data)
    assert state["most"] >= 2


@pytest.mark.timeout(120)
def test_blocks_leased_to_fill_are_fetched_side_by_side(make_cache_fs, tmp_path, monkeypatch):
    """The daemon's leases (several nodes, or no claims to take) come for a batch at once:
    the blocks leased to this process are fetched side by side too, and one that fails
    ends its own lease (the next read fills it)."""
    data = files(tmp_path, 1, 6 * BS + 100)
    (path, content), = data.items()
    other = files(tmp_path / "o", 1, 2 * BS)
    target = SlowTarget()
    fs = make_cache_fs(fs=target, block_size=BS, daemon_timeout=30)
    monkeypatch.setattr(fs.reader, "_take_claim", lambda key: False)  # the lease path
    assert fs.cat_file(path) == content
    assert target.most >= 2 and fs.stats()["misses"] == 7
    published(fs)
    target.most = 0
    assert fs.cat_file(path) == content and target.most == 0
    (opath, ocontent), = other.items()
    target.failing.add(opath)
    with pytest.raises(OSError, match="injected"):
        fs.cat_file(opath)
    target.failing.clear()
    started = time.monotonic()
    assert fs.cat_file(opath) == ocontent
    assert time.monotonic() - started < 10  # its leases ended: no wait on them


class OneAtATime(MemoryFileSystem):
    """A store of the kind that takes one request at a time (fsspec's tar, zip, FTP share
    one file object or connection): counts how many run at once."""

    cachable = False
    protocol = "oneatatime"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lock = threading.Lock()
        self.now = self.most = 0

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.02)
            return super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.timeout(120)
def test_a_store_that_takes_one_request_at_a_time_is_asked_one_at_a_time(make_cache_fs):
    target = OneAtATime()
    rng = random.Random(3)
    data = {}
    for i in range(6):
        path = f"/fanout-one/{os.getpid()}/f{i}"
        data[path] = rng.randbytes(3 * BS + i)
        target.pipe_file(path, data[path])
    fs = make_cache_fs(fs=target, block_size=BS)
    assert not fs.reader.source.concurrent
    got = fs.cat(sorted(data))
    assert {fs._strip_protocol(k): v for k, v in got.items()} == data
    assert target.most == 1


def test_which_stores_are_asked_side_by_side(tmp_path):
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem

    from cachemw.tiers.source import SourceTier

    local = fsspec.filesystem("file")
    assert SourceTier(local).concurrent and SourceTier(SlowTarget()).concurrent
    assert SourceTier(DirFileSystem(str(tmp_path), fs=local)).concurrent
    assert SourceTier(fsspec.filesystem("http", skip_instance_cache=True)).concurrent
    assert not SourceTier(MemoryFileSystem()).concurrent
    assert not SourceTier(DirFileSystem("/x", fs=MemoryFileSystem())).concurrent
