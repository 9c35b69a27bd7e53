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
