"""Blocks fetched before their lease, leased and noted in batches (cachemw/client/adopt.py,
fills.FillWriter.store_many, NodeCache.lease_fetched, ops.FILLED_MANY).

What must hold: a batch never reserves so much of a tier that room made for one of its
fills evicts another in flight (the daemon grants part of it and answers the rest
"later", asked again with their claims kept); every block is cached once all the same;
whatever raises, every lease granted ends and every claim is released or kept for a
block asked again; a batch note with a bad entry still lands the others.
"""
from __future__ import annotations

import os

import fsspec
import pytest

from cachemw import blockfile
from cachemw.bench import SlowLocalFileSystem
from cachemw.claims import Claims, claims_dir, holder_name
from cachemw.client.adopt import LATER, Adopted, Adoptions
from cachemw.config import DaemonConfig, TierConfig
from cachemw.node.cache import NodeCache
from conftest import daemon_stats, published, wait_for

BS = 65536
STORED = blockfile.stored_size(BS)


def _key(i: int) -> str:
    return f"{i:02x}" + "0" * 30


def test_the_daemon_grants_a_batch_part_of_a_tier_at_a_time(tmp_path):
    """A batch of 12 on a tier of 6 blocks: granted a quarter at a time, the rest "later",
    their claims left to the caller; asked again after the notes, all are cached, none of
    the fills in flight cancelled to make room for another."""
    node = NodeCache(DaemonConfig(
        tiers=(TierConfig("dram", str(tmp_path / "dram"), 6 * STORED),
               TierConfig("nvme", str(tmp_path / "nvme"), 64 << 20)),
        runtime_dir=str(tmp_path / "rt")))
    claims = Claims(claims_dir(str(tmp_path / "rt")))
    claims.make()
    conn = object()
    items = [(_key(i), BS, "file:///x", None) for i in range(12)]
    for key, *_ in items:
        assert claims.take(key)
    rounds = 0
    while items:
        rounds += 1
        replies = node.lease_fetched(items, conn, True)
        granted = [(item, r) for item, r in zip(items, replies) if r[0] == "fill"]
        assert granted and all(r == LATER for r in replies[len(granted):])
        assert sum(STORED for _ in granted) <= 6 * STORED // NodeCache.BATCH_SHARE + STORED
        for (key, *_), (_, tier, lease) in granted:
            stored = node._tiers[tier].tier.stage(key, os.urandom(BS), lease)
            assert node.filled(key, tier, stored, conn, lease)  # published, not cancelled
        for key, *_ in items[len(granted):]:
            assert claims.held(key)  # "later": still the caller's
        items = items[len(granted):]
    assert rounds > 2
    stats = node.stats()
    assert stats["inflight"] == 0
    assert sum(t["blocks"] for t in stats["tiers"].values()) == 12
    assert os.listdir(claims.dir) == []  # every lease's end released its claim


@pytest.mark.timeout(90)
def test_a_batch_larger_than_a_tier_allows_is_cached_whole(runtime_dir, spawn_daemon,
                                                           make_tree, monkeypatch):
    """Through a real daemon whose DRAM tier holds 16 blocks: a batch of 12 fetched blocks
    is leased a part at a time; every read is right, every block filled once, no claim,
    lease or staged file left, and all are read back as hits."""
    from cachemw.client.fills import FillWriter

    monkeypatch.setattr(FillWriter, "LINGER", 30.0)  # one batch of all 12, at the drain
    monkeypatch.setattr(FillWriter, "BATCH_BYTES", 1 << 20)
    spawn_daemon(runtime_dir, dram_capacity=16 * STORED)
    files = make_tree([BS] * 12, seed=3)

    def cache_fs():
        return fsspec.filesystem("cachemw", fs=SlowLocalFileSystem(latency=0.001),
                                 runtime_dir=runtime_dir, autostart=False, block_size=BS,
                                 skip_instance_cache=True)
    fs = cache_fs()
    for path, data in files.items():
        assert fs.cat_file(path) == data
    published(fs)
    s = fs.stats()
    assert s["misses"] == 12 and s["fills"] == 12
    assert s["fill_errors"] == s["bypassed"] == s["fallbacks"] == 0
    assert s["lease_requests"] == 3  # a quarter of the tier a round (and one block): 5, 5, 2
    assert os.listdir(claims_dir(runtime_dir)) == []
    stats = daemon_stats(runtime_dir)
    assert stats["inflight"] == 0
    dram = stats["tiers"]["dram"]
    assert dram["blocks"] == 12 and dram["used_bytes"] == 12 * STORED
    assert not [n for _, _, names in os.walk(dram["path"]) for n in names
                if n.endswith((".staged", ".tmp"))]
    fresh = cache_fs()
    for path, data in files.items():
        assert fresh.cat_file(path) == data
    assert fresh.stats()["hits"] == 12 and fresh.stats()["misses"] == 0


@pytest.mark.timeout(60)
def test_a_batch_note_with_a_bad_entry_still_lands_the_others(runtime_dir, spawn_daemon,
                                                              tmp_path):
    from cachemw.client.link import DaemonClient

    spawn_daemon(runtime_dir)
    client = DaemonClient(runtime_dir, autostart=False, timeout=10.0)
    try:
        key = _key(7)
        (reply,) = client.lease_fetched([(key, BS, "file:///x", None)], False)
        assert reply[0] == "fill"
        tier = next(t for t in client.tiers() if t.name == reply[1])
        stored = tier.stage(key, os.urandom(BS), reply[2])
        assert client.note_via(client.link(), "filled_many",
                               [("not", "an entry"), (key, reply[1], stored, reply[2])])
        assert client.ping()  # the daemon read the note (it reads a connection in order)
        stats = client.daemon_stats()
        assert stats["inflight"] == 0 and stats["tiers"][reply[1]]["blocks"] == 1
        assert client.lease_fetched([(key, BS, "file:///x", None)], False) == [
            ("present", reply[1])]
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_connection_gone_ends_its_leases_removing_only_its_own_claims(runtime_dir,
                                                                       spawn_daemon):
    """Through a real daemon: leases asked with this process's claims, then the connection
    closes before any note. The daemon ends them; the claim still naming this process
    goes, the one another process took meanwhile stays."""
    from cachemw.client.link import DaemonClient

    spawn_daemon(runtime_dir)
    claims = Claims(claims_dir(runtime_dir))
    client = DaemonClient(runtime_dir, autostart=False, timeout=10.0)
    try:
        keys = [_key(20), _key(21)]
        assert all(claims.take(k) for k in keys)
        replies = client.lease_fetched([(k, BS, "file:///x", None) for k in keys], True)
        assert [r[0] for r in replies] == ["fill", "fill"]
        with open(os.path.join(claims.dir, keys[1]), "w") as f:  # another live process's
            f.write(f"{os.getppid()} 0")
    finally:
        client.close()
    wait_for(lambda: daemon_stats(runtime_dir)["inflight"] == 0, 10,
             what="the daemon to end the leases of the closed connection")
    assert os.listdir(claims.dir) == [keys[1]]


class _Client:
    """Replies to lease_fetched from a script; records aborts and counts."""

    def __init__(self, replies):
        self.replies, self.aborted, self.counts = list(replies), [], {}

    def lease_fetched(self, items, claimed):
        reply = self.replies.pop(0)
        return None if reply is None else reply[:len(items)]

    def abort(self, key, reason):
        self.aborted.append(key)

    def count(self, name, n=1):
        self.counts[name] = self.counts.get(name, 0) + n

    def link(self):
        return None

    def drop(self, key, reason):
        pass


class _Fills:
    def __init__(self, fail=False):
        self.fail, self.stored = fail, []

    def on_writer(self):
        return True

    def store_many(self, fills):
        self.stored.extend(f.key for f in fills)
        if self.fail:
            raise KeyboardInterrupt


def _adoptions(client, fills, claims):
    return Adoptions(client, fills, claims, item_of=lambda piece: (piece.key,),
                     tier_named=lambda name: type("T", (), {
                         "name": name, "contains": lambda self, key: False})(),
                     timed=lambda *args: None)


class _Piece:
    def __init__(self, key):
        self.key = key
        self.meta = type("M", (), {"url": "file:///x"})()


def _entries(claims, n):
    out = []
    for i in range(n):
        assert claims.take(_key(i))
        out.append(Adopted(_Piece(_key(i)), b"x", lambda: False, True, "claimed_duplicates"))
    return out


def test_claims_kept_for_later_end_when_nothing_more_is_asked(tmp_path):
    """An interrupt while the granted fills are written: the claims kept for "later" are
    released (nobody will ask for those blocks again); a daemon that grants none of a
    round (never this one) ends the loop instead of spinning: claims released, counted."""
    claims = Claims(str(tmp_path / "claims"))
    claims.make()
    client = _Client([[("fill", "dram", 1), LATER, LATER]])
    fills = _Fills(fail=True)
    with pytest.raises(KeyboardInterrupt):
        _adoptions(client, fills, claims)(_entries(claims, 3))
    assert fills.stored == [_key(0)]  # its lease ends with its note (the daemon releases)
    assert os.listdir(claims.dir) == [_key(0)]
    os.unlink(os.path.join(claims.dir, _key(0)))

    client = _Client([[LATER, LATER]])
    _adoptions(client, _Fills(), claims)(_entries(claims, 2))
    assert os.listdir(claims.dir) == [] and client.counts["bypassed"] == 2


def test_an_entry_that_raises_ends_its_lease_and_the_rest(tmp_path):
    """A bug on one entry of a reply (here: its tag cannot be made): its lease and those
    after it are aborted, the later one's claim released, the fills before it written."""
    import cachemw.client.adopt as adopt

    claims = Claims(str(tmp_path / "claims"))
    claims.make()
    entries = _entries(claims, 4)
    client = _Client([[("fill", "dram", 1), ("fill", "dram", 2), ("fill", "dram", 3), LATER]])
    fills = _Fills()
    real = adopt.url_tag
    calls = []

    def tag(url):
        calls.append(url)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return real(url)

    adopt.url_tag = tag
    try:
        with pytest.raises(RuntimeError):
            _adoptions(client, fills, claims)(entries)
    finally:
        adopt.url_tag = real
    assert fills.stored == [_key(0)]
    assert client.aborted == [_key(1), _key(2)]
    # aborted leases' claims are the daemon's to release; the one asked "later" ended here
    assert sorted(os.listdir(claims.dir)) == [_key(0), _key(1), _key(2)]


def test_an_unanswered_request_releases_only_this_processs_claims(tmp_path):
    """No answer to a batch's lease request (a timeout, the daemon gone): the client ends
    the claims it brought, unless one is no longer its own (the daemon, seeing the
    connection gone, ended a lease granted with it, and another process claimed the block
    since): that one stays."""
    claims = Claims(str(tmp_path / "claims"))
    claims.make()
    entries = _entries(claims, 2)
    with open(os.path.join(claims.dir, _key(1)), "w") as f:  # another live process's now
        f.write(f"{os.getppid()} 0")
    assert open(os.path.join(claims.dir, _key(0))).read() == holder_name()
    client = _Client([None])
    _adoptions(client, _Fills(), claims)(entries)
    assert os.listdir(claims.dir) == [_key(1)] and client.counts["fallbacks"] == 2
