"""How clients find and talk to their node's daemon, without Ray.

The daemon publishes ``<runtime_dir>/daemon.json`` (socket path, a per-daemon secret, its
tier directories) in a 0700 directory, and holds an exclusive lock on
``<runtime_dir>/daemon.lock`` for as long as it lives, so a crashed daemon is detected
without pid games. The socket is a ``multiprocessing.connection`` Unix socket: mode 0600
in that private directory, plus an HMAC challenge with the secret on every connection.

Messages are tuples ``(op, *args)``; those in REPLY_OPS are answered (``invalidate`` too,
so a write returns only once the old blocks are gone), the rest (``filled``, ``abort``,
``report``, ``drop``) are one-way so a client never waits on them.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass

# Counters clients add to through access reports; the daemon adds the rest.
CLIENT_COUNTERS = (
    "hits", "hit_bytes", "misses", "fills", "bytes_from_source", "fallbacks",
    "bypassed", "corrupt_repaired", "fill_errors",
    "remote_hits",   # cached at their owner node, sent straight from there
    "remote_reads",  # owned elsewhere and not cached there yet: fetched by the owner
    "direct_failures",  # an owner's block server failed or timed out: read the usual way
)

REGISTRY = "daemon.json"
LOCK = "daemon.lock"
SOCKET = "daemon.sock"

REPLY_OPS = frozenset({"hello", "lease", "lease_many", "invalidate", "ring", "stats", "ping",
                       "shutdown"})


@dataclass(frozen=True)
class DaemonAddress:
    node_id: str
    pid: int
    socket: str
    secret: str  # hex
    tiers: tuple  # ({"name", "path", "capacity"}, ...) fastest first
    meta_dir: str
    kind: str = "autostarted"  # or "ray"

    @property
    def authkey(self) -> bytes:
        return bytes.fromhex(self.secret)


def ensure_private_dir(path: str) -> str:
    """Create ``path`` as a 0700 directory owned by us; refuse one someone else owns."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path}: owned by uid {st.st_uid}, refusing to use it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def publish(runtime_dir: str, address: DaemonAddress) -> None:
    path = os.path.join(runtime_dir, REGISTRY)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(address), f)
    os.rename(tmp, path)


def unpublish(runtime_dir: str, pid: int) -> None:
    """Remove the registry if it still names the daemon ``pid``."""
    address = lookup(runtime_dir)
    if address is not None and address.pid == pid:
        try:
            os.unlink(os.path.join(runtime_dir, REGISTRY))
        except FileNotFoundError:
            pass


def lookup(runtime_dir: str) -> DaemonAddress | None:
    try:
        with open(os.path.join(runtime_dir, REGISTRY)) as f:
            d = json.load(f)
        d["tiers"] = tuple(d["tiers"])
        return DaemonAddress(**d)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (ValueError, TypeError, KeyError):  # a torn or foreign file: treat as absent
        return None


class DaemonLock:
    """The lock a live daemon holds on its runtime dir; released by the kernel when it dies."""

    def __init__(self, runtime_dir: str) -> None:
        self.path = os.path.join(runtime_dir, LOCK)
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.set_inheritable(fd, False)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` alive on this node? (A pid owned by another user counts as alive.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
