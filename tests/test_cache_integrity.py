"""Integrity: a damaged block file in a tier (flipped byte, truncated, overwritten with
garbage or with another block's sound file) is detected on read, dropped, refetched from
the source; the read returns the right bytes and the repair is counted."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

from cachemw import blockfile
from cachemw.keys import block_count, block_key
from cachemw.tiers.directory import DirectoryTier
from conftest import daemon_stats, published, wait_for

BS = 65536


def _flip(at):
    def damage(path, length):
        with open(path, "r+b") as f:
            pos = at(length, os.path.getsize(path))
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([byte[0] ^ 0x40]))
    return damage


def _truncate(to):
    def damage(path, length):
        os.truncate(path, to(length, os.path.getsize(path)))
    return damage


def _replace(content):
    def damage(path, length):
        with open(path, "wb") as f:
            f.write(content(length, os.path.getsize(path)))
    return damage


def _another_block(length, size):
    """A sound block file of ``length`` data bytes, written under another key's name: what
    a misdirected write or a copy by hand leaves in place of the block."""
    other = f"/dev/shm/{'f' * 32}" if os.path.isdir("/dev/shm") else f"/tmp/{'f' * 32}"
    other += f"-{os.getpid()}"
    try:
        blockfile.write_block(other, random.Random(length).randbytes(length))
        with open(other, "rb") as f:
            return f.read()
    finally:
        os.unlink(other)


def _directory(path, length):
    """A directory (with a file in it) where the block file was."""
    os.unlink(path)
    os.mkdir(path)
    with open(os.path.join(path, "inside"), "wb") as f:
        f.write(b"x")


def _append(path, length):
    with open(path, "ab") as f:
        f.write(b"\0junk")


# Each damage touches the first page (blockfile.PAGE_SIZE) of the block's data or its checksums/trailer.
DAMAGES = {
    "flip data byte": _flip(lambda length, size: 100),
    "flip last data byte of the page": _flip(lambda length, size: min(length, blockfile.PAGE_SIZE) - 1),
    "flip page checksum": _flip(lambda length, size: length),
    "flip trailer magic": _flip(lambda length, size: size - blockfile.TRAILER_SIZE),
    "flip whole-data checksum": _flip(lambda length, size: size - blockfile.TRAILER_SIZE + 32),
    "flip source tag": _flip(lambda length, size: size - 17),
    "flip block key": _flip(lambda length, size: size - 1),
    "truncate inside data": _truncate(lambda length, size: 50),
    "truncate one byte": _truncate(lambda length, size: size - 1),
    "empty file": _truncate(lambda length, size: 0),
    "append garbage": _append,
    "garbage of the same size": _replace(lambda length, size: random.Random(size).randbytes(size)),
    "short garbage file": _replace(lambda length, size: b"garbage"),
    "another block's file": _replace(_another_block),
    "a directory in its place": _directory,
}

FILES = {"whole": 5000, "multi": 3 * BS + 999}  # cached whole / as 4 blocks (damage block 1)


def _cached(fs, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and read it through ``fs``: its blocks cached, published."""
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)


def _read(fs, path, data, how):
    if how == "cat_file":
        return fs.cat_file(path), data
    if how == "range":  # a range inside the damaged block, touching the damaged page
        lo = (BS if len(data) > BS else 0) + 50
        return fs.cat_file(path, lo, lo + 200), data[lo:lo + 200]
    with fs.open(path) as f:
        return f.read(), data


@pytest.mark.parametrize("how", ["cat_file", "range", "open"])
def test_a_block_file_that_cannot_be_read_is_read_from_the_source_and_forgotten(make_cache_fs, runtime_dir,
                                                                                tmp_path, how, caplog):
    """Not a corrupt block: the file cannot be opened at all (ELOOP here: its directory in
    the tier was made a link to itself; EIO and EACCES take the same path, which a test run
    as root cannot make with a chmod). The read is served from the source, counted, logged
    once, and the daemon no longer lists the block. (A directory made a file holds no
    block: a miss, test_tier_absent_blocks.py.)"""
    fs = make_cache_fs(block_size=BS)
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])
    datas = {}
    for i in range(3):
        path = str(tmp_path / f"f{i}.bin")
        datas[path] = random.Random(i).randbytes(3 * BS + 99 if i == 0 else 5000)
        with open(path, "wb") as f:
            f.write(datas[path])
        assert fs.cat_file(path) == datas[path]
    published(fs)
    blocks = daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"]
    broken = set()
    for path, data in datas.items():  # the directory of the block each read touches made a loop
        meta = fs.meta.file(path)
        index = 1 if how == "range" and len(data) > BS else 0  # see _read
        sub = os.path.dirname(dram.block_path(block_key(meta.url, meta.version, index, BS)))
        if sub not in broken:
            os.rename(sub, sub + ".aside")
            os.symlink(os.path.basename(sub), sub)  # opening sub/<key>: ELOOP
            broken.add(sub)
    with caplog.at_level("WARNING", logger="cachemw"):
        for _ in range(2):
            for path, data in datas.items():
                got, want = _read(fs, path, data, how)
                assert got == want
    # once per block read from a broken sub-directory, however often read (another block
    # of f0 may hash into one of those too)
    unreadable = 0
    for path, data in datas.items():
        meta = fs.meta.file(path)
        single = 1 if len(data) > BS else 0
        for index in ([single] if how == "range" else range(block_count(len(data), BS))):
            key = block_key(meta.url, meta.version, index, BS)
            unreadable += os.path.dirname(dram.block_path(key)) in broken
    assert unreadable >= len(datas)
    assert fs.stats()["tier_read_errors"] == unreadable
    assert len([r for r in caplog.records if "cannot read cached blocks" in r.getMessage()]) == 1
    fs.client.flush()
    wait_for(lambda: daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"] <= blocks - len(datas), 5,
             what="the daemon to forget the unreadable blocks")
    # the daemon's check of its tiers makes the sub-directories again: cached again, and hit
    wait_for(lambda: all(os.path.isdir(sub) for sub in broken), 5, what="the tier's repair")
    for path, data in datas.items():
        assert _read(fs, path, data, how)[0] == _read(fs, path, data, how)[1]
    published(fs)
    before = fs.stats()["hits"]
    for path, data in datas.items():
        got, want = _read(fs, path, data, how)
        assert got == want
    assert fs.stats()["hits"] > before


@pytest.mark.parametrize("how", ["cat_file", "range", "open"])
def test_damaged_block_detected_dropped_refetched(make_cache_fs, runtime_dir, tmp_path, how):
    fs = make_cache_fs(block_size=BS)
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])
    rng = random.Random(how)
    expected_repairs = 0
    for kind, size in FILES.items():
        for name, damage in DAMAGES.items():
            path = str(tmp_path / f"{kind}-{name.replace(' ', '_')}.bin")
            data = rng.randbytes(size)
            with open(path, "wb") as f:
                f.write(data)
            assert fs.cat_file(path) == data  # cached
            published(fs)  # its block files written (behind the read) and published
            meta = fs.meta.file(path)
            index = 1 if size > BS else 0
            length = min(BS, size - index * BS)
            block = dram.block_path(block_key(meta.url, meta.version, index, BS))
            assert blockfile.read_block(block, length) == data[index * BS:index * BS + length]

            damage(block, length)
            before = dict(fs.stats())
            got, want = _read(fs, path, data, how)
            assert got == want, (kind, name)
            after = fs.stats()
            if how == "range" and name in ("flip whole-data checksum", "flip source tag"):
                # a range read verifies the pages it returns (and the trailer's sizes and
                # key), not the whole-data checksum nor the table/tag hash: right bytes, and the
                # damage is caught by the next whole-block read
                assert after["corrupt_repaired"] == before["corrupt_repaired"]
                assert fs.cat_file(path) == data
                after = fs.stats()
            assert after["corrupt_repaired"] - before["corrupt_repaired"] == 1, (kind, name)
            assert after["misses"] - before["misses"] == 1, (kind, name)
            assert after["bytes_from_source"] - before["bytes_from_source"] == length, (kind, name)
            expected_repairs += 1
            # the block was refilled, sound, and is served again from the tier
            published(fs)
            assert blockfile.read_block(block, length) == data[index * BS:index * BS + length]
            before = dict(fs.stats())
            assert fs.cat_file(path) == data
            assert fs.stats()["misses"] == before["misses"], (kind, name)

    fs.client.flush()
    stats = wait_for(lambda: (s := daemon_stats(runtime_dir))["counters"]["corrupt_repaired"]
                     == expected_repairs and s, 5, what="the repairs to be reported")
    nblocks = len(DAMAGES) * (1 + 4)
    assert stats["tiers"]["dram"]["blocks"] == nblocks
    assert stats["counters"]["fills"] == nblocks + expected_repairs
    assert stats["inflight"] == 0


def test_foreign_files_in_a_tier_are_ignored_on_restart(runtime_dir, spawn_daemon, tmp_path):
    """A daemon re-indexing its tier skips what is not a block, sweeps crashed fills and
    removes blocks of an older format (an upgrade), none of them counted as corrupt."""
    dram = os.path.join(runtime_dir, "dram")
    proc = spawn_daemon(runtime_dir)
    import fsspec

    fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    path = str(tmp_path / "f.bin")
    data = os.urandom(2 * BS)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)  # both blocks written and published before the daemon dies
    with open(os.path.join(dram, "ab", "notablock"), "wb") as f:
        f.write(b"x")
    stray_tmp = os.path.join(dram, "cd", "cd" + "0" * 30 + ".123.abcd.tmp")
    with open(stray_tmp, "wb") as f:
        f.write(b"partial fill")
    older = os.path.join(dram, "ef", "ef" + "1" * 30)  # a block an older version wrote
    blockfile.write_block(older, os.urandom(5000))
    with open(older, "r+b") as f:  # its trailer's format field
        f.seek(os.path.getsize(older) - blockfile.TRAILER_SIZE + 4)
        f.write((blockfile.FORMAT_VERSION - 1).to_bytes(4, "little"))
    proc.kill()
    proc.wait(10)
    spawn_daemon(runtime_dir)
    stats = daemon_stats(runtime_dir)
    assert stats["counters"]["reindexed"] == 2
    assert stats["tiers"]["dram"]["blocks"] == 2
    assert not os.path.exists(stray_tmp)
    assert not os.path.exists(older)  # removed at the start, not indexed, not "corrupt"
    assert stats["counters"]["corrupt_repaired"] == 0
    fresh = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                              runtime_dir=runtime_dir, skip_instance_cache=True)
    assert fresh.cat_file(path) == data
    assert fresh.stats()["misses"] == 0


def test_open_file_small_reads_verify_open_block_pages_and_count_hits(make_cache_fs, runtime_dir,
                                                                   tmp_path):
    """An open file serves small reads from the block file it holds open: each read
    verifies the pages it touches (a page damaged while open is caught and repaired, with
    the right bytes returned), and the reads are counted as hits by the time it closes."""
    fs = make_cache_fs(block_size=BS)
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])
    data = random.Random(3).randbytes(3 * BS)
    path = str(tmp_path / "mapped.bin")
    _cached(fs, path, data)
    meta = fs.meta.file(path)
    block = dram.block_path(block_key(meta.url, meta.version, 1, BS))
    before = dict(fs.stats())
    offsets = [BS + 4000, BS + 100, 2 * BS - 4096, BS + 8191]  # 1-2 pages each, in block 1
    with fs.open(path, "rb") as f:
        for o in offsets:
            f.seek(o)
            assert f.read(4096) == data[o:o + 4096]
        assert 1 in f._blocks and f._blocks[1] is not None  # served from the open block
        with open(block, "r+b") as raw:  # damage page 1 of the mapped block in place
            raw.seek(4096 + 7)
            byte = raw.read(1)
            raw.seek(4096 + 7)
            raw.write(bytes([byte[0] ^ 0x01]))
        f.seek(BS + 4000)
        assert f.read(4096) == data[BS + 4000:BS + 8096]
    after = fs.stats()
    assert after["corrupt_repaired"] - before["corrupt_repaired"] == 1
    assert after["misses"] - before["misses"] == 1  # refetched once
    assert after["hits"] - before["hits"] == len(offsets)
    assert after["hit_bytes"] - before["hit_bytes"] == 4096 * len(offsets)
    published(fs)
    assert blockfile.read_block(block, BS) == data[BS:2 * BS]  # the repaired block is sound


@pytest.mark.timeout(60)
def test_a_block_file_truncated_under_an_open_file_is_repaired_not_a_crash(
        make_cache_fs, runtime_dir, tmp_path):
    """An open file reading a block it already read from, truncated in its tier meanwhile:
    the read gets the right bytes and the block is repaired (a memory map of the file would
    end the process with SIGBUS, so the reads run in a child process here)."""
    fs = make_cache_fs(block_size=BS)
    data = random.Random(5).randbytes(3 * BS)
    path = str(tmp_path / "truncated.bin")
    _cached(fs, path, data)
    dram = daemon_stats(runtime_dir)["tiers"]["dram"]["path"]
    script = f"""
import os, sys, fsspec
from cachemw.keys import block_key
fs = fsspec.filesystem("cachemw", target_protocol="file", block_size={BS}, autostart=False,
                       runtime_dir={runtime_dir!r}, skip_instance_cache=True)
data = open({path!r}, "rb").read()
meta = fs.meta.file({path!r})
with fs.open({path!r}, "rb") as f:
    f.seek({BS} + 100)
    assert f.read(100) == data[{BS} + 100:{BS} + 200]
    key = block_key(meta.url, meta.version, 1, {BS})
    block = os.path.join({dram!r}, key[:2], key)
    os.truncate(block, 1000)
    for at in ({BS} + 8192, {BS} + 100, 2 * {BS} - 50):
        f.seek(at)
        assert f.read(50) == data[at:at + 50], at
print("corrupt_repaired", fs.stats()["corrupt_repaired"])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "corrupt_repaired 1" in proc.stdout


@pytest.mark.parametrize("damaged", [0, 1, 2, 3])
def test_open_block_read_verifies_every_page_it_touches(tmp_path, damaged):
    """OpenBlock.read's one- and two-page fast path and its general path (the partial
    last page, longer reads) each catch a flipped byte in any page they return."""
    length = 3 * blockfile.PAGE_SIZE + 1000  # three whole pages and a partial one
    data = random.Random(damaged).randbytes(length)
    path = str(tmp_path / "b.blk")
    blockfile.write_block(path, data)
    ps = blockfile.PAGE_SIZE
    reads = [(0, 100), (ps - 10, ps + 10), (ps, 3 * ps), (2 * ps + 5, length), (0, length)]
    block = blockfile.OpenBlock(path, length)
    for start, end in reads:
        assert block.read(start, end) == data[start:end]
    block.close()
    with open(path, "r+b") as f:
        f.seek(damaged * ps + 3)
        byte = f.read(1)
        f.seek(damaged * ps + 3)
        f.write(bytes([byte[0] ^ 0x40]))
    block = blockfile.OpenBlock(path, length)
    try:
        for start, end in reads:
            touches = range(start // ps, (end - 1) // ps + 1)
            if damaged in touches:
                with pytest.raises(blockfile.CorruptBlock):
                    block.read(start, end)
            else:
                assert block.read(start, end) == data[start:end]
    finally:
        block.close()


@pytest.mark.parametrize("offset, damaged_page", [
    (BS + 4096, 1),         # a one-page read
    (BS + 4000, 0),         # a two-page read, its first page damaged
    (BS + 4000, 1),         # ... its second page damaged
    (2 * BS - 4096, 15),    # the block's last page
])
def test_open_file_fast_path_catches_a_damaged_page(make_cache_fs, runtime_dir, tmp_path,
                                                     offset, damaged_page):
    """CachedFile.read's inlined 1-2 page path verifies every page it returns: a page
    damaged after the block was mapped gives the right bytes, repaired and counted."""
    fs = make_cache_fs(block_size=BS)
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])
    data = random.Random(offset + damaged_page).randbytes(2 * BS)
    path = str(tmp_path / "fast.bin")
    _cached(fs, path, data)
    meta = fs.meta.file(path)
    block = dram.block_path(block_key(meta.url, meta.version, 1, BS))
    before = dict(fs.stats())
    with fs.open(path, "rb") as f:
        f.seek(BS)
        assert f.read(10) == data[BS:BS + 10]  # block 1 is mapped now
        with open(block, "r+b") as raw:
            raw.seek(damaged_page * blockfile.PAGE_SIZE + 11)
            byte = raw.read(1)
            raw.seek(damaged_page * blockfile.PAGE_SIZE + 11)
            raw.write(bytes([byte[0] ^ 0x08]))
        f.seek(offset)
        assert f.read(4096) == data[offset:offset + 4096]
    assert fs.stats()["corrupt_repaired"] - before["corrupt_repaired"] == 1


@pytest.mark.parametrize("name", ["flip data byte", "flip page checksum", "flip trailer magic",
                                  "flip whole-data checksum", "truncate one byte",
                                  "garbage of the same size", "append garbage"])
def test_a_damaged_block_of_a_read_joined_from_mapped_blocks(make_cache_fs, runtime_dir,
                                                             tmp_path, name):
    """Reads of several whole blocks of 1 MiB and more are joined straight from the mapped
    block files (reader.VIEW_MIN): each is verified all the same, and a damaged one is
    dropped and refetched."""
    from cachemw.client.reader import VIEW_MIN

    bs = VIEW_MIN
    fs = make_cache_fs(block_size=bs)
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])
    path = str(tmp_path / "big.bin")
    data = random.Random(name).randbytes(2 * bs + bs // 3)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)
    before = dict(fs.stats())
    assert fs.cat_file(path) == data  # three hits, two of them joined from mappings
    assert fs.stats()["hits"] - before["hits"] == 3
    meta = fs.meta.file(path)
    DAMAGES[name](dram.block_path(block_key(meta.url, meta.version, 1, bs)), bs)
    before = dict(fs.stats())
    assert fs.cat_file(path) == data
    after = fs.stats()
    assert after["corrupt_repaired"] - before["corrupt_repaired"] == 1
    assert after["bytes_from_source"] - before["bytes_from_source"] == bs
    published(fs)
    assert fs.cat_file(path, bs - 10, 2 * bs + 10) == data[bs - 10:2 * bs + 10]


def test_a_sound_block_under_another_keys_name_is_refused(tmp_path):
    """Every way a block file is read checks that its trailer names the key the file is
    read as: another block's sound file (same length, right checksums) is corrupt there."""
    length = 3 * blockfile.PAGE_SIZE + 1000
    mine, other = "a" * 32, "b" * 32
    blockfile.write_block(str(tmp_path / other), random.Random(1).randbytes(length))
    os.rename(tmp_path / other, tmp_path / mine)
    path = str(tmp_path / mine)
    with pytest.raises(blockfile.CorruptBlock, match="another block"):
        blockfile.read_block(path, length)
    with pytest.raises(blockfile.CorruptBlock, match="another block"):
        blockfile.read_range(path, length, 10, 20)
    with pytest.raises(blockfile.CorruptBlock, match="another block"):
        blockfile.hold_block(path, length)
    with pytest.raises(blockfile.CorruptBlock, match="another block"):
        blockfile.OpenBlock(path, length)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(blockfile.CorruptBlock):
            blockfile.data_hash(fd, mine, length)
        assert blockfile.data_hash(fd, other, length) == blockfile.hash_of(
            random.Random(1).randbytes(length))
    finally:
        os.close(fd)
    # under its own name, and staged under its own key, it reads back
    os.rename(path, tmp_path / f"{other}.7.staged")
    assert blockfile.read_block(str(tmp_path / f"{other}.7.staged"), length) == \
        random.Random(1).randbytes(length)


def test_an_error_of_the_reading_process_is_raised_not_blamed_on_the_block(make_cache_fs, runtime_dir,
                                                                           tmp_path, monkeypatch):
    """EMFILE (this process's descriptors used up, as a DataLoader leaking them does) is no
    fault of the cached block: raised, as a plain read would, and the node's copy is kept."""
    import errno

    fs = make_cache_fs(block_size=BS)
    path = str(tmp_path / "f.bin")
    data = random.Random(5).randbytes(5000)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)
    blocks = daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"]

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    for tier in fs.client.tiers():
        monkeypatch.setattr(tier, "get", no_descriptors)
    with pytest.raises(OSError) as info:
        fs.cat_file(path)
    assert info.value.errno == errno.EMFILE
    assert fs.stats()["tier_read_errors"] == 0
    monkeypatch.undo()
    fs.client.flush()
    assert daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"] == blocks
    assert fs.cat_file(path) == data


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_block_file_is_damage_not_a_hang(runtime_dir, spawn_daemon, tmp_path):
    """A block file's open waited for a writer when the file was a FIFO put in the tier by
    hand: readers hung for good, and so did the daemon re-indexing its tier at its start
    and clearing it at its stop (review loaders5). Opened without blocking, it is a
    damaged block: read from the source, and the FIFO removed."""
    import signal

    import fsspec

    proc = spawn_daemon(runtime_dir)
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])

    def new_fs():
        return fsspec.filesystem("cachemw", target_protocol="file", block_size=BS,
                                 autostart=False, runtime_dir=runtime_dir,
                                 skip_instance_cache=True)

    fs = new_fs()
    path = str(tmp_path / "f.bin")
    data = os.urandom(2 * BS + 100)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path) == data
    published(fs)
    meta = fs.meta.file(path)
    blocks = [dram.block_path(block_key(meta.url, meta.version, i, BS)) for i in range(3)]

    def fifos():
        for block in blocks:
            if os.path.exists(block):
                os.unlink(block)
            os.mkfifo(block)

    fifos()
    assert new_fs().cat_file(path) == data
    fifos()
    assert new_fs().cat_file(path, BS - 10, BS + 10) == data[BS - 10:BS + 10]
    fifos()
    with new_fs().open(path) as f:
        assert f.read() == data
    fifos()  # with a writer holding them open: reads find no data (EAGAIN), not an error
    writers = [os.open(block, os.O_RDWR) for block in blocks]
    try:
        for read in (lambda b: blockfile.read_block(b, BS),
                     lambda b: blockfile.read_range(b, BS, 10, 20)):
            with pytest.raises(blockfile.CorruptBlock):  # not EAGAIN's BlockingIOError
                read(blocks[0])
        assert new_fs().cat_file(path) == data
        fifos()
        writers += [os.open(block, os.O_RDWR) for block in blocks]
        assert new_fs().cat_file(path, BS - 10, BS + 10) == data[BS - 10:BS + 10]
    finally:
        for fd in writers:
            os.close(fd)
    fifos()
    proc.kill()  # a new daemon indexes the tier: the FIFOs are no blocks
    proc.wait(10)
    proc = spawn_daemon(runtime_dir)
    assert daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"] == 0
    assert new_fs().cat_file(path) == data
    fifos()
    proc.send_signal(signal.SIGTERM)  # its stop clears the tier
    assert proc.wait(20) is not None


class _DamagingLocal(LocalFileSystem):
    """A local source that runs ``damage()`` once, at its first read of a file's bytes: what
    a tier file damaged in place while a read waits on the store for its misses meets."""

    damage = None

    def _open(self, path, mode="rb", **kwargs):
        fs = self

        class Opener(LocalFileOpener):
            def read(self, *args, **kw):
                fs._damage_once()
                return super().read(*args, **kw)

            def readinto(self, *args, **kw):
                fs._damage_once()
                return super().readinto(*args, **kw)

        return Opener(self._strip_protocol(path), mode, fs=self, **kwargs)

    def _damage_once(self):
        damage, self.damage = self.damage, None
        if damage is not None:
            damage()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["flip data byte", "truncate inside data",
                                  "garbage of the same size"])
def test_a_block_damaged_while_a_joined_read_fetches_its_misses_is_never_returned(
        make_cache_fs, runtime_dir, tmp_path, kind, caplog):
    """A read of several large blocks holds those cached (whole blocks of 1 MiB and more,
    joined from their files) while it fetches the others. They were checked on their
    mappings before the fetch and copied after it: a block file damaged in place meanwhile
    came back as it was, a flipped byte as wrong bytes, a truncation as SIGBUS (review
    faults7, 3 of 3 with a 2 s store). The bytes are checked where they land."""
    bs = 1 << 20
    source = _DamagingLocal(skip_instance_cache=True)
    fs = make_cache_fs(fs=source, block_size=bs, write_behind=0, validate="immutable")
    dram = DirectoryTier("dram", daemon_stats(runtime_dir)["tiers"]["dram"]["path"])
    path = str(tmp_path / "f.bin")
    data = random.Random(7).randbytes(4 * bs)
    with open(path, "wb") as f:
        f.write(data)
    assert fs.cat_file(path, 0, 2 * bs) == data[:2 * bs]  # blocks 0 and 1 cached
    published(fs)
    meta = fs.meta.file(path)
    held = [dram.block_path(block_key(meta.url, meta.version, i, bs)) for i in (0, 1)]
    assert all(os.path.exists(p) for p in held)
    source.damage = lambda: [DAMAGES[kind](p, bs) for p in held]
    with caplog.at_level("WARNING", logger="cachemw"):
        assert fs.cat_file(path) == data  # blocks 2 and 3 from the source, damaging 0 and 1
    assert source.damage is None  # the damage did come while the read was under way
    assert "corrupt cached block" in caplog.text
    assert fs.cat_file(path) == data
