"""A promotion the node cannot carry out (the faster tier full: a /dev/shm other jobs
filled, or broken) leaves the block where it is, and the placement engine counts it there
again, with room made for it (Engine.kept_in): counted in the tier it never reached, its
room in the slower tier was handed out again, and an NVMe tier of 64 MiB held 87 MiB
(review epochs4). No Ray: the node cache and its mover, driven by hand."""
from __future__ import annotations

import os
import time

import pytest

from cachemw.config import DaemonConfig, TierConfig
from cachemw.keys import block_key
from cachemw.node.cache import NodeCache

BS = 4096


@pytest.mark.timeout(60)
def test_promotions_into_a_full_faster_tier_never_overfill_the_slower_one(tmp_path):
    node = NodeCache(DaemonConfig(
        tiers=(TierConfig("dram", str(tmp_path / "dram"), 4 * (BS + 200)),
               TierConfig("nvme", str(tmp_path / "nvme"), 6 * (BS + 200))),
        runtime_dir=str(tmp_path / "rt"), placement="lru"))
    try:
        conn = object()
        keys = [block_key("file:///x", "v", i, BS) for i in range(10)]
        for key in keys:  # 10 blocks: 4 in dram, 6 in nvme
            kind, tier, lease = node.lease(key, BS, "file:///x", conn)
            assert kind == "fill"
            node.filled(key, tier, node.tier(tier).stage(key, os.urandom(BS), lease), conn, lease)
        node._tiers["dram"].full_until = time.monotonic() + 3600  # out of space: admits nothing
        for _ in range(3):
            for key in keys:  # hits in nvme: the engine promotes them, the node cannot
                where = node._index[key].tier if key in node._index else None
                if where is not None:
                    node.report({}, [(key, where)])
                with node._lock:
                    moves, node._pending = node._pending, []
                node.run_moves(moves)
                for name in ("dram", "nvme"):
                    t = node.stats()["tiers"][name]
                    assert t["used_bytes"] <= t["capacity_bytes"], (name, t)
    finally:
        node.close()
