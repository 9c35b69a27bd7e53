"""Fills are staged and published by the daemon (tiers/directory.py, NodeCache.land): a block
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

from cachemw.client.link import DaemonClient
from cachemw.config import DaemonConfig, TierConfig
from cachemw.keys import block_key
from cachemw.client.metadata import MetadataCache
from cachemw.node.cache import NodeCache
from cachemw.tiers.directory import DirectoryTier
from conftest import daemon_stats, staged_files, wait_for

BS = 65536


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _node(tmp_path):
    return NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),),
                                  runtime_dir=str(tmp_path / "rt")))


@pytest.mark.timeout(90)
def test_a_fill_cancelled_by_a_write_never_appears_under_its_key(make_cache_fs, tmp_path, gate):
    """A's fill of the old bytes (its lease taken by A's fill writer, after the fetch: claims.py)
    is written after B's write through the cache returned, the file's version token unchanged
    (a coarse mtime). The stale block is staged and dropped, never published; a third process
    D reads the new bytes, also while another client (C) holds a lease A waits on."""
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
    assert a.cat_file(f) == old  # A's fill of f is queued, its writer held at the write
    wait_for(lambda: daemon_stats(rt, drain=False)["inflight"] == 2, 10,
             what="A's writer to lease f's block")
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
            gate.set()  # A's writer stages the old bytes now
            assert a.reader.fills.drain(30)
            result["published"] = os.path.exists(tier.block_path(key))
            result["d"] = make_cache_fs(block_size=BS).cat_file(f)
        except BaseException as exc:
            result["exc"] = exc
        finally:
            c.close()  # C goes away: A's lease of g goes on

    t = threading.Thread(target=meanwhile)
    t.start()
    a.cat_file(g)
    t.join(60)
    assert "exc" not in result, result.get("exc")
    assert result["published"] is False
    assert result["d"] == new
    wait_for(lambda: not staged_files(tier, key), 10, what="the cancelled fill to be dropped")
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
    kind, _, lease = node.lease(key, BS, "file:///x", conn)
    assert kind == "fill"
    tier.stage(key, os.urandom(BS), lease)
    node.invalidate("file:///x")
    node.release(conn)
    s = node.stats()
    assert s["tiers"]["dram"]["blocks"] == 0 and s["counters"]["adopted"] == 0
    assert not os.path.exists(tier.block_path(key))
    assert not staged_files(tier, key)


@pytest.mark.parametrize("end", ["filled", "release"])
def test_a_key_whose_fill_was_cancelled_can_be_cached_again(tmp_path, end):
    node = _node(tmp_path)
    tier = node._tiers["dram"].tier
    url, key, conn = "file:///x", "cd" + "0" * 30, object()
    kind, _, lease = node.lease(key, BS, url, conn)
    assert kind == "fill"
    stored = tier.stage(key, os.urandom(BS), lease)
    node.invalidate(url)
    if end == "filled":
        assert node.filled(key, "dram", stored, conn, lease) is False
    else:
        node.release(conn)
    assert node.lease(key, BS, url, object())[:2] == ("fill", "dram")
    assert not staged_files(tier, key)


@pytest.mark.timeout(60)
def test_a_fill_adopted_on_disconnect_is_kept_by_the_client_too(make_cache_fs, tmp_path,
                                                                monkeypatch):
    """The connection drops after the fill was staged, before its note: the daemon adopts
    the staged block, the writer's note fails, and what it cleans up is its staged file
    only, never the published block: the index and the tier directory agree."""
    staged, go = threading.Event(), threading.Event()
    real_stage = DirectoryTier.stage

    def stage(self, key, data, lease, tag=b""):
        n = real_stage(self, key, data, lease, tag=tag)
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
    for conn in list(fs.client._conns):  # the process's connections drop (the fill writer's
        conn.close()                       # holds the lease: it asked for it after the fetch)
    wait_for(lambda: daemon_stats(rt, drain=False)["inflight"] == 0, 10,
             what="the daemon to release the connection")
    go.set()
    assert fs.reader.fills.drain(30)
    meta = fs.meta.file(path)
    block = fs.client.tiers()[0].block_path(block_key(meta.url, meta.version, 0, BS))
    s = daemon_stats(rt)
    assert s["counters"]["adopted"] == 1 and s["tiers"]["dram"]["blocks"] == 1
    assert os.path.exists(block)


URL = "file:///data/f.bin"
KEY = "ef" + "0" * 30


@pytest.mark.timeout(30)
def test_a_reader_publishing_a_prefetch_gives_its_room_back_once(tmp_path, monkeypatch):
    """A reader waiting on a prefetch publishes its staged block; the prefetch then ends
    without releasing the reserved room a second time."""
    import types

    from cachemw.node import prefetch

    node = _node(tmp_path)
    ts = node._tiers["dram"]
    node.announce([(KEY, BS, URL, ("{}", "/data/f.bin", 0, BS, BS, "v"))])
    real_stage = DirectoryTier.stage
    answers = []

    def stage(self, key, data, lease, tag=b""):  # a reader asks right after the staging
        stored = real_stage(self, key, data, lease, tag=tag)
        t = threading.Thread(target=lambda: answers.append(node.lease(KEY, BS, URL, object())))
        t.start()
        t.join(10)
        return stored

    monkeypatch.setattr(DirectoryTier, "stage", stage)
    src = types.SimpleNamespace(read_block=lambda *a: os.urandom(BS))
    monkeypatch.setattr(prefetch, "source_for", lambda _target: src)
    prefetch.run_prefetch(node, 1 << 20)
    assert answers == [("present", "dram")]
    assert KEY in node._index and ts.reserved == 0
    assert node.counters["prefetched"] == 1


@pytest.mark.timeout(30)
def test_a_cancelled_lease_staged_file_is_never_taken_for_the_next_lease(tmp_path, monkeypatch):
    """C1's fill was cancelled by a write; while its staged file is being deleted, C2 gets
    the next lease and C3 waits on it: C3 must not get C1's stale bytes as C2's fill."""
    node = _node(tmp_path)
    tier = node._tiers["dram"].tier
    c1, c2, c3 = object(), object(), object()
    old = os.urandom(BS)
    kind, _, lease1 = node.lease(KEY, BS, URL, c1)
    stored = tier.stage(KEY, old, lease1)
    node.invalidate(URL)
    in_unstage, go_on = threading.Event(), threading.Event()
    real_unstage = DirectoryTier.unstage

    def unstage(self, key, lease):  # hold the deletion of C1's staged file
        if threading.current_thread().name == "note":
            in_unstage.set()
            go_on.wait(10)
        return real_unstage(self, key, lease)

    monkeypatch.setattr(DirectoryTier, "unstage", unstage)
    note = threading.Thread(target=node.filled, args=(KEY, "dram", stored, c1, lease1),
                            name="note")
    note.start()
    try:
        assert in_unstage.wait(10)
        assert node.lease(KEY, BS, URL, c2)[0] == "fill"
        assert node.lease(KEY, BS, URL, c3, wait=0.3) == ("nofill", "busy")
        assert node.read_local(KEY, BS) is None
    finally:
        go_on.set()
        note.join(10)
    assert not os.path.exists(tier.staged_path(KEY, lease1))


def test_a_late_fill_of_an_ended_lease_is_never_published_nor_left_behind(tmp_path):
    """C1's lease ended with its connection before its writer staged; C2 holds the next
    lease. C1's late file is not taken for C2's, C2's fill is published, and C1's note
    (if it gets through) deletes C1's file."""
    node = _node(tmp_path)
    tier = node._tiers["dram"].tier
    c1, c2, c3 = object(), object(), object()
    old, mine = os.urandom(BS), os.urandom(BS)
    lease1 = node.lease(KEY, BS, URL, c1)[2]
    node.release(c1)
    lease2 = node.lease(KEY, BS, URL, c2)[2]
    late = tier.stage(KEY, old, lease1)
    assert node.lease(KEY, BS, URL, c3, wait=0.3) == ("nofill", "busy")
    assert node.filled(KEY, "dram", tier.stage(KEY, mine, lease2), c2, lease2) is True
    assert node.read_local(KEY, BS) == mine
    assert node.filled(KEY, "dram", late, c1, lease1) is False
    assert not staged_files(tier, KEY)


@pytest.mark.parametrize("where", ["owner", "prefetch"])
def test_an_unexpected_error_staging_a_daemon_fill_still_ends_its_lease(tmp_path, monkeypatch,
                                                                        where):
    """An owner's fill for another node, or a prefetch: a bug or a failing tier while
    staging ends the lease (a later miss is leased again, not left waiting on it)."""

    from cachemw.cluster import owner
    from cachemw.keys import version_token
    from cachemw.node import prefetch

    node = _node(tmp_path)
    path = str(tmp_path / "src.bin")
    _write(path, os.urandom(BS))
    fs = LocalFileSystem()
    url = fs.unstrip_protocol(path)
    key = block_key(url, version_token(fs.info(path)), 0, BS)

    def broken(self, *args, **kwargs):
        raise RuntimeError("a bug in a tier")

    monkeypatch.setattr(DirectoryTier, "stage", broken)
    source = (fs.to_json(), path, 0, BS, BS, version_token(fs.info(path)))
    if where == "owner":
        out = owner.serve_blocks(node, [(key, BS, url, source)])
        assert out == [None]  # logged; the requester reads its own source
    else:
        node.announce([(key, BS, url, source)])
        prefetch.run_prefetch(node, 1 << 20)
        assert node.counters.get("prefetched", 0) == 0
    assert not node._inflight and node._tiers["dram"].reserved == 0
    monkeypatch.undo()
    assert node.lease(key, BS, url, object())[0] == "fill"


def _invalidate_while_staging(monkeypatch, node, url):
    real_stage = DirectoryTier.stage

    def stage(self, key, data, lease, tag=b""):
        stored = real_stage(self, key, data, lease, tag=tag)
        node.invalidate(url)  # the file is written through the cache right then
        return stored

    monkeypatch.setattr(DirectoryTier, "stage", stage)


def test_a_replica_of_a_remote_block_written_over_meanwhile_is_not_kept(tmp_path, monkeypatch):
    node = _node(tmp_path)
    tier = node._tiers["dram"].tier
    _invalidate_while_staging(monkeypatch, node, URL)
    assert node.admit_replica(KEY, os.urandom(BS), URL) is False
    assert KEY not in node._index and not node._inflight
    assert not os.path.exists(tier.block_path(KEY)) and not staged_files(tier, KEY)
    assert node._tiers["dram"].reserved == 0 and node.counters["replicas"] == 0


def test_a_block_moved_between_tiers_while_written_over_is_not_kept(tmp_path, monkeypatch):
    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),
                                         TierConfig("nvme", str(tmp_path / "nvme"), 1 << 30)),
                                  runtime_dir=str(tmp_path / "rt")))
    kind, tier, lease = node.lease(KEY, BS, URL, object())
    assert (kind, tier) == ("fill", "dram")
    dram, nvme = node._tiers["dram"].tier, node._tiers["nvme"].tier
    node.filled(KEY, "dram", dram.stage(KEY, os.urandom(BS), lease), node._inflight[KEY].conn,
                lease)
    assert KEY in node._index
    _invalidate_while_staging(monkeypatch, node, URL)
    node._move_tier(KEY, "nvme")
    assert KEY not in node._index
    for t in (dram, nvme):
        assert not os.path.exists(t.block_path(KEY)) and not staged_files(t, KEY)


def _one_block_of_dram_over_nvme(tmp_path) -> NodeCache:
    """A node whose DRAM tier holds one block of BS (the next fill demotes it) over NVMe."""
    from cachemw import blockfile

    stored = blockfile.stored_size(BS)
    return NodeCache(DaemonConfig(tiers=(
        TierConfig("dram", str(tmp_path / "dram"), stored, high_watermark=1.0),
        TierConfig("nvme", str(tmp_path / "nvme"), 8 * stored, high_watermark=1.0)),
        runtime_dir=str(tmp_path / "rt")))


@pytest.mark.timeout(30)
def test_a_block_demoted_while_its_fill_is_in_flight_lands_then_moves(tmp_path):
    """A fill written behind its read is still in flight (staged, not yet noted) when the
    next miss makes the engine demote it: the move lands it (it is staged) and moves it; it
    used to fail, the engine forgot the block, the fill was indexed anyway, and from then
    on every miss was bypassed (the engine saw room the tier did not have)."""
    node = _one_block_of_dram_over_nvme(tmp_path)
    conn = object()
    first, second = (block_key(URL, "v", i, BS) for i in range(2))
    kind, tier, lease = node.lease(first, BS, URL, conn)
    assert (kind, tier) == ("fill", "dram")
    node.tier("dram").stage(first, os.urandom(BS), lease)  # its 'filled' note not sent yet
    assert node.lease(second, BS, URL, conn)[:2] == ("fill", "dram")
    assert node._index[first].tier == "nvme" and os.path.exists(node.tier("nvme").block_path(first))


@pytest.mark.timeout(30)
def test_a_demote_of_a_block_whose_fill_has_not_been_written_waits_for_no_one(tmp_path):
    """The engine demotes a block whose fill is leased but not written yet (its writer
    may itself be waiting for a lease that needs this very room): the move is put off to
    the next maintenance pass instead of holding the moves' lock, and so every reader of
    the node, while it waits (2 s a time, in steps, before). The lease that wanted the
    room reads on without it; once the fill lands, the move is carried out."""
    node = _one_block_of_dram_over_nvme(tmp_path)
    conn = object()
    first, second = (block_key(URL, "v", i, BS) for i in range(2))
    kind, tier, lease = node.lease(first, BS, URL, conn)
    assert (kind, tier) == ("fill", "dram")
    started = time.monotonic()
    answer = node.lease(second, BS, URL, object())  # nothing of the first staged yet
    assert time.monotonic() - started < 1.0
    assert answer[0] in ("nofill", "fill"), answer
    assert first in node._deferred and first not in node._index
    node.filled(first, "dram", node.tier("dram").stage(first, os.urandom(BS), lease), conn, lease)
    with node._lock:
        moves, node._pending = node._pending, []
    node.run_moves(moves)  # the maintenance pass
    assert node._index[first].tier == "nvme" and first not in node._deferred
    assert os.path.exists(node.tier("nvme").block_path(first))


def test_moves_into_a_full_tier_stop_it_admitting_and_say_so_once(tmp_path, monkeypatch, caplog):
    """Demotions into an NVMe tier out of space: the tier stops admitting for a while (as
    a fill meeting ENOSPC does), and that is said once, not per block."""
    import errno
    import logging

    caplog.set_level(logging.WARNING, logger="cachemw")
    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),
                                         TierConfig("nvme", str(tmp_path / "nvme"), 1 << 30)),
                                  runtime_dir=str(tmp_path / "rt")))
    keys = [block_key(URL, "v", i, BS) for i in range(5)]
    for key in keys:
        kind, tier, lease = node.lease(key, BS, URL, object())
        node.filled(key, "dram", node.tier("dram").stage(key, os.urandom(BS), lease),
                    node._inflight[key].conn, lease)
    tries = []

    def full(key, data, lease, tag=b""):
        tries.append(key)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(node.tier("nvme"), "stage", full)
    from cachemw.node.mover import DESTINATION_FAILED

    for key in keys:  # the copies in DRAM stay sound: the destination failed, not they
        assert node._move_tier(key, "nvme") is DESTINATION_FAILED
        assert node.tier("dram").contains(key)
    assert len(tries) == len(keys)  # each tried: room may have come back meanwhile
    assert node.stats()["tiers"]["nvme"]["admitting"] is False
    assert len([r for r in caplog.records if "out of space" in r.getMessage()]) == 1
