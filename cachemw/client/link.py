"""A process's calls on its node daemon: leases for misses, announcements, drops, stats,
and the delivery of its batched access reports (gathered by reporting.Reporter).

Each call is one message over this thread's connection (connection.py: opened on first use,
fork-safe, every wait bounded, a dead daemon replaced); a call the daemon could not answer
returns None or False and the reader goes to the source.
"""
from __future__ import annotations

import logging

from .connection import DaemonConnection
from .fills import drain_all
from .. import ops, reports
from . import reporting
from .wire import DaemonUnavailable
from ..claims import holder_name
from ..protocol import lock_holder

log = logging.getLogger(__name__)


class DaemonClient(DaemonConnection, reporting.Reporter):
    """What a process asks and tells its node daemon. ``report_interval``: seconds between
    reports (reporting.py); the other options are DaemonConnection's."""

    def __init__(self, runtime_dir: str, *, autostart: bool = True, timeout: float = 5.0,
                 report_interval: float = 0.5, daemon_config: dict | None = None) -> None:
        self.report_interval = report_interval
        super().__init__(runtime_dir, autostart=autostart, timeout=timeout,
                         daemon_config=daemon_config)

    def _reset_after_fork(self) -> None:
        super()._reset_after_fork()
        self._warned_ranks = False  # a daemon that predates several ranks' orders: said once
        self._reset_reports()

    # -- requests ----------------------------------------------------------------------

    def ring(self, *, strict: bool = False) -> dict | None:
        """Who owns which block and where to fetch it directly (None: a daemon not in a Ray
        cluster, or none reached; a cluster of one node has a ring of one). ``strict``: no
        daemon reached is DaemonUnavailable, not None (a warm must not take a daemon slow
        to answer for a node alone)."""
        reply = self._call(ops.RING)
        if reply is None and strict:
            raise DaemonUnavailable(f"the cache daemon of {self.runtime_dir} did not answer")
        return None if reply is None else reply[1]

    def lease_many(self, items: list[tuple]) -> list[tuple] | None:
        """One reply per (key, length, url, source) item; None if the daemon is unreachable."""
        reply = self._call(ops.LEASE_MANY, items)
        return None if reply is None else reply[1]

    def lease_fetched(self, items: list[tuple], claimed: bool) -> list[tuple] | None:
        """Leases for blocks fetched already (ops.LEASE_FETCHED); None if unreachable (said
        at the next miss: see tell_unreachable). Blocks fetched under this process's claims
        (``claimed``) name what its claims hold (claims.holder_name), so that the daemon,
        should this connection go, removes only claims that still name this process."""
        self._local.quiet = True
        try:
            reply = self._call(ops.LEASE_FETCHED, items, holder_name() if claimed else False)
        finally:
            self._local.quiet = False
        return None if reply is None else reply[1]

    def announce(self, items: list[tuple], stream: tuple | None = None) -> bool:
        """Tell the daemon the next reads, in order: (key, length, url, source) each;
        ``stream``: (group, rank, ranks, first, replace, owner) of one rank's order among the
        node's (Engine.announce). A daemon that does not know of it (of the first release)
        is sent the order alone, which it appends to the others (said once)."""
        if stream is not None and self._connect() is not None \
                and ops.ANNOUNCE_STREAMS not in self._features:
            if not self._warned_ranks and (stream[2] > 1 or stream[4]):
                self._warned_ranks = True
                log.warning("the cachemw daemon at %s predates announcements by several ranks "
                            "of a node and replacing ones: each order is appended to the "
                            "others' (restart the daemon for both)", self.runtime_dir)
            stream = None
        if stream is None:
            return self._send(ops.ANNOUNCE, items)
        return self._send(ops.ANNOUNCE, items, stream)

    def abort(self, key: str, reason: str) -> None:
        self._send(ops.ABORT, key, reason)

    def drop(self, key: str, reason: str, tier: str | None = None) -> bool:
        """Have the daemon forget and delete a block; with ``tier``, only if that tier holds
        it (a failing copy there, not a sound one elsewhere): not sent to a daemon that
        cannot tell (an earlier release), which would drop any copy. True if sent."""
        if tier is None:
            return self._send(ops.DROP, key, reason)
        return self._send_if_known(ops.DROP_IN_TIER, ops.DROP, key, reason, tier)

    def superseded(self, url: str, version: str, size: int, block_size: int) -> bool:
        """Tell the daemon that the source has moved on from ``version`` of ``url``: it
        drops the blocks of it it holds (node/superseded.py). Not sent to a daemon that
        does not know the note (an earlier release); True if sent."""
        return self._send_if_known(ops.SUPERSEDED_NOTE, ops.SUPERSEDED, url, version, size,
                                   block_size)

    def peer_silent(self, owner: str) -> bool:
        """Tell the daemon that ``owner``'s block server (its name in the ring directory)
        kept a direct transfer waiting the whole peer timeout: the lease of the same blocks
        that follows on this connection then does not wait on that peer again (ops
        PEER_SILENT). Not sent to a daemon that does not know the note (an earlier
        release); True if sent."""
        return self._send_if_known(ops.PEER_SILENT_NOTE, ops.PEER_SILENT, owner)

    def peer_refused(self, owner: str) -> bool:
        """Tell the daemon that nothing listens at the block server address it gave for
        ``owner``: a daemon restarted (Ray restarts a killed one) listens on another port,
        which the daemon then asks it for (ops PEER_REFUSED). True if sent."""
        return self._send_if_known(ops.PEER_REFUSED_NOTE, ops.PEER_REFUSED, owner)

    def _send_if_known(self, feature: str, op: str, *args) -> bool:
        """``op`` sent only to a daemon naming ``feature`` in its features (one of an
        earlier release would not understand it); True if sent."""
        if self._connect() is None or feature not in self._features:
            return False
        return self._send(op, *args)

    def invalidate(self, url: str) -> bool:
        """Drop every cached block of ``url`` node-wide; False if the daemon is unreachable."""
        return self._call(ops.INVALIDATE, url) is not None

    def daemon_stats(self) -> dict | None:
        drain_all(self)
        self.flush()
        reply = self._call(ops.STATS)
        return None if reply is None else reply[1]

    # -- reports (reporting.Reporter gathers them) ------------------------------------

    def _deliver(self, counters: dict, accesses: dict[str, list[str]], connect: bool = True) -> bool:
        """One report: on this thread's connection if it has one (one-way), else left in
        the runtime dir for the daemon (cachemw.reports), so a process that only hits never
        connects to report them. False if the daemon is unreachable either way, or if
        this would need a new connection and ``connect`` is False."""
        if getattr(self._local, "conn", None) is None and self._address is not None \
                and lock_holder(self.runtime_dir) is not None \
                and reports.write(self.runtime_dir, counters, accesses):
            return True
        if not connect and getattr(self._local, "conn", None) is None:
            return False
        return self._send(ops.REPORT, counters,
                          [(key, tier) for tier, keys in accesses.items() for key in keys])

    def close(self) -> None:
        self._local.closing = True  # this thread's last report (other threads read on)
        try:
            drain_all(self)
            self.flush()
        finally:
            self._local.closing = False
        self._close_connections()
