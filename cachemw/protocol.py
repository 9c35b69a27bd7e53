"""How clients find and talk to their node's daemon, without Ray.

The daemon publishes ``<runtime_dir>/daemon.json`` (socket path, a per-daemon secret, its
tier directories) in a 0700 directory, and holds an exclusive lock on
``<runtime_dir>/daemon.lock`` for as long as it lives: the lock, not the socket file, says
whether a daemon lives (the kernel drops it when the process dies, however it dies), and
the lock file names its holder (pid, kind, DRAM tier) so a dead one's leftovers can be
found. The socket is a ``multiprocessing.connection`` Unix socket: mode 0600 in that
private directory, plus an HMAC challenge with the secret on every connection.

The runtime dir is trusted only if it is a real directory (not a symlink) of this user
that no one else can write to: on a shared node another user can create
``/dev/shm/cachemw-$UID`` first, and a registry planted there would point readers at a
daemon and tier files of theirs.

What travels on the socket, op by op, is cachemw.ops.
"""
from __future__ import annotations

import fcntl
import json
import os
import stat
import weakref
from dataclasses import asdict, dataclass

from .files import atomic_write, flock_within
from .readtime import MISS_COUNTERS, READ_TIME_COUNTERS

# Counters clients add to through access reports; the daemon adds the rest.
CLIENT_COUNTERS = (
    "hits", "hit_bytes", "misses", "fills", "bytes_from_source", "fallbacks",
    "bypassed", "corrupt_repaired", "fill_errors",
    "tier_read_errors",  # a tier's block file that could not be read (EIO, EACCES): read as a miss
    "remote_hits",   # cached at their owner node, sent straight from there
    "remote_reads",  # owned elsewhere and not cached there yet: fetched by the owner
    "direct_failures",  # an owner's block server failed or timed out: read the usual way
    "cold_gets",  # cold reads whose GET named the file's version: no info asked first
    "cold_get_fallbacks",  # ... whose GET named none (no ETag, size): info asked, then read
    "cold_get_duplicates",  # ... whose block another process filled meanwhile: fetched twice
    "claimed_duplicates",  # misses fetched under their claim whose block was filled (or
                           # being filled) by a process without one: fetched twice
) + READ_TIME_COUNTERS + MISS_COUNTERS  # where the readers' time went (readtime.py)

REGISTRY = "daemon.json"
LOCK = "daemon.lock"
SOCKET = "daemon.sock"



@dataclass(frozen=True)
class DaemonAddress:
    node_id: str
    pid: int
    socket: str
    secret: str  # hex
    tiers: tuple  # ({"name", "path", "capacity"}, ...) fastest first
    meta_dir: str
    kind: str = "autostarted"  # or "ray"
    # when the daemon started (time.time()): node-shared metadata fetched before it is not
    # fresh under ``ttl``, for it may be a previous job's (the meta dir lives on the NVMe
    # tier, which outlives jobs) and the files may have changed between the jobs
    started: float = 0.0

    @property
    def authkey(self) -> bytes:
        return bytes.fromhex(self.secret)


class UnsafeDirectory(PermissionError):
    """A directory another user could control: refused, never chmod-ed or written to."""


def check_private_dir(path: str) -> os.stat_result:
    """Raise UnsafeDirectory unless ``path`` is a real directory (not a symlink) owned by
    this user that no other user can write to. A directory of ours that others may only
    read or list is accepted: nothing can have been put into it (ensure_private_dir then
    closes it)."""
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = f"a symlink (to {os.readlink(path)!r})"
    elif not stat.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid != os.getuid():
        why = f"owned by uid {st.st_uid}, not by us (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why is not None:
        raise UnsafeDirectory(f"{path}: {why}; refusing to use it (another user may have "
                              f"made it: remove it, or set another runtime_dir)")
    return st


def ensure_private_dir(path: str) -> str:
    """Create ``path`` as a 0700 directory of ours; an existing one must pass
    check_private_dir (group/other read bits of our own directory are taken away)."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = check_private_dir(path)
    if st.st_mode & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False)
    return path


def _private_file(path: str, flags: int = os.O_RDONLY):
    """Open a file of ours that only we can read, never through a symlink; None if it
    does not exist (or is not such a file)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # absent, or a symlink (ELOOP)
        return None
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd


def publish(runtime_dir: str, address: DaemonAddress) -> None:
    atomic_write(os.path.join(runtime_dir, REGISTRY), json.dumps(asdict(address)).encode())


def unpublish(runtime_dir: str, pid: int) -> None:
    """Remove the registry if it still names the daemon ``pid``."""
    address = lookup(runtime_dir)
    if address is not None and address.pid == pid:
        try:
            os.unlink(os.path.join(runtime_dir, REGISTRY))
        except FileNotFoundError:
            pass


def lookup(runtime_dir: str) -> DaemonAddress | None:
    """The address the daemon of ``runtime_dir`` published; None if there is none, or if
    the directory or the registry is not safely ours (see check_private_dir)."""
    try:
        check_private_dir(runtime_dir)
    except OSError:
        return None
    fd = _private_file(os.path.join(runtime_dir, REGISTRY))
    if fd is None:
        return None
    try:
        with os.fdopen(fd) as f:
            d = json.load(f)
        d["tiers"] = tuple(d["tiers"])
        return DaemonAddress(**d)
    except (OSError, ValueError, TypeError, KeyError):  # a torn or foreign file: absent
        return None


_held_locks: "weakref.WeakSet[DaemonLock]" = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    # A forked child (a DataLoader worker) must not keep a daemon's lock alive after the
    # daemon (or the process that is handing the lock to a new daemon) is gone.
    for lock in list(_held_locks):
        lock.forget()


os.register_at_fork(after_in_child=_forget_locks_in_child)


class DaemonLock:
    """The lock a live daemon holds on its runtime dir; released by the kernel when it dies.

    The file names the holder (``{"pid", "kind", "dram", "host"}``, JSON) so that `cachemw stop`
    can find a daemon whose socket or registry is gone, and what a dead one left behind.
    A process that starts a daemon takes the lock first and hands it to the new process
    (``fd`` is inherited), so exactly one of several processes that find the daemon dead
    starts the next one.
    """

    def __init__(self, runtime_dir: str) -> None:
        self.path = os.path.join(runtime_dir, LOCK)
        self._fd: int | None = None

    @property
    def fd(self) -> int | None:
        return self._fd

    def acquire(self, wait: float = 0.0) -> bool:
        """Take the lock, trying for up to ``wait`` seconds (a probe holds it for
        microseconds, a daemon shutting down for a moment)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafeDirectory(f"{self.path}: not a lock file of ours, refusing it")
        if not flock_within(fd, wait=wait, poll=0.02):
            os.close(fd)
            return False
        self._fd = fd
        _held_locks.add(self)
        return True

    def adopt(self, fd: int) -> None:
        """Take over a lock already held through ``fd`` (handed over by our starter)."""
        os.set_inheritable(fd, False)
        self._fd = fd
        _held_locks.add(self)

    def describe(self, **holder) -> None:
        """Write who holds the lock (pid, kind, DRAM tier) into the lock file."""
        data = json.dumps(holder).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def still_held(self) -> bool:
        """Is the lock file at our path still the one we hold? Not once the runtime dir or
        the lock file was removed (an ``rm -rf`` to reset the cache): a new daemon would
        take a new lock there, and every tool would find that one, not us."""
        if self._fd is None:
            return False
        try:
            here, ours = os.stat(self.path, follow_symlinks=False), os.fstat(self._fd)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino)

    def release(self) -> None:
        """Unlock and close (the daemon's exit: the lock is free for the next one)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no holder any more
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            _held_locks.discard(self)

    def forget(self) -> None:
        """Close our descriptor without unlocking: the lock stays with whoever shares it (the
        daemon it was handed to); a forked child's copy must not keep it alive."""
        fd, self._fd = self._fd, None
        _held_locks.discard(self)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def lock_holder(runtime_dir: str) -> dict | None:
    """Who holds the daemon lock of ``runtime_dir``: None if no one does (no daemon lives),
    else what the holder wrote (``{}`` while it has not yet said)."""
    path = os.path.join(runtime_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def last_holder(runtime_dir: str) -> dict:
    """What the lock file says of its last holder (for leftovers of a dead daemon)."""
    fd = _private_file(os.path.join(runtime_dir, LOCK))
    if fd is None:
        return {}
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return True
