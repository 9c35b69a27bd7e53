"""One read call waits on a silent (stopped) daemon for one ``daemon_timeout`` in all, not
once per request it makes (client/silence.py). README: ``daemon_timeout`` is the "seconds
the daemon may stay silent (hung, stopped) before a read goes to the source instead"; a
``cat`` once waited 2 x that (review faults3, defect 6)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from cachemw.bench import SlowLocalFileSystem
from cachemw.claims import Claims, claims_dir
from cachemw.client import connection
from cachemw.keys import block_key
from cachemw.processes import process_state
from conftest import published, wait_for

BS = 65536
TIMEOUT = 3.0
LATENCY = 0.5  # the source's per request, longer than the back-off below


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_read_call_waits_one_daemon_timeout_for_a_stopped_daemon(
        runtime_dir, spawn_daemon, tmp_path, monkeypatch):
    """With the daemon stopped, a ``cat`` of two files asks the daemon twice: for the ring
    (re-asked every 2 s) and then, after fetching the block it could claim from a slow
    source, for the lease of the block another process has claimed. The back-off after
    the first silence is over by then, so the second request (a new connection, whose
    check waits for the stopped daemon) waited another daemon_timeout: 2 x in one call."""
    monkeypatch.setattr(connection, "RETRY_SECONDS", 0.2)  # over before the source answers
    daemon = spawn_daemon(runtime_dir)
    import fsspec

    fs = fsspec.filesystem("cachemw", fs=SlowLocalFileSystem(latency=LATENCY),
                           runtime_dir=runtime_dir, autostart=False, block_size=BS,
                           daemon_timeout=TIMEOUT, skip_instance_cache=True)
    warm, claimed, free = (str(tmp_path / n) for n in ("warm.bin", "claimed.bin", "free.bin"))
    contents = {}
    for p in (warm, claimed, free):
        contents[p] = os.urandom(BS)
        with open(p, "wb") as f:
            f.write(contents[p])
    assert fs.cat_file(warm) == contents[warm]  # connected, the ring known
    published(fs)
    meta = fs.meta.file(claimed)
    assert fs.meta.file(free)
    key = block_key(meta.url, meta.version, 0, BS)
    other = Claims(claims_dir(runtime_dir))
    assert other.take(key)  # as another process would: this one asks for the lease
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(daemon.pid) == "T", 10, what="the daemon to stop")
        fs.reader.direct._fetched_at = -1e9  # the ring is due again (every 2 s)
        started = time.monotonic()
        got = fs.cat([claimed, free])
        took = time.monotonic() - started
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        other.release(key)
    assert got == {claimed: contents[claimed], free: contents[free]}
    # one timeout and the source's requests (2 x LATENCY): was 2 x TIMEOUT + that
    assert took < 2 * TIMEOUT, took
    assert fs.stats()["fallbacks"] >= 1
