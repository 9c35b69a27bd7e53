"""A read that holds some of its blocks' claims asks the daemon for the others beside its
own fetches (client/misses.py, fanout.beside). Whatever interrupts it (Ctrl-C, any
BaseException) leaves no fill lease of the daemon's and no claim held by this process,
which lives on (a notebook, a loop that catches KeyboardInterrupt): every other reader of
those blocks would wait the daemon's lease wait (30 s) on each read (review diffrev-5)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import fsspec
import pytest

from cachemw.claims import claims_dir
from cachemw.client import fanout
from cachemw.keys import block_key
from cachemw.processes import process_start

BS = 1 << 16


def _file_with_block_1_claimed(runtime_dir, tmp_path):
    """(fs, path, data, block keys, a process holding block 1's claim)."""
    path = str(tmp_path / "f.bin")
    data = os.urandom(2 * BS)
    with open(path, "wb") as f:
        f.write(data)
    fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                           autostart=False, block_size=BS, skip_instance_cache=True)
    meta = fs.meta.file(path)
    keys = [block_key(meta.url, meta.version, i, BS) for i in (0, 1)]
    other = subprocess.Popen(["sleep", "100"])  # another process, fetching block 1
    with open(os.path.join(claims_dir(runtime_dir), keys[1]), "w") as f:
        f.write(f"{other.pid} {process_start(other.pid)}")
    return fs, path, data, keys, other


def _another_read_takes(runtime_dir, path, data) -> float:
    prog = ("import fsspec, time\n"
            f"fs = fsspec.filesystem('cachemw', target_protocol='file', runtime_dir={runtime_dir!r}, "
            f"autostart=False, block_size={BS})\n"
            f"t = time.monotonic(); d = fs.cat_file({path!r}); print(time.monotonic() - t)\n"
            f"assert d == open({path!r}, 'rb').read()\n")
    done = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.timeout(120)
def test_an_interrupt_while_the_claimed_fetches_run_ends_the_leases_already_granted(
        runtime_dir, spawn_daemon, tmp_path):
    """The daemon granted the fill of block 1 (its holder gone meanwhile); the fetch of
    block 0, this read's own claim, is then interrupted: the fill lease ends with it."""
    spawn_daemon(runtime_dir)
    fs, path, data, keys, other = _file_with_block_1_claimed(runtime_dir, tmp_path)
    real = fs.reader.source.read_block
    leased = threading.Event()

    def interrupted(p, index, *args, **kwargs):
        if index == 0:
            leased.wait(20)  # the lease of block 1 came back: a fill
            time.sleep(0.2)
            raise KeyboardInterrupt
        return real(p, index, *args, **kwargs)

    lease_many = fs.reader._lease_many

    def lease(pieces):
        replies = lease_many(pieces)
        leased.set()
        return replies

    fs.reader.source.read_block = interrupted
    fs.reader._lease_many = lease
    threading.Timer(0.5, lambda: (other.kill(), other.wait())).start()  # its claim goes stale
    with pytest.raises(KeyboardInterrupt):
        fs.cat_file(path)
    assert leased.is_set()
    fs.reader.source.read_block = real
    assert _another_read_takes(runtime_dir, path, data) < 10  # before: 30 s, the lease left


@pytest.mark.timeout(120)
def test_an_interrupt_before_the_claimed_fetches_started_releases_their_claims(
        runtime_dir, spawn_daemon, tmp_path):
    """The pool of claimed fetches is busy; the wait on the daemon for block 1 is
    interrupted before this read's fetch of block 0 started: it never starts, and its
    claim is released (before: held by this live process for good)."""
    spawn_daemon(runtime_dir)
    fs, path, data, keys, other = _file_with_block_1_claimed(runtime_dir, tmp_path)
    gate = threading.Event()
    pool = fanout._executor(fanout.CLAIMED)
    busy = [pool.submit(gate.wait, 30) for _ in range(fanout.LIMIT - 1)]

    def interrupted(pieces):
        raise KeyboardInterrupt

    fs.reader._lease_many = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            fs.cat_file(path)
    finally:
        gate.set()
        for b in busy:
            b.result(30)
        other.kill()
        other.wait()
    assert not os.path.exists(os.path.join(claims_dir(runtime_dir), keys[0]))
