"""Losing the daemon costs speed, never a read: with the daemon SIGKILLed mid-epoch every
read still returns the right bytes (hits from the tier files, misses from the source), the
fallbacks are counted and logged once; a new daemon re-indexes the tiers and clients
reconnect to it on their own."""
from __future__ import annotations

import logging

import fsspec
import pytest

from conftest import daemon_stats, wait_for

BS = 65536


def nblocks(files, paths):
    return sum(max(1, -(-len(files[p]) // BS)) for p in paths)


def new_fs(runtime_dir):
    return fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                             runtime_dir=runtime_dir, skip_instance_cache=True)


def unreachable_warnings(caplog):
    return [r for r in caplog.records
            if r.name == "cachemw.client.link" and "unreachable" in r.getMessage()]


@pytest.mark.timeout(90)
def test_daemon_killed_mid_epoch_then_restarted(runtime_dir, spawn_daemon, dataset, caplog):
    caplog.set_level(logging.INFO, logger="cachemw")
    root, files = dataset
    paths = sorted(files)
    half, rest = paths[:len(paths) // 2], paths[len(paths) // 2:]
    daemon = spawn_daemon(runtime_dir)
    fs = new_fs(runtime_dir)

    for p in half:
        assert fs.cat_file(p) == files[p]
    assert fs.stats()["fills"] == nblocks(files, half)
    assert fs.stats()["fallbacks"] == 0
    fs.client.flush()  # so the new daemon's counters below hold only what came after the kill
    wait_for(lambda: daemon_stats(runtime_dir)["counters"]["fills"] == nblocks(files, half), 5,
             what="the report to the first daemon")

    daemon.kill()
    daemon.wait(10)

    # the rest of the epoch: misses read the source, each block counted as a fallback
    for p in rest:
        assert fs.cat_file(p) == files[p]
    s = fs.stats()
    assert s["fallbacks"] == nblocks(files, rest)
    assert s["fills"] == nblocks(files, half)
    for p in rest:  # other read paths work too
        with fs.open(p) as f:
            f.seek(1000)
            assert f.read(2000) == files[p][1000:3000]
        assert fs.cat_ranges([p, p], [0, -10], [10, None]) == [files[p][:10], files[p][-10:]]

    # hits are still served from the tier files: no byte from the source
    before = dict(fs.stats())
    for p in half:
        assert fs.cat_file(p) == files[p]
    after = fs.stats()
    assert after["hits"] - before["hits"] == nblocks(files, half)
    assert after["bytes_from_source"] == before["bytes_from_source"]
    assert after["fallbacks"] == before["fallbacks"]

    # a process that starts now (a new DataLoader worker) finds the tiers and reads hits too
    late = new_fs(runtime_dir)
    for p in half:
        assert late.cat_file(p) == files[p]
    assert late.stats()["bytes_from_source"] == 0
    assert late.stats()["hits"] == nblocks(files, half)

    # once per client that needed the daemon, not per read: the late one only hit, so it
    # never reached for the daemon (its hits are reported once one is back)
    assert len(unreachable_warnings(caplog)) == 1
    assert len([r for r in unreachable_warnings(caplog) if r.levelno == logging.WARNING]) == 1
    assert late.client.link() is None

    # a new daemon on the same runtime dir adopts the blocks; the client finds it alone
    spawn_daemon(runtime_dir)
    stats = daemon_stats(runtime_dir)
    assert stats["counters"]["reindexed"] == nblocks(files, half)
    assert stats["tiers"]["dram"]["blocks"] == nblocks(files, half)
    wait_for(fs.client.connected, 5, interval=0.2, what="the client to reconnect")
    fallbacks = fs.stats()["fallbacks"]
    for p in rest:
        assert fs.cat_file(p) == files[p]
    s = fs.stats()
    assert s["fallbacks"] == fallbacks
    assert s["fills"] == nblocks(files, paths)
    fs.client.flush()
    stats = wait_for(lambda: (d := daemon_stats(runtime_dir))["counters"]["fills"]
                     == nblocks(files, rest) and d, 5, what="the client's report")
    assert stats["counters"]["fallbacks"] == fallbacks  # counted while it was gone, reported now
    assert stats["tiers"]["dram"]["blocks"] == nblocks(files, paths)
    assert len(unreachable_warnings(caplog)) == 1


@pytest.mark.timeout(60)
def test_no_daemon_at_all_reads_from_source(runtime_dir, dataset, caplog):
    """autostart=False and no daemon ever: every read succeeds, counted, one warning."""
    caplog.set_level(logging.WARNING, logger="cachemw")
    root, files = dataset
    fs = new_fs(runtime_dir)
    for _ in range(2):
        for p, data in files.items():
            assert fs.cat_file(p) == data
    assert fs.stats()["fallbacks"] == 2 * nblocks(files, files)
    assert fs.stats()["hits"] == fs.stats()["fills"] == 0
    assert len(unreachable_warnings(caplog)) == 1


@pytest.mark.timeout(90)
def test_a_daemon_stopped_before_the_process_exits_is_not_reported_at_exit(
        runtime_dir, spawn_daemon, dataset):
    """The exit flush (access reports, fills written behind) finding the daemon gone is no
    news: nothing is read after it, so no "misses read the source directly" warning."""
    import subprocess
    import sys

    _, files = dataset
    daemon = spawn_daemon(runtime_dir)
    code = (
        "import sys, fsspec\n"
        f"fs = fsspec.filesystem('cachemw', target_protocol='file', block_size={BS},"
        f" autostart=False, runtime_dir={runtime_dir!r}, skip_instance_cache=True)\n"
        f"for p in {sorted(files)!r}:\n"
        "    fs.cat_file(p)\n"
        "print('read', flush=True)\n"
        "sys.stdin.readline()\n"  # the daemon is stopped meanwhile, reports still unsent
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "read"
        daemon.kill()
        daemon.wait(10)
        _, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "unreachable" not in err, err


def test_the_warning_says_why_no_daemon_was_found(runtime_dir):
    """No daemon's address: with autostart one was just started and is gone, so the warning
    points at its log, not at `cachemw start` (which a user of autostart never ran)."""
    from cachemw.client.finding import why_none
    started = why_none(runtime_dir, may_start=True)
    assert "gone already" in started
    assert f"{runtime_dir}/daemon.log" in started
    assert "start one with `cachemw start`" in why_none(runtime_dir, may_start=False)
