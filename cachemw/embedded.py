"""The embedded daemon: started inside the first main process that uses the filesystem
when no daemon runs on the node, so a single-machine user needs no setup at all.

It lives as long as that process. Other processes of the node (DataLoader workers, other
ranks) use it through its socket like any daemon.
"""
from __future__ import annotations

import atexit
import logging
import threading

from .config import DaemonConfig
from .protocol import DaemonAddress, DaemonLock, lookup
from .service import DaemonAlreadyRunning, NodeService

log = logging.getLogger("cachemw.embedded")

_services: dict[str, NodeService] = {}  # by runtime dir
_lock = threading.Lock()


def ensure_embedded_daemon(runtime_dir: str, options: dict | None = None) -> DaemonAddress | None:
    """Start an embedded daemon for ``runtime_dir`` unless one runs; return its address."""
    with _lock:
        service = _services.get(runtime_dir)
        if service is not None and not service.stopped.is_set():
            return service.address
        if DaemonLock(runtime_dir).held_by_someone():
            return lookup(runtime_dir)  # another process's daemon (may still be starting)
        try:
            config = DaemonConfig.build(runtime_dir=runtime_dir, **(options or {}))
            service = NodeService(config, kind="embedded")
        except DaemonAlreadyRunning:
            return lookup(runtime_dir)
        except (OSError, ValueError) as exc:
            log.warning("could not start an embedded cachemw daemon: %s", exc)
            return None
        if not _services:
            atexit.register(stop_embedded_daemon)
        _services[runtime_dir] = service
        log.info("started an embedded cachemw daemon in %s (it ends with this process)",
                 runtime_dir)
        return service.address


def stop_embedded_daemon(runtime_dir: str | None = None) -> None:
    """Stop this process's embedded daemon for ``runtime_dir`` (all of them if None)."""
    with _lock:
        dirs = list(_services) if runtime_dir is None else [runtime_dir]
        for d in dirs:
            service = _services.pop(d, None)
            if service is not None:
                service.close()


def embedded_service(runtime_dir: str) -> NodeService | None:
    return _services.get(runtime_dir)
