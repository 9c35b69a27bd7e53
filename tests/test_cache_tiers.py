"""Tiers: a DRAM tier smaller than the dataset (reads go on, capacity holds, evictions
counted), a tier that really runs out of space (ENOSPC: reads go on, fill errors counted,
the tier stops admitting), and an NVMe tier under DRAM (demotion, reads from NVMe, blocks
surviving a daemon restart)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import fsspec
import pytest

from cachemw import blockfile
from conftest import daemon_stats, wait_for

BS = 65536
STORED = blockfile.stored_size(BS)  # bytes a full block occupies in a tier
NFILES = 24


@pytest.fixture
def blocks_dataset(make_tree):
    """NFILES files of exactly one block each."""
    return make_tree([BS] * NFILES, seed=11, fmt="s{i:02d}.bin")


def new_fs(runtime_dir, **options):
    return fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                             runtime_dir=runtime_dir, skip_instance_cache=True, **options)


def disk_usage(tier_dir: str) -> int:
    """Bytes of the block files in a tier directory: its metadata records excluded, and the
    temp files of a fill or move under way (a restart removes them; a block file's name is
    its 32-character key)."""
    total = 0
    for sub in os.listdir(tier_dir):
        if len(sub) == 2:
            for entry in os.scandir(os.path.join(tier_dir, sub)):
                if len(entry.name) == 32 and entry.name.startswith(sub):
                    total += entry.stat().st_size
    return total


@pytest.mark.timeout(60)
def test_dram_smaller_than_dataset_history_keeps_a_stable_subset(runtime_dir, spawn_daemon,
                                                                 blocks_dataset):
    """The default placement (history) under repeated scans: it fills the tier, then stops
    admitting instead of churning, so every later epoch hits on the blocks it kept."""
    capacity = 8 * STORED + 100
    spawn_daemon(runtime_dir, dram_capacity=capacity)
    fs = new_fs(runtime_dir)
    for epoch in range(3):
        for path, data in blocks_dataset.items():
            assert fs.cat_file(path) == data, (epoch, path)
        # the epoch's fills landed (or were not admitted) before the next reads them: a
        # block re-read while its fill is pending is served from memory (a hit, admitted
        # or not), which the counts below do not expect
        assert fs.reader.fills.drain(30)
    fs.client.flush()
    stats = fs.client.daemon_stats()
    t = stats["tiers"]["dram"]
    kept = t["blocks"]
    assert 0 < kept and t["used_bytes"] == kept * STORED <= int(capacity * 0.95)
    assert t["evictions"] == 0
    s = fs.stats()
    assert s["misses"] == kept  # filled once, never evicted and refetched
    assert s["hits"] == 2 * kept
    assert s["bypassed"] == 3 * NFILES - 3 * kept
    assert s["fallbacks"] == 0 and s["fill_errors"] == 0


@pytest.mark.timeout(60)
def test_dram_smaller_than_dataset(runtime_dir, spawn_daemon, blocks_dataset):
    capacity = 8 * STORED + 100
    spawn_daemon(runtime_dir, dram_capacity=capacity, placement="lru")
    fs = new_fs(runtime_dir)
    dram = fs.client.daemon_stats()["tiers"]["dram"]["path"]
    for epoch in range(2):
        for path, data in blocks_dataset.items():
            assert fs.cat_file(path) == data, (epoch, path)
            t = fs.client.daemon_stats()["tiers"]["dram"]
            assert t["used_bytes"] <= t["capacity_bytes"] == capacity
            assert disk_usage(dram) <= capacity
    s = fs.stats()
    assert s["fallbacks"] == 0 and s["fill_errors"] == 0
    assert s["hits"] + s["misses"] + s["bypassed"] == 2 * NFILES
    stats = wait_for(lambda: (d := fs.client.daemon_stats())["tiers"]["dram"]["used_bytes"]
                     <= int(capacity * 0.95) and d, 5, what="eviction below the high watermark")
    t = stats["tiers"]["dram"]
    assert t["evictions"] > 0
    assert t["used_bytes"] == t["blocks"] * STORED == disk_usage(dram)
    assert stats["counters"]["fills"] - t["evictions"] == t["blocks"]


def test_tier_accounting_counts_the_checksum_tail_against_capacity(tmp_path):
    """Admission reserves a block's data length, but the tier then charges its stored size
    (data + checksums + trailer): a capacity between the two lets the tier pass its capacity."""
    from cachemw.config import DaemonConfig, TierConfig
    from cachemw.node.cache import NodeCache

    capacity = 2 * STORED + BS + 8  # room for 2 stored blocks + a 3rd block's data, not its tail
    node = NodeCache(DaemonConfig(tiers=(TierConfig("dram", str(tmp_path / "dram"), capacity),),
                                  runtime_dir=str(tmp_path / "rt")))
    conn = object()
    tier = node._tiers["dram"].tier
    for i in range(3):
        key = f"{i:02x}" + "0" * 30
        kind, name, *lease = node.lease(key, BS, "file:///x", conn)
        if kind == "fill":
            node.filled(key, name, tier.stage(key, os.urandom(BS), lease[0]), conn, lease[0])
    t = node.stats()["tiers"]["dram"]
    assert t["used_bytes"] <= t["capacity_bytes"], \
        f"tier holds {t['used_bytes']} bytes, capacity {t['capacity_bytes']}"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (a DRAM dir that really fills up); skipped where mounting is denied."""
    mnt = tmp_path / "shm1m"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(60)
def test_real_enospc_reads_go_on_and_tier_stops_admitting(runtime_dir, spawn_daemon,
                                                          blocks_dataset, small_tmpfs, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="cachemw")
    daemon = spawn_daemon(runtime_dir, dram_dir=small_tmpfs, dram_capacity="64MiB")
    try:
        fs = new_fs(runtime_dir)
        paths = list(blocks_dataset)
        full_at = None
        for i, path in enumerate(paths):
            assert fs.cat_file(path) == blocks_dataset[path]
            if full_at is None and fs.stats()["fill_errors"]:
                full_at = i
                t = fs.client.daemon_stats()["tiers"]["dram"]
                assert t["admitting"] is False
        assert full_at is not None, "1 MiB tmpfs never filled up"
        s = fs.stats()
        assert s["fill_errors"] >= 1
        assert s["fallbacks"] == 0
        assert s["misses"] + s["bypassed"] == NFILES  # every read answered, none twice
        assert s["fills"] == s["misses"] - s["fill_errors"]
        warnings = [r for r in caplog.records if r.name == "cachemw.client.fills"
                    and "could not fill" in r.getMessage()]
        assert len(warnings) == 1
        # the blocks that did fit are served; everything reads right a second time
        for path, data in blocks_dataset.items():
            assert fs.cat_file(path) == data
        stats = fs.client.daemon_stats()
        assert stats["tiers"]["dram"]["used_bytes"] == disk_usage(small_tmpfs)
        assert stats["counters"]["fill_errors"] == fs.stats()["fill_errors"]
        assert stats["inflight"] == 0
    finally:
        daemon.kill()
        daemon.wait(10)


@pytest.mark.timeout(90)
def test_nvme_tier_demotion_and_restart(runtime_dir, spawn_daemon, blocks_dataset, tmp_path):
    nvme = str(tmp_path / "nvme")
    config = dict(dram_capacity=6 * STORED, nvme_dir=nvme, nvme_capacity="64MiB")
    daemon = spawn_daemon(runtime_dir, **config)
    fs = new_fs(runtime_dir)
    for path, data in blocks_dataset.items():
        assert fs.cat_file(path) == data
    assert fs.stats()["misses"] == NFILES

    def settled():
        s = fs.client.daemon_stats()
        t = s["tiers"]
        return (t["dram"]["used_bytes"] <= int(6 * STORED * 0.95)
                and t["dram"]["blocks"] + t["nvme"]["blocks"] == NFILES and s)

    stats = wait_for(settled, 10, what="demotion below the DRAM high watermark")
    dram, nv = stats["tiers"]["dram"], stats["tiers"]["nvme"]
    assert dram["demotions"] > 0  # the rest of NVMe's blocks were filled there directly
    assert 0 < dram["demotions"] <= nv["blocks"]
    assert dram["evictions"] == nv["evictions"] == 0
    assert nv["used_bytes"] == nv["blocks"] * STORED == disk_usage(nvme)

    # every block still reads right, the demoted ones from NVMe, none from the source
    before = dict(fs.stats())
    for path, data in blocks_dataset.items():
        assert fs.cat_file(path) == data
        assert fs.cat_file(path, 100, 200) == data[100:200]
    after = fs.stats()
    assert after["bytes_from_source"] == before["bytes_from_source"]
    fs.client.flush()
    stats = wait_for(lambda: (d := fs.client.daemon_stats())["tiers"]["nvme"]["hits"] > 0 and d,
                     5, what="NVMe hits to be reported")
    assert stats["tiers"]["nvme"]["hit_bytes"] > 0

    # restart: the blocks on NVMe (and in the DRAM dir) are re-indexed, not refetched
    stats = wait_for(settled, 10, what="the tiers to settle")
    daemon.kill()
    daemon.wait(10)
    # what is on disk when it died (a promotion may have been under way at the kill)
    on_nvme = disk_usage(nvme) // STORED
    on_dram = disk_usage(stats["tiers"]["dram"]["path"]) // STORED
    assert on_nvme + on_dram >= NFILES
    spawn_daemon(runtime_dir, **config)
    stats = daemon_stats(runtime_dir)
    assert stats["counters"]["reindexed"] == NFILES
    # blocks stay where they are; a block caught in both tiers keeps its faster copy
    assert stats["tiers"]["dram"]["blocks"] == on_dram
    assert stats["tiers"]["nvme"]["blocks"] == on_nvme - (on_nvme + on_dram - NFILES)
    fresh = new_fs(runtime_dir)
    for path, data in blocks_dataset.items():
        assert fresh.cat_file(path) == data
    assert fresh.stats()["bytes_from_source"] == 0
    assert fresh.stats()["hits"] == NFILES


@pytest.mark.timeout(120)
def test_a_file_changed_between_two_jobs_on_an_nvme_tier_is_read_anew(runtime_dir, tmp_path,
                                                                      monkeypatch):
    """The node's metadata lives on the NVMe tier and outlives the job's daemon, so that
    the next job on the node starts warm. Under ``ttl`` a record the last job's readers
    wrote less than ``ttl`` ago was still fresh in the next job, whose NVMe tier held the
    old version's blocks: a file changed between the jobs came back with its old bytes
    (rewritten in place, grown, replaced). Metadata fetched before the node's daemon
    started is not fresh now."""
    from conftest import service_procs

    src = tmp_path / "src"
    src.mkdir()
    files = {src / f"f{i}": os.urandom(70_000) for i in range(3)}
    for path, data in files.items():
        path.write_bytes(data)
    monkeypatch.setenv("CACHEMW_NVME_DIR", str(tmp_path / "nvme"))
    monkeypatch.setenv("CACHEMW_NVME_CAPACITY", "64MiB")

    def job(runtime: str) -> fsspec.AbstractFileSystem:
        return fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=True,
                                 runtime_dir=runtime, skip_instance_cache=True)

    def stop(runtime: str) -> None:  # a clean stop: DRAM's blocks copied down to NVMe
        out = subprocess.run([sys.executable, "-m", "cachemw.cli", "stop"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, CACHEMW_RUNTIME_DIR=runtime))
        assert out.returncode == 0, out.stderr
        wait_for(lambda: not service_procs(runtime), 30, what="the daemon to exit")

    next_job = str(tmp_path / "runtime-next")  # the next job's runtime dir, the same NVMe dir
    try:
        fs = job(runtime_dir)
        for path, data in files.items():
            assert fs.cat_file(str(path)) == data
        assert fs.reader.fills.drain(30)  # the node's metadata records are written behind reads
        stop(runtime_dir)

        with open(src / "f0", "r+b") as f:  # in place, same size
            f.write(b"\x00" * 100)
        with open(src / "f1", "ab") as f:  # grown
            f.write(b"tail")
        (src / "f2.new").write_bytes(os.urandom(70_000))
        os.rename(src / "f2.new", src / "f2")  # replaced

        fresh = job(next_job)
        for path in files:
            assert fresh.cat_file(str(path)) == path.read_bytes(), path.name
        assert fresh.stats()["hits"] == 0  # every block of a new version comes from the store
        stats = daemon_stats(next_job)
        assert stats["counters"]["reindexed"] > 0  # the old versions' blocks were there
    finally:
        for runtime in (runtime_dir, next_job):
            for proc in service_procs(runtime):
                proc.kill()


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o1770])
def test_a_shared_directory_is_refused_as_a_tier_not_made_private(tmp_path, mode):
    """A tier directory is made 0700. One that other users can write to (as /tmp or
    /dev/shm), or a sticky one, is refused, naming a directory of its own to use, and left
    as it was: made 0700, it would lock its other users out."""
    from cachemw.tiers.directory import DirectoryTier

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    (shared / "someone-elses").write_bytes(b"x")
    with pytest.raises(PermissionError, match=r"nvme_dir .* other users can write to it.*cachemw-"):
        DirectoryTier("nvme", str(shared), create=True)
    assert os.stat(shared).st_mode & 0o7777 == mode and os.listdir(shared) == ["someone-elses"]
    own = shared / f"cachemw-{os.getuid()}"
    DirectoryTier("nvme", str(own), create=True)
    assert os.stat(own).st_mode & 0o777 == 0o700


def test_a_group_writable_directory_of_ones_own_is_made_private(tmp_path):
    """What a umask of 002 gives (0775): a directory of one's own, made 0700, as is a tier
    directory a reader's makedirs made again under a running daemon (its repair)."""
    from cachemw.tiers.directory import DirectoryTier

    own = tmp_path / "own"
    own.mkdir()
    os.chmod(own, 0o775)
    DirectoryTier("dram", str(own), create=True)
    assert os.stat(own).st_mode & 0o777 == 0o700


@pytest.mark.timeout(120)
def test_a_broken_dram_tier_costs_its_own_blocks_not_nvmes(runtime_dir, spawn_daemon, blocks_dataset,
                                                           tmp_path):
    """DRAM's directory made a file under the daemon: every read probes DRAM first and fails
    there (ENOTDIR). The blocks on NVMe are still read from NVMe and stay there (a drop of
    the failing DRAM copy must not take NVMe's); DRAM's are read from the source."""
    nvme = str(tmp_path / "nvme")
    spawn_daemon(runtime_dir, dram_capacity=6 * STORED, nvme_dir=nvme, nvme_capacity="64MiB")
    fs = new_fs(runtime_dir)
    for path, data in blocks_dataset.items():
        assert fs.cat_file(path) == data
    stats = wait_for(lambda: (s := fs.client.daemon_stats())["tiers"]["nvme"]["blocks"] > 0
                     and s["tiers"]["dram"]["blocks"] + s["tiers"]["nvme"]["blocks"] == NFILES and s,
                     10, what="demotions to NVMe")
    on_nvme = stats["tiers"]["nvme"]["blocks"]
    dram = stats["tiers"]["dram"]["path"]
    os.rename(dram, dram + ".aside")
    with open(dram, "wb") as f:
        f.write(b"not a directory")
    reader = new_fs(runtime_dir)  # a process that has not read these files yet
    for _ in range(2):
        before = dict(reader.stats())
        for path, data in blocks_dataset.items():
            assert reader.cat_file(path) == data
        from_source = reader.stats()["bytes_from_source"] - before["bytes_from_source"]
        assert from_source <= (NFILES - on_nvme) * BS, (from_source, on_nvme)
    reader.client.flush()
    stats = fs.client.daemon_stats()
    assert stats["tiers"]["nvme"]["blocks"] == on_nvme  # none dropped for DRAM's failure
    assert reader.stats()["tier_read_errors"] <= NFILES - on_nvme


def test_a_file_in_a_sub_directorys_place_is_passed_over_and_replaced(tmp_path):
    """A tier's 2-hex sub-directory made a file (a stray copy, a broken clean-up): listing
    the tier passes over it (a daemon's stop died there, leaving its DRAM tier in place), the
    tier is not intact, and repair (as a daemon's start or its check each second does)
    makes it a directory again, 0700."""
    from cachemw.keys import block_key
    from cachemw.tiers.directory import DirectoryTier

    tier = DirectoryTier("dram", str(tmp_path / "dram"), create=True)
    keys = [block_key("file:///x", "v", i, BS) for i in range(40)]
    for key in keys:
        tier.put(key, os.urandom(1000))
    broken = os.path.dirname(tier.block_path(keys[0]))
    shutil.rmtree(broken)
    with open(broken, "wb") as f:
        f.write(b"debris")
    listed = {e.key for e in tier.scan()}
    assert listed == {k for k in keys if not tier.block_path(k).startswith(broken + "/")}
    assert not tier.intact()
    tier.repair()
    assert tier.intact() and os.path.isdir(broken) and os.stat(broken).st_mode & 0o777 == 0o700
    assert tier.clear() > 0
