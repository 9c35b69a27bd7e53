"""Files of the kernel's pseudo filesystems read as they are: a sysfs file states a page
(4096 bytes) whatever it holds, and read in blocks of that size it failed every time with a
ChangedSourceError ("4096 bytes expected ... the source returned 23; reopen") that no
reopen cured. It is read to its end now, uncached, as a ``/proc`` file (stated as 0 bytes)
is; a regular file of exactly a page is cached as before.
"""
from __future__ import annotations

import os

import pytest
from fsspec.implementations.local import LocalFileSystem

from cachemw.tiers.source import PAGE_SIZE, SourceTier
from conftest import daemon_stats


def _sysfs_file() -> str:
    """A sysfs file whose stated size (a page) is not its content's."""
    for path in ("/sys/devices/system/cpu/online", "/sys/kernel/mm/transparent_hugepage/enabled",
                 "/sys/kernel/mm/transparent_hugepage/defrag", "/sys/power/state"):
        try:
            with open(path, "rb") as f:
                data = f.read()
            if os.stat(path).st_size == PAGE_SIZE and len(data) != PAGE_SIZE:
                return path
        except OSError:
            continue
    pytest.skip("no readable sysfs file here")


def _plain(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.timeout(60)
def test_sysfs_files_read_to_their_end(make_cache_fs, runtime_dir):
    path = _sysfs_file()
    fs = make_cache_fs()
    for _ in range(2):  # the second read as the first: nothing stale was kept
        want = _plain(path)  # (these files' content is stable: the CPUs online, a setting)
        assert fs.cat_file(path) == want
        assert fs.cat_file(path, 1, 3) == want[1:3]
        assert fs.cat_file(path, -2) == want[-2:]
        with fs.open(path, "rb") as f:
            assert f.read() == want
        assert fs.cat([path, path + "-not-there"], on_error="omit") == {path: want}
        assert fs.cat_ranges([path, path], [0, 1], [2, None]) == [want[:2], want[1:]]
    assert fs.info(path)["size"] == PAGE_SIZE  # what fsspec's local filesystem says
    assert fs.stats()["bypassed"] >= 1
    # /proc files (stated as 0 bytes) as before
    assert fs.cat_file("/proc/self/stat").startswith(str(os.getpid()).encode())


@pytest.mark.timeout(60)
def test_regular_page_sized_files_are_cached(make_cache_fs, runtime_dir, make_tree):
    files = make_tree([PAGE_SIZE, PAGE_SIZE, 100])
    fs = make_cache_fs()
    for _ in range(3):
        for path, data in files.items():
            assert fs.cat_file(path) == data
            with fs.open(path, "rb") as f:
                assert f.read() == data
    fs.client.flush()
    counters = daemon_stats(runtime_dir)["counters"]
    assert counters["leases"] == len(files)  # each filled once, then hits
    assert fs.stats().get("bypassed", 0) == 0


def test_pseudo_filesystem_told_by_its_type(tmp_path):
    source = SourceTier(LocalFileSystem())
    regular = tmp_path / "page.bin"
    regular.write_bytes(b"x" * PAGE_SIZE)
    assert not source.on_pseudo_fs(str(regular))
    assert not source.on_pseudo_fs(str(tmp_path / "missing"))
    assert not source.on_pseudo_fs(str(tmp_path))  # a directory is no file of one
    assert source.on_pseudo_fs(_sysfs_file())


@pytest.mark.timeout(60)
def test_a_fifo_with_no_writer_is_refused_not_waited_on(make_cache_fs, tmp_path):
    """A FIFO given as a source path blocked its reader for good in open(), before the
    check that refuses what is not a regular file could run (review loaders6)."""
    import subprocess
    import sys

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    script = f"""
import errno, fsspec
fs = fsspec.filesystem("cachemw", skip_instance_cache=True)
for read in (lambda: fs.cat_file({str(fifo)!r}), lambda: fs.cat_file({str(fifo)!r}, 0, 10),
             lambda: fs.open({str(fifo)!r}, "rb").read()):
    try:
        read()
        print("read")
    except OSError as exc:
        print(errno.errorcode.get(exc.errno), "regular file" in str(exc))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=20, env=dict(os.environ, CACHEMW_RUNTIME_DIR=str(tmp_path / "rt")))
    assert out.stdout.split("\n")[:3] == ["EINVAL True"] * 3, (out.stdout, out.stderr[-2000:])


@pytest.mark.timeout(60)
def test_a_file_under_a_write_lease_is_read_once_the_lease_is_given_up(make_cache_fs, tmp_path):
    """A file another process holds a write lease on (Samba's oplocks, an NFS server's
    delegations): an open without blocking fails EAGAIN at once, where a blocking one
    breaks the lease and waits. Opened without blocking only (for FIFOs), the read failed
    with BlockingIOError (diffrev-11)."""
    import fcntl
    import subprocess
    import sys

    path = tmp_path / "sample.bin"
    data = os.urandom(100_000)
    path.write_bytes(data)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, signal, time
fd = os.open({str(path)!r}, os.O_RDWR)
signal.signal(signal.SIGIO, lambda *a: (time.sleep(0.3), fcntl.fcntl(fd, {fcntl.F_SETLEASE}, fcntl.F_UNLCK)))
try:
    fcntl.fcntl(fd, {fcntl.F_SETLEASE}, fcntl.F_WRLCK)
except OSError as exc:
    print("no lease", exc, flush=True)
else:
    print("leased", flush=True)
time.sleep(30)
"""], stdout=subprocess.PIPE, text=True)
    try:
        said = holder.stdout.readline().strip()
        if said != "leased":
            pytest.skip(f"no write lease on this filesystem: {said}")
        fs = make_cache_fs()
        assert fs.cat_file(str(path)) == data
    finally:
        holder.kill()
        holder.wait()
