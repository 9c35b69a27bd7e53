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

import json
import logging
import os
import signal
import socket
import threading
import time

from .. import trace
from ..config import DaemonConfig, filesystem_size
from ..config_values import format_size
from ..launch import clear_failure, free_dram, held_by_another_host, note_freed
from ..metrics import MetricsServer
from ..processes import process_start, process_state
from ..protocol import (REGISTRY, SOCKET, DaemonAddress, DaemonLock, ensure_private_dir,
                        lock_holder, publish, unpublish)
from .cache import NodeCache
from .server import SocketServer

log = logging.getLogger(__name__)


class DaemonAlreadyRunning(RuntimeError):
    """Another live daemon holds this runtime dir."""


def _held(runtime_dir: str) -> str:
    """Why no daemon can start for ``runtime_dir``: another holds its lock."""
    shared = held_by_another_host(runtime_dir)
    if shared is not None:  # (review ops5: it said to stop that one, which is not the fix)
        return shared
    holder = lock_holder(runtime_dir) or {}
    return (f"a cachemw {holder.get('kind', '')} daemon (pid {holder.get('pid', '?')}) "
            f"already serves {runtime_dir}; stop it first (`cachemw stop`)").replace("  ", " ")


class NodeService:
    """``lock``: the runtime dir's daemon lock, already held (handed over by the process
    that spawned us); without it, it is taken here. ``host``: the name the metrics
    endpoint is advertised under, when it listens on every address (default: hostname).
    ``stats``: what the endpoint exports, read when scraped (the Ray daemon adds its peers'
    counters to the node's stats: it sets this after start)."""

    def __init__(self, config: DaemonConfig, *, kind: str = "autostarted",
                 lock: DaemonLock | None = None, host: str | None = None) -> None:
        self.config = config
        self.kind = kind
        self.metrics = None
        if config.trace_dir:
            trace.start(config.trace_dir)
        ensure_private_dir(config.runtime_dir)
        self._lock = lock if lock is not None else DaemonLock(config.runtime_dir)
        if self._lock.fd is None and not self._lock.acquire(wait=3.0):
            raise DaemonAlreadyRunning(_held(config.runtime_dir))
        started = time.time()  # no daemon before this one is still serving the runtime dir
        self.free_dram_at_exit = False  # an autostarted daemon's main sets it
        self.stopped = threading.Event()
        try:
            dram = next(t.path for t in config.tiers if t.name == "dram")
            self._lock.describe(pid=os.getpid(), start=process_start(os.getpid()), kind=kind,
                                dram=os.path.abspath(dram), host=socket.gethostname())
            try:  # we hold the lock: a registry here is a dead daemon's
                os.unlink(os.path.join(config.runtime_dir, REGISTRY))
            except FileNotFoundError:
                pass
            note_freed(config.runtime_dir, None)  # the DRAM tier is ours now
            self.node = NodeCache(config)
            self.stats = self.node.stats
            if config.metrics_port is not None:
                self.metrics = MetricsServer(lambda: self.stats(), config.metrics_host,
                                             config.metrics_port, advertise=host)
                self.node.metrics_url = self.metrics.url
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
                started=started,
            )
            publish(config.runtime_dir, self.address)
            clear_failure(config.runtime_dir)
        except BaseException:  # the lock goes whatever failed, even Ctrl-C; re-raised
            if self.metrics is not None:
                self.metrics.close()
            self._lock.release()
            raise
        trace.open_now()  # started: its trace file is there from now (none for a failed start)
        log.info("cachemw %s daemon for node %s serving %s", kind, config.node_id, sock)
        for tier in config.tiers:
            room = filesystem_size(tier.path)
            if room is not None and tier.capacity > room:  # it fills the disk, then admits nothing
                log.warning("%s tier %s: its capacity (%s) is more than its filesystem holds "
                            "(%s): once that is full it admits nothing more; give a capacity "
                            "within it", tier.name, tier.path, format_size(tier.capacity),
                            format_size(room))

    def orphaned(self) -> bool:
        """The runtime dir (or its lock) was removed under us: no client, tool or successor
        can find this daemon any more, and a new one may already serve its tiers."""
        return not self._lock.still_held()

    def close(self, orphaned: bool = False) -> None:
        """Stop serving; with an NVMe tier, copy what DRAM holds down to it (the next daemon
        on the node, of this job or the next, starts warm); an autostarted daemon then frees
        its DRAM tier, before it lets go of the lock (a successor re-indexes the tiers as
        soon as it has the lock). Nothing lands in a tier once it is sealed, before the free
        (a fill or move landing after it left block files in the freed DRAM tier), and the
        tier freed is noted for a later `cachemw stop` (launch.note_freed). ``orphaned``:
        the tiers may be a successor's by now, so they are left as they are, DRAM too
        unless no successor holds the runtime dir."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        unpublish(self.config.runtime_dir, os.getpid())
        self.server.close()
        if self.metrics is not None:
            self.metrics.close()
        self.node.close()
        if not orphaned:
            self.node.keep_on_stop()
        self.node.seal()  # nothing lands from here on: the DRAM tier freed below stays so
        # /dev/shm is the node's RAM, shared with other jobs; orphaned: freed only if no
        # successor holds the runtime dir (it may serve the same tier by now)
        if self.free_dram_at_exit and (not orphaned or not lock_holder(self.config.runtime_dir)):
            for tier in self.config.tiers:
                if tier.name == "dram":
                    freed = free_dram(tier.path)
                    log.info("freed %d bytes of the DRAM tier %s", freed, tier.path)
                    if not orphaned:  # (the lock file is ours to say it in no more)
                        note_freed(self.config.runtime_dir, tier.path)
        self._lock.release()
        trace.stop()  # closed with "]" here: a Ray-managed daemon is killed after this, no atexit
        log.info("cachemw daemon for node %s stopped", self.config.node_id)


def main(argv: list[str] | None = None) -> int:
    """A daemon process: serves until --parent-pid exits, or, without one, until no client
    has been connected for --idle-exit seconds, or until SIGTERM/SIGINT/SIGHUP, each a
    clean exit (an autostarted daemon frees its DRAM tier). Its start's outcome goes to
    --ready-fd ("ok" or "error <message>") for the process that spawned it."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m cachemw.node.service")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--idle-exit", type=float, default=600.0)
    p.add_argument("--options", default="{}", help="DaemonConfig.build keywords, as JSON")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process exits (the trainer that autostarted us)")
    p.add_argument("--keep-dram", action="store_true",
                   help="leave the DRAM tier's blocks in place at exit (by default an "
                        "autostarted daemon frees the node's shared memory when it ends)")
    p.add_argument("--lock-fd", type=int, default=None,
                   help="the daemon lock, already taken by the process that spawned us")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="where to say 'ok' or 'error <message>' once started")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop.set())
    lock = None
    if args.lock_fd is not None:
        lock = DaemonLock(args.runtime_dir)
        lock.adopt(args.lock_fd)
    try:
        config = DaemonConfig.build(runtime_dir=args.runtime_dir, **json.loads(args.options))
        service = NodeService(config, kind="autostarted", lock=lock)
    except DaemonAlreadyRunning as exc:
        log.info("%s", exc)
        _tell(args.ready_fd, "ok")
        return 0
    except Exception as exc:  # any failure is told on --ready-fd: the starter waits for it
        message = str(exc) if isinstance(exc, (OSError, ValueError)) else (
            f"{type(exc).__name__}: {exc}")
        log.error("cachemw daemon cannot start: %s", message)
        _tell(args.ready_fd, f"error {message}")
        return 1
    service.free_dram_at_exit = not args.keep_dram
    _tell(args.ready_fd, "ok")
    while not service.stopped.wait(0.5):
        if stop.is_set():
            log.info("asked to stop (signal): exiting")
            service.close()
        elif service.orphaned():
            log.warning("the runtime dir %s or its lock was removed under the daemon: exiting, "
                        "its tiers left as they are (the next reader starts a new daemon)",
                        args.runtime_dir)
            service.close(orphaned=True)
        elif args.parent_pid is not None:
            if process_state(args.parent_pid) in (None, "Z"):  # exited (maybe unreaped)
                log.info("process %d that started us is gone: exiting", args.parent_pid)
                service.close()
        elif service.server.idle_seconds() > args.idle_exit:
            log.info("no client for %.0f s: exiting", args.idle_exit)
            service.close()
    return 0


def _tell(fd: int | None, message: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, message.encode())
    except OSError:  # the starter stopped waiting
        pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main())
