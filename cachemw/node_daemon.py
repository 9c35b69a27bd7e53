"""Is a cache daemon running on this node, and where: the public answer for the
checkpointer (which lands saves in the node's DRAM when a daemon runs) and for tools,
without their knowing the registry's format or the daemon lock's protocol."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

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
