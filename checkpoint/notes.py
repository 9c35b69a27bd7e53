"""What a save tells the node's cachemw daemon: that it began (and how long it blocked the
training loop) and how it ended (its bytes, how long until durable), one note each over
the daemon's socket, from the checkpointer's worker thread. The daemon turns them into the
``cachemw_checkpoint_*`` metrics and the checkpoints in flight of ``cachemw top``
(cachemw.node.checkpoints says why through the daemon). No daemon on the node: nothing is
sent, nothing fails.
"""
from __future__ import annotations

import os

from cachemw.node_daemon import note_checkpoint
from cachemw.processes import process_start


def _record(event: str, step: int, **fields) -> dict:
    pid = os.getpid()
    return dict(fields, event=event, pid=pid, start=process_start(pid), step=step)


def note_begin(root: str, step: int, stall: float) -> None:
    note_checkpoint(_record("begin", step, root=root, stall=stall))


def note_end(step: int, ok: bool, nbytes: int, durable: float) -> None:
    note_checkpoint(_record("end", step, ok=ok, bytes=nbytes, durable=durable))
