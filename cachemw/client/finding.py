"""Where a process finds its node's daemon, starts one if none lives, and what it says
when it has none: the daemon connection's (connection.py) questions to the runtime dir, which hold no
state of the link's own."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import time

from ..config_values import format_size, parse_size
from ..launch import LOG, START_WAIT, DaemonStartError, await_address, spawn_detached
from ..processes import process_state
from ..protocol import DaemonAddress, UnsafeDirectory, check_private_dir, lock_holder, lookup


def is_main_process() -> bool:
    return multiprocessing.parent_process() is None


def find(runtime_dir: str, *, may_start: bool, daemon_config: dict, timeout: float) -> DaemonAddress | None:
    """The live daemon's address: the published one if its publisher holds the lock;
    a new daemon's if none lives and ``may_start`` (a dead Ray-managed daemon is Ray's to
    restart). Waits a few seconds at most for one that is starting."""
    if os.path.lexists(runtime_dir):
        check_private_dir(runtime_dir)  # UnsafeDirectory: someone else's
    address = lookup(runtime_dir)
    holder = lock_holder(runtime_dir)
    if holder is None:  # no daemon lives; a published address is a dead one's
        # (not for the exit flush's last report: no daemon is started just for that)
        if may_start and (address is None or address.kind != "ray"):
            return start(runtime_dir, daemon_config)
        return address  # its tier files still serve hits
    if address is not None and address.pid == holder.get("pid"):
        return address
    found = await_address(runtime_dir, min(START_WAIT, timeout))
    if (found is None and may_start and (address is None or address.kind != "ray")
            and lock_holder(runtime_dir) is None):
        # the holder was a daemon on its way out (its address withdrawn, then its lock
        # freed): the next is started now, not after a back-off of misses to the source
        return start(runtime_dir, daemon_config)
    return found or address


def released(runtime_dir: str, pid: int, wait: float) -> bool:
    """Whether the daemon ``pid``, which refused a connection while holding the node's
    lock, frees the lock within ``wait`` s: a daemon stopping (its process's parent gone,
    its idle time out, a ``cachemw stop``) closes its socket before it has cleared its
    tiers and let the lock go. A process started in those moments waited out a back-off,
    its misses read uncached, and was told the daemon it never started was gone."""
    deadline = time.monotonic() + wait
    while True:
        holder = lock_holder(runtime_dir)
        if holder is None:
            return True
        if holder.get("pid") != pid or time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


_outliving = 0  # how many daemons_outlive() blocks are under way


@contextlib.contextmanager
def daemons_outlive():
    """While in this block, a daemon this process starts outlives it (and exits once idle),
    as one a DataLoader worker starts does: for a warm, whose purpose is to leave the cache
    warm. A daemon started as the warm's own and lost under it was replaced by one that
    ended with the warm and freed what it had warmed, after the warm had reported every
    block cached (review ops6). A block, not for good: the warm may be a call of the Python
    API in a trainer, whose later daemons are its own (diffrev-10)."""
    global _outliving
    _outliving += 1
    try:
        yield
    finally:
        _outliving -= 1


def start(runtime_dir: str, daemon_config: dict) -> DaemonAddress | None:
    """No daemon lives: start one, as a process of its own (never threads in the trainer,
    which would fight it for the GIL). Started by a main process, it ends with that
    process; started by a DataLoader worker (a dataset of plain cachemw:: URLs), or by a
    process whose daemons outlive it, it exits once idle."""
    parent = os.getpid() if is_main_process() and not _outliving else None
    return spawn_detached(runtime_dir, daemon_config, parent_pid=parent, wait=START_WAIT)


def running(pid: int, timeout: float) -> bool:
    """The daemon is not stopped (SIGSTOP, a debugger), or runs again within ``timeout``
    (``daemon_timeout``, as long as it may stay silent): a handshake would wait on it."""
    deadline = time.monotonic() + timeout
    while process_state(pid) in ("T", "t"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def why_none(runtime_dir: str, *, may_start: bool) -> str:
    """Why no daemon's address was found, for the one warning."""
    if lock_holder(runtime_dir) is not None:
        return "the daemon is still starting"
    if may_start:  # one was started and is gone already
        return (f"the daemon started for {runtime_dir} is gone already (its log: "
                f"{os.path.join(runtime_dir, LOG)}); another is started at the "
                f"next miss after the back-off")
    return "no daemon runs (start one with `cachemw start`)"


def why_not_started(runtime_dir: str, exc: Exception) -> str:
    """Why no daemon can be had: it cannot start, or the runtime dir is not safely ours."""
    if isinstance(exc, UnsafeDirectory):
        return f"cachemw runtime dir refused: {exc}"
    if isinstance(exc, DaemonStartError):
        return f"cachemw daemon cannot start: {exc}"
    return f"cachemw daemon cannot start in {runtime_dir}: {exc}"


def ignored_settings(address: DaemonAddress, asked: dict) -> list[str]:
    """The tier settings ``asked`` (a filesystem's ``daemon_options`` over the CACHEMW_*
    variables) that the running daemon at ``address`` does not have: they apply only to a
    daemon the process starts, and were ignored without a word (review loaders5: a
    daemon a DataLoader worker had started kept serving the next job's other tiers)."""
    have = {t["name"]: t for t in address.tiers}
    out = []
    for tier in ("dram", "nvme"):
        held = have.get(tier)
        where, size = asked.get(f"{tier}_dir"), asked.get(f"{tier}_capacity")
        if where is not None and "{" in str(where):  # a cluster's per-node form: not here
            where = None
        try:
            size = None if size is None else parse_size(size, name=f"{tier}_capacity")
        except ValueError:
            size = None  # (checked where the filesystem was made)
        if where is not None and (held is None or os.path.realpath(str(where))
                                  != os.path.realpath(held["path"])):
            out.append(f"{tier}_dir {str(where)!r} (it has "
                       f"{repr(held['path']) if held else f'no {tier} tier'})")
        if size is not None and (held is None or size != held.get("capacity")):
            out.append(f"{tier}_capacity {format_size(size)} (it has "
                       f"{format_size(held['capacity']) if held else f'no {tier} tier'})")
    return out
