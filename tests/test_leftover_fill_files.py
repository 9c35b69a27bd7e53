"""Fill files whose writer died while a daemon ran are removed by that daemon (node/
leftovers.py), not only by the next one's start: a reader killed between creating a block's
temp file and renaming it, after the daemon's start-up sweep, left its file in the DRAM tier,
uncounted, until the daemon stopped (review loaders5). What a live writer may still be
writing, and the staged fill of a lease still held, are left alone."""
from __future__ import annotations

import logging
import os
import time

import pytest

from cachemw.config import DaemonConfig, TierConfig
from cachemw.node.cache import NodeCache
from cachemw.tiers.directory import FANOUT, DirectoryTier
from conftest import wait_for

KEY = "00" + "ab" * 15  # a block key (32 hex digits) of the first sub-directory


def _plant(path: str, size: int, age: float) -> str:
    with open(path, "wb") as f:
        f.write(b"x" * size)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def _node(tmp_path) -> NodeCache:
    return NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),),
                                  runtime_dir=str(tmp_path / "rt")))


def test_a_sub_directory_sweep_removes_old_fill_files_only(tmp_path):
    tier = DirectoryTier("dram", str(tmp_path / "dram"), create=True)
    sub = tier.path + "/00"
    dead_tmp = _plant(f"{sub}/{KEY}.7.staged.4242.0a0b0c0d.tmp", 4096, 3600)
    fresh_tmp = _plant(f"{sub}/{KEY}.8.staged.4243.0a0b0c0d.tmp", 4096, 1)
    dead_staged = _plant(f"{sub}/{KEY}.9.staged", 8192, 3600)
    held_staged = _plant(f"{sub}/{KEY}.10.staged", 8192, 3600)
    block = _plant(f"{sub}/{KEY}", 8192, 3600)  # a block: never the sweep's
    foreign = _plant(f"{sub}/notes.txt", 10, 3600)  # not a name a tier makes
    files, freed = tier.sweep_leftovers("00", time.time() - 300,
                                        lambda key, lease: (key, lease) == (KEY, 10))
    assert (files, freed) == (2, 4096 + 8192)
    assert not os.path.exists(dead_tmp) and not os.path.exists(dead_staged)
    assert all(os.path.exists(p) for p in (fresh_tmp, held_staged, block, foreign))
    assert tier.sweep_leftovers("01", time.time(), lambda key, lease: False) == (0, 0)


def test_a_round_goes_through_every_tier_sub_directory_counts_and_logs(tmp_path, caplog):
    node = _node(tmp_path)
    try:
        dram = node._tiers["dram"].tier.path
        planted = [_plant(f"{dram}/{sub}/{sub}{'cd' * 15}.3.staged.99.00000000.tmp", 1000, 900)
                   for sub in ("00", "7f", "ff")]
        granted = node.lease(KEY, 1000, "file:///x", conn=object())
        assert granted[0] == "fill"
        held = _plant(node._tiers["dram"].tier.staged_path(KEY, granted[2]), 1000, 900)
        with caplog.at_level(logging.WARNING, logger="cachemw.node.leftovers"):
            removed = 0
            for _ in FANOUT:
                node._leftovers.due = 0.0  # the pace is SUB_EVERY seconds: not waited for here
                removed += node.sweep_leftovers()
        assert removed == 3 and node.counters["leftovers_removed"] == 3
        assert not any(os.path.exists(p) for p in planted)
        assert os.path.exists(held)  # its lease is held: the daemon publishes or drops it
        said = [r.getMessage() for r in caplog.records if "writers died" in r.getMessage()]
        assert said == ["removed 3 fill file(s) of 3000 bytes whose writers died before "
                        "finishing them (counted as leftovers_removed)"]
    finally:
        node.close(wait=5)


@pytest.mark.timeout(60)
def test_the_running_daemons_maintenance_removes_a_dead_writers_file(tmp_path):
    """The maintenance thread sweeps by itself (its first step: the first sub-directory)."""
    node = _node(tmp_path)
    dram = node._tiers["dram"].tier.path
    dead = _plant(f"{dram}/00/00{'ef' * 15}.12.staged.31337.deadbeef.tmp", 65536, 600)
    live = _plant(f"{dram}/00/00{'ef' * 15}.13.staged.31338.deadbeef.tmp", 65536, 0)
    node.start_maintenance()
    try:
        wait_for(lambda: not os.path.exists(dead), 30, what="the dead writer's file removed")
        assert os.path.exists(live)
        wait_for(lambda: node.counters["leftovers_removed"] == 1, 5, what="the removal counted")
    finally:
        node.close(wait=5)
