"""A process that starts while the node's daemon is on its way out (its starter gone, its
idle time up, a `cachemw stop`: the socket closed, the tiers being cleared, the lock still
held) waits for the lock to be freed and starts the next daemon. It took the daemon for
dead or unreachable: its misses went to the source uncached until a back-off ended, and it
warned that "the daemon started for ... is gone already", which it had never started
(review loaders5: 122 of 300 cold reads in one run)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import fsspec
import pytest

from cachemw.launch import stop_local

# A daemon that holds the lock and refuses every connection (no socket at its address):
# "withdrawn": on its way out (node/service.py close: the address withdrawn, then the socket
# closed and the tiers cleared, then the lock freed after a moment); "live": never stopping
# (its socket removed by hand, its address published), until killed.
_REFUSING = r"""
import json, os, sys, time
from cachemw.protocol import DaemonAddress, DaemonLock, ensure_private_dir, publish
runtime_dir, how = sys.argv[1], sys.argv[2]
ensure_private_dir(runtime_dir)
lock = DaemonLock(runtime_dir)
assert lock.acquire(5)
lock.describe(pid=os.getpid(), kind="autostarted")
if how == "live":
    publish(runtime_dir, DaemonAddress(node_id="n", pid=os.getpid(),
                                       socket=os.path.join(runtime_dir, "gone.sock"),
                                       secret="00" * 16, tiers=(), meta_dir=runtime_dir))
print("holding", flush=True)
if how == "live":
    time.sleep(3600)
time.sleep(float(sys.argv[3]))
lock.release()
"""


@pytest.mark.timeout(60)
def test_a_reader_started_while_the_daemon_stops_starts_the_next_one(tmp_path, caplog):
    runtime_dir = str(tmp_path / "rt")
    src = tmp_path / "src"
    src.mkdir()
    files = {str(src / f"f{i}"): os.urandom(5000 + i) for i in range(5)}
    for path, data in files.items():
        with open(path, "wb") as f:
            f.write(data)
    stopping = subprocess.Popen([sys.executable, "-c", _REFUSING, runtime_dir, "withdrawn", "1.0"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stopping.stdout.readline().strip() == "holding"
        fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                               skip_instance_cache=True)
        with caplog.at_level(logging.WARNING, logger="cachemw"):
            for path, data in files.items():
                assert fs.cat_file(path) == data
        stats = fs.stats()
        assert stats["fallbacks"] == 0 and stats["misses"] == len(files), stats
        assert not [r for r in caplog.records if "unreachable" in r.getMessage()], caplog.text
        assert stopping.wait(10) == 0
        holder = json.loads(open(os.path.join(runtime_dir, "daemon.lock")).read() or "{}")
        assert holder.get("pid") not in (None, stopping.pid)  # a new daemon holds it
    finally:
        if stopping.poll() is None:
            stopping.kill()
        stopping.stdout.close()
        stop_local(runtime_dir)


@pytest.mark.timeout(60)
def test_tier_settings_a_running_daemon_lacks_are_said_once(tmp_path, runtime_dir,
                                                              spawn_daemon, caplog,
                                                              monkeypatch):
    """A process's daemon settings apply only to a daemon it starts; where one runs with
    other tiers they were ignored without a word (review loaders5)."""
    spawn_daemon(runtime_dir, dram_capacity="32MiB")
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 5000)

    def read(**options):
        fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                               skip_instance_cache=True, **options)
        assert fs.cat_file(str(path)) == b"x" * 5000

    with caplog.at_level(logging.WARNING, logger="cachemw"):
        read(daemon_options={"dram_capacity": "32MiB"})  # what it has: nothing to say
        assert not [r for r in caplog.records if "other tiers" in r.getMessage()]
        monkeypatch.setenv("CACHEMW_NVME_DIR", str(tmp_path / "nvme"))
        monkeypatch.setenv("CACHEMW_NVME_CAPACITY", "1GiB")
        read(daemon_options={"dram_capacity": "64MiB"})
        read(daemon_options={"dram_capacity": "64MiB"})
    said = [r.getMessage() for r in caplog.records if "other tiers" in r.getMessage()]
    assert len(said) == 1, said
    assert "dram_capacity 64.0 MiB (it has 32.0 MiB)" in said[0], said
    assert "nvme_dir" in said[0] and "no nvme tier" in said[0], said

    import multiprocessing  # a DataLoader worker (forked) has its parent's settings: quiet

    log_file = tmp_path / "worker.log"

    def worker():
        handler = logging.FileHandler(log_file)
        logging.getLogger("cachemw").addHandler(handler)
        fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                               daemon_options={"dram_capacity": "64MiB"},
                               skip_instance_cache=True)
        fs.cat_file(str(path))
        handler.flush()

    child = multiprocessing.get_context("fork").Process(target=worker)
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert "other tiers" not in log_file.read_text()


@pytest.mark.timeout(60)
def test_a_live_daemon_that_refuses_is_not_waited_on(tmp_path):
    """A daemon that refuses connections with its address still published (its socket
    removed by hand, its backlog full) is not stopping: reads go to the source at once,
    counted, as before; waiting for its lock cost each read call the whole budget of
    silence, 5 s (diffrev-6)."""
    import time

    runtime_dir = str(tmp_path / "rt")
    path = tmp_path / "f.bin"
    path.write_bytes(b"y" * 5000)
    live = subprocess.Popen([sys.executable, "-c", _REFUSING, runtime_dir, "live", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "holding"
        fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                               skip_instance_cache=True)
        for _ in range(2):
            began = time.monotonic()
            assert fs.cat_file(str(path)) == b"y" * 5000
            assert time.monotonic() - began < 2.0
            time.sleep(2.2)  # past the back-off: asked again
        assert fs.stats()["fallbacks"] == 2
    finally:
        live.kill()
        live.wait(10)
        live.stdout.close()
