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
