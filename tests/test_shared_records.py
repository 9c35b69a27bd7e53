"""What one process knows of files across its filesystems (client/shared_records.py):
records queued for a node's tables belong to that node (its runtime directory), drops are
the process's."""
from __future__ import annotations

import time

from fsspec.implementations.local import LocalFileSystem

from cachemw.client.metadata import MetadataCache


def _file(tmp_path, data=b"abc"):
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _deferring(meta_dir, deferred):
    return MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir,
                         defer=lambda fn, arg: deferred.append((fn, arg)))


def test_a_record_queued_for_one_node_is_not_another_nodes(tmp_path):
    """Two filesystems of one process on two runtime directories (two nodes' caches):
    what one has queued for its node's table is found by the filesystems of that node
    only, and written to that node's table, not taken for the other's."""
    path = _file(tmp_path)
    a_dir, b_dir = str(tmp_path / "a-meta"), str(tmp_path / "b-meta")
    a_queue, b_queue = [], []
    a, b = _deferring(a_dir, a_queue), _deferring(b_dir, b_queue)
    a.info(path)
    assert a_queue  # queued, not written
    a_too = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: a_dir)
    assert a_too._load_shared("info", path)[0]["size"] == 3  # same node: found
    assert b._load_shared("info", path) is None  # other node: not its record
    for fn, arg in a_queue:
        fn(arg)
    b_fresh = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: b_dir)
    assert b_fresh._load_shared("info", path) is None
    a_fresh = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: a_dir)
    assert a_fresh._load_shared("info", path)[0]["size"] == 3


def test_a_drop_through_one_node_keeps_the_others_queued_record_unwritten(tmp_path):
    """Metadata fetched before the process dropped a file (here through a filesystem of
    another runtime directory, which wrote it) is written to no node's table."""
    path = _file(tmp_path)
    a_dir, b_dir = str(tmp_path / "a-meta"), str(tmp_path / "b-meta")
    a_queue = []
    a, b = _deferring(a_dir, a_queue), _deferring(b_dir, [])
    a.info(path)  # fetched now, queued for node A
    time.sleep(0.01)
    with open(path, "wb") as f:
        f.write(b"abcdef")
    b.forget(path)  # the file written through node B's filesystem
    for fn, arg in a_queue:
        fn(arg)
    a_fresh = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: a_dir)
    assert a_fresh._load_shared("info", path) is None
    assert a_fresh.info(path)["size"] == 6


def test_a_write_through_the_cache_stays_known_after_the_file_is_read_again(tmp_path):
    """``dropped_since`` tells a process whether a block it fetched before some time is
    still its file's: a write through the cache since says no. A read of the file after the
    write (its info shared again) replaced the drop's entry in the node's table, and the
    write was forgotten: the old bytes of a fill still pending were served, then cached."""
    from cachemw.client.metatable import MetaTable, written_at

    table = MetaTable(str(tmp_path / "meta" / "info"))
    table.store("file:///f", {"size": 3}, 10.0, (3, "v1", "file"))
    assert table.drop("file:///f", 20.0, written=True)
    assert table.store("file:///f", {"size": 3}, 30.0, (3, "v1", "file"))  # read again since
    found = table.get("file:///f")
    assert not found[1] and found[2][:3] == (3, "v1", "file") and written_at(found) == 20.0
    assert table.store("file:///f", {"size": 3}, 40.0, (3, "v1", "file"))  # and again
    assert written_at(table.get("file:///f")) == 20.0
    assert table.drop("file:///f", 50.0, written=False)  # a version gone: no write
    assert written_at(table.get("file:///f")) == 20.0

    path = _file(tmp_path)
    meta_dir = str(tmp_path / "meta2")
    writer = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)
    reader = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)
    before = time.time()
    time.sleep(0.01)
    writer.forget(path)  # written through the cache
    time.sleep(0.01)
    MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir).info(path)  # read since
    assert reader.dropped_since(path, before)
    assert not reader.dropped_since(path, time.time())
    assert reader.info(path)["size"] == 3  # the record stored since is used as ever
