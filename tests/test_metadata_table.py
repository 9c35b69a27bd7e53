"""The node's shared metadata table (cachemw/client/metatable.py): what one process learned
of a file is what a new process reads, it grows without losing entries, a drop is seen at
once by every process (also one that mapped the table before), a store of metadata fetched
before a drop never brings it back, damage reads as absent; through the filesystem, a file
written through the cache or changed at the source is never read at its old version by a
new process once the bound allows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import fsspec
import pytest

from cachemw.client import metatable
from cachemw.client.metatable import SHARDS, MetaTable, path_hash


def got(table, key):
    """(value, fetched, dropped) of ``key`` in ``table``, or None."""
    import pickle

    found = table.get(key)
    return None if found is None else (
        None if found[1] else pickle.loads(found[3]), found[0], found[1])

from conftest import wait_for


def test_entries_are_shared_and_survive_growth(tmp_path):
    d = str(tmp_path / "info")
    writer, reader = MetaTable(d), MetaTable(d)
    assert got(reader, "/a") is None
    assert writer.store("/a", {"size": 1}, 10.0)
    assert got(reader, "/a") == ({"size": 1}, 10.0, False)
    reader_maps = list(reader._maps)
    paths = [f"/data/{i:05d}.bin" for i in range(3000)]  # far past a shard's first capacity
    for i, p in enumerate(paths):
        assert writer.store(p, {"size": i, "name": p}, 20.0 + i)
    assert writer.store("/a", {"size": 2}, 11.0)  # rewritten
    for i, p in enumerate(paths):  # the old mappings were superseded, the reader follows
        assert got(reader, p) == ({"size": i, "name": p}, 20.0 + i, False)
    assert got(reader, "/a") == ({"size": 2}, 11.0, False)
    assert reader._maps != reader_maps
    assert got(MetaTable(d), "/data/missing") is None


def test_a_drop_wins_over_older_metadata_and_is_seen_at_once(tmp_path):
    d = str(tmp_path / "info")
    a, b = MetaTable(d), MetaTable(d)
    assert a.store("/f", {"size": 3}, 100.0)
    assert got(b, "/f")[0] == {"size": 3}  # b has the shard mapped
    assert a.drop("/f", 101.0)
    assert got(b, "/f") == (None, 101.0, True)
    assert not a.store("/f", {"size": 3}, 100.5)  # fetched before the drop: refused
    assert got(b, "/f")[2]
    assert a.drop("/f", 99.0)  # an older drop keeps the later one
    assert got(b, "/f") == (None, 101.0, True)
    assert a.store("/f", {"size": 4}, 102.0)  # fetched after it: shared again
    assert got(b, "/f") == ({"size": 4}, 102.0, False)


def test_drops_are_counted_node_wide_and_stores_are_not(tmp_path):
    d = str(tmp_path / "info")
    a, b = MetaTable(d), MetaTable(d)
    assert b.drops() == 0  # before any write: the count is made, at 0
    assert a.store("/f", {"size": 3}, 100.0)
    assert b.drops() == 0
    assert a.drop("/f", 101.0) and a.drop("/g", 101.0)
    assert b.drops() == 2 and a.drops() == 2  # b reads it from the mapping it holds
    assert a.drop("/f", 99.0)  # an older one (the later kept): counted too, which costs a lookup
    assert b.forked().drops() == 3


def test_damaged_shards_read_as_absent_and_are_rebuilt(tmp_path):
    d = str(tmp_path / "info")
    table = MetaTable(d)
    paths = [f"/p{i}" for i in range(200)]
    for p in paths:
        assert table.store(p, {"size": 7}, 1.0)
    shard = path_hash(paths[0]) >> 58
    with open(os.path.join(d, f"t{shard:02d}.{metatable.FORMAT}"), "r+b") as f:  # scribble over the data
        size = os.fstat(f.fileno()).st_size
        f.seek(size // 2)
        f.write(os.urandom(size - size // 2))
    fresh = MetaTable(d)
    found = [got(fresh, p) for p in paths]
    assert all(g is None or g == ({"size": 7}, 1.0, False) for g in found)
    with open(os.path.join(d, f"t{shard:02d}.{metatable.FORMAT}"), "wb") as f:  # not a table at all
        f.write(b"junk")
    assert got(MetaTable(d), paths[0]) is None
    assert table.store(paths[0], {"size": 8}, 2.0)  # the writer starts the shard over
    assert got(MetaTable(d), paths[0]) == ({"size": 8}, 2.0, False)


@pytest.mark.timeout(120)
def test_concurrent_writers_in_processes_lose_nothing(tmp_path):
    d = str(tmp_path / "info")
    code = (
        "import sys\nfrom cachemw.client.metatable import MetaTable\n"
        "t = MetaTable(sys.argv[1]); w = int(sys.argv[2])\n"
        "for i in range(600):\n"
        "    assert t.store(f'/w{w}/{i}', {'size': i}, float(w))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, d, str(w)]) for w in range(4)]
    assert [p.wait(100) for p in procs] == [0] * 4
    table = MetaTable(d)
    for w in range(4):
        for i in range(600):
            assert got(table, f"/w{w}/{i}") == ({"size": i}, float(w), False)
    assert len([n for n in os.listdir(d) if n.startswith("t")]) <= SHARDS
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


def _read_in_new_process(runtime_dir, path, **options):
    code = (
        "import fsspec, json, sys\n"
        f"fs = fsspec.filesystem('cachemw', target_protocol='file', runtime_dir={runtime_dir!r},"
        f" **{options!r})\n"
        f"data = fs.cat_file({path!r})\n"
        "print(json.dumps([data.decode(), fs.meta.source_calls]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(120)
def test_a_new_process_never_reads_the_version_before_a_write_through_the_cache(
        make_cache_fs, runtime_dir, tmp_path):
    path = str(tmp_path / "f.txt")
    with open(path, "w") as f:
        f.write("one")
    fs = make_cache_fs(validate="immutable")
    assert fs.cat_file(path) == b"one"
    fs.reader.fills.drain()  # its metadata shared
    assert _read_in_new_process(runtime_dir, path, validate="immutable") == ["one", 0]
    writer = make_cache_fs(validate="immutable")  # another filesystem of the node writes
    writer.pipe_file(path, b"two!")
    # immutable: no metadata call once a file is known, yet the write through the cache
    # dropped what the node knew, so a new process asks the source again
    assert _read_in_new_process(runtime_dir, path, validate="immutable") == ["two!", 1]
    fs.reader.fills.drain()
    assert _read_in_new_process(runtime_dir, path, validate="immutable") == ["two!", 0]


@pytest.mark.timeout(120)
def test_a_new_process_reads_a_changed_source_once_the_ttl_has_passed(
        make_cache_fs, runtime_dir, tmp_path):
    path = str(tmp_path / "f.txt")
    with open(path, "w") as f:
        f.write("one")
    fs = make_cache_fs(validate="ttl", ttl=1)
    assert fs.cat_file(path) == b"one"
    fs.reader.fills.drain()
    with open(path, "w") as f:  # changed at the source, behind the cache's back
        f.write("two")
    time.sleep(1.1)
    assert _read_in_new_process(runtime_dir, path, validate="ttl", ttl=1) == ["two", 1]
    wait_for(lambda: _read_in_new_process(runtime_dir, path, validate="ttl",
                                          ttl=60)[1] == 0, 10, what="the new info to be shared")
    assert _read_in_new_process(runtime_dir, path, validate="ttl", ttl=60) == ["two", 0]


def test_a_files_metadata_round_trips_through_the_packed_form_a_process_keeps():
    """What a process keeps per file (client/metadata.py: a string, no object for the garbage
    collector) gives back the FileMeta it was made from, whatever the URL and version hold."""
    from cachemw.client.metadata import FileMeta, _pack, _unpack

    undecodable = os.fsdecode(b"/d/latin1-\xff")
    for meta in (FileMeta("/d/f", "file:///d/f", 4096, "mtime=1.5:size=4096", 1764132000.123456),
                 FileMeta(undecodable, "file://" + undecodable, 0, "", 0.0),
                 FileMeta("/d/\u65e5", "s3://b/\u65e5\0x", 2 ** 62, "v\0\u00e9\U0001f600",
                          1.5e9 + 1 / 3),
                 FileMeta("p", "", 1, "etag=\"abc\"", time.time())):
        packed = _pack(meta)
        assert type(packed) is str
        back = _unpack(meta.path, packed)
        assert back == meta and type(back) is FileMeta
        assert (back.url, back.version, back.size, back.fetched) == (
            meta.url, meta.version, meta.size, meta.fetched)


def test_a_shard_of_an_earlier_format_is_left_to_its_processes(tmp_path):
    """Processes of an earlier release on the node keep their own shard files: a write by
    this release emptied a shard of the other format (entries and drops gone) and left its
    readers on the replaced file."""
    d = str(tmp_path / "info")
    table = MetaTable(d)
    table.store("/a", {"size": 1}, 10.0, (1, "v", "file"))
    shard = path_hash("/a") >> 58
    old = os.path.join(d, f"t{shard:02d}")  # an earlier release's file of that shard
    with open(old, "wb") as f:
        f.write(b"an earlier format's shard")
    table.store("/b", {"size": 2}, 11.0, (2, "v", "file"))
    table.drop("/a", 12.0)
    with open(old, "rb") as f:
        assert f.read() == b"an earlier format's shard"
    assert MetaTable(d).get("/a")[1]  # the drop, in this release's file


@pytest.mark.timeout(60)
def test_a_child_forked_while_the_table_is_written_does_not_keep_its_lock(tmp_path):
    """A flock belongs to the open file, which a forked child shares: a trainer forking its
    DataLoader workers while its fill writer wrote to the table left them holding the
    lock for their whole life. Every store of the node waited its time in vain, and a
    worker's exit, draining its stores, took 30 s (review faults7)."""
    import fcntl
    import threading

    lock = str(tmp_path / "lock")
    holding, release = threading.Event(), threading.Event()

    def writer():
        with metatable._FileLock(lock, 1.0):
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=writer)
    thread.start()
    assert holding.wait(10)
    started, tell = os.pipe()
    child = os.fork()
    if child == 0:  # a DataLoader worker: lives on, never writes
        os.write(tell, b"x")  # (its fork handlers have run)
        time.sleep(20)
        os._exit(0)
    os.close(tell)
    try:
        assert os.read(started, 1) == b"x"  # (a loaded machine may not have run it yet)
        os.close(started)
        release.set()
        thread.join(10)
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free, the child still alive
        finally:
            os.close(fd)
        assert os.waitpid(child, os.WNOHANG) == (0, 0)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
