"""A block a tier does not hold is a miss, however the tier is broken: a reader probes a
tier by opening the block's file, and a tier directory made a file fails that open with
ENOTDIR. Counted as a fault of a cached block (``tier_read_errors``, the
``tier_read`` fallback, the "cannot read cached blocks" log line) it made every read of
a never-cached file look like a lost cached block (review ops2, defect 2)."""
from __future__ import annotations

import os
import random

import pytest

from cachemw import blockfile
from cachemw.tiers.directory import DirectoryTier
from conftest import daemon_stats, wait_for

KEY = "ab" * 16


def test_a_block_under_a_directory_that_is_a_file_is_absent(tmp_path):
    tier = DirectoryTier("dram", str(tmp_path / "dram"), create=True)
    tier.put(KEY, b"x" * 10_000)
    assert tier.get(KEY, 10_000) == b"x" * 10_000
    os.rename(tier.path, tier.path + ".aside")
    with open(tier.path, "wb") as f:  # the tier directory replaced by a file
        f.write(b"not a directory")
    assert tier.get(KEY, 10_000) is None
    assert tier.get(KEY, 10_000, 100, 200) is None  # a range read
    assert tier.view(KEY, 10_000) is None
    path = tier.block_path(KEY)
    assert blockfile.read_block(path, 10_000) is None
    assert blockfile.read_range(path, 10_000, 5, 50) is None
    assert blockfile.hold_block(path, 10_000) is None


@pytest.mark.timeout(120)
def test_never_cached_files_read_past_a_tier_made_a_file_count_no_tier_read_errors(
        make_cache_fs, runtime_dir, tmp_path, caplog):
    fs = make_cache_fs()
    files = {}
    for i in range(6):
        path = str(tmp_path / f"f{i}.bin")
        files[path] = random.Random(i).randbytes(30_000)
        with open(path, "wb") as f:
            f.write(files[path])
    first = next(iter(files))
    assert fs.cat_file(first) == files[first]  # the daemon and the tier at work
    dram = daemon_stats(runtime_dir)["tiers"]["dram"]["path"]
    os.rename(dram, dram + ".aside")
    with open(dram, "wb") as f:
        f.write(b"not a directory")
    before = dict(fs.stats())
    with caplog.at_level("WARNING", logger="cachemw"):
        for path, data in list(files.items())[1:]:  # never cached: nothing to fail to read
            assert fs.cat_file(path) == data
            with fs.open(path) as f:
                assert f.read() == data
    after = fs.stats()
    assert after["tier_read_errors"] == before["tier_read_errors"] == 0
    assert not [r for r in caplog.records if "cannot read cached blocks" in r.getMessage()]
    # each read went to the source (the tier admits nothing while it is a file), as a miss
    assert after["source_reads"] - before["source_reads"] >= len(files) - 1
    fs.client.flush()
    counters = wait_for(lambda: (c := daemon_stats(runtime_dir)["counters"])
                        .get("source_reads", 0) >= len(files) and c, 10,
                        what="the reads' reports")
    assert counters.get("tier_read_errors", 0) == 0
