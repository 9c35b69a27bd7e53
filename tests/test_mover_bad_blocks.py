"""Blocks the daemon's mover finds bad (a promotion or demotion reads a block file that
fails its checksum, or cannot be read: a symlink loop, EIO) are counted as readers' finds
are (``corrupt_repaired``, ``tier_read_errors``), dropped, and logged with them at most
once a minute, not in a WARNING per block (a failing disk fails them all)."""
from __future__ import annotations

import logging
import os

from cachemw.config import DaemonConfig, TierConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache
from cachemw.placement import Demote, Promote

BS = 4096
URL = "file:///data/x"


def _node_with_blocks_in_nvme(tmp_path, n: int) -> tuple[NodeCache, list[str]]:
    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),
                                         TierConfig("nvme", str(tmp_path / "nvme"), 1 << 30)),
                                  runtime_dir=str(tmp_path / "rt")))
    keys = [block_key(URL, "v", i, BS) for i in range(n)]
    for key in keys:
        kind, tier, lease = node.lease(key, BS, URL, object())
        assert (kind, tier) == ("fill", "dram")
        node.filled(key, "dram", node.tier("dram").stage(key, os.urandom(BS), lease),
                    node._inflight[key].conn, lease)
        assert node._move_tier(key, "nvme") is True
    return node, keys


def test_corrupt_and_unreadable_blocks_met_by_moves_are_counted_and_logged_rarely(tmp_path,
                                                                                  caplog):
    node, keys = _node_with_blocks_in_nvme(tmp_path, 12)
    nvme = node.tier("nvme")
    corrupt, looped = keys[:8], keys[8:11]
    for key in corrupt:
        path = nvme.block_path(key)
        with open(path, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
    for key in looped:
        path = nvme.block_path(key)
        os.unlink(path)
        os.symlink(path, path)
    before = dict(node.counters)
    node.say_dropped(now=True)  # nothing pending: the next find logs at once
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cachemw"):
        node.run_moves([Promote(k, 0, "nvme", "dram") for k in corrupt + looped] +
                       [Promote(keys[11], 0, "nvme", "dram")])
    counters = node.counters
    assert counters["corrupt_repaired"] - before["corrupt_repaired"] == len(corrupt)
    assert counters["tier_read_errors"] - before["tier_read_errors"] == len(looped)
    for key in corrupt + looped:
        assert key not in node._index and not os.path.lexists(nvme.block_path(key))
    assert node._index[keys[11]].tier == "dram"  # the sound one moved
    messages = [r.getMessage() for r in caplog.records]
    assert not any("moving" in m for m in messages), messages
    assert len(messages) <= 1, messages  # the first find said; the rest within the minute
    node.say_dropped(now=True)  # the daemon's stop says what is left untold
    told = " ".join(r.getMessage() for r in caplog.records)
    assert "corrupt" in told and "unreadable" in told


def test_a_clean_stop_says_what_it_could_not_copy_in_one_line(tmp_path, caplog):
    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), 1 << 30),
                                         TierConfig("nvme", str(tmp_path / "nvme"), 1 << 30)),
                                  runtime_dir=str(tmp_path / "rt")))
    keys = [block_key(URL, "v", i, BS) for i in range(6)]
    for key in keys:
        kind, tier, lease = node.lease(key, BS, URL, object())
        node.filled(key, "dram", node.tier("dram").stage(key, os.urandom(BS), lease),
                    node._inflight[key].conn, lease)
    for key in keys[:5]:
        with open(node.tier("dram").block_path(key), "r+b") as f:
            f.write(b"\0\0\0\0")
    with caplog.at_level(logging.WARNING, logger="cachemw"):
        assert node.keep_on_stop() == 1
    lines = [r.getMessage() for r in caplog.records if "clean stop" in r.getMessage()]
    assert len(lines) == 1 and "5 block(s)" in lines[0], lines


def test_a_demotion_of_a_corrupt_block_drops_it_counted(tmp_path):
    node, keys = _node_with_blocks_in_nvme(tmp_path, 1)
    key = keys[0]
    assert node._move_tier(key, "dram") is True  # back in DRAM
    with open(node.tier("dram").block_path(key), "r+b") as f:
        f.write(b"\0\0\0\0")
    before = node.counters["corrupt_repaired"]
    node.run_moves([Demote(key, 0, "dram", "nvme")])
    assert node.counters["corrupt_repaired"] == before + 1
    assert key not in node._index
