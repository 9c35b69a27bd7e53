"""The other nodes' daemons, through Ray: membership, block ownership, remote fetches.

Each daemon keeps its own view (no central metadata server on the read path): the alive
Ray nodes that run a daemon, minus peers that recently failed a call, hashed into a ring by
their hostnames (cachemw.ring.ring_names: Ray's node ids change from one job to the next,
hostnames do not, so a node owns the same blocks again and its NVMe tier is warm).
A failed or slow peer costs one bounded timeout, then the ring is recomputed without it
and its blocks are read from the source (counted); it rejoins when it answers again. The
timeout is one for a reader's direct transfer from the peer's block server and the call
through Ray that follows it: a reader whose transfer timed out says so (``silent``), and
this daemon's calls to that peer then fail at once for a timeout's length.

The leader (the alive daemon with the smallest node id) also places a daemon on any alive
node that lacks one, so nodes that join later get a daemon without a re-run of
``cachemw start``.
"""
from __future__ import annotations

import logging
import threading
import time

from ..ring import HashRing, ring_names
from .names import NAMESPACE, actor_name

log = logging.getLogger(__name__)

# Bytes per second a call to a peer is given, on top of ``timeout``, for the blocks it asks
# for (the rate client/direct.py gives a reader's direct fetch).
TRANSFER_RATE = 50e6

# An owner's blocks come back in the call's reply, cut in pieces that Ray sends inline (its
# max_direct_call_object_size is 100 KiB): a reply of one array went through Ray's object
# store, and its pull across nodes stalled about 1 s, or a multiple of it, now and then
# (Ray 2.60, simulated nodes: 2-8 of 40 calls of one 256 KiB block, 58-70 of 120 with three
# callers per node; in pieces none of 120, median 2.5 against 13 ms). Readers missing one
# multi-block file on several nodes at once waited it out (review nodes6).
PIECE = 96 << 10
# A reply past this goes as one piece: Ray puts what a reply holds past 10 MiB in its object
# store anyway, and there many 96 KiB objects cost more than one (a 32 MiB block: 315 ms
# against 100-119 ms, diffrev-10). Calls stay under it (owner.BATCH_BYTES) unless one block
# is larger.
INLINE_MOST = 8 << 20


class PeerSet:
    def __init__(self, self_id: str, *, spawn=None, refresh_interval: float = 2.0,
                 timeout: float = 10.0, vnodes: int = 1024, secret: str | None = None,
                 blocks: tuple | None = None) -> None:
        import ray

        self._ray = ray
        # what a call to a peer raises: ray.get's RayError family, and ValueError or OSError
        # from the core worker's status codes; anything else is a bug, not a failed peer
        self._call_errors = (ray.exceptions.RayError, ValueError, OSError)
        self.self_id = self_id
        self.spawn = spawn  # callable(node_id): place a daemon on that node
        self.refresh_interval = refresh_interval
        self.timeout = timeout
        self.vnodes = vnodes
        self._handles: dict[str, object] = {}
        self.secret = secret  # the cluster secret of the block servers (hex)
        self._blocks: dict[str, tuple] = {self_id: blocks} if blocks else {}
        self._suspect_until: dict[str, float] = {}
        # node id -> until when calls to it fail at once: a reader of this node waited a
        # whole timeout on its block server just before (see silent)
        self._silent_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # node id -> name on the ring, of the alive nodes
        self.alive = 1  # alive Ray nodes at the last refresh (a reader tells a forming ring)
        self.members: tuple[str, ...] = ()  # node ids in the ring
        self._route: tuple[HashRing, dict, dict] = (HashRing([], vnodes), {}, {})
        self._set_members([self_id])
        self.counters = {"remote_requests": 0, "remote_blocks": 0, "remote_bytes": 0,
                         "peer_failures": 0, "ring_changes": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- membership ----------------------------------------------------------------

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="cachemw-peers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_interval):
            try:
                self.refresh()
            except Exception:  # the membership thread never dies: it tries again
                log.exception("membership refresh failed")

    def refresh(self) -> None:
        ray = self._ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        alive = sorted(n["NodeID"] for n in nodes)
        self._names = ring_names({n["NodeID"]: n.get("NodeManagerHostname") or "" for n in nodes})
        self.alive = len(alive)
        now = time.monotonic()
        handles = {}
        for node_id in alive:
            handle = self._handles.get(node_id)
            if handle is None:
                try:
                    handle = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
                except ValueError:
                    handle = None
                if handle is not None:
                    self._handles[node_id] = handle
            if handle is not None:
                handles[node_id] = handle
        # where each peer's block server listens, until it answers (it may still be
        # starting), and whether each suspect whose time is up answers a ping: asked of all
        # at once, under one deadline (one at a time, a peer down cost each refresh its
        # own 5 s, and k of them 5k s)
        asks = {}
        for node_id, handle in handles.items():
            if node_id == self.self_id:
                continue
            try:  # (a call that cannot be made is one not answered: that peer only)
                if self.secret and node_id not in self._blocks:
                    asks[node_id, "address"] = handle.address.remote()
                if node_id in self._suspect_until and self._suspect_until[node_id] <= now:
                    asks[node_id, "ping"] = handle.ping.remote()
            except self._call_errors:
                continue
        answers = self._answers(asks)
        members = []
        for node_id in handles:
            address = answers.get((node_id, "address"))
            if address and address.get("blocks"):
                self._blocks[node_id] = tuple(address["blocks"])
            if node_id != self.self_id and node_id in self._suspect_until:
                if (node_id, "ping") not in answers:
                    continue
                del self._suspect_until[node_id]  # it answers again: back in the ring
                self._silent_until.pop(node_id, None)
            members.append(node_id)
        if self.self_id not in members:
            members.append(self.self_id)
        missing = [n for n in alive if n not in self._handles]
        if (missing and self.spawn is not None and min(members) == self.self_id
                and not self._stop.is_set()):
            for node_id in missing:
                log.info("placing a daemon on new node %s", node_id)
                try:
                    self.spawn(node_id)
                except Exception as exc:  # best effort: the next refresh tries again
                    log.warning("could not place a daemon on node %s: %s", node_id, exc)
        for node_id in [n for n in self._handles if n not in alive]:
            del self._handles[node_id]  # node gone: a replacement gets a fresh handle
            self._blocks.pop(node_id, None)
        self._set_members(members)

    def directory(self) -> dict | None:
        """What a reader needs to fetch blocks from their owners without Ray, and a warm to
        know its node's share: the ring by names, this node's name, each member's block
        server, and how many Ray nodes are alive (a ring with fewer members is forming)."""
        if not self.secret:
            return None
        ring, _, names = self._route
        blocks = dict(self._blocks)  # (a copy: the refresh and refused() change it meanwhile)
        return {"self": names[self.self_id], "members": list(ring.nodes), "vnodes": self.vnodes,
                "blocks": {names[n]: list(a) for n, a in blocks.items() if n in names},
                "secret": self.secret, "timeout": self.timeout, "alive": self.alive}

    @property
    def ring(self) -> HashRing:
        """The ring over the members' names (see owner() for a key's node id)."""
        return self._route[0]

    def _answers(self, asks: dict) -> dict:
        """The answers to the calls ``asks`` (made already) that came within one deadline,
        the timeout's (at most 5 s): a suspect rejoins only once it answers in time."""
        deadline = time.monotonic() + min(self.timeout, 5.0)
        answers = {}
        for what, ref in asks.items():
            try:
                answers[what] = self._ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except self._call_errors:
                continue
        return answers

    def _set_members(self, members) -> None:
        """Rebuild the ring when its members or their names change: the ring over names,
        name -> node id, node id -> name, swapped as one (owner() reads it unlocked)."""
        members = tuple(sorted(members))
        names = {n: self._names.get(n, n) for n in members}
        with self._lock:
            if members != self.members or names != self._route[2]:
                if self.members:
                    log.info("ring now has %d node(s)", len(members))
                    self.counters["ring_changes"] += 1
                self._route = (HashRing(names.values(), self.vnodes),
                               {name: n for n, name in names.items()}, names)
                self.members = members

    def silent(self, name: str) -> None:
        """A reader of this node waited ``timeout`` on the block server of the member named
        ``name`` (as the directory names it) in vain. The reads it sends its daemon next
        (the same blocks, through Ray) would wait on the same peer as long again: calls to
        it fail at once instead, for as long as a timeout, as a call of it timing out
        would (the peer suspected, its blocks read from the source, counted). A peer that
        answers again rejoins as any suspect does."""
        node_id = self._route[1].get(name)
        if node_id is None or node_id == self.self_id:
            return  # not (or no longer) a member: its blocks go elsewhere already
        log.info("a reader's direct transfer from peer %s timed out (%s s): calls to it fail "
                 "at once for as long", node_id, self.timeout)
        self._silent_until[node_id] = time.monotonic() + self.timeout

    def refused(self, name: str) -> None:
        """A reader of this node found nothing listening at the block server address
        given for the member named ``name``: its daemon restarted (Ray restarts a killed
        actor in place, its block server on a new port). The address is asked for again
        at the next refresh; until then readers go through this daemon. It was learned
        once, so every remote hit on that node went through Ray for the rest of the job
        (review ops6)."""
        node_id = self._route[1].get(name)
        if node_id is not None and node_id != self.self_id and \
                self._blocks.pop(node_id, None) is not None:
            log.info("the block server of peer %s refused a reader: asking it where it "
                     "listens now", node_id)

    def _suspect(self, node_id: str, why: str) -> None:
        log.warning("peer %s failed (%s); reading its blocks from the source for now", node_id, why)
        self._silent_until.pop(node_id, None)  # its own window from here (_suspect_until)
        self.counters["peer_failures"] += 1
        self._suspect_until[node_id] = time.monotonic() + max(5.0, 3 * self.refresh_interval)
        self._set_members([n for n in self.members if n != node_id])

    # -- routing ---------------------------------------------------------------------

    def owner(self, key: str) -> str:
        """The node id of the block's owner."""
        ring, node_of, _ = self._route
        return node_of[ring.owner(key)]

    def fetch_many(self, by_owner: dict[str, list[tuple]]) -> dict[str, list[bytes | None] | None]:
        """Fetch blocks from their owners: one call per owner, all in flight at once.

        Returns, per owner, the blocks' bytes (None for a block the owner could not
        serve), or None for an owner that failed or timed out (suspected: out of the ring
        for a while). Each call has ``timeout`` plus its bytes' time at TRANSFER_RATE, as a
        reader's direct fetch has (client/direct.py). Callers keep calls bounded (owner.py
        batches: an owner serves one in about one source latency), so a call past that is
        an owner that does not answer, not one that is busy with a large batch: a call of
        a whole prefetch pass went past it on a healthy owner and took it out of the ring.
        """
        refs = {}
        out: dict[str, list | None] = {}
        now = time.monotonic()
        for owner, requests in by_owner.items():
            handle = self._handles.get(owner)
            if handle is None:
                out[owner] = None
                continue
            if self._silent_until.get(owner, 0.0) > now:  # its timeout is spent already
                self._suspect(owner, "its block server did not answer a reader here within "
                                     f"{self.timeout} s")
                out[owner] = None
                continue
            refs[owner] = handle.serve_blocks.options(
                num_returns=1 + pieces_for(requests)).remote(requests)
            self.counters["remote_requests"] += 1
        started = time.monotonic()
        for owner, ref in refs.items():
            deadline = started + self.timeout + sum(
                max(0, int(r[1])) for r in by_owner[owner]) / TRANSFER_RATE
            try:
                lengths, *pieces = self._ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
            except Exception as exc:  # anything: else owner.RemoteReads.fetch strands its flights
                if type(exc).__name__ == "GetTimeoutError":
                    try:
                        self._ray.cancel(ref[0])  # the call (any of its returns)
                    except Exception:  # best effort: the peer is marked suspect anyway
                        pass
                else:
                    self._collect(ref)
                self._suspect(owner, type(exc).__name__)
                out[owner] = None
                continue
            try:
                out[owner] = unpack(lengths, pieces, by_owner[owner])
            except ValueError as exc:  # not what was asked: a peer of another version
                self._suspect(owner, f"an answer that does not fit the request ({exc})")
                out[owner] = None
                continue
            self.counters["remote_blocks"] += sum(1 for n in lengths if n >= 0)
            self.counters["remote_bytes"] += sum(n for n in lengths if n > 0)
        return out

    def _collect(self, refs: list) -> None:
        """Get each return of a failed call: the error is in every one, and Ray logs an
        "unhandled error" with its traceback for each one never got (one call, up to 86
        tracebacks in the daemon's log for one failure)."""
        for ref in refs:
            try:
                self._ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - the error already counted for the call
                pass


def pieces_for(requests: list[tuple]) -> int:
    """How many pieces the reply to ``requests`` (key, length, ...) comes in (PIECE, one
    past INLINE_MOST): both sides count them from the lengths asked for, as Ray needs the
    number of a call's returns when it is made."""
    total = sum(max(0, int(r[1])) for r in requests)
    return 1 if total > INLINE_MOST else max(1, -(-total // PIECE))


def pack(blocks: list[bytes | None], requests: list[tuple]) -> tuple:
    """An owner's answer to ``requests``: (lengths, piece, piece, ...), a length -1 for a
    block not given (also one whose length is not the one asked for: another version), the
    given blocks' bytes one after another, cut into ``pieces_for(requests)`` pieces."""
    given = [b if b is not None and len(b) == int(r[1]) else None
             for b, r in zip(blocks, requests)]
    lengths = [-1 if b is None else len(b) for b in given]
    joined = b"".join(b for b in given if b)
    count = pieces_for(requests)  # (the last piece takes the rest: all of it, for one)
    return (lengths, *(joined[i * PIECE:(i + 1) * PIECE if i + 1 < count else None]
                       for i in range(count)))


def unpack(lengths: list[int], pieces: list[bytes], requests: list[tuple]) -> list[bytes | None]:
    """The blocks of an owner's answer (pack); ValueError if it does not fit ``requests``."""
    if len(lengths) != len(requests) or any(
            n not in (-1, int(r[1])) for n, r in zip(lengths, requests)):
        raise ValueError("lengths differ from those asked for")
    joined = b"".join(pieces)
    if len(joined) != sum(n for n in lengths if n > 0):
        raise ValueError("bytes differ from the lengths given")
    if sum(n >= 0 for n in lengths) == 1:  # one block given: its bytes as they came
        return [joined if n >= 0 else None for n in lengths]
    view = memoryview(joined)
    out, pos = [], 0
    for n in lengths:
        if n < 0:
            out.append(None)
        else:
            out.append(bytes(view[pos:pos + n]))
            pos += n
    return out
