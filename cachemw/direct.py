"""A reader's side of direct block transfer: blocks owned by other nodes, fetched straight
from their owners' block servers (blockserver.py) instead of through the local daemon and
Ray. Only blocks the owner already holds come this way; anything else (absent at the
owner, owner unreachable) goes the usual way, through the local daemon's lease, which
fetches it from the source at the owner.

The ring, the owners' addresses and the cluster secret come from the local daemon (its
`ring` op), refreshed every few seconds and after any failure; no Ray in the reader.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from .blockserver import BlockClient
from .ring import HashRing

log = logging.getLogger("cachemw.direct")

REFRESH = 2.0


def _receive(conn: BlockClient, batch):
    try:
        return conn.receive(batch)
    except (OSError, ConnectionError) as exc:
        return exc


class DirectReads:
    def __init__(self, client, timeout: float = 5.0) -> None:
        self.client = client
        self.timeout = timeout
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._fetched_at = -REFRESH
        self._dir = None
        self._ring: HashRing | None = None
        self._local = threading.local()
        self._warned = False

    def _directory(self):
        if self._pid != os.getpid():
            self._reset()
        now = time.monotonic()
        if now - self._fetched_at >= REFRESH:
            self._fetched_at = now
            reply = self.client._call("ring")
            d = None if reply is None else reply[1]
            if d != self._dir:
                self._dir = d
                self._ring = None if not d else HashRing(d["members"], d["vnodes"])
                self._local = threading.local()  # owners may have moved: new connections
            if d and set(d["members"]) - set(d["blocks"]):  # a peer still starting: ask soon
                self._fetched_at = now - REFRESH + 0.2
        return self._dir

    def fetch(self, items: list[tuple[str, int]]) -> dict[str, bytes]:
        """Blocks (key, length) owned elsewhere and held there, verified; others absent."""
        d = self._directory()
        if not d or self._ring is None:
            return {}
        by_owner: dict[str, list[tuple[str, int]]] = {}
        for key, length in items:
            owner = self._ring.owner(key)
            if owner != d["self"] and owner in d["blocks"]:
                by_owner.setdefault(owner, []).append((key, length))
        if not by_owner:
            return {}
        out: dict[str, bytes] = {}
        sent = []
        for owner, batch in by_owner.items():
            conn = self._conn(owner, d)
            if conn is None:
                continue
            try:
                conn.request(batch)
                sent.append((owner, conn, batch))
            except OSError as exc:
                self._failed(owner, exc)
        if len(sent) > 1:  # receive from every owner at once: their sends overlap
            results = list(self._pool().map(lambda x: _receive(x[1], x[2]), sent))
        else:
            results = [_receive(conn, batch) for _, conn, batch in sent]
        for (owner, _, batch), got in zip(sent, results):
            if isinstance(got, Exception):
                self._failed(owner, got)
                continue
            for (key, _), data in zip(batch, got):
                if data is not None:
                    out[key] = data
        return out

    def _pool(self):
        pool = getattr(self, "_executor", None)
        if pool is None or self._executor_pid != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            pool = self._executor = ThreadPoolExecutor(4, thread_name_prefix="cachemw-direct")
            self._executor_pid = os.getpid()
        return pool

    def _conn(self, owner: str, d) -> BlockClient | None:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(owner)
        if conn is None:
            try:
                conn = conns[owner] = BlockClient(d["blocks"][owner], bytes.fromhex(d["secret"]),
                                                  self.timeout)
            except (OSError, PermissionError) as exc:
                self._failed(owner, exc)
                return None
        return conn

    def _failed(self, owner: str, exc: Exception) -> None:
        conns = getattr(self._local, "conns", {})
        conn = conns.pop(owner, None)
        if conn is not None:
            conn.close()
        self._fetched_at = -REFRESH  # ask the daemon again for who is where
        if not self._warned:
            log.warning("direct block transfer from node %s failed (%s); reading through "
                        "the daemon instead", owner, exc)
            self._warned = True
