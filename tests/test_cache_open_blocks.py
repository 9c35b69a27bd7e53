"""Open files' block files (CachedFile's OpenBlocks): a tier's disk failing a read through
one is handled as the normal read path handles it, and a process holds a bounded number
of them, however many files it keeps open."""
from __future__ import annotations

import errno
import random

import pytest

from cachemw import blockfile
from conftest import published

BS = 65536


def _cached(fs, tmp_path, name: str, nblocks: int, seed: int) -> tuple[str, bytes]:
    """A source file of ``nblocks`` blocks, read once through ``fs`` so its blocks are cached."""
    path = str(tmp_path / name)
    data = random.Random(seed).randbytes(nblocks * BS)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)
    return path, data


def test_a_tier_disk_failing_a_read_of_an_open_block_is_read_elsewhere_and_counted(
        make_cache_fs, runtime_dir, tmp_path, monkeypatch):
    """A bad page of a tier's disk fails the ``pread`` of an open file's block with EIO:
    the read still returns the right bytes (the normal path: another tier, or the
    source) and the fault is counted as that path counts it, not raised to the user."""
    fs = make_cache_fs(block_size=BS)
    path, data = _cached(fs, tmp_path, "eio.bin", 3, 1)
    before = dict(fs.stats())
    with fs.open(path, "rb") as f:
        f.seek(BS + 100)
        assert f.read(4096) == data[BS + 100:BS + 4196]
        assert f._blocks.get(1) is not None  # served from the open block

        def failing_disk(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(blockfile, "_pread", failing_disk)  # the open block's reads
        for tier in fs.client.tiers():  # and the normal path's, of the same bad disk
            monkeypatch.setattr(tier, "get", failing_disk)
        f.seek(BS + 8000)
        assert f.read(4096) == data[BS + 8000:BS + 12096]
        assert f._blocks[1] is None  # read the normal way from now on
        f.seek(BS + 20000)
        assert f.read(100) == data[BS + 20000:BS + 20100]
    assert fs.stats()["tier_read_errors"] - before["tier_read_errors"] == 1


def test_an_error_of_the_process_reading_an_open_block_is_raised(make_cache_fs, runtime_dir,
                                                                   tmp_path, monkeypatch):
    """EMFILE, ENOMEM are no fault of the tier: raised, as the normal path raises them."""
    fs = make_cache_fs(block_size=BS)
    path, data = _cached(fs, tmp_path, "emfile.bin", 2, 2)
    with fs.open(path, "rb") as f:
        f.seek(10)
        assert f.read(10) == data[10:20]

        def no_memory(*args, **kwargs):
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

        monkeypatch.setattr(blockfile, "_pread", no_memory)
        f.seek(100)
        with pytest.raises(OSError) as info:
            f.read(10)
        assert info.value.errno == errno.ENOMEM
    assert fs.stats()["tier_read_errors"] == 0


def _held(f) -> list[int]:
    """The blocks open file ``f`` holds open (OpenBlocks, each a descriptor)."""
    return [i for i, block in f._blocks.items() if block is not None]


def test_open_files_hold_at_most_the_process_cap_of_block_files(make_cache_fs, runtime_dir,
                                                                 tmp_path, monkeypatch):
    """Each OpenBlock holds a descriptor: with many large files open and read at random,
    MAX_OPEN (64) per file alone reached the usual soft limit of 1024 descriptors. At the
    process's cap a file closes its oldest open block for a new one, and a file that holds
    none reads the normal way; the reads return the right bytes all along."""
    from cachemw.client.openfile import HELD

    fs = make_cache_fs(block_size=BS)
    a, a_data = _cached(fs, tmp_path, "a.bin", 3, 3)
    b, b_data = _cached(fs, tmp_path, "b.bin", 2, 4)
    base = HELD.n  # (files other tests left open, if any)
    monkeypatch.setattr(HELD, "cap", base + 2)

    def read(f, data, at):
        f.seek(at)
        assert f.read(100) == data[at:at + 100]

    with fs.open(a, "rb") as fa, fs.open(b, "rb") as fb:
        read(fa, a_data, 10)
        read(fa, a_data, BS + 10)
        assert _held(fa) == [0, 1] and HELD.n == base + 2
        read(fa, a_data, 2 * BS + 10)  # at the cap: its oldest block gives way
        assert _held(fa) == [1, 2] and HELD.n == base + 2
        read(fb, b_data, 10)  # holds none to give up: read the normal way
        read(fb, b_data, BS + 10)
        assert _held(fb) == [] and HELD.n == base + 2
        read(fa, a_data, 20)
        assert _held(fa) == [2, 0]
        fa.close()
        assert HELD.n == base
        read(fb, b_data, BS + 20)  # room again
        assert _held(fb) == [1] and HELD.n == base + 1
    assert HELD.n == base


def test_a_forked_child_counts_the_block_files_it_holds(make_cache_fs, runtime_dir, tmp_path):
    """A forked child (a DataLoader worker) inherits the parent's open files, their open
    blocks and descriptors: it counts those it holds, under a lock of its own (the parent's
    is held by another thread here, at the fork), and gives them back as it closes them."""
    import os
    import threading

    from cachemw.client.openfile import HELD

    fs = make_cache_fs(block_size=BS)
    path, data = _cached(fs, tmp_path, "forked.bin", 2, 5)
    base = HELD.n
    with fs.open(path, "rb") as f:
        for at in (10, BS + 10):
            f.seek(at)
            assert f.read(10) == data[at:at + 10]
        assert _held(f) == [0, 1]
        taken, release = threading.Event(), threading.Event()

        def hold():
            with HELD.lock:
                taken.set()
                release.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        assert taken.wait(30)
        try:
            pid = os.fork()
            if pid == 0:  # the child: nothing of pytest's, only this check, then out
                ok = HELD.n == base + 2 and HELD.lock.acquire(timeout=10)
                if ok:
                    HELD.lock.release()
                    for index in _held(f):
                        f._close_block(index)
                    ok = HELD.n == base and f._blocks == {}
                os._exit(0 if ok else 1)
        finally:
            release.set()
            holder.join(30)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _held(f) == [0, 1] and HELD.n == base + 2  # the parent's, untouched
    assert HELD.n == base
