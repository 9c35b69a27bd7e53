"""Starting, replacing and stopping a node's autostarted daemon from any process, without Ray.

Liveness is the daemon lock (protocol.DaemonLock), never the socket file: a daemon killed
by SIGKILL leaves its socket and registry behind, but the kernel drops its lock. A process
that needs a daemon and finds the lock free takes the lock itself, clears the dead one's
socket and registry, and hands the lock to the daemon it spawns (an inherited descriptor),
so of many processes that find the daemon dead at once exactly one starts the next, with
no moment in which the lock is free. The others wait a few seconds for it to publish.

The new daemon re-indexes the DRAM tier the dead one left: a block file exists only once
published (rename), and every read verifies its checksums, so a whole block is kept and a
damaged one costs a refetch; partial and staged fills, which no lease owns any more, are
deleted (tiers/directory.py). An NVMe tier is always re-indexed, never wiped.

A daemon that cannot start (an unusable tier directory...) says why on a pipe its starter
reads, within its start-up time instead of a 20 s stall, and the starter records the
failure in the runtime dir for FAILURE_MEMORY seconds, so the processes after it (every
DataLoader worker) do not each respawn a daemon that is sure to fail.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import shutil
import signal
import site
import socket
import stat
import subprocess
import sys
import threading
import time

from .config import DaemonConfig
from .files import atomic_write
from .node_daemon import CHECKPOINTS
from .processes import process_alive
from .protocol import (LOCK, REGISTRY, SOCKET, DaemonAddress, DaemonLock, check_private_dir,
                       ensure_private_dir, last_holder, lock_holder, lookup)
from .tiers.directory import DirectoryTier

log = logging.getLogger(__name__)

FAILED = "daemon.failed"
FREED = "dram.freed"  # the DRAM tier the last daemon freed at its clean exit (see note_freed)
LOG = "daemon.log"
FAILURE_MEMORY = 30.0  # seconds a failed start is remembered (no respawn meanwhile)
START_WAIT = 5.0  # how long a reader waits for a new daemon before reading on from the source


class DaemonStartError(RuntimeError):
    """The daemon could not start; the message is the daemon's own."""


def held_by_another_host(runtime_dir: str) -> str | None:
    """What to say if ``runtime_dir``'s daemon lock is held by another host's daemon: the
    directory is on a filesystem the nodes share (where locks are seen across nodes); else
    None. Nothing of such a directory is this node's to stop or remove."""
    holder = lock_holder(runtime_dir) or {}
    host = _other_host(holder)
    if host is None:
        return None
    return (f"the cachemw {holder.get('kind', '')} daemon of host {host} (pid "
            f"{holder.get('pid', '?')}) serves {runtime_dir}: the runtime dir is on a "
            f"filesystem the nodes share; give each node one of its own (CACHEMW_RUNTIME_DIR "
            f"or --runtime-dir: a node-local path, such as one under /tmp, or one with "
            f"{{node_id}} in it)").replace("  ", " ")


def _other_host(holder: dict) -> str | None:
    """The host a lock file's holder runs on if it is not this one (None: this one, or a
    holder that did not say)."""
    host = holder.get("host")
    return host if host and host != socket.gethostname() else None


def holder_alive(holder: dict) -> bool:
    """Is the process a lock file names still that process? Never one of another host (a
    runtime dir on a filesystem the nodes share): its pid here is some other process."""
    return _other_host(holder) is None and process_alive(holder.get("pid"), holder.get("start"))


def _options_key(options: dict | None) -> str:
    text = json.dumps(options or {}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def recent_failure(runtime_dir: str, options: dict | None) -> str | None:
    """The message of a failed start with these settings less than FAILURE_MEMORY s ago."""
    path = os.path.join(runtime_dir, FAILED)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if record.get("options") != _options_key(options):
        return None
    if not 0 <= time.time() - record.get("time", 0) < FAILURE_MEMORY:
        return None
    return record.get("error") or "the daemon could not start"


def _record_failure(runtime_dir: str, options: dict | None, error: str) -> None:
    record = {"time": time.time(), "options": _options_key(options), "error": error}
    try:
        atomic_write(os.path.join(runtime_dir, FAILED), json.dumps(record).encode())
    except OSError:
        pass


def clear_failure(runtime_dir: str) -> None:
    try:
        os.unlink(os.path.join(runtime_dir, FAILED))
    except OSError:
        pass


def free_dram(path: str) -> int:
    """Free a DRAM tier an autostarted daemon owned: its blocks and its metadata records
    (/dev/shm is the node's RAM, shared with other jobs). Returns the bytes freed."""
    if not os.path.isdir(path):
        return 0
    freed = DirectoryTier("dram", path).clear()
    shutil.rmtree(os.path.join(path, "meta"), ignore_errors=True)
    return freed


def note_freed(runtime_dir: str, dram: str | None) -> None:
    """Note (``dram``: the tier's path), or forget (None), which DRAM tier the last daemon
    of ``runtime_dir`` freed when it exited; called with the daemon lock held. Why: a clean
    exit leaves the lock file empty, so a `cachemw stop` after it would not know the
    tier was an autostarted daemon's, to free what a client wrote into it afterwards.
    A daemon forgets it when it starts: the tier is its own then, kept for a restart if
    it is Ray's."""
    path = os.path.join(runtime_dir, FREED)
    try:
        if dram is None:
            os.unlink(path)
        else:
            atomic_write(path, json.dumps({"dram": os.path.abspath(dram)}).encode())
    except OSError:  # none to forget; or not noted: only a later stop's sweep is lost
        pass


def _freed_dram(runtime_dir: str) -> str | None:
    """The DRAM tier noted by note_freed, if any."""
    path = os.path.join(runtime_dir, FREED)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        with open(path, "rb") as f:
            return json.loads(f.read(4096)).get("dram")
    except (OSError, ValueError, AttributeError):
        return None


def _unlink_stale(runtime_dir: str) -> None:
    """A dead daemon's socket and registry (called with the daemon lock held)."""
    for name, kind in ((SOCKET, stat.S_ISSOCK), (REGISTRY, stat.S_ISREG)):
        path = os.path.join(runtime_dir, name)
        try:
            if kind(os.lstat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass


def reclaim(runtime_dir: str, *, free_dram_tier: bool) -> dict | None:
    """Clear what a dead daemon left in ``runtime_dir``: its socket and registry, and, if
    ``free_dram_tier`` and it was autostarted (whose DRAM tier is freed when it exits), its
    DRAM tier. None if a daemon lives (nothing is touched), else what the dead one was and
    the bytes freed (``{}``: no daemon had been there)."""
    if not os.path.isdir(runtime_dir) or not os.path.exists(os.path.join(runtime_dir, LOCK)):
        return {}
    lock = DaemonLock(runtime_dir)
    if not lock.acquire(wait=1.0):
        return None
    try:
        dead = last_holder(runtime_dir)
        address = lookup(runtime_dir)
        left = os.path.lexists(os.path.join(runtime_dir, SOCKET)) or address is not None
        _unlink_stale(runtime_dir)
        freed = 0
        kind = dead.get("kind") or (address.kind if address else None)
        dram = dead.get("dram") or next((t["path"] for t in (address.tiers if address else ())
                                         if t["name"] == "dram"), None)
        if free_dram_tier and kind == "autostarted" and dram:
            freed = free_dram(dram)
        elif free_dram_tier and not dead and address is None:  # exited cleanly, freeing its
            noted = _freed_dram(runtime_dir)  # DRAM tier: what was written into it since
            if noted:
                freed = free_dram(noted)
        if not (dead or left):
            if freed:
                log.info("freed %d bytes written into the DRAM tier of %s after its daemon "
                         "exited", freed, runtime_dir)
            return {}
        return {"pid": dead.get("pid") or (address.pid if address else None), "kind": kind,
                "freed": freed}
    finally:
        lock.release()


def await_address(runtime_dir: str, wait: float) -> DaemonAddress | None:
    """The address of the daemon that holds the lock once it has published it; None if it
    has not within ``wait`` s, or if no daemon holds the lock any more."""
    deadline = time.monotonic() + wait
    while True:
        holder = lock_holder(runtime_dir)
        if holder is None:
            return None
        address = lookup(runtime_dir)
        if address is not None and holder.get("pid") == address.pid:
            return address
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


# The daemon runs this cachemw, not one it would find first on its own path: ``python -m``
# puts the working directory first, and a reader started where a directory named cachemw
# lies (a checkout of another version, say) had its daemon import that one. The daemon
# runs in its runtime dir (private; no modules), with this package's parent on its path
# where the path would not hold it (a checkout run in place), after the PYTHONPATH given:
# never a site-packages ahead of the standard library.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _daemon_env() -> dict | None:
    """The daemon's environment: this one, with this package's parent on PYTHONPATH unless
    it is a site directory the daemon's path holds anyway (None: this one as it is)."""
    sites = set(site.getsitepackages()) | {site.getusersitepackages()}
    if _PACKAGE_PARENT in sites:
        return None
    given = os.environ.get("PYTHONPATH", "")
    if _PACKAGE_PARENT in given.split(os.pathsep):
        return None
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (given, _PACKAGE_PARENT) if p))


def spawn_detached(runtime_dir: str, options: dict | None = None, *, idle_exit: float = 600,
                   parent_pid: int | None = None, wait: float = START_WAIT):
    """Start a daemon process for ``runtime_dir`` unless one lives; return its address once
    published, None if none has within ``wait`` s (the caller reads on and retries).
    The daemon exits when ``parent_pid`` exits, if given, or else after ``idle_exit``
    seconds with no client. Raises DaemonStartError with the daemon's own message if it
    could not start (or did not within FAILURE_MEMORY s with the same options), and
    UnsafeDirectory if the runtime dir is not safely ours."""
    ensure_private_dir(runtime_dir)
    config = DaemonConfig.build(runtime_dir=runtime_dir, **(options or {}))
    settings = config.to_dict()  # what it would run with, CACHEMW_* included
    failure = recent_failure(runtime_dir, settings)
    if failure is not None:
        raise DaemonStartError(failure)
    lock = DaemonLock(runtime_dir)
    if not lock.acquire(wait=0.2):  # one lives, or another process is starting one
        return await_address(runtime_dir, wait)
    try:
        dead = last_holder(runtime_dir)
        _unlink_stale(runtime_dir)  # clients must not take a dead one's secret for the new one
        new_dram = os.path.abspath(config.tiers[0].path)
        if dead.get("kind") == "autostarted" and dead.get("dram") not in (None, new_dram):
            free_dram(dead["dram"])  # the next daemon will not re-index it
        lock.describe(starting=os.getpid())
        read_end, write_end = os.pipe()
        try:
            log_path = os.path.join(runtime_dir, LOG)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            log_start = os.fstat(fd).st_size  # what this start writes comes after
            with os.fdopen(fd, "ab") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "cachemw.node.service", "--runtime-dir", runtime_dir,
                     "--idle-exit", str(idle_exit), "--options", json.dumps(options or {}),
                     "--lock-fd", str(lock.fd), "--ready-fd", str(write_end),
                     *(["--parent-pid", str(parent_pid)] if parent_pid else [])],
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                    start_new_session=True, pass_fds=(lock.fd, write_end),
                    cwd=runtime_dir, env=_daemon_env(),
                )
            # it is our child until we exit: reaped as soon as it ends, not left a zombie
            threading.Thread(target=proc.wait, name="cachemw-daemon-reaper", daemon=True).start()
        finally:
            os.close(write_end)
    except BaseException:  # the lock goes whatever failed, even Ctrl-C; re-raised
        lock.release()
        raise
    lock.forget()  # the daemon holds it now; if it could not start, no one does
    try:
        answer = _read_answer(read_end, wait)
    finally:
        os.close(read_end)
    if answer is None:  # still starting (a large tier to re-index): read on meanwhile
        return None
    if answer == "ok":
        return lookup(runtime_dir)
    if answer.startswith("error "):
        error = answer[len("error "):]
    elif answer:
        error = answer
    else:  # it died without a word: how, and what it logged in this start, if anything
        try:
            status = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            status = None
        if status is not None and status < 0:  # killed (kill -9, the OOM killer): not its
            raise DaemonStartError(  # settings, so not remembered: the next process retries
                f"the daemon was killed while it started ({_signal_name(-status)})")
        error = _log_tail(runtime_dir, log_start) or (
            f"the daemon exited while it started (exit status {status})")
    _record_failure(runtime_dir, settings, error)
    raise DaemonStartError(error)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _read_answer(fd: int, wait: float) -> str | None:
    """What the new daemon wrote on its ready pipe ("ok", "error <message>", or "" if it
    exited without a word); None if it has not finished starting within ``wait`` s."""
    deadline = time.monotonic() + wait
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:  # closed: the daemon said all it had to say, or died
            return b"".join(chunks).decode(errors="replace").strip()
        chunks.append(chunk)


def _log_tail(runtime_dir: str, since: int) -> str:
    """The last line the daemon's log got from offset ``since`` on (this start's), or ""."""
    try:
        with open(os.path.join(runtime_dir, LOG), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(since, f.tell() - 2000))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    except OSError:
        return ""


def stop_local(runtime_dir: str, timeout: float = 10.0, notes: list | None = None) -> bool:
    """Stop the daemon of ``runtime_dir`` that is not Ray-managed, found by its lock (so
    also one whose socket or registry is gone): SIGTERM, which it handles as a normal
    exit, then SIGKILL if it has not exited within ``timeout``; then clear whatever a
    dead daemon left (socket, registry, an autostarted daemon's DRAM tier). True if a
    live daemon was stopped. ``notes`` gets a line about leftovers reclaimed."""
    try:
        check_private_dir(runtime_dir)
    except FileNotFoundError:
        return False
    holder = lock_holder(runtime_dir)
    stopped = False
    if holder is not None:
        if holder.get("kind") == "ray":  # Ray restarts its actors: stopped through Ray
            return False
        pid = holder.get("pid")
        if not pid or not holder_alive(holder):  # starting: give it a moment to say who
            time.sleep(0.5)
            holder = lock_holder(runtime_dir) or {}
            pid = holder.get("pid")
        if pid and holder_alive(holder):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a stopped daemon must run to exit cleanly
            deadline = time.monotonic() + timeout
            while lock_holder(runtime_dir) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if lock_holder(runtime_dir) is not None and holder_alive(holder):
                log.warning("daemon pid %d did not exit within %.0f s: killing it", pid, timeout)
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while lock_holder(runtime_dir) is not None and time.monotonic() < deadline:
                    time.sleep(0.05)
            stopped = True
    dead = reclaim(runtime_dir, free_dram_tier=True)
    if dead and not stopped and notes is not None:
        notes.append(f"reclaimed what a dead daemon (pid {dead.get('pid')}) left in "
                     f"{runtime_dir}: its socket and registry"
                     + (f", {dead['freed']} bytes of its DRAM tier" if dead["freed"] else ""))
    clear_failure(runtime_dir)
    return stopped


def remove_checkpoint_copies(runtime_dir: str) -> bool:
    """Delete the node-DRAM copies of checkpoints that saves through a daemon of this
    runtime dir made (the durable copies are at each checkpointer's root)."""
    path = os.path.join(runtime_dir, CHECKPOINTS)
    try:
        check_private_dir(runtime_dir)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
