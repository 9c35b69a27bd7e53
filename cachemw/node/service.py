"""NodeService: a node cache served on the node's local socket.

This is the body of every daemon: the one a process autostarts when none runs on the node
(``python -m cachemw.node.service``: a process of its own, so it never competes with the trainer
for its GIL; it ends with the main process that started it, or after being idle when a
DataLoader worker started it) and the Ray actor started by ``cachemw start`` run the same
thing. It takes the runtime dir's
lock (one daemon per node), re-indexes the tiers, starts the socket server and eviction,
and publishes its address for clients.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading

from ..config import DaemonConfig
from .cache import NodeCache
from ..protocol import (SOCKET, DaemonAddress, DaemonLock, ensure_private_dir, pid_alive, publish,
                       unpublish)
from .server import SocketServer
from ..tiers.directory import DirectoryTier

log = logging.getLogger(__name__)


class DaemonAlreadyRunning(RuntimeError):
    """Another live daemon holds this runtime dir."""


class NodeService:
    def __init__(self, config: DaemonConfig, *, kind: str = "autostarted") -> None:
        self.config = config
        self.kind = kind
        ensure_private_dir(config.runtime_dir)
        self._lock = DaemonLock(config.runtime_dir)
        if not self._lock.acquire():
            raise DaemonAlreadyRunning(f"a cachemw daemon already runs for {config.runtime_dir}")
        os.register_at_fork(after_in_child=self._forget_lock_in_child)
        self.stopped = threading.Event()
        try:
            self.node = NodeCache(config)
            secret = os.urandom(32)
            sock = os.path.join(config.runtime_dir, SOCKET)
            self.server = SocketServer(self.node, sock, secret, on_shutdown=self.close)
            self.server.start()
            self.node.start_maintenance()
            meta_dir = os.path.join(config.tiers[-1].path, "meta")
            ensure_private_dir(meta_dir)
            self.address = DaemonAddress(
                node_id=config.node_id, pid=os.getpid(), socket=sock, secret=secret.hex(),
                tiers=tuple(self.node.tier_dirs()), meta_dir=meta_dir, kind=kind,
            )
            publish(config.runtime_dir, self.address)
        except BaseException:
            self._lock.release()
            raise
        log.info("cachemw %s daemon for node %s serving %s", kind, config.node_id, sock)

    def _forget_lock_in_child(self) -> None:
        # The child's copy of the lock fd must not keep the lock alive after we exit.
        fd = self._lock._fd
        self._lock._fd = None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        unpublish(self.config.runtime_dir, os.getpid())
        self.server.close()
        self.node.close()
        self._lock.release()
        log.info("cachemw daemon for node %s stopped", self.config.node_id)


def spawn_detached(runtime_dir: str, options: dict | None = None, *, idle_exit: float = 600,
                   parent_pid: int | None = None, wait: float = 20.0):
    """Start a daemon process in its own session and return its address once published
    (None if none appeared in ``wait`` seconds). It exits when ``parent_pid`` exits, if
    given, or else after ``idle_exit`` seconds with no client."""
    import json
    import subprocess
    import sys
    import time

    from ..protocol import lookup

    ensure_private_dir(runtime_dir)
    log_path = os.path.join(runtime_dir, "daemon.log")
    with open(log_path, "ab") as log_file:
        os.chmod(log_path, 0o600)
        subprocess.Popen(
            [sys.executable, "-m", "cachemw.node.service", "--runtime-dir", runtime_dir,
             "--idle-exit", str(idle_exit), "--options", json.dumps(options or {}),
             *(["--parent-pid", str(parent_pid)] if parent_pid else [])],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True,
        )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        address = lookup(runtime_dir)
        if address is not None:
            return address
        time.sleep(0.05)
    return None


def main(argv: list[str] | None = None) -> int:
    """A daemon process: serves until --parent-pid exits, or, without one, until no client
    has been connected for --idle-exit seconds."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m cachemw.node.service")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--idle-exit", type=float, default=600.0)
    p.add_argument("--options", default="{}", help="DaemonConfig.build keywords, as JSON")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process exits (the trainer that autostarted us)")
    p.add_argument("--keep-dram", action="store_true",
                   help="leave the DRAM tier's blocks in place at exit (by default an "
                        "autostarted daemon frees the node's shared memory when it ends)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = DaemonConfig.build(runtime_dir=args.runtime_dir, **json.loads(args.options))
    try:
        service = NodeService(config, kind="autostarted")
    except DaemonAlreadyRunning:
        return 0
    while not service.stopped.wait(0.5):
        if args.parent_pid is not None:
            if not pid_alive(args.parent_pid):
                log.info("process %d that started us is gone: exiting", args.parent_pid)
                service.close()
        elif service.server.idle_seconds() > args.idle_exit:
            log.info("no client for %.0f s: exiting", args.idle_exit)
            service.close()
    if not args.keep_dram:  # /dev/shm is the node's RAM, shared with other jobs
        for tier in config.tiers:
            if tier.name == "dram":
                freed = DirectoryTier(tier.name, tier.path).clear()
                shutil.rmtree(os.path.join(tier.path, "meta"), ignore_errors=True)  # ours
                log.info("freed %d bytes of the DRAM tier %s", freed, tier.path)
    return 0


def stop_local(runtime_dir: str, timeout: float = 10.0) -> bool:
    """Ask the daemon of ``runtime_dir`` to stop (whatever started it); True if one did."""
    import time

    from ..client.link import DaemonClient
    from ..protocol import lookup

    address = lookup(runtime_dir)
    if address is None:
        return False
    client = DaemonClient(runtime_dir, autostart=False, timeout=timeout)
    try:
        client._call("shutdown")
    finally:
        client.close()
    deadline = time.monotonic() + timeout
    while lookup(runtime_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return lookup(runtime_dir) is None


if __name__ == "__main__":
    raise SystemExit(main())
