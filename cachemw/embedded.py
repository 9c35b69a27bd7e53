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

_service: NodeService | None = None
_lock = threading.Lock()


def ensure_embedded_daemon(runtime_dir: str, options: dict | None = None) -> DaemonAddress | None:
    """Start an embedded daemon for ``runtime_dir`` unless one runs; return its address."""
    global _service
    with _lock:
        if _service is not None and not _service.stopped.is_set():
            return _service.address
        if DaemonLock(runtime_dir).held_by_someone():
            return lookup(runtime_dir)  # another process's daemon (may still be starting)
        try:
            config = DaemonConfig.build(runtime_dir=runtime_dir, **(options or {}))
            _service = NodeService(config, kind="embedded")
        except DaemonAlreadyRunning:
            return lookup(runtime_dir)
        except (OSError, ValueError) as exc:
            log.warning("could not start an embedded cachemw daemon: %s", exc)
            return None
        atexit.register(stop_embedded_daemon)
        log.info("started an embedded cachemw daemon (it ends with this process)")
        return _service.address


def stop_embedded_daemon() -> None:
    global _service
    with _lock:
        if _service is not None:
            _service.close()
            _service = None


def embedded_service() -> NodeService | None:
    return _service
