"""The private local Ray cluster ``cachemw start`` makes when given no address.

Its head runs with Ray's token authentication (the token in a 0600 file of the runtime
dir), in a 0700 temp dir of its own, and is remembered in ``<runtime_dir>/ray.json`` so
that later commands reach it and ``stop`` stops its processes, and only those (``ray stop``
would stop every Ray cluster of the user on the machine).

Starts are serialized per runtime dir (``<runtime_dir>/ray.start.lock``, flock): the process
that starts the cluster holds the lock until its daemon holds the runtime dir (or it exits,
or it forgets the cluster after a failed start), and ``read_state`` in another process waits
for that meanwhile. Why: two `cachemw start` at once each made a cluster of its own; the
second's ray.json replaced the first's, and the one whose daemon lost the runtime dir's lock,
cleaning up, deleted the winner's ray.json and token, so that neither `cachemw stop` nor
``--address`` could reach the daemon and its cluster again. Now the second finds the
first's cluster, as a start after it would (a no-op with the same settings). Within one
process, the flock is the process's (taken once, see _take_start_lock), so threads are
serialized by a lock of their own per runtime dir (``_thread_guard``): two threads
starting at once made two clusters, and a thread reading the state while another started
found none.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from ..files import flock_within
from ..protocol import ensure_private_dir, lock_holder

RAY_STATE = "ray.json"
START_LOCK = "ray.start.lock"
START_WAIT = 300.0  # at most this long another process waits for a start (ray start, placing)
_held: dict[str, int] = {}  # runtime dir -> the start lock's descriptor, while we hold it
_held_lock = threading.Lock()
_guards: dict[str, threading.RLock] = {}  # runtime dir -> held by the thread of ours starting there


def _thread_guard(runtime_dir: str) -> threading.RLock:
    with _held_lock:
        return _guards.setdefault(os.path.abspath(runtime_dir), threading.RLock())


def _new_locks_in_child() -> None:
    """A forked child has none of its parent's threads: a lock one of them held at the
    fork would be held for good (a read_state waited START_WAIT s)."""
    global _held_lock
    _held_lock = threading.Lock()
    _guards.clear()


os.register_at_fork(after_in_child=_new_locks_in_child)


def state_path(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, RAY_STATE)


def read_state(runtime_dir: str) -> dict | None:
    """The local cluster's record; while another process is starting it (see the module
    docstring), once that start has ended, for at most START_WAIT s."""
    _await_start(runtime_dir)
    try:
        with open(state_path(runtime_dir)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def start(runtime_dir: str) -> dict:
    """Start a private Ray head with token auth; remember how to reach it (its GCS is
    reached on 127.0.0.1: it listens on every interface). Under the runtime dir's start
    lock, held on return until this process's daemon holds the runtime dir (see
    _hold_start); a cluster another start made meanwhile (this one asked before that
    one took the lock) is RuntimeError, nothing touched: it is that start's to undo."""
    ensure_private_dir(runtime_dir)
    guard = _thread_guard(runtime_dir)
    if not guard.acquire(timeout=START_WAIT):
        raise TimeoutError(f"another `cachemw start` of {runtime_dir} in this process has "
                           f"not ended within {START_WAIT:.0f} s")
    try:
        _take_start_lock(runtime_dir)
        try:
            state = read_state(runtime_dir)
            if state is not None and alive(state):
                raise RuntimeError(
                    f"another `cachemw start` started the Ray cluster of {runtime_dir} "
                    f"meanwhile (at {state['address']}): run `cachemw start` again (with the "
                    f"same settings it is a no-op), or `cachemw stop`")
            state = _start(runtime_dir)
        except BaseException:
            _release_start_lock(runtime_dir)
            raise
        _hold_start(runtime_dir)
        return state
    finally:
        guard.release()


def _start(runtime_dir: str) -> dict:
    token_path = os.path.join(runtime_dir, "ray-token")
    if not os.path.exists(token_path):
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        raise RuntimeError("the `ray` command is not installed next to this Python")
    # unpredictable and 0700: a fixed name in /tmp could be taken first by another user.
    # Ray makes its temp dir (its sockets in it) 0777, so it goes one level down in ours.
    private = tempfile.mkdtemp(prefix=f"cachemw-ray-{os.getuid()}-", dir="/tmp")
    temp_dir = os.path.join(private, "ray")
    # --node-ip-address: Ray (2.60) takes loopback for the node's own address and listens
    # on every interface regardless; asked for all the same, for a Ray that honours it
    cmd = [ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    began = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        stop(temp_dir)
        forget_state(runtime_dir)
        raise RuntimeError(f"`ray start` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    os.chmod(temp_dir, 0o700)
    state = {"address": f"127.0.0.1:{port}", "token_path": token_path, "temp_dir": temp_dir,
             "started_by_cachemw": True, "strays": _client_servers(port, since=began)}
    fd = os.open(state_path(runtime_dir), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    return state


def _client_servers(port: int, since: float) -> list:
    """[pid, start time] of the Ray client servers our head started (``ray start`` has just
    returned: they exist): this user's processes of ``ray.util.client.server`` for the GCS
    on ``port``, started since ``since``. They name neither our temp dir nor a parent of
    ours (they are reparented at once), so stop finds them by what is kept
    here; the start time tells a pid reused since from them."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "uids", "create_time"]):
        try:
            args = p.info["cmdline"] or ()
            if (p.info["uids"] is not None and p.info["uids"].real == os.getuid()
                    and p.info["create_time"] >= since - 1
                    and "ray.util.client.server" in args
                    and any(a.startswith("--address=") and a.endswith(f":{port}") for a in args)):
                out.append([p.pid, p.info["create_time"]])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def stop(temp_dir: str, strays: list | None = None) -> None:
    """Stop the processes of the Ray cluster cachemw started, and only those.

    `ray stop` would stop every Ray cluster of this user on the machine; ours are the
    processes whose command line names our private temp dir, and all their descendants
    (the raylet's agents and workers rename themselves: ``ray::DashboardAgent``...), and
    ``strays``, the [pid, start time] of processes of ours that name neither (Ray's client
    server: see _client_servers), which would outlive the cluster on their port.
    """
    import psutil

    roots = []
    for pid, started in strays or ():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 0.01:  # the same process, not a reused pid
                roots.append(p)
        except psutil.Error:
            continue
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in (p.info["cmdline"] or ())):
                roots.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    procs = list(found.values())
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    parent = os.path.dirname(temp_dir)
    private = os.path.basename(temp_dir) == "ray" and os.path.basename(parent).startswith(
        f"cachemw-ray-{os.getuid()}-")
    shutil.rmtree(parent if private else temp_dir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(state: dict) -> bool:
    return answers(state["address"])


# What an HTTP/2 client sends first (RFC 9113 3.4): the preface, then its SETTINGS frame
# (empty); a server answers with a SETTINGS frame of its own (frame type 4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def answers(address: str) -> bool:
    """Does a gRPC server (as Ray's GCS is) answer at a Ray GCS address ``host:port``?
    Other forms ("auto", a ``ray://`` client address) are Ray's to resolve: True. Not
    only a listener: ray.init at a port where another server listens (an HTTP server, a
    typo'd port) retried for good, and the command with it (review ops5); a gRPC server
    answers an HTTP/2 preface with its SETTINGS frame. A server that accepts and says
    nothing within 2 s is taken as answering (a GCS paused, or under load: the cluster
    ``cachemw start`` made must not be taken for dead, diffrev-7); with TLS (RAY_USE_TLS)
    the port listening is all that is asked."""
    return probe(address, patience=2.0) in ("grpc", "silent")


def probe(address: str, patience: float) -> str:
    """What listens at ``address``: "grpc" (a server answered the HTTP/2 preface with its
    SETTINGS frame, as Ray's GCS does; also any form Ray resolves itself, and any listener
    under TLS), "silent" (accepted, said nothing within ``patience`` s), "other" (said
    something else, or closed), "unanswered" (no answer to the connection within
    ``patience`` s: a host that drops it) or "none" (refused, or no such host)."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return "grpc"
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address: [::1]:6379
    try:
        sock = socket.create_connection((host, int(port)), timeout=patience)
    except TimeoutError:
        return "unanswered"
    except OSError:
        return "none"
    try:
        with sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return "grpc"
            sock.settimeout(patience)
            sock.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                try:
                    chunk = sock.recv(9 - len(head))
                except TimeoutError:
                    return "silent"
                if not chunk:
                    return "other"
                head += chunk
            return "grpc" if head[3] == 4 else "other"  # a SETTINGS frame
    except OSError:
        return "other"  # (accepted, then reset)


def names(state: dict | None, address: str) -> bool:
    """Does ``address`` name the local cluster of ``state`` (``ray.json``)? Its GCS listens
    on every interface of this machine: its port at any address of this machine (127.0.0.1,
    localhost, the node's IP) is that cluster, whose token a command must then present."""
    import socket

    if state is None or "://" in address:
        return False
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) != int(state["address"].rpartition(":")[2]):
        return False
    host = host.removeprefix("[").removesuffix("]")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(family) as s:  # binds only to an address of this machine
                s.bind((host, 0))
            return True
        except (OSError, ValueError):  # not of this machine (in this family), or no host
            continue
    return False


def forget_state(runtime_dir: str) -> None:
    """The local cluster is gone: its state and its token (the next one makes a fresh one).
    A start of ours that failed ends here: its lock goes too."""
    for path in (state_path(runtime_dir), os.path.join(runtime_dir, "ray-token")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    _release_start_lock(runtime_dir)


def _take_start_lock(runtime_dir: str) -> None:
    """Hold the runtime dir's start lock, waiting for another process's start (at most
    START_WAIT s: then TimeoutError, nothing started)."""
    key = os.path.abspath(runtime_dir)
    with _held_lock:
        if key in _held:  # this process starts again (a start of ours is still held)
            return
    fd = os.open(os.path.join(runtime_dir, START_LOCK),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if not flock_within(fd, wait=START_WAIT, poll=0.1):
        os.close(fd)
        raise TimeoutError(f"another `cachemw start` of {runtime_dir} has not ended "
                           f"within {START_WAIT:.0f} s")
    with _held_lock:
        _held[key] = fd


def _release_start_lock(runtime_dir: str) -> None:
    with _held_lock:
        fd = _held.pop(os.path.abspath(runtime_dir), None)
    if fd is not None:
        os.close(fd)  # (closing the only descriptor unlocks)


def _hold_start(runtime_dir: str) -> None:
    """Let the start lock go once this process's start has placed its daemon (a Ray
    daemon holds the runtime dir's daemon lock), or forgotten the cluster (a failed start:
    forget_state), or after START_WAIT s, or with the process."""
    def watch() -> None:
        deadline = time.monotonic() + START_WAIT
        key = os.path.abspath(runtime_dir)
        while time.monotonic() < deadline:
            with _held_lock:
                if key not in _held:
                    return
            if (lock_holder(runtime_dir) or {}).get("kind") == "ray":
                break
            time.sleep(0.2)
        _release_start_lock(runtime_dir)

    threading.Thread(target=watch, name="cachemw-start-lock", daemon=True).start()


def _await_start(runtime_dir: str) -> None:
    """Wait while another process holds the runtime dir's start lock and no Ray daemon of
    it holds the runtime dir yet (its start is under way), at most START_WAIT s."""
    key = os.path.abspath(runtime_dir)
    with _held_lock:
        ours = key in _held
        guard = _guards.get(key) if ours else None
    if ours:  # our own process's start: done once its thread's start() returns
        if guard is not None and guard.acquire(timeout=START_WAIT):  # (at once in that
            guard.release()                                          # thread: reentrant)
        return
    try:
        fd = os.open(os.path.join(runtime_dir, START_LOCK),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # none was ever started here
        return
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return
        # returns once no start is under way (the lock is free), or its daemon is up (the
        # start has done what we wait for), or after START_WAIT s
        flock_within(fd, wait=START_WAIT, poll=0.1, exclusive=False,
                     give_up=lambda: (lock_holder(runtime_dir) or {}).get("kind") == "ray")
    finally:
        os.close(fd)
