"""Writing files so that no reader ever sees half of one, and making them durable: one
helper each for the whole package (block files, metadata records, the daemon's registry,
the checkpointer's files); and waiting, for a bounded time, for a file's lock."""
from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import Callable


def atomic_write(path: str, *chunks, mode: int = 0o600, durable: bool = False) -> int:
    """Write ``chunks`` (bytes-like) as the file ``path``: a reader sees the old file or the
    whole new one, never a part. The bytes go to a temp file beside it (created with
    ``O_EXCL``, so never through a planted symlink; named ``*.tmp`` for sweepers), which
    is renamed over ``path``; on any failure it is removed. ``durable``: fsync the file
    before the rename and the directory after it. Returns the bytes written."""
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    written = 0
    try:
        try:
            views = [memoryview(c).cast("B") for c in chunks]
            while views:  # one system call for all chunks, unless the kernel writes less
                n = os.writev(fd, views) if len(views) > 1 else os.write(fd, views[0])
                written += n
                while views and n >= len(views[0]):
                    n -= len(views.pop(0))
                if views and n:
                    views[0] = views[0][n:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:  # any failure, interrupts too: no temp file left behind; re-raised
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_path(os.path.dirname(path) or ".")
    return written


def fsync_path(path: str) -> None:
    """fsync a file or directory by its path (its data, or its entries, reach the disk)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dirs(path: str) -> None:
    """``os.makedirs`` with every directory it makes 0700, not only the last one (a tier
    directory removed under the daemon must not come back readable by others)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def flock_within(fd: int, *, wait: float, poll: float, exclusive: bool = True,
                 give_up: Callable[[], bool] | None = None) -> bool:
    """Lock the open file ``fd`` (``flock``: exclusive, or shared), trying every ``poll``
    seconds for up to ``wait`` seconds, at least once (``wait`` 0: one try). True once
    held; False when ``wait`` has passed with the lock held elsewhere, or sooner when
    ``give_up()``, asked after each failed try, says there is no more to wait for.

    Tries, not a blocking flock: a blocking one cannot be bounded without a signal
    (``alarm``), which is not a library's to take, and its holder may be a stopped process.
    ``poll`` is each caller's, to fit how long its lock is held: a metadata table write
    holds its lock for microseconds (1 ms), the daemon's lock is held by a probe for
    microseconds and by a daemon shutting down for a moment (20 ms), a local Ray start for
    seconds (100 ms). ``give_up``: a wait for another process's Ray start ends once its
    daemon is up, though the starter still holds the lock then.

    The descriptor stays the caller's, open in every outcome: closing it (its last copy)
    releases the lock, and the caller says what a timeout means (False, TimeoutError,
    BlockingIOError). No state is kept here, so nothing to undo in a forked child; a
    lock belongs to the open file, which a child shares with its parent until it closes
    its copy (callers that hold one across a fork see to it). An interrupted flock or
    sleep (EINTR) is retried by Python; an error other than EWOULDBLOCK raises."""
    deadline = time.monotonic() + wait
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    while True:
        try:
            fcntl.flock(fd, op)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline or (give_up is not None and give_up()):
                return False
        time.sleep(poll)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` (files or directories) in one step: a reader, or a
    crash, sees both old or both new (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs,
    btrfs, tmpfs). False where the kernel, the filesystem or the C library cannot (then
    nothing was moved); other failures raise OSError."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # a C library without it (glibc < 2.28, musl < 1.2.4)
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


# Filesystems whose pages are allocated when first touched, also by a read through a
# mapping: a hole read through a MAP_SHARED mapping of a full one ends the process with
# SIGBUS, which no handler can turn into an error. (On a disk filesystem a read of a hole
# needs no space: only a full memory filesystem kills a mapping reader.)
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "devtmpfs", "ramfs", "hugetlbfs", "shm"})
_memory_devices: dict[int, bool] = {}  # st_dev -> on a memory filesystem (from mountinfo)


def preallocate(fd: int, size: int) -> None:
    """Give the open file ``fd`` real space for its first ``size`` bytes (extending it to
    ``size`` if shorter), without changing what it holds: a file that is mapped must have
    no holes (``mappable``). OSError (ENOSPC) where the filesystem has not the room: here,
    where it can be handled, not as SIGBUS in a process reading it. A filesystem without
    fallocate gets the size only: none such is a memory filesystem (tmpfs has it)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)


def mappable(st: os.stat_result) -> bool:
    """May the file of ``st`` be mapped and read without risking SIGBUS from the kernel?
    Not if it has holes (fewer blocks than its size) on a memory filesystem (tmpfs), or on
    a filesystem that cannot be told (a hole on a disk filesystem is harmless, and files
    there may hold fewer blocks than bytes: compression, ZFS)."""
    if st.st_blocks * 512 >= st.st_size:
        return True
    memory = _memory_devices.get(st.st_dev)
    if memory is None:
        memory = _memory_devices[st.st_dev] = _on_memory_filesystem(st.st_dev)
    return not memory


def _on_memory_filesystem(dev: int) -> bool:
    """Is the device ``dev`` (``st_dev``) a memory filesystem's? True where it cannot be
    told (no /proc, a device mountinfo does not list): then only a file without holes is
    mapped, the safe side."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    fstype = line.split(" - ", 1)[1].split()[0]
                    return fstype in _MEMORY_FILESYSTEMS
    except OSError:
        pass
    return True
