"""A claims directory that cannot be used (a file in its place: ENOTDIR; unwritable) costs
the single flight only: leases go on without claims (counted as ``claim_errors``, logged
at most once a minute), no lease request fails for it, the daemon makes the directory
again where it can, and its start does not fail for it. (Before, every lease request
raised, readers flipped between "unreachable" and "reachable again", and a daemon found
the file at its start and failed with EEXIST.)"""
from __future__ import annotations

import errno
import logging
import os
import shutil

import pytest

from cachemw.claims import Claims, claims_dir
from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from conftest import daemon_stats, published

BS = 1 << 16
L = 4096


def _file_in_place_of(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    with open(directory, "w") as f:
        f.write("debris")


def test_a_claims_dir_that_is_a_file_never_raises_and_is_made_again(tmp_path):
    directory = str(tmp_path / "claims")
    _file_in_place_of(directory)
    claims = Claims(directory)
    claims.release("k")  # raised NotADirectoryError
    claims.release("k", "123 4")
    assert not claims.held("k")
    assert claims.clear() == 0
    with pytest.raises(NotADirectoryError):  # for the caller to lease without a claim
        claims.take("k")
    assert claims.make() and os.path.isdir(directory)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert claims.take("k") and claims.faults == 0


def test_a_claims_dir_that_cannot_be_made_is_counted_not_raised(tmp_path, monkeypatch, caplog):
    claims = Claims(str(tmp_path / "claims"))

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "makedirs", refused)
    with caplog.at_level(logging.WARNING, logger="cachemw.claims"):
        assert not claims.make()
        assert not claims.make()
    assert claims.faults == 2
    assert len([r for r in caplog.records if "claims directory" in r.getMessage()]) == 1


def _node(tmp_path) -> NodeCache:
    return NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity=1 << 24),
                     lease_wait=5.0)


def _fill(nc, key, reply, conn):
    assert reply[0] == "fill", reply
    stored = nc.tier(reply[1]).stage(key, b"x" * L, reply[2])
    assert nc.filled(key, reply[1], stored, conn, reply[2])


def test_a_daemon_starts_over_a_file_in_place_of_its_claims_dir(tmp_path):
    directory = claims_dir(str(tmp_path / "rt"))
    os.makedirs(os.path.dirname(directory))
    _file_in_place_of(directory)
    nc = _node(tmp_path)  # failed: FileExistsError
    assert os.path.isdir(directory)
    key = block_key("file:///x", "v", 0, L)
    reply = nc.lease(key, L, "file:///x", "conn")
    assert os.path.exists(os.path.join(directory, key))
    _fill(nc, key, reply, "conn")


def test_leases_go_on_without_claims_counted_and_logged_once(tmp_path, caplog):
    nc = _node(tmp_path)
    directory = nc.claims.dir
    keys = [block_key("file:///x", "v", i * L, L) for i in range(20)]
    _file_in_place_of(directory)  # replaced under the running daemon: made again
    reply = nc.lease(keys[0], L, "file:///x", "conn")
    assert os.path.isdir(directory) and os.path.exists(os.path.join(directory, keys[0]))
    _file_in_place_of(directory)  # the claim of a lease in flight went with it
    _fill(nc, keys[0], reply, "conn")  # its release raised NotADirectoryError

    def refused(key):  # an unwritable claims dir (root ignores modes: made so here)
        raise PermissionError(errno.EACCES, "Permission denied")

    nc.claims.take = refused
    with caplog.at_level(logging.WARNING, logger="cachemw.node.waits"):
        for key in keys[1:]:
            _fill(nc, key, nc.lease(key, L, "file:///x", "conn"), "conn")
    assert nc.stats()["counters"]["claim_errors"] == len(keys) - 1
    assert len([r for r in caplog.records if "without a claim" in r.getMessage()]) == 1
    assert nc.stats()["inflight"] == 0


@pytest.mark.timeout(120)
def test_reads_through_a_daemon_whose_claims_dir_is_a_file(make_cache_fs, runtime_dir, tmp_path):
    fs = make_cache_fs(block_size=BS)
    files = {}
    for i in range(4):
        path = str(tmp_path / f"f{i}.bin")
        files[path] = os.urandom(2 * BS + 100)
        with open(path, "wb") as f:
            f.write(files[path])
    directory = claims_dir(runtime_dir)
    _file_in_place_of(directory)
    for path, data in files.items():
        assert fs.cat_file(path) == data
    published(fs)
    assert fs.stats()["fallbacks"] == 0  # every lease request answered
    stats = daemon_stats(runtime_dir)
    assert sum(t["blocks"] for t in stats["tiers"].values()) == 12
    assert os.path.isdir(directory)  # made again by the daemon
    before = dict(fs.stats())
    for path, data in files.items():
        assert fs.cat_file(path) == data
    assert fs.stats()["hits"] - before["hits"] == 12
    log = "".join(p.read_text() for p in tmp_path.glob("daemon-*.log"))
    assert "failed" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(60)
def test_a_claim_path_that_cannot_be_read_leases_at_once_without_a_claim(tmp_path):
    """A directory (or a symlink loop, EIO) under a claim's name: no claim can be taken
    there, so the lease goes without one at once, counted. It waited lease_wait (30 s by
    default) for a claim no one held, then answered busy (the read went to the source)."""
    nc = _node(tmp_path)
    key = block_key("file:///x", "v", 0, L)
    os.mkdir(os.path.join(nc.claims.dir, key))
    reply = nc.lease(key, L, "file:///x", "conn", wait=20)
    assert reply[0] == "fill", reply
    assert nc.stats()["counters"]["claim_errors"] == 1
    _fill(nc, key, reply, "conn")
    assert nc.stats()["inflight"] == 0
