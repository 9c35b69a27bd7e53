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
from conftest import daemon_stats, published, staged_files, wait_for

BS = 65536


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
def test_a_re_read_of_a_pending_block_is_served_from_memory(make_cache_fs, counting_target,
                                                            tmp_path, gate):
    """A block filled by this process is served from memory until its file has landed,
    without fetching it from the source again and without waiting for the fill writer
    (tests/test_cache_pending_reads.py: that wait could deadlock with a finalizer run on
    the writer); a write through the cache elsewhere keeps it from being served (below)."""
    fs = make_cache_fs(fs=counting_target, block_size=BS)
    path = str(tmp_path / "f.bin")
    data = os.urandom(3 * BS + 100)
    _write(path, data)
    counting_target.reset()
    assert fs.cat_file(path) == data
    assert not os.path.exists(_block_file(fs, path))  # the writer is held
    assert fs.reader.fills.pending
    got = {}
    reader = threading.Thread(target=lambda: got.update(r=fs.cat_file(path, 10, 2 * BS + 7)))
    reader.start()
    reader.join(30)
    assert not reader.is_alive()  # not waiting for the fill to land
    assert got["r"] == data[10:2 * BS + 7]
    with fs.open(path, "rb") as f:
        f.seek(BS - 5)
        assert f.read(10) == data[BS - 5:BS + 5]
    assert not os.path.exists(_block_file(fs, path))  # still held
    gate.set()
    assert len(counting_target.calls("cat_file")) == 4  # one per block, no re-read
    assert fs.reader.fills.drain(30)
    assert not fs.reader.fills.pending
    s = fs.stats()
    assert s["fills"] == 4 and s["fill_errors"] == 0 and s["bypassed"] == 0
    # the notes went over this process's connection: another one may see them a moment later
    wait_for(lambda: _cached_bytes(fs.options.runtime_dir)[0] > len(data), 10,
             what="the daemon to account the four blocks")
    assert _cached_bytes(fs.options.runtime_dir)[1] == 0


@pytest.mark.timeout(60)
def test_a_write_elsewhere_is_seen_by_a_process_with_the_old_fill_pending(make_cache_fs,
                                                                           tmp_path, gate):
    """Process (here: filesystem instance) A has the old bytes' fill pending; B writes the
    file through the cache; A's next read returns the new bytes, never the old ones."""
    a = make_cache_fs(block_size=BS, validate="ttl", ttl=3600)
    b = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(BS), os.urandom(BS)
    _write(path, old)
    st = os.stat(path)
    assert a.cat_file(path) == old  # A's fill of the old bytes is held
    b.pipe_file(path, new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same version token (coarse mtime)
    got = {}
    reader = threading.Thread(target=lambda: got.update(r=a.cat_file(path)))
    reader.start()
    reader.join(0.3)
    gate.set()
    reader.join(30)
    assert got["r"] == new


def _slow_source(latency):
    from cachemw.bench import SlowLocalFileSystem

    return SlowLocalFileSystem(latency=latency)


def _read_in_order(runtime_dir, paths, barrier, out):
    fs = fsspec.filesystem("cachemw", fs=_slow_source(0.3), runtime_dir=runtime_dir,
                           autostart=False, block_size=BS, skip_instance_cache=True)
    barrier.wait(30)
    import time

    t = time.monotonic()
    for p in paths:
        fs.cat_file(p)
    with open(out, "w") as f:
        f.write(str(time.monotonic() - t))


@pytest.mark.timeout(90)
def test_two_processes_waiting_on_each_others_fills_do_not_stall(make_cache_fs, tmp_path):
    """A reads K1 then K2, B reads K2 then K1. Each one's note for its first fill may queue
    on its connection behind its second lease, which waits on the other's first fill: the
    daemon sees the block file land instead of waiting for the note (was 30 s each)."""
    fs = make_cache_fs(block_size=BS)
    k1, k2 = str(tmp_path / "k1.bin"), str(tmp_path / "k2.bin")
    for p in (k1, k2):
        _write(p, os.urandom(BS))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    outs = [str(tmp_path / "a.out"), str(tmp_path / "b.out")]
    procs = [ctx.Process(target=_read_in_order, args=(fs.options.runtime_dir, order, barrier, o))
             for order, o in (([k1, k2], outs[0]), ([k2, k1], outs[1]))]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for o in outs:
        with open(o) as f:
            assert float(f.read()) < 5.0
    assert daemon_stats(fs.options.runtime_dir)["counters"]["busy"] == 0


@pytest.mark.timeout(60)
def test_a_dropped_filesystem_leaves_no_writer_thread_behind(make_cache_fs, tmp_path,
                                                             monkeypatch):
    import gc
    import time

    from cachemw.client.fills import FillWriter

    monkeypatch.setattr(FillWriter, "IDLE", 0.1)
    before = threading.active_count()
    for i in range(5):
        fs = make_cache_fs(block_size=BS)
        path = str(tmp_path / f"f{i}.bin")
        _write(path, os.urandom(BS))
        fs.cat_file(path)
        del fs
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert threading.active_count() <= before


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
    """The connection holding a fill's lease drops before the block is written: the daemon
    ends the lease, the writer's staged file is deleted (nobody would account it), and the
    next read reconnects at once to the daemon, which still runs, and fills the block."""
    fs = make_cache_fs(block_size=BS)
    rt = fs.options.runtime_dir
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    _write(path, data)
    assert fs.cat_file(path) == data
    block = _block_file(fs, path)
    # the fill writer leases the block after the fetch (adopt), then waits at the gate
    wait_for(lambda: _cached_bytes(rt, drain=False)[1] == 1, 10, what="the fill's lease")
    for conn in list(fs.client._conns):  # the process's connections drop, the lease's too
        conn.close()
    wait_for(lambda: _cached_bytes(rt, drain=False)[1] == 0, 10,
             what="the daemon to drop the lease")
    gate.set()
    assert fs.reader.fills.drain(30)
    assert not os.path.exists(block)  # staged, then deleted: nobody would account it
    assert not staged_files(fs.client.tiers()[0], os.path.basename(block))
    assert _cached_bytes(rt) == (0, 0)
    assert fs.stats()["fills"] == 0
    # no back-off: the daemon lives, so the next message on a closed connection (stats'
    # report, the fill's lease) goes on a new one at once
    assert fs.cat_file(path) == data
    published(fs)
    assert os.path.exists(block)
    s = fs.stats()
    assert s["fills"] == 1 and s["fallbacks"] == 0


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
    assert fs.stats()["fills"] == 1  # written (staged and noted) before cat_file returned
    published(fs)
    assert os.path.exists(_block_file(fs, path))


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


def _deferring_cache(tmp_path):
    """A file of 3 bytes and a MetadataCache whose shared records are queued in `deferred`
    (as the fill writer would hold them) until the test runs them."""
    from fsspec.implementations.local import LocalFileSystem

    from cachemw.client.metadata import MetadataCache

    path = str(tmp_path / "f.bin")
    _write(path, b"abc")
    meta_dir = str(tmp_path / "meta")
    deferred = []
    cache = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir,
                          defer=lambda fn, arg: deferred.append((fn, arg)))
    return path, meta_dir, deferred, cache, MetadataCache, LocalFileSystem


def test_a_dropped_metadata_record_is_not_written_after_the_drop(tmp_path):
    path, meta_dir, deferred, cache, MetadataCache, LocalFileSystem = _deferring_cache(tmp_path)
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

    def stage(self, key, data, lease, tag=b""):
        self.written.append(key)
        return len(data)

    def unstage(self, key, lease):
        self.written.remove(key)


class _Client:
    def __init__(self):
        self.notes, self.counts = [], {}

    def note_via(self, link, *msg):
        self.notes.append(msg)
        return True

    def count(self, name, n=1):
        self.counts[name] = self.counts.get(name, 0) + n

    def link(self):
        return None  # the calling thread has no connection

    def settle(self):
        self.notes.append(("ping",))
        return True


class _LinkedClient(_Client):
    """A client whose every thread has a connection of its own (fake: an object per thread)."""

    def __init__(self):
        super().__init__()
        self._local = threading.local()

    def link(self):
        if not hasattr(self._local, "conn"):
            self._local.conn = (object(), threading.Lock())
        return self._local.conn

    def settle(self):
        self.notes.append(("ping", threading.current_thread().name))
        return True


def test_a_drain_sees_the_notes_on_the_callers_connection_read():
    """A "filled" the writer sent on the reading thread's connection sits in the daemon's
    socket buffer until the daemon reads it: a drain by that thread ends with a round trip
    on it, so that another connection (a stats request, a look at the claims) is answered
    after it. No notes on it, no round trip; another thread's notes are its drain's."""
    from cachemw.client.fills import Fill, FillWriter

    tier, client = _Tier(), _LinkedClient()
    writer = FillWriter(client, 1 << 20)
    assert writer.drain(10) and client.notes == []  # nothing sent: nothing to wait for
    writer.submit(Fill("k0", tier, b"x" * 4096, b"", client.link(), 1), waited=10.0)
    assert writer.drain(10)
    me = ("ping", threading.current_thread().name)
    assert client.notes[-1] == me  # after the "filled"
    assert writer.drain(10) and client.notes.count(me) == 1  # once per notes sent
    other = {}
    thread = threading.Thread(target=lambda: other.update(link=client.link()), name="other")
    thread.start()
    thread.join()
    writer.submit(Fill("k1", tier, b"x" * 4096, b"", other["link"], 2), waited=10.0)
    pings = len([n for n in client.notes if n[0] == "ping"])
    assert writer.drain(10)
    assert len([n for n in client.notes if n[0] == "ping"]) == pings  # not this thread's


def test_a_source_faster_than_the_write_is_filled_on_the_reader_path():
    """Written behind, a fill only helps when the reader has a wait to hide it in."""
    from cachemw.client.fills import Fill, FillWriter

    tier, client = _Tier(), _Client()
    writer = FillWriter(client, 1 << 20)
    writer.store(Fill("k0", tier, b"x" * 4096, b"", None, 1))  # measures what a write costs
    writer.submit(Fill("k1", tier, b"x" * 4096, b"", None, 2), waited=0.0)
    assert tier.written == ["k0", "k1"] and not writer.pending  # written before returning
    writer.submit(Fill("k2", tier, b"x" * 4096, b"", None, 3), waited=10.0)
    assert "k2" in writer.pending or "k2" in tier.written
    assert writer.drain(10)
    assert tier.written == ["k0", "k1", "k2"] and not writer.pending
    assert client.counts == {"fills": 3}
    assert [n[0] for n in client.notes] == ["filled"] * 3


def test_an_unexpected_error_in_a_write_still_ends_the_lease():
    from cachemw.client.fills import Fill, FillWriter

    class Broken(_Tier):
        def stage(self, key, data, lease, tag=b""):
            raise RuntimeError("a bug in a tier")

    client = _Client()
    writer = FillWriter(client, 1 << 20)
    writer.submit(Fill("k", Broken(), b"x" * 4096, b"", None, 1), waited=10.0)
    assert writer.drain(10)
    assert client.notes == [("abort", "k", "error")] and client.counts == {"fill_errors": 1}
    assert not writer.pending


def test_a_deferred_record_does_not_undo_a_drop_by_another_process(tmp_path):
    """A's record of a file, written behind its reads, must not land after B (another
    process of the node) wrote the file and dropped its records: B leaves a tombstone."""
    import time

    path, meta_dir, deferred, a, MetadataCache, LocalFileSystem = _deferring_cache(tmp_path)
    b = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)
    a.info(path)  # fetched now, its record queued
    time.sleep(0.01)
    _write(path, b"abcdef")
    b.forget(path)  # B wrote the file: drops every record of it
    for fn, arg in deferred:
        fn(arg)
    fresh = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)
    assert fresh._load_shared("info", path) is None
    assert fresh.info(path)["size"] == 6
    deferred.clear()
    a.forget(path)
    a.info(path)  # fetched after the drop: its record is written
    for fn, arg in deferred:
        fn(arg)
    assert fresh._load_shared("info", path)[0]["size"] == 6


def test_a_client_gone_after_writing_its_fill_has_the_block_adopted(tmp_path):
    """A process killed between writing a fill and noting it (or before its writer's note
    was read): the daemon keeps the block if its file is whole and verifies; a damaged or
    missing one is dropped and the lease aborted, as before."""
    from cachemw.config import DaemonConfig, TierConfig
    from cachemw.node.cache import NodeCache

    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),),
                                  runtime_dir=str(tmp_path / "rt")))
    tier = node._tiers["dram"].tier
    conn = object()
    keys, leases = [f"{i:02x}" + "0" * 30 for i in range(3)], []
    for key in keys:
        reply = node.lease(key, BS, "file:///x", conn)
        assert reply[:2] == ("fill", "dram")
        leases.append(reply[2])
    tier.stage(keys[0], os.urandom(BS), leases[0])  # written whole, never noted
    tier.stage(keys[1], os.urandom(BS), leases[1])
    with open(tier.staged_path(keys[1], leases[1]), "r+b") as f:  # written, then damaged
        f.seek(100)
        f.write(b"\xff" * 8)
    node.release(conn)  # keys[2]: never written
    stats = node.stats()
    assert stats["inflight"] == 0 and stats["counters"]["adopted"] == 1
    assert stats["tiers"]["dram"]["blocks"] == 1
    assert node.lease(keys[0], BS, "file:///x", object()) == ("present", "dram")
    assert node.lease(keys[1], BS, "file:///x", object())[0] == "fill"
    assert node.lease(keys[2], BS, "file:///x", object())[0] == "fill"


@pytest.mark.timeout(60)
def test_small_blocks_are_leased_and_noted_in_batches(make_cache_fs, tmp_path, monkeypatch):
    """Blocks fetched under their claims are leased many to a request and noted many to a
    message (each one wakes the daemon); every block is cached all the same, once, and
    read back as a hit."""
    from cachemw.client.fills import FillWriter
    from cachemw.client.link import DaemonClient

    monkeypatch.setattr(FillWriter, "LINGER", 30.0)  # batches by size and drains only
    notes = []
    real_note = DaemonClient.note_via
    monkeypatch.setattr(DaemonClient, "note_via",
                        staticmethod(lambda link, *msg: notes.append(msg[0]) or
                                     real_note(link, *msg)))
    fs = make_cache_fs(fs=_slow_source(0.001), block_size=BS)
    files = {}
    for i in range(40):
        path = str(tmp_path / f"f{i:02d}.bin")
        files[path] = os.urandom(4096 + i)
        _write(path, files[path])
    for path, data in files.items():
        assert fs.cat_file(path) == data
    published(fs)
    s = fs.stats()
    assert s["misses"] == 40 and s["fills"] == 40 and s["fill_errors"] == 0
    # 16 to a batch (FillWriter.BATCH), the rest at the drain (a first miss may take its
    # lease before its fetch, noted alone): not one request and one note per block
    assert s["lease_requests"] <= 8
    assert notes.count("filled_many") >= 2 and notes.count("filled") <= 2
    stats = daemon_stats(fs.options.runtime_dir)
    assert stats["inflight"] == 0 and stats["tiers"]["dram"]["blocks"] == 40
    fresh = make_cache_fs(fs=_slow_source(0.001), block_size=BS)
    for path, data in files.items():
        assert fresh.cat_file(path) == data
    assert fresh.stats()["hits"] == 40 and fresh.stats()["misses"] == 0


def test_a_batch_ends_every_lease_whatever_fails():
    """In one batch: fills on two connections get one note each (a batch note for two),
    a failed write ends its own lease, and an interrupt in the middle still ends every
    lease of the batch (the staged ones noted, the rest aborted) before it goes on up."""
    from cachemw.client.fills import Fill, FillWriter

    class Flaky(_Tier):
        def stage(self, key, data, lease, tag=b""):
            if key == "bad":
                raise OSError(28, "No space left on device")
            if key == "stop":
                raise KeyboardInterrupt
            return super().stage(key, data, lease, tag)

    tier, client = Flaky(), _Client()
    writer = FillWriter(client, 1 << 20)
    a, b = (object(), threading.Lock()), (object(), threading.Lock())
    writer.store_many([Fill("k1", tier, b"x", b"", a, 1), Fill("bad", tier, b"x", b"", a, 2),
                       Fill("k2", tier, b"x", b"", b, 3), Fill("k3", tier, b"x", b"", a, 4)])
    assert client.notes == [("abort", "bad", "nospace"),
                            ("filled_many", [("k1", "dram", 1, 1), ("k3", "dram", 1, 4)]),
                            ("filled", "k2", "dram", 1, 3)]
    assert client.counts == {"fill_errors": 1, "fills": 3}
    client.notes.clear()
    with pytest.raises(KeyboardInterrupt):
        writer.store_many([Fill("k4", tier, b"x", b"", a, 5), Fill("stop", tier, b"x", b"", a, 6),
                           Fill("k5", tier, b"x", b"", a, 7)])
    assert client.notes == [("abort", "stop", "error"), ("abort", "k5", "error"),
                            ("filled", "k4", "dram", 1, 5)]
