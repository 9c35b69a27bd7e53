"""Telling consumer processes that a step committed, through a node-local channel.

A watcher binds a Unix datagram socket in a node-local directory (the fast tier, or a
per-root directory under /tmp); the coordinator sends one small datagram to every socket
there after each commit. The watcher blocks on its socket, so it learns of a commit at once
without touching the PFS; a slow fallback poll of the checkpoint directories (default every
30 s) covers lost datagrams and savers on other nodes. Dead watchers' sockets are removed by
the next notification that finds nobody listening; the last watcher to close removes the
directory (one per checkpoint root under /tmp would otherwise stay for good).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import tempfile
import uuid

CHANNEL_DIRNAME = ".cachemw-watch"


def channel_dir(root_url: str, fast_root: str | None) -> str:
    """The node-local directory where watchers of ``root_url`` bind their sockets."""
    if fast_root is not None:
        return os.path.join(fast_root, CHANNEL_DIRNAME)
    digest = hashlib.blake2b(root_url.encode(), digest_size=8).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"cachemw-watch-{digest}")


def notify(directory: str, message: dict) -> int:
    """Send ``message`` to every watcher in ``directory``; return how many received it."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    payload = json.dumps(message).encode()
    sent = gone = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for name in names:
            if not name.endswith(".sock"):
                continue
            path = os.path.join(directory, name)
            try:
                sock.sendto(payload, path)
                sent += 1
            except (ConnectionRefusedError, FileNotFoundError):
                gone += 1
                try:
                    os.unlink(path)  # its watcher is gone
                except FileNotFoundError:
                    pass
            except OSError as exc:  # a full queue: the watcher will see it on its next poll
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                    raise
    if gone and not sent:  # the last watchers were killed (no close): the directory goes too
        try:
            os.rmdir(directory)
        except OSError:
            pass
    return sent


class Listener:
    """One watcher's socket; ``receive`` returns the next message or None after ``timeout``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            for attempt in range(3):
                os.makedirs(directory, mode=0o700, exist_ok=True)
                try:
                    self.sock.bind(self.path)
                    break
                except FileNotFoundError:  # the last watcher before us removed it: again
                    if attempt == 2:
                        raise
            os.chmod(self.path, 0o600)
        except BaseException:
            self.sock.close()
            raise

    def receive(self, timeout: float | None) -> dict | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.directory)  # only when no other watcher's socket is left in it
        except OSError:
            pass

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
