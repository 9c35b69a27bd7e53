"""A block this process fetched and has not landed yet (write-behind, client/fills.py) is
re-read from memory, never by waiting for the fill writer thread: a garbage collection on
that thread runs arbitrary finalizers, and one that needs a lock the reader holds (h5py's
global lock, held while h5py reads through a file object) made both wait for 60 s (review
loaders3, defect 1)."""
from __future__ import annotations

import gc
import os
import threading

import pytest

from cachemw.tiers.directory import DirectoryTier

BS = 65536


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


class _Collecting:
    """Each stage on the fill writer first collects garbage (as an allocation there may),
    after ``ready`` is set: the finalizers then run on the writer thread."""

    def __init__(self, monkeypatch):
        self.ready = threading.Event()
        self.stages = 0
        real_stage = DirectoryTier.stage

        def stage(tier, key, data, lease, tag=b""):
            self.ready.wait(30)
            self.stages += 1
            gc.collect()
            return real_stage(tier, key, data, lease, tag=tag)

        monkeypatch.setattr(DirectoryTier, "stage", stage)


@pytest.fixture
def no_automatic_gc():
    """Garbage is collected only where a test collects it (on the fill writer here)."""
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def _cyclic_garbage_whose_finalizer_takes(lock, finalized):
    class Node:
        def __del__(self):
            with lock:
                finalized.append(threading.current_thread().name)

    node = Node()
    node.cycle = node  # freed by the cyclic collector only


@pytest.mark.timeout(120)
def test_a_re_read_does_not_wait_on_a_writer_whose_finalizer_needs_the_readers_lock(
        make_cache_fs, tmp_path, monkeypatch, no_automatic_gc):
    """The reader holds a lock (as h5py holds its own around the file object's read) and
    re-reads a block whose fill is pending; the fill writer, staging it, collects garbage
    whose finalizer takes that lock. Was: the re-read waited up to 60 s for the fill to
    land while the writer waited for the lock."""
    collecting = _Collecting(monkeypatch)
    fs = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    data = os.urandom(2 * BS + 100)
    _write(path, data)
    lock = threading.RLock()
    finalized: list[str] = []
    got = {}

    def read_holding_the_lock():
        with lock:
            _cyclic_garbage_whose_finalizer_takes(lock, finalized)
            got["first"] = fs.cat_file(path)  # misses: the fills are written behind
            assert fs.reader.fills.pending
            collecting.ready.set()  # the writer collects: its finalizer waits for the lock
            with fs.open(path, "rb") as f:  # re-reads the pending blocks
                f.seek(BS - 10)
                got["again"] = f.read(BS + 20)
            got["range"] = fs.cat_file(path, 5, 2 * BS + 50)

    reader = threading.Thread(target=read_holding_the_lock)
    reader.start()
    reader.join(20)  # was 60 s or more
    assert not reader.is_alive(), "the re-read waited on the fill writer"
    assert got["first"] == data
    assert got["again"] == data[BS - 10:2 * BS + 10]
    assert got["range"] == data[5:2 * BS + 50]
    assert fs.reader.fills.drain(30)  # the writer went on once the lock was free
    assert collecting.stages >= 1
    assert finalized == ["cachemw-fills"]  # the shape the test is about
    s = fs.stats()
    assert s["fills"] == 3 and s["fill_errors"] == 0 and s["bypassed"] == 0
    assert s["bytes_from_source"] == len(data)  # the re-reads came from memory
    assert fs.cat_file(path) == data  # and the blocks landed


class _Witness:
    """Says on which thread the garbage it is part of was freed."""

    def __init__(self, freed):
        self.freed = freed

    def __del__(self):
        self.freed.append(threading.current_thread().name)


def _h5_file(path, value):
    import h5py
    import numpy as np

    with h5py.File(path, "w") as h:
        h.create_dataset("d", data=value + np.arange(100_000, dtype=np.int64))
        h.attrs["v"] = value


@pytest.mark.timeout(120)
def test_h5py_reading_a_pending_block_through_fs_open_does_not_stall(
        make_cache_fs, tmp_path, monkeypatch, no_automatic_gc):
    """The reviewer's shape with h5py itself: h5py.File over fs.open() holds h5py's lock
    while it reads blocks whose fills are pending; the fill writer's garbage collection
    frees h5py objects (in a reference cycle), whose deallocation needs that lock."""
    h5py = pytest.importorskip("h5py")
    collecting = _Collecting(monkeypatch)
    fs = make_cache_fs(block_size=BS)
    path, other = str(tmp_path / "g.h5"), str(tmp_path / "other.h5")
    _h5_file(path, 7)
    _h5_file(other, 1)
    got = {}
    freed: list[str] = []

    def read():
        held = h5py.File(other, "r")  # an h5py object in cyclic garbage
        holder = {"file": held, "dataset": held["d"], "witness": _Witness(freed)}
        holder["self"] = holder
        del held, holder
        fs.cat_file(path)  # the blocks miss; their fills are pending
        assert fs.reader.fills.pending

        class Signalling:  # sets ``ready`` from inside h5py (which holds its lock then)
            def __init__(self, f):
                self.f = f

            def readinto(self, b):
                collecting.ready.set()
                return self.f.readinto(b)

            def __getattr__(self, name):
                return getattr(self.f, name)

        with fs.open(path, "rb") as f, h5py.File(Signalling(f), "r") as h:
            got["v"] = int(h.attrs["v"])
            got["d"] = h["d"][:]

    def run():
        try:
            read()
        except BaseException as exc:  # shown below
            got["error"] = exc

    reader = threading.Thread(target=run)
    reader.start()
    reader.join(30)  # was 60 s or more
    assert not reader.is_alive(), "h5py's read waited on the fill writer"
    assert "error" not in got, got.get("error")
    assert got["v"] == 7 and int(got["d"][0]) == 7 and int(got["d"][-1]) == 7 + 99_999
    assert fs.reader.fills.drain(30)
    assert collecting.stages >= 1
    assert freed == ["cachemw-fills"]  # the h5py objects were freed on the fill writer


@pytest.mark.timeout(90)
def test_pending_bytes_of_a_file_written_through_the_cache_since_are_not_served(
        make_cache_fs, tmp_path, gate):
    """A's fill of the old bytes is pending; B writes the file through the cache. A's open
    file, pinned to the old version, must not get the pending old bytes (the write has
    the daemon cancel the fill): its read goes to the source, pinned to that version,
    which is gone, so it raises ChangedSourceError, as it would with no fill pending."""
    from cachemw.tiers.source import ChangedSourceError

    a = make_cache_fs(block_size=BS)
    b = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(BS), os.urandom(BS)
    _write(path, old)
    with a.open(path, "rb") as f:
        assert f.read(10) == old[:10]  # a miss: its fill is held by the gate
        assert a.reader.fills.pending
        f.seek(20)
        assert f.read(10) == old[20:30]  # from memory: the file was not written since
        b.pipe_file(path, new)
        f.seek(0)
        with pytest.raises(ChangedSourceError):  # the pending bytes would have been returned
            f.read(BS)
    gate.set()
    assert a.reader.fills.drain(30)
    assert a.cat_file(path) == new
