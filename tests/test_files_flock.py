"""flock_within (cachemw/files.py), the one bounded wait for a file's lock: against a lock
another process holds, it gives up after its bound (or when told to) and leaves the
descriptor open, and takes the lock once the holder lets it go mid-wait; and its three
callers keep what a timeout means to each (the daemon's lock: False; a metadata table
write: BlockingIOError; a local Ray start: TimeoutError), closing their descriptor."""
from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import time

import pytest

from cachemw.client import metatable
from cachemw.cluster import local_ray
from cachemw.files import flock_within
from cachemw.protocol import DaemonLock

# holds the lock on argv[1] (ex or sh) until its stdin is closed
HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX if sys.argv[2] == "ex" else fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def hold():
    """hold(path, "ex"|"sh"): a process holding that lock on ``path`` until its stdin is
    closed (``.stdin.close()``); all are ended after the test."""
    procs = []

    def start(path, mode="ex"):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline() == "held\n"
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        for f in (p.stdin, p.stdout):
            if not f.closed:
                f.close()


def _open(path):
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_a_held_lock_is_waited_for_its_bound_then_false_with_the_fd_left_open(tmp_path, hold):
    path = tmp_path / "lock"
    hold(path, "ex")
    fd = _open(path)
    try:
        assert flock_within(fd, wait=0, poll=0.01) is False  # one try
        began = time.monotonic()
        assert flock_within(fd, wait=0.3, poll=0.01) is False
        assert 0.3 <= time.monotonic() - began < 30
        assert flock_within(fd, wait=0.1, poll=0.01, exclusive=False) is False
        os.fstat(fd)  # still open: the caller's to close
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_a_lock_released_mid_wait_is_taken(tmp_path, hold):
    path = tmp_path / "lock"
    holder = hold(path, "ex")
    fd = _open(path)
    asked = []

    def release_once():  # asked after a failed try: the wait is under way
        if not asked:
            holder.stdin.close()
        asked.append(1)
        return False

    try:
        assert flock_within(fd, wait=120, poll=0.01, give_up=release_once) is True
        assert asked  # it did wait
        holder.wait(timeout=30)
        other = _open(path)
        try:  # held by us now
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_give_up_ends_the_wait_before_its_bound(tmp_path, hold):
    path = tmp_path / "lock"
    hold(path, "ex")
    fd = _open(path)
    asked = []

    def third_time():
        asked.append(1)
        return len(asked) == 3

    try:
        began = time.monotonic()
        assert flock_within(fd, wait=120, poll=0.01, give_up=third_time) is False
        assert len(asked) == 3 and time.monotonic() - began < 60
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_shared_locks_share_and_keep_out_an_exclusive_one(tmp_path, hold):
    path = tmp_path / "lock"
    hold(path, "sh")
    shared, exclusive = _open(path), _open(path)  # two open files: two lockers
    try:
        assert flock_within(shared, wait=0, poll=0.01, exclusive=False) is True
        assert flock_within(exclusive, wait=0.1, poll=0.01) is False
    finally:
        os.close(shared)
        os.close(exclusive)


def test_a_second_descriptor_of_this_process_waits_for_the_first(tmp_path):
    path = tmp_path / "lock"
    first, second = _open(path), _open(path)
    try:
        assert flock_within(first, wait=0, poll=0.01) is True
        assert flock_within(second, wait=0.1, poll=0.01) is False
        os.close(first)
        first = -1
        assert flock_within(second, wait=0, poll=0.01) is True
    finally:
        for fd in (first, second):
            if fd >= 0:
                os.close(fd)


# The callers: what a timeout means to each, and no descriptor left behind.

@pytest.mark.timeout(60)
def test_daemon_lock_acquire_returns_false_after_its_wait(tmp_path):
    holder = DaemonLock(str(tmp_path))
    assert holder.acquire()
    try:
        other = DaemonLock(str(tmp_path))
        fds = _open_fds()
        began = time.monotonic()
        assert other.acquire(wait=0.2) is False
        assert time.monotonic() - began >= 0.2
        assert other.fd is None and _open_fds() == fds
    finally:
        holder.release()
    assert other.acquire(wait=0)
    other.release()


@pytest.mark.timeout(60)
def test_metadata_table_lock_raises_blocking_io_error_after_its_wait(tmp_path, hold):
    path = tmp_path / "lock"
    hold(path, "ex")
    fds = _open_fds()
    with pytest.raises(BlockingIOError) as caught:
        with metatable._FileLock(str(path), 0.1):
            pass
    assert caught.value.errno == errno.EWOULDBLOCK
    assert _open_fds() == fds


@pytest.mark.timeout(60)
def test_metadata_table_write_is_refused_while_its_lock_is_held(tmp_path, hold):
    table = metatable.MetaTable(str(tmp_path / "info"))
    assert table.store("/a", {"size": 1}, 10.0)
    hold(tmp_path / "info" / "lock", "ex")
    assert table.store("/b", {"size": 2}, 10.0) is False  # busy: not shared, no error


@pytest.mark.timeout(60)
def test_local_ray_start_lock_raises_timeout_error_after_its_wait(tmp_path, hold, monkeypatch):
    hold(tmp_path / local_ray.START_LOCK, "ex")
    monkeypatch.setattr(local_ray, "START_WAIT", 0.2)
    fds = _open_fds()
    with pytest.raises(TimeoutError, match="has not ended within 0 s"):
        local_ray._take_start_lock(str(tmp_path))
    assert _open_fds() == fds
    assert os.path.abspath(tmp_path) not in local_ray._held


@pytest.mark.timeout(60)
def test_local_ray_await_start_waits_for_a_start_under_way(tmp_path, hold, monkeypatch):
    holder = hold(tmp_path / local_ray.START_LOCK, "ex")
    monkeypatch.setattr(local_ray, "START_WAIT", 0.2)
    began = time.monotonic()
    local_ray._await_start(str(tmp_path))  # no daemon comes: its bound
    assert time.monotonic() - began >= 0.2
    holder.stdin.close()
    holder.wait(timeout=30)
    monkeypatch.setattr(local_ray, "START_WAIT", 120)
    began = time.monotonic()
    local_ray._await_start(str(tmp_path))  # no start under way: at once
    assert time.monotonic() - began < 60
