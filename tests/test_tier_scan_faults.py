"""A tier file that cannot be read when the daemon re-indexes its tiers (a symlink loop,
EIO from a bad sector, EACCES) costs that block, not the node cache: the scan forgets
the file, counts and logs it once, and goes on, and the daemon starts with every other
block re-indexed (before, one such file kept every daemon of the node from starting)."""
from __future__ import annotations

import logging
import os

import fsspec
import pytest

from cachemw import blockfile
from cachemw.tiers.directory import DirectoryTier
from conftest import daemon_stats, wait_for

BS = 65536


def _keys(n: int) -> list[str]:
    return [f"{i:02x}" + f"{i:030x}" for i in range(n)]


def test_scan_forgets_unreadable_files_and_goes_on(tmp_path, caplog):
    tier = DirectoryTier("nvme", str(tmp_path / "nvme"), create=True)
    keys = _keys(6)
    for k in keys:
        tier.put(k, os.urandom(1000), tag=b"t")
    loop = tier.block_path(keys[1])
    os.unlink(loop)
    os.symlink(loop, loop)  # ELOOP when followed
    sub = os.path.join(tier.path, keys[2][:2])  # a sub-directory that is a symlink loop
    for name in os.listdir(sub):
        os.unlink(os.path.join(sub, name))
    os.rmdir(sub)
    os.symlink(sub, sub)
    with caplog.at_level(logging.WARNING, logger="cachemw.tiers.directory"):
        found = sorted(e.key for e in tier.scan())
    assert found == sorted(set(keys) - {keys[1], keys[2]})
    assert tier.unreadable == 2
    assert not os.path.lexists(loop)  # forgotten: removed
    warnings = [r for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(warnings) == 1 and "forgot 2" in warnings[0].getMessage()


def test_read_tag_tells_a_fault_from_a_file_that_is_no_block(tmp_path):
    other = tmp_path / "other"
    other.write_bytes(b"x" * 10)
    assert blockfile.read_tag(str(other)) is None
    assert blockfile.read_tag(str(tmp_path / "absent")) is None
    assert blockfile.read_tag(str(tmp_path)) is None  # a directory
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(OSError):
        blockfile.read_tag(str(loop))


@pytest.mark.timeout(120)
def test_a_daemon_starts_over_an_nvme_tier_with_a_symlink_loop(runtime_dir, spawn_daemon,
                                                              make_tree, tmp_path):
    tree = make_tree([BS] * 8, seed=5, fmt="f{i:02d}.bin")
    nvme = str(tmp_path / "nvme")
    stored = blockfile.stored_size(BS)
    config = dict(nvme_dir=nvme, nvme_capacity="64MiB", dram_capacity=3 * stored)
    daemon = spawn_daemon(runtime_dir, **config)
    fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    for path, data in tree.items():
        assert fs.cat_file(path) == data
    wait_for(lambda: daemon_stats(runtime_dir)["tiers"]["nvme"]["blocks"] >= 3, 20,
             what="blocks demoted to NVMe")
    daemon.kill()
    daemon.wait(30)

    def block_files(tier_dir):
        return {n: os.path.join(d, n) for d, _, names in os.walk(tier_dir) for n in names
                if len(n) == 32}

    on_nvme, on_dram = block_files(nvme), block_files(os.path.join(runtime_dir, "dram"))
    looped = sorted(set(on_nvme) - set(on_dram))[0]
    os.unlink(on_nvme[looped])
    os.symlink(on_nvme[looped], on_nvme[looped])
    spawn_daemon(runtime_dir, **config)  # failed before: ELOOP out of the re-index
    stats = daemon_stats(runtime_dir)
    assert stats["counters"]["reindexed"] == len(set(on_nvme) | set(on_dram)) - 1
    assert not os.path.lexists(on_nvme[looped])  # forgotten
    fresh = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                              runtime_dir=runtime_dir, skip_instance_cache=True)
    for path, data in tree.items():
        assert fresh.cat_file(path) == data
    assert fresh.stats()["misses"] >= 1  # the forgotten block, read from the source
