"""Fills are staged and published by the daemon (tiers/directory.py, node._land): a block
fetched before a write through the cache never appears under its key after the write,
however late its filler writes it; the daemon's index and the tier files agree whatever
order the note, a waiter and a disconnect come in; a cancelled fill leaves nothing behind
(file, placement entry, counter). Found by review of the write-behind fills."""
from __future__ import annotations

import os
import threading
import time

import pytest
from fsspec.implementations.local import LocalFileSystem

from cachemw.client import DaemonClient
from cachemw.config import DaemonConfig, TierConfig
from cachemw.keys import block_key
from cachemw.metadata import MetadataCache
from cachemw.node import NodeCache
from cachemw.tiers.directory import DirectoryTier
from conftest import daemon_stats, wait_for

BS = 65536


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _node(tmp_path):
    return NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),),
                                  runtime_dir=str(tmp_path / "rt")))


@pytest.mark.timeout(90)
def test_a_fill_cancelled_by_a_write_never_appears_under_its_key(make_cache_fs, tmp_path, gate):
    """A's fill of the old bytes is written after B's write through the cache returned,
    while A's note waits behind A's next lease (held up by another client's fill). A third
    process D must read the new bytes: the stale block stays staged, then is dropped."""
    a, b = make_cache_fs(block_size=BS), make_cache_fs(block_size=BS)
    rt = a.options.runtime_dir
    f, g = str(tmp_path / "f.bin"), str(tmp_path / "g.bin")
    old, new = os.urandom(BS), os.urandom(BS)
    _write(f, old)
    _write(g, os.urandom(BS))
    st = os.stat(f)
    gm = a.meta.file(g)
    c = DaemonClient(rt, autostart=False, timeout=60)  # C holds the lease of g's block
    assert c.lease_many([(block_key(gm.url, gm.version, 0, BS), BS, gm.url, None)])[0][0] == "fill"
    assert a.cat_file(f) == old  # A's fill of f is queued, its writer held
    fm = a.meta.file(f)
    tier = a.client.tiers()[0]
    key = block_key(fm.url, fm.version, 0, BS)
    b.pipe_file(f, new)  # invalidates f: A's lease is cancelled
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same version token (coarse mtime)
    result = {}

    def meanwhile():
        try:
            wait_for(lambda: daemon_stats(rt, drain=False)["counters"]["waits"] >= 1, 20,
                     what="A to wait on C's lease")
            gate.set()  # A's writer stages the old bytes now; its note waits behind A
            wait_for(lambda: os.path.exists(tier.staged_path(key)), 10, what="the fill")
            time.sleep(0.3)
            result["published"] = os.path.exists(tier.block_path(key))
            result["d"] = make_cache_fs(block_size=BS).cat_file(f)
        except BaseException as exc:
            result["exc"] = exc
        finally:
            c.close()  # C goes away: A's lease of g goes on, then A's note is read

    t = threading.Thread(target=meanwhile)
    t.start()
    a.cat_file(g)
    t.join(60)
    assert "exc" not in result, result.get("exc")
    assert result["published"] is False
    assert result["d"] == new
    wait_for(lambda: not os.path.exists(tier.staged_path(key)), 10,
             what="the cancelled fill to be dropped once its note is read")
    assert not os.path.exists(tier.block_path(key))


class _AnswersFromBefore(LocalFileSystem):
    """A source whose answer to ``info`` was taken before ``during()`` ran (a round trip
    to NFS or S3 in which another process wrote the file)."""

    cachable = False
    during = None

    def info(self, path, **kw):
        answer = super().info(path, **kw)
        if self.during is not None:
            fn, self.during = self.during, None
            fn()
        return answer


def test_a_drop_during_the_metadata_fetch_wins_over_the_deferred_record(tmp_path):
    path = str(tmp_path / "f.bin")
    _write(path, b"abc")
    meta_dir = str(tmp_path / "meta")
    deferred = []
    src = _AnswersFromBefore()
    a = MetadataCache(src, "ttl", 60.0, lambda: meta_dir,
                      defer=lambda fn, arg: deferred.append((fn, arg)))
    b = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)

    def b_writes():
        _write(path, b"abcdef")
        b.forget(path)

    src.during = b_writes
    assert a.info(path)["size"] == 3  # A's fetch straddled the write
    for fn, arg in deferred:
        fn(arg)
    fresh = MetadataCache(LocalFileSystem(), "ttl", 60.0, lambda: meta_dir)
    assert fresh._load_shared("info", path) is None
    assert fresh.info(path)["size"] == 6


def test_a_write_during_another_process_metadata_fetch_is_seen_by_a_third(make_cache_fs,
                                                                          tmp_path):
    path = str(tmp_path / "f.bin")
    _write(path, b"abc")
    src = _AnswersFromBefore()
    a = make_cache_fs(fs=src, validate="ttl", ttl=3600)
    b = make_cache_fs(validate="ttl", ttl=3600)
    src.during = lambda: b.pipe_file(path, b"abcdef")
    assert a.info(path)["size"] == 3
    assert a.reader.fills.drain(30)  # A's deferred record had its chance
    assert make_cache_fs(validate="ttl", ttl=3600).cat_file(path) == b"abcdef"


def test_release_of_a_cancelled_lease_keeps_nothing_and_counts_nothing(tmp_path):
    node = _node(tmp_path)
    tier = node._tiers["dram"].tier
    conn, key = object(), "ab" + "0" * 30
    assert node.lease(key, BS, "file:///x", conn) == ("fill", "dram")
    tier.stage(key, os.urandom(BS))
    node.invalidate("file:///x")
    node.release(conn)
    s = node.stats()
    assert s["tiers"]["dram"]["blocks"] == 0 and s["counters"]["adopted"] == 0
    assert not os.path.exists(tier.block_path(key))
    assert not os.path.exists(tier.staged_path(key))


@pytest.mark.parametrize("end", ["filled", "release"])
def test_a_key_whose_fill_was_cancelled_can_be_cached_again(tmp_path, end):
    node = _node(tmp_path)
    tier = node._tiers["dram"].tier
    url, key, conn = "file:///x", "cd" + "0" * 30, object()
    assert node.lease(key, BS, url, conn) == ("fill", "dram")
    stored = tier.stage(key, os.urandom(BS))
    node.invalidate(url)
    if end == "filled":
        assert node.filled(key, "dram", stored, conn) is False
    else:
        node.release(conn)
    assert node.lease(key, BS, url, object()) == ("fill", "dram")


@pytest.mark.timeout(60)
def test_a_fill_adopted_on_disconnect_is_kept_by_the_client_too(make_cache_fs, tmp_path,
                                                                monkeypatch):
    """The connection drops after the fill was staged, before its note: the daemon adopts
    the staged block, the writer's note fails, and what it cleans up is its staged file
    only, never the published block: the index and the tier directory agree."""
    staged, go = threading.Event(), threading.Event()
    real_stage = DirectoryTier.stage

    def stage(self, key, data, tag=b""):
        n = real_stage(self, key, data, tag=tag)
        staged.set()
        go.wait(30)
        return n

    monkeypatch.setattr(DirectoryTier, "stage", stage)
    fs = make_cache_fs(block_size=BS)
    rt = fs.options.runtime_dir
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    _write(path, data)
    assert fs.cat_file(path) == data
    assert staged.wait(10)
    fs.client._unreachable("test: connection dropped")
    wait_for(lambda: daemon_stats(rt, drain=False)["inflight"] == 0, 10,
             what="the daemon to release the connection")
    go.set()
    assert fs.reader.fills.drain(30)
    meta = fs.meta.file(path)
    block = fs.client.tiers()[0].block_path(block_key(meta.url, meta.version, 0, BS))
    s = daemon_stats(rt)
    assert s["counters"]["adopted"] == 1 and s["tiers"]["dram"]["blocks"] == 1
    assert os.path.exists(block)
