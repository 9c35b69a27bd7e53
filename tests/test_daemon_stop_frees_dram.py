"""A daemon that frees its DRAM tier when it stops leaves it empty: nothing lands in it
after the free (a move of the maintenance thread, a fill noted late), and `cachemw stop`
after a clean exit frees what was written into it since.

Before: the stop waited 5 s for the maintenance thread, then freed the tier while the
thread, busy with promotions from NVMe, went on publishing block files into it (left on
/dev/shm in 4 of 6 runs of a reviewer's repro), and a `cachemw stop` afterwards did not
touch them: the clean exit had emptied the lock file, so nothing said the tier was an
autostarted daemon's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from cachemw.config import DaemonConfig
from cachemw.keys import block_key
from cachemw.node import mover
from cachemw.node.cache import NodeCache
from cachemw.node.service import NodeService
from cachemw.placement import Demote, Promote

L = 4096
URL = "file:///x"


def files_in(tier_dir: str) -> list[str]:
    """Block files (and staged fills) in a tier directory, metadata and others aside."""
    out = []
    for sub in os.listdir(tier_dir) if os.path.isdir(tier_dir) else ():
        if len(sub) == 2 and os.path.isdir(os.path.join(tier_dir, sub)):
            out += [n for n in os.listdir(os.path.join(tier_dir, sub)) if n.startswith(sub)]
    return out


def _config(tmp_path) -> DaemonConfig:
    return DaemonConfig.build(runtime_dir=str(tmp_path / "rt"), dram_dir=str(tmp_path / "dram"),
                              dram_capacity=64 * L, nvme_dir=str(tmp_path / "nvme"),
                              nvme_capacity=256 * L)


def _fill(nc: NodeCache, key: str, conn: str = "c") -> None:
    reply = nc.lease(key, L, URL, conn)
    assert reply[0] == "fill", reply
    stored = nc.tier(reply[1]).stage(key, b"b" * L, reply[2])
    assert nc.filled(key, reply[1], stored, conn, reply[2])


@pytest.mark.timeout(60)
def test_a_promotion_running_past_the_stop_leaves_nothing_in_the_freed_dram_tier(
        tmp_path, monkeypatch):
    """A promotion from NVMe into DRAM that is slow (6 s, past the 5 s the stop used to
    wait for the maintenance thread) ends before the tier is freed: the tier is empty
    once the stop returns."""
    service = NodeService(_config(tmp_path))
    service.free_dram_at_exit = True
    nc = service.node
    key = block_key(URL, "v", 0, L)
    _fill(nc, key)
    size = nc._index[key].stored
    nc.run_moves([Demote(key, size, "dram", "nvme")])
    assert nc._index[key].tier == "nvme"
    # a file not of the tier's in the block's directory: the free leaves it, and so the
    # directory (as a fill staged in it does while the free runs), for the move to land in
    other = os.path.join(str(tmp_path / "dram"), key[:2], "not-a-block")
    with open(other, "wb") as f:
        f.write(b"x")

    reading, release = threading.Event(), threading.Event()
    real = mover._read_whole

    def slow_read(path):
        reading.set()
        release.wait(30)
        return real(path)

    monkeypatch.setattr(mover, "_read_whole", slow_read)
    with nc._lock:
        nc._pending.append(Promote(key, size, "nvme", "dram"))
    nc._wake.set()
    assert reading.wait(10)  # the promotion has begun: past its admission check
    timer = threading.Timer(6.0, release.set)
    timer.start()
    try:
        service.close()
    finally:
        release.set()
        timer.cancel()
    nc._maintainer.join(30)
    assert files_in(str(tmp_path / "dram")) == []  # before: the promoted block's file
    assert key in [n[:32] for n in files_in(str(tmp_path / "nvme"))]  # kept in NVMe


def test_nothing_lands_in_a_sealed_node(tmp_path):
    """The backstop for a fill noted, or a move finished, after the stop began: once
    sealed, a fill that lands deletes its staged file, and a move publishes nothing."""
    nc = NodeCache(_config(tmp_path))
    fill_key, move_key = block_key(URL, "v", 1, L), block_key(URL, "v", 2, L)
    reply = nc.lease(fill_key, L, URL, "conn")
    assert reply[0] == "fill"
    stored = nc.tier(reply[1]).stage(fill_key, b"f" * L, reply[2])
    _fill(nc, move_key)
    size = nc._index[move_key].stored
    nc.run_moves([Demote(move_key, size, "dram", "nvme")])
    nc.close()
    nc.seal()
    assert not nc.filled(fill_key, reply[1], stored, "conn", reply[2])
    assert nc._move_tier(move_key, "dram") is False
    assert files_in(str(tmp_path / "dram")) == []
    assert nc.lease(block_key(URL, "v", 3, L), L, URL, "conn") == ("nofill", "full")


@pytest.mark.timeout(60)
def test_stop_frees_what_was_written_into_a_cleanly_freed_dram_tier(tmp_path):
    """After an autostarted daemon's clean exit (its DRAM tier freed, its lock file empty)
    a block file appears in the tier (a writer that outlived it): `cachemw stop` frees it.
    A daemon started since owns the tier: the note of the free is gone with its start."""
    config = _config(tmp_path)
    service = NodeService(config)
    service.free_dram_at_exit = True
    _fill(service.node, block_key(URL, "v", 4, L))
    service.close()
    dram = str(tmp_path / "dram")
    assert files_in(dram) == []
    late, key = service.node.tier("dram"), block_key(URL, "v", 5, L)
    os.makedirs(os.path.dirname(late.block_path(key)), exist_ok=True)
    late.put(key, b"late" * 100)
    assert len(files_in(dram)) == 1
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=config.runtime_dir)
    r = subprocess.run([sys.executable, "-m", "cachemw.cli", "stop"], env=env,
                       capture_output=True, text=True, timeout=40)
    assert r.returncode == 0, r.stderr
    assert files_in(dram) == []  # before: left

    again = NodeService(config)  # a new daemon: the tier is its own
    try:
        assert not os.path.exists(os.path.join(config.runtime_dir, "dram.freed"))
    finally:
        again.close()
