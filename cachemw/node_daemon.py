"""Is a cache daemon running on this node, and where: the public answer for the
checkpointer (which lands saves in the node's DRAM when a daemon runs, and tells the
daemon of its saves for the node's metrics) and for tools, without their knowing the
registry's format, the daemon lock's protocol or the socket's."""
from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge

from . import ops
from .config import resolve_runtime_dir
from .protocol import lock_holder, lookup

CHECKPOINTS = "checkpoints"  # under the runtime dir: the checkpointer's node-DRAM copies


@dataclass(frozen=True)
class NodeDaemon:
    runtime_dir: str  # its socket, registry and (by default) DRAM tier live here
    pid: int
    kind: str  # "autostarted" or "ray"

    def checkpoints_dir(self, root: str) -> str:
        """Where saves of checkpoints under ``root`` land in this node's DRAM first (one
        directory per root; ``cachemw stop`` removes them all)."""
        digest = hashlib.blake2b(str(root).encode(), digest_size=8).hexdigest()
        return os.path.join(self.runtime_dir, CHECKPOINTS, digest)


def node_daemon(runtime_dir: str | None = None) -> NodeDaemon | None:
    """The daemon serving ``runtime_dir`` (default: CACHEMW_RUNTIME_DIR, else the per-user
    default) if one lives now; a dead daemon's leftover registry does not count."""
    runtime_dir = resolve_runtime_dir(runtime_dir)
    holder = lock_holder(runtime_dir)
    address = lookup(runtime_dir) if holder is not None else None
    if address is None or holder.get("pid") != address.pid:
        return None
    return NodeDaemon(runtime_dir, address.pid, address.kind)


def note_checkpoint(record: dict, runtime_dir: str | None = None, timeout: float = 2.0) -> bool:
    """Tell this node's daemon of a checkpoint save (a one-way ``checkpoint`` note: what
    its metrics and ``cachemw top`` show, see cachemw.node.checkpoints). False if no daemon
    runs or it does not take the note within ``timeout``; never raises for that: a save
    does not depend on its being counted."""
    address = lookup(resolve_runtime_dir(runtime_dir))
    if address is None:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address.socket)
        sock.setblocking(True)
    except OSError:
        sock.close()
        return False
    conn = Connection(sock.detach())
    try:
        if not conn.poll(timeout):
            return False
        answer_challenge(conn, address.authkey)
        conn.send((ops.CHECKPOINT, record))
        return True
    except Exception:  # a daemon gone mid-handshake, a refused challenge: no note
        return False
    finally:
        conn.close()
