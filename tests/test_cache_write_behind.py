"""Write-behind fills (cachemw/fills.py): a miss returns its bytes before the block file is
written; until then this process serves the block from memory, other processes wait on the
lease, and nothing is lost or left unaccounted when the connection, the process or the
queue's room goes away."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import fsspec
import pytest

from cachemw.keys import block_key
from cachemw.tiers.directory import DirectoryTier
from conftest import daemon_stats, wait_for

BS = 65536


@pytest.fixture
def gate(monkeypatch):
    """Hold every tier write of this process (the fill writer's) until ``gate.set()``."""
    held = threading.Event()
    real_put = DirectoryTier.put

    def put(self, key, data, tag=b""):
        if not held.wait(60):
            raise TimeoutError("test gate never opened")
        return real_put(self, key, data, tag=tag)

    monkeypatch.setattr(DirectoryTier, "put", put)
    yield held
    held.set()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _block_file(fs, path, index=0):
    meta = fs.meta.file(path)
    return fs.client.tiers()[0].block_path(block_key(meta.url, meta.version, index, BS))


def _cached_bytes(runtime_dir, drain=True):
    stats = daemon_stats(runtime_dir, drain)
    return stats["tiers"]["dram"]["used_bytes"], stats["inflight"]


@pytest.mark.timeout(60)
def test_pending_block_served_from_memory_until_written(make_cache_fs, counting_target,
                                                        tmp_path, gate):
    fs = make_cache_fs(fs=counting_target, block_size=BS)
    path = str(tmp_path / "f.bin")
    data = os.urandom(3 * BS + 100)
    _write(path, data)
    counting_target.reset()
    assert fs.cat_file(path) == data
    assert not os.path.exists(_block_file(fs, path))  # the writer is held
    assert fs.reader.fills.pending  # ... so the blocks are still in memory
    hits = fs.client.counters["hits"]
    assert fs.cat_file(path, 10, 2 * BS + 7) == data[10:2 * BS + 7]
    with fs.open(path, "rb") as f:
        f.seek(BS - 5)
        assert f.read(10) == data[BS - 5:BS + 5]
    assert fs.client.counters["hits"] > hits
    assert len(counting_target.calls("cat_file")) == 4  # one per block, no re-read
    gate.set()
    assert fs.reader.fills.drain(30)
    assert not fs.reader.fills.pending
    assert os.path.exists(_block_file(fs, path))
    s = fs.stats()
    assert s["fills"] == 4 and s["fill_errors"] == 0
    # the notes went over this process's connection: another one may see them a moment later
    wait_for(lambda: _cached_bytes(fs.options.runtime_dir)[0] > len(data), 10,
             what="the daemon to account the four blocks")
    assert _cached_bytes(fs.options.runtime_dir)[1] == 0


def _read_once(fs, path, out):
    with open(out, "wb") as f:
        f.write(fs.cat_file(path))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_other_processes_wait_for_the_pending_fill(make_cache_fs, counting_target, tmp_path,
                                                   gate, method):
    fs = make_cache_fs(fs=counting_target, block_size=BS)
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    _write(path, data)
    counting_target.reset()
    assert fs.cat_file(path) == data  # leased and fetched here; its write is held
    ctx = multiprocessing.get_context(method)
    out = str(tmp_path / "child.out")
    child = ctx.Process(target=_read_once, args=(fs, path, out))
    child.start()
    try:
        # the child misses, asks for a lease and waits on ours (a forked child does not
        # see this process's pending bytes: it has no writer of its own yet)
        wait_for(lambda: daemon_stats(fs.options.runtime_dir, drain=False)["counters"]["waits"] >= 1, 30,
                 what="the child to wait on the fill in flight")
        gate.set()
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    with open(out, "rb") as f:
        assert f.read() == data
    assert len(counting_target.calls("cat_file")) == 1  # single flight across processes
    assert daemon_stats(fs.options.runtime_dir)["counters"]["busy"] == 0


@pytest.mark.timeout(60)
def test_lost_connection_before_the_write_leaves_no_unaccounted_file(make_cache_fs, tmp_path,
                                                                     gate):
    fs = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    _write(path, data)
    assert fs.cat_file(path) == data
    block = _block_file(fs, path)
    fs.client._unreachable("test: connection dropped")  # the daemon aborts the lease
    wait_for(lambda: _cached_bytes(fs.options.runtime_dir, drain=False)[1] == 0, 10,
             what="the daemon to drop the lease")
    gate.set()
    assert fs.reader.fills.drain(30)
    assert not os.path.exists(block)  # written, then deleted: nobody would account it
    assert _cached_bytes(fs.options.runtime_dir) == (0, 0)
    assert fs.stats()["fills"] == 0
    fs.client._next_try = 0  # reconnect now rather than after the back-off
    assert fs.cat_file(path) == data
    assert fs.reader.fills.drain(30)
    assert os.path.exists(block)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write_behind", [0, 1000])
def test_no_room_to_queue_writes_on_the_reader_path(make_cache_fs, tmp_path, gate,
                                                    write_behind):
    fs = make_cache_fs(block_size=BS, write_behind=write_behind)
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    _write(path, data)
    gate.set()
    assert fs.cat_file(path) == data
    assert not fs.reader.fills.pending
    assert os.path.exists(_block_file(fs, path))  # written before cat_file returned
    assert fs.stats()["fills"] == 1


@pytest.mark.timeout(60)
def test_a_process_that_exits_right_after_reading_lands_every_fill(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS)  # the daemon
    paths = []
    for i in range(40):
        paths.append(str(tmp_path / f"f{i}.bin"))
        _write(paths[-1], os.urandom(BS // 2))
    code = (
        "import sys, fsspec\n"
        f"fs = fsspec.filesystem('cachemw', runtime_dir={fs.options.runtime_dir!r}, "
        f"autostart=False, block_size={BS})\n"
        f"for p in {paths!r}:\n"
        "    fs.cat_file(p)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    def landed():  # the exited process's last messages may still be in the daemon's hands
        stats = daemon_stats(fs.options.runtime_dir)
        return stats["inflight"] == 0 and stats["counters"]["fills"] == len(paths)

    wait_for(landed, 10, what="every fill of the exited process to be accounted")
    for p in paths:
        assert os.path.exists(_block_file(fs, p))


@pytest.mark.timeout(60)
def test_write_to_the_target_waits_for_pending_fills(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(BS), os.urandom(BS)
    _write(path, old)
    assert fs.cat_file(path) == old
    fs.pipe_file(path, new)  # the old block's fill lands (or not) before the invalidation
    assert fs.cat_file(path) == new
    assert fs.reader.fills.drain(30)
    assert fs.cat_file(path) == new


def test_write_behind_option_is_checked():
    with pytest.raises(ValueError, match="write_behind"):
        fsspec.filesystem("cachemw", autostart=False, write_behind="lots",
                          skip_instance_cache=True)


@pytest.mark.timeout(60)
def test_a_reader_that_stops_missing_still_lands_its_fills(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    _write(path, data)
    assert fs.cat_file(path) == data  # no further miss kicks the writer, no drain
    block = _block_file(fs, path)
    wait_for(lambda: os.path.exists(block), 5, what="the fill to land on its own")
    assert _cached_bytes(fs.options.runtime_dir, drain=False)[1] == 0


def test_a_dropped_metadata_record_is_not_written_after_the_drop(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    from cachemw.metadata import MetadataCache

    path = str(tmp_path / "f.bin")
    _write(path, b"abc")
    meta_dir = str(tmp_path / "meta")
    deferred = []
    cache = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir,
                          defer=lambda fn, arg: deferred.append((fn, arg)))
    cache.info(path)
    assert deferred and not os.path.exists(meta_dir)  # queued, not written
    cache.forget(path)  # e.g. the file was written: its record must not reappear
    for fn, arg in deferred:
        fn(arg)
    other = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)
    assert other._load_shared("info", path) is None
    cache.info(path)  # stored again, then written: shared with other processes
    for fn, arg in deferred[1:]:
        fn(arg)
    assert other._load_shared("info", path)[0]["size"] == 3


class _Tier:
    name = "dram"

    def __init__(self):
        self.written = []

    def put(self, key, data, tag=b""):
        self.written.append(key)
        return len(data)

    def delete(self, key):
        self.written.remove(key)


class _Client:
    def __init__(self):
        self.notes, self.counts = [], {}

    def note_via(self, link, *msg):
        self.notes.append(msg)
        return True

    def count(self, name, n=1):
        self.counts[name] = self.counts.get(name, 0) + n


def test_a_source_faster_than_the_write_is_filled_on_the_reader_path():
    """Written behind, a fill only helps when the reader has a wait to hide it in."""
    from cachemw.fills import Fill, FillWriter

    tier, client = _Tier(), _Client()
    writer = FillWriter(client, 1 << 20)
    writer.store(Fill("k0", tier, b"x" * 4096, b"", None))  # measures what a write costs
    writer.submit(Fill("k1", tier, b"x" * 4096, b"", None), waited=0.0)
    assert tier.written == ["k0", "k1"] and not writer.pending  # written before returning
    writer.submit(Fill("k2", tier, b"x" * 4096, b"", None), waited=10.0)
    assert "k2" in writer.pending or "k2" in tier.written
    assert writer.drain(10)
    assert tier.written == ["k0", "k1", "k2"] and not writer.pending
    assert client.counts == {"fills": 3}
    assert [n[0] for n in client.notes] == ["filled"] * 3


def test_an_unexpected_error_in_a_write_still_ends_the_lease():
    from cachemw.fills import Fill, FillWriter

    class Broken(_Tier):
        def put(self, key, data, tag=b""):
            raise RuntimeError("a bug in a tier")

    client = _Client()
    writer = FillWriter(client, 1 << 20)
    writer.submit(Fill("k", Broken(), b"x" * 4096, b"", None), waited=10.0)
    assert writer.drain(10)
    assert client.notes == [("abort", "k", "error")] and client.counts == {"fill_errors": 1}
    assert not writer.pending
