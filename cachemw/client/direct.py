"""A reader's side of direct block transfer: blocks owned by other nodes, fetched straight
from their owners' block servers (blockserver.py) instead of through the local daemon and
Ray. Only blocks the owner already holds come this way; anything else (absent at the
owner, owner unreachable) goes the usual way, through the local daemon's lease, which
fetches it from the source at the owner.

The ring, the owners' addresses and the cluster secret come from the local daemon (its
`ring` op), refreshed every few seconds and after any failure; no Ray in the reader.

A hung owner costs one timeout, not two: an owner that kept a transfer waiting the whole
timeout without a word of its reply (not even its headers) is named to the daemon
(``peer_silent``) before the lease of its blocks, so the daemon's call to it through Ray
fails at once (the blocks are read from the source, counted as ``peer_fallbacks``)
instead of waiting as long again, and this reader asks it directly no more for as long
(until then the daemon's ring it was told may still list it). An owner that answered and
then sent its blocks too slowly is alive: it is not named.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time

from ..blockwire import fetch_deadline
from .blockclient import BlockClient
from .silence import silence_left, waited_silent
from ..ring import HashRing

log = logging.getLogger(__name__)

REFRESH = 2.0
_damage_said = 0  # the pid of the process that logged a damaged block from an owner


class _Reply:
    """Where the receipt of one owner's reply stands."""

    __slots__ = ("owner", "conn", "batch", "headers", "next", "deadline")

    def __init__(self, owner: str, conn: BlockClient, batch: list, deadline: float) -> None:
        self.owner, self.conn, self.batch, self.deadline = owner, conn, batch, deadline
        self.headers = None
        self.next = 0


class DirectReads:
    def __init__(self, client, timeout: float = 5.0) -> None:
        """``timeout``: bounds a fetch from silent owners (plus the bytes' time at 50 MB/s)
        until the daemon's directory says otherwise (its ``peer_timeout``)."""
        self.client = client
        self.timeout = timeout
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._fetched_at = -REFRESH
        # the daemon's directory and its ring, swapped as one (read unlocked)
        self._view: tuple[dict | None, HashRing | None] = (None, None)
        self._asked = False  # the daemon has answered (or failed to) once
        self._asking = threading.Lock()
        self._local = threading.local()
        self._warned = False
        self._silent: dict[str, float] = {}  # owner -> until when it is not asked directly

    def _directory(self) -> tuple[dict | None, HashRing | None]:
        """(the daemon's directory, its ring), asked again every REFRESH seconds by one
        thread while the others go on with the last answer. Before the first answer they
        wait for it: taken for "no ring" meanwhile, a reader of a cluster would read its
        misses as a lone node does (claim, fetch from the source, fill locally: every
        thread of a warm but one did, for blocks other nodes own or hold)."""
        if self._pid != os.getpid():
            self._reset()
        if not self._asked:
            # the wait for another thread's first ask is a wait on the daemon: within the
            # read call's budget of silence (silence.py), spent if it stays unanswered
            began = time.monotonic()
            if self._asking.acquire(timeout=max(0.0, silence_left(self.client.timeout))):
                try:
                    if not self._asked:  # not by another thread meanwhile
                        self._ask()
                finally:
                    self._asking.release()
            else:
                waited_silent(time.monotonic() - began)
        elif time.monotonic() - self._fetched_at >= REFRESH and self._asking.acquire(False):
            try:
                if time.monotonic() - self._fetched_at >= REFRESH:  # not by another, since
                    self._ask()
            finally:
                self._asking.release()
        return self._view

    def _ask(self) -> None:
        now = time.monotonic()
        self._fetched_at = now
        d = self.client.ring()
        if d != self._view[0]:
            if d and d.get("timeout"):
                self.timeout = float(d["timeout"])
            self._view = (d, None if not d else HashRing(d["members"], d["vnodes"]))
            self._local = threading.local()  # owners may have moved: new connections
        if d and set(d["members"]) - set(d["blocks"]):  # a peer still starting: ask soon
            self._fetched_at = now - REFRESH + 0.2
        self._asked = True  # after the view: a thread that finds it set reads the answer

    def alone(self) -> bool:
        """True if no other node shares blocks with this one (no ring, or a ring of one)."""
        d = self._directory()[0]
        return not d or len(d.get("members") or ()) <= 1

    def fetch(self, items: list[tuple[str, int]]) -> dict[str, bytes]:
        """Blocks (key, length) owned elsewhere and held there, verified; others absent.

        One request per owner, all sent before any reply is read; the replies are read in
        this thread as they arrive, a block at a time from whichever owner has data (no
        thread pool: handing blocks between threads cost more than the receive itself, and
        the owners' sends overlap anyway, into socket buffers that hold a whole reply).
        """
        d, ring = self._directory()
        if not d or ring is None:
            return {}
        me, held, owner_of = d["self"], d["blocks"], ring.owner
        if self._silent:  # owners that timed out a moment ago: their blocks go the usual way
            now = time.monotonic()
            silent = {o for o, until in list(self._silent.items()) if until > now}
            held = {o: a for o, a in held.items() if o not in silent}
        by_owner: dict[str, list[tuple[str, int]]] = {}
        for item in items:
            owner = owner_of(item[0])
            if owner != me and owner in held:
                batch = by_owner.get(owner)
                if batch is None:
                    by_owner[owner] = [item]
                else:
                    batch.append(item)
        if not by_owner:
            return {}
        out: dict[str, bytes] = {}
        pending: dict[int, _Reply] = {}
        # one budget for the whole fetch, every owner included: a slow or dripping owner
        # costs at most this, then its blocks go the usual way
        deadline = fetch_deadline(self.timeout, items)
        for owner, batch in by_owner.items():
            conn = self._conn(owner, d)
            if conn is None:
                continue
            try:
                conn.request(batch)
            except OSError as exc:
                self._failed(owner, exc, silent=True)  # not even taking the request
                continue
            pending[conn.fileno()] = _Reply(owner, conn, batch, deadline)
        try:
            if len(pending) == 1:
                (reply,) = pending.values()
                try:
                    self._take(reply, out, len(reply.batch))
                except OSError as exc:
                    self._failed(reply.owner, exc, silent=reply.headers is None)
                pending.clear()
            elif pending:
                self._receive_all(pending, out)
        finally:  # interrupted mid-reply: those connections are out of step, drop them
            for reply in pending.values():
                self._drop(reply.owner)
        return out

    def _receive_all(self, pending: dict[int, _Reply], out: dict[str, bytes]) -> None:
        """Read several owners' replies at once, each block from a socket that has data;
        owners not done by the fetch's deadline are failed (their blocks go the usual way)."""
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLIN)
        while pending:
            left = min(r.deadline for r in pending.values()) - time.monotonic()
            ready = poller.poll(max(1, int(left * 1000) + 1)) if left > 0 else []
            if not ready and time.monotonic() >= min(r.deadline for r in pending.values()):
                # an owner whose reply waits unread (this thread sat in a slow owner's
                # receive meanwhile) answered: not silent
                answered = {fd for fd, _ in poller.poll(0)}
                for fd, reply in list(pending.items()):
                    poller.unregister(fd)
                    del pending[fd]
                    self._failed(reply.owner, TimeoutError(f"no reply within {self.timeout} s"),
                                 silent=reply.headers is None and fd not in answered)
                return
            for fd, _ in ready:
                reply = pending[fd]
                try:
                    done = self._take(reply, out, 1)
                except OSError as exc:
                    done = True
                    # not silent: its socket had data (a deadline that another owner's
                    # receive used up may time it out here, answered or not)
                    self._failed(reply.owner, exc, silent=False)
                if done:
                    poller.unregister(fd)
                    del pending[fd]

    def _take(self, reply: _Reply, out: dict[str, bytes], blocks: int) -> bool:
        """Read (the headers and) up to ``blocks`` sent blocks of ``reply``; True once all
        of it is read. A block that fails verification is left out and counted: the
        reader fetches it again the usual way, through its daemon."""
        conn, batch = reply.conn, reply.batch
        if reply.headers is None:
            reply.headers = conn.headers(batch, reply.deadline)
        headers, i, n = reply.headers, reply.next, len(batch)
        while i < n:
            header = headers[i]
            if header[0] == 1:  # absent blocks have nothing on the wire
                if not blocks:
                    break
                key, length = batch[i]
                data = conn.block(length, header, reply.deadline)
                if data is None:
                    self._damaged(reply.owner, key)
                else:
                    out[key] = data
                blocks -= 1
            i += 1
        reply.next = i
        return i >= n

    def _damaged(self, owner: str, key: str) -> None:
        """Counted each; logged for the first in this process (as a corrupt block in a tier
        here is): a damaged tier at an owner would log every block of it."""
        global _damage_said
        self.client.count("corrupt_repaired")
        if _damage_said != os.getpid():
            _damage_said = os.getpid()
            log.warning("block %s from node %s failed verification; fetching it again "
                        "(further ones counted as corrupt_repaired; logged once)", key, owner)

    def _conn(self, owner: str, d) -> BlockClient | None:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(owner)
        if conn is not None and conn.busy:  # an exchange was cut short: out of step, drop it
            conns.pop(owner)
            conn.close()
            conn = None
        if conn is None:
            try:
                conn = conns[owner] = BlockClient(d["blocks"][owner], bytes.fromhex(d["secret"]),
                                                  self.timeout)
            except (OSError, PermissionError) as exc:
                self._failed(owner, exc, silent=True)  # the connect or handshake
                return None
        return conn

    def _drop(self, owner: str) -> None:
        conn = getattr(self._local, "conns", {}).pop(owner, None)
        if conn is not None:
            conn.close()

    def _failed(self, owner: str, exc: Exception, silent: bool) -> None:
        """A transfer from ``owner`` failed: its blocks go the usual way. ``silent``: the
        owner sent nothing of its reply (no headers) before ``exc``; an owner that timed
        out so is hung or gone, and is named to the daemon. One that answered its headers
        and then sent its blocks slower than the fetch's budget (50 MB/s) is alive: named,
        the daemon would suspect it (out of its ring for seconds, counted as a peer
        failure) for being slow."""
        self.client.count("direct_failures")
        self._drop(owner)
        self._fetched_at = -REFRESH  # ask the daemon again for who is where
        if silent and isinstance(exc, TimeoutError):  # for the whole timeout: hung, or gone
            self._silent[owner] = time.monotonic() + self.timeout
            self.client.peer_silent(owner)  # before the lease of its blocks (same connection)
        elif isinstance(exc, ConnectionRefusedError):  # its daemon restarted on another port
            self.client.peer_refused(owner)
        if not self._warned:
            log.warning("direct block transfer from node %s failed (%s); reading through "
                        "the daemon instead", owner, exc)
            self._warned = True
