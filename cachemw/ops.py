"""The node daemon's socket protocol, defined once: every op a client may send, whether
the daemon answers it, its arguments and its reply. The server (cachemw.node.server)
dispatches through this table and the client (cachemw.client.link) sends these names.

A message is a tuple ``(op, *args)`` pickled over the daemon's authenticated Unix socket
(cachemw.protocol: how it is found and entered). Answered ops get exactly one reply, a
tuple, in order on their connection; while the daemon works on one it may send
``(BUSY,)`` first, any number of times, so a client tells a slow daemon from a hung one.
One-way ops are never answered, so a client never waits on them; an answered op that
fails in the daemon is answered ``("error", message)``.

The lease protocol (how a block missing from every tier of the node gets there once):

1. ``LEASE`` / ``LEASE_MANY`` -- ask for one block or a batch (a batch's blocks owned by
   other nodes are fetched from their owners, one Ray call per owner).
   ``LEASE_FETCHED`` -- the same for blocks the caller has fetched already: a cold read's
   first block, or a block whose claim it took (cachemw.claims: single flight without
   the round trip before the fetch); never waits.

   Args: key (blake2b of url, version, block index), data length, source url; for a
   batch, ``(key, length, url, source)`` each, ``source`` being what an owner node needs
   to fetch the block itself (the target's JSON, path, index, block size, file size,
   version).

   Returns, per block: ``("fill", tier, lease)``: this client fetches the block and
   stages it in ``tier`` under the lease number; ``("present", tier)``: read it from
   ``tier`` (another process filled it meanwhile: single flight); ``("data", bytes)``: an
   owner node sent it; ``("nofill", why)`` / ``("fallback", why)``: read the source
   directly, and count it. ``LEASE_FETCHED`` may answer ``("nofill", "later")`` for part
   of a batch (never for all of it): ask again once the fills granted have been noted.

2. ``FILLED`` (one-way) -- the fill of a lease is staged: the daemon publishes it under the
   block's key, unless a write through the cache cancelled the lease meanwhile (then the
   staged file is deleted, never served). ``FILLED_MANY``: the same for a batch.
   ``ABORT`` (one-way) -- the fill of a lease failed (source error, full tier): the lease
   ends with nothing cached, and a waiter gets its own lease.

3. A client that disconnects with leases open (killed mid-fill) has them ended by the
   daemon: a verified staged block is adopted, anything else is deleted.

Every lease ends one of these three ways; a waiter on another process's lease waits at
most the daemon's lease wait, then reads the source.
"""
from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    answered: bool
    args: str   # the arguments after the op name, for readers and error messages
    reply: str  # what an answered op returns


HELLO = "hello"
LEASE = "lease"
LEASE_MANY = "lease_many"
LEASE_FETCHED = "lease_fetched"
FILLED = "filled"
FILLED_MANY = "filled_many"
ABORT = "abort"
REPORT = "report"
ANNOUNCE = "announce"
DROP = "drop"
INVALIDATE = "invalidate"
RING = "ring"
STATS = "stats"
PING = "ping"
SHUTDOWN = "shutdown"
CHECKPOINT = "checkpoint"
PEER_SILENT = "peer_silent"
PEER_REFUSED = "peer_refused"
SUPERSEDED = "superseded"
BUSY = "busy"  # sent by the daemon, never by a client (see above)

#: What a daemon can do beyond the first release's protocol, named in its HELLO reply (a
#: daemon of that release names nothing, and a client then sends what it understands).
ANNOUNCE_STREAMS = "announce-streams"  # ANNOUNCE's (group, rank, ranks, first, replace, owner)
DROP_IN_TIER = "drop-in-tier"  # DROP's third argument: the tier whose copy failed
PEER_SILENT_NOTE = "peer-silent"  # PEER_SILENT is understood
SUPERSEDED_NOTE = "superseded"  # SUPERSEDED is understood
PEER_REFUSED_NOTE = "peer-refused"  # PEER_REFUSED is understood
FEATURES = (ANNOUNCE_STREAMS, DROP_IN_TIER, PEER_SILENT_NOTE, SUPERSEDED_NOTE, PEER_REFUSED_NOTE)

OPS: dict[str, Op] = {
    HELLO: Op(True, "client pid[, keepalive seconds: how often to say BUSY]",
              "('ok', node_id, daemon pid, [feature, ...]: FEATURES)"),
    LEASE: Op(True, "key, length, url", "a lease reply (see 1.)"),
    LEASE_MANY: Op(True, "[(key, length, url, source), ...]", "('ok', [lease reply, ...])"),
    LEASE_FETCHED: Op(True, "[(key, length, url, source), ...], claimed (the caller holds "
                            "their claims: the name they hold, claims.holder_name, or True; "
                            "else False)", "('ok', [lease reply, ...]), never waiting"),
    FILLED: Op(False, "key, tier, stored bytes, lease", "-"),
    FILLED_MANY: Op(False, "[(key, tier, stored bytes, lease), ...]: FILLED for each", "-"),
    ABORT: Op(False, "key, reason", "-"),
    REPORT: Op(False, "counters, [(key, tier) hit, ...]", "-"),
    ANNOUNCE: Op(False, "[(key, length, url, source), ...] in read order[, (group, rank, "
                        "ranks, first, replace, owner): one rank's order among the node's, "
                        "and whether it replaces the unread rest its owner announced; sent "
                        "to a daemon naming ANNOUNCE_STREAMS]", "-"),
    DROP: Op(False, "key, reason ('corrupt', 'missing', 'unreadable')[, tier: dropped only "
                    "if that tier holds it; sent to a daemon naming DROP_IN_TIER]", "-"),
    SUPERSEDED: Op(False, "url, version, size, block size: the source has moved on from that "
                          "version of the file; the daemon drops the blocks of it it holds "
                          "(node/superseded.py); sent to a daemon naming SUPERSEDED_NOTE", "-"),
    INVALIDATE: Op(True, "source url (written through the cache)",
                   "('ok', blocks dropped): answered once no block of it can be read"),
    RING: Op(True, "-", "('ok', {self, members, vnodes, blocks, secret, timeout, alive} "
                        "or None: not in a cluster)"),
    STATS: Op(True, "-", "('ok', stats dict)"),
    PING: Op(True, "-", "('pong',)"),
    SHUTDOWN: Op(True, "-", "('ok',), then the daemon stops"),
    CHECKPOINT: Op(False, "{event: begin|end, pid, start, step, stall | ok, bytes, durable}: "
                          "a trainer's save, for the daemon's metrics (node/checkpoints.py)", "-"),
    PEER_SILENT: Op(False, "owner (its name in the RING directory): its block server did not "
                           "answer a direct transfer within the peer timeout; the daemon's "
                           "calls to it fail at once for that long (its time is spent: one "
                           "timeout, not two); sent to a daemon naming PEER_SILENT_NOTE", "-"),
    PEER_REFUSED: Op(False, "owner (its name in the RING directory): nothing listens at its "
                            "block server's address (its daemon restarted on another port); "
                            "the daemon asks it for its address again; sent to a daemon "
                            "naming PEER_REFUSED_NOTE", "-"),
}

ANSWERED = frozenset(name for name, op in OPS.items() if op.answered)
