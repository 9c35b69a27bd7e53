"""The read path's misses: the blocks a read finds in no tier of the node (the half of
BlockReader, reader.py, that the hits do not need).

A miss on a node of its own takes the block's claim (cachemw.claims: a file created with
O_EXCL, the node's single flight), fetches the block, and leaves its lease and its fill to
the fill writer (``adopt``): no round trip to the daemon before the source request. Misses
whose claim another process holds, and misses in a cluster of several nodes, go to the
daemon in one request; for each block it answers: fill it (fetch the whole block from the
source and write the tier file), it is present now (the claim's holder filled it), here
are its bytes (fetched from the node that owns it), or read the source yourself; that
request goes out beside the call's own claimed fetches, so the daemon counts the call
among those blocks' waiting readers while they are fetched (node/demand.py). The
blocks one call fetches (its claimed ones, or the ones leased to it) are fetched side by
side (fanout.py).
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import NamedTuple

from . import fanout
from .adopt import Adopted
from ..blockfile import CorruptBlock
from .fills import Fill
from ..keys import url_tag
from .metadata import FileMeta
from ..reports import remote_hit_tier
from .silence import ReadCall
from .. import trace
from ..tiers.source import MOVED_ON

log = logging.getLogger(__name__)


class Piece(NamedTuple):
    """One block's part of a read: bytes ``[lo, hi)`` of block ``index`` of ``meta``'s
    file, whose key is ``key`` and whose data is ``length`` bytes long."""
    meta: FileMeta
    index: int
    lo: int
    hi: int
    key: str
    length: int


class Misses:
    """Resolves a read's misses; mixed into BlockReader, whose source, client, claims,
    fills, direct reads and hit path (``_hit``, ``_direct``, ``took``, ``_moved_on``) it
    uses."""

    def _misses(self, pieces: list[Piece]) -> list[bytes]:
        # its waits on a silent daemon (the ring, leases, a connection) add up to one
        # daemon_timeout at most, with the rest of the read call's (silence.py)
        with trace.span("miss", trace.READ, blocks=len(pieces)), ReadCall(self.client.timeout):
            return self._resolve_misses(pieces)

    def _resolve_misses(self, pieces: list[Piece]) -> list[bytes]:
        """One lease per distinct block (a batch may name a block twice); every fill lease
        is finished or aborted, even when resolving an earlier piece raises."""
        started = time.perf_counter()
        first: dict[str, int] = {}
        for i, p in enumerate(pieces):
            first.setdefault(p.key, i)
        unique = [pieces[i] for i in first.values()]
        out: dict[int, bytes] = {}
        direct = self.direct.fetch([(p.key, p.length) for p in unique])
        now = self.took("remote_hit_seconds", "remote_hit", started, len(direct))
        if direct:  # hits at their owner nodes, sent straight from there
            for p in unique:
                block = direct.get(p.key)
                if block is not None:
                    self.client.count("remote_hits")
                    self.client.count("remote_bytes", len(block))
                    # told the daemon (which never sees it): hot blocks are copied here
                    if self.client.report_remote_hits:
                        self.client.accessed(p.key,
                                             remote_hit_tier(p.length, url_tag(p.meta.url)))
                    self._missed(started, now)
                    out[first[p.key]] = block if (p.lo, p.hi) == (0, len(block)) else block[p.lo:p.hi]
            unique = [p for p in unique if p.key not in direct]
        claimed: dict[str, Piece] = {}
        if unique and self.direct.alone():  # claimed: fetched now, leased behind the read
            claimed, found = self._claim(unique)
            for key, data in found.items():
                out[first[key]] = data
            unique = [p for p in unique if p.key not in claimed and p.key not in found]
        replies = []
        asked_at = time.time()  # before the leases' fetches: see _fill
        fetch = partial(self._fetch_claimed, claimed, first, out, started)
        if unique and claimed:
            # the blocks other processes hold the claims of are asked for beside this call's
            # own fetches, not after them: from now on the daemon counts them among the
            # reads waiting on those blocks when it decides whether to keep them (on a
            # full tier, a block decided before this read was heard of was refused, and
            # this read fetched it again: node/demand.py)
            leased: list = []

            def lease() -> list[tuple] | None:
                leased.append(self._lease_many(unique))
                return leased[0]

            try:
                error, replies = fanout.beside(
                    fetch, lease, never_run=partial(self._release_claims, claimed))
            except BaseException:  # (Ctrl-C while the claimed fetches ran on)
                self._abort_fills(unique, leased[0] if leased else None)
                raise
            if isinstance(error, BaseException):
                self._abort_fills(unique, replies)
                raise error
        elif claimed:
            fetch()
        elif unique:
            replies = self._lease_many(unique)
        done = -1  # the leases after it are aborted if this ends early
        try:
            fetched = self._prefetch_fills(unique, replies)
            for done, p in enumerate(unique):
                reply = None if replies is None else replies[done]
                out[first[p.key]] = self._resolve(p, reply, fetched.get(done), asked_at)
                if reply is None or reply[0] != "present":  # filled meanwhile: a hit
                    self._missed(started, time.perf_counter())
            done = len(unique)
        finally:
            if replies is not None:
                self._abort_fills(unique[done + 1:], replies[done + 1:])
        for i, p in enumerate(pieces):  # the repeats: from the block this call got, the tier,
            if i not in out:            # or the source
                block = direct.get(p.key)
                if block is None:  # fetched by this call: pending in its fill, most likely
                    pending = self.fills.pending_fill(p.key)
                    block = pending[0] if pending is not None and pending[1] else None
                data = block[p.lo:p.hi] if block is not None else self._hit(p)
                out[i] = data if data is not None else self._direct(p)
        self.client.maybe_flush()
        return [out[i] for i in range(len(pieces))]

    def _abort_fills(self, pieces: list[Piece], replies) -> None:
        """End the fill leases of ``replies`` (one per piece): this call fills none."""
        for p, reply in zip(pieces, replies or ()):
            if reply[0] == "fill":
                self.client.abort(p.key, "error")

    def _release_claims(self, claimed: dict[str, Piece]) -> None:
        for p in claimed.values():
            self.claims.release(p.key)

    def _lease_many(self, pieces: list[Piece]) -> list[tuple] | None:
        """The daemon's replies for blocks this call holds no claim of (None: unreachable)."""
        asked = time.perf_counter()
        replies = self.client.lease_many([self.item(p) for p in pieces])
        self.client.count("lease_requests")
        self.client.count("lease_waits", len(pieces))
        self.took("lease_seconds", "lease_wait", asked, len(pieces))
        return replies

    def _claim(self, pieces: list[Piece]) -> tuple[dict[str, Piece], dict[str, bytes]]:
        """The pieces whose claims this process took, and the ones found cached once their
        claim was ours (a fill publishes its block before its claim ends: it landed since
        the hit was missed), both by key; none where the node has no claims directory (no
        daemon has run there yet: the lease path starts one)."""
        taken: dict[str, Piece] = {}
        found: dict[str, bytes] = {}
        for p in pieces:
            if not self._take_claim(p.key):
                continue
            data = self._hit(p)
            if data is None:
                taken[p.key] = p
            else:
                self.claims.release(p.key)
                found[p.key] = data
        return taken, found

    def _take_claim(self, key: str) -> bool:
        """``key``'s claim, if this process can take it. No claims directory (no daemon has
        run here yet), or one where no claim can be made (a full tmpfs): False, and the miss
        asks the daemon for its lease first, as with several nodes (said once)."""
        try:
            return self.claims.take(key)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if not self._warned_claims:
                self._warned_claims = True
                log.warning("cannot make a claim in %s (%s): misses ask the node daemon "
                            "for their lease before fetching (logged once)", self.claims.dir, exc)
            return False

    def _fetch_claimed(self, claimed: dict[str, Piece], first: dict, out: dict,
                       started: float) -> None:
        """Fetch the claimed blocks, side by side (fanout.py); each is leased and filled
        behind (adopt), and its claim ends with its lease (or here, if its fetch failed:
        the first failure is raised once every fetch has ended)."""
        dropped_since = self.dropped_since
        self.client.tell_unreachable()  # if a fill's lease behind earlier reads found it so
        pending = list(claimed.values())
        self.fills.kick()  # the earlier fills get written while we wait on the source
        asked = time.time()

        def dropped(path: str) -> bool:
            return dropped_since is not None and dropped_since(path, asked)

        error = None
        try:
            results = fanout.run_all([partial(self._fetch_source, p) for p in pending],
                                     parallel=self.source.concurrent)
            while pending:
                p, result = pending[0], results[len(claimed) - len(pending)]
                if isinstance(result, BaseException):
                    error = error or result
                    self.claims.release(p.key)
                    pending.pop(0)
                    continue
                block, _, now = result
                pending.pop(0)
                self.client.count("bytes_from_source", len(block))
                self._missed(started, now)
                written = partial(dropped, p.meta.path)
                self.fills.adopt(p.key, block,
                                 Adopted(p, block, written, True, "claimed_duplicates"),
                                 self.adoptions, written if dropped_since is not None else None)
                out[first[p.key]] = block if (p.lo, p.hi) == (0, len(block)) else block[p.lo:p.hi]
        finally:
            for p in pending:  # not fetched, or not handed on (interrupted): nobody's claim
                self.claims.release(p.key)
        if error is not None:
            raise error

    def _fetch_source(self, piece: Piece) -> tuple[bytes, float, float]:
        """(the block from the source, pinned to its version; when the fetch began, ended),
        counted and traced in the thread that fetched it (reader._source_read). A version
        gone from the source is dropped (reader._moved_on) before the error is raised."""
        meta = piece.meta
        started = time.perf_counter()
        try:
            block = self.source.read_block(meta.path, piece.index, self.block_size, meta.size,
                                           meta.version)
        except MOVED_ON:
            self._moved_on(meta)
            raise
        return block, started, self._source_read(piece, started, len(block))

    def _prefetch_fills(self, unique: list[Piece], replies) -> dict[int, tuple | BaseException]:
        """The blocks of a batch this process was leased to fill, fetched side by side when
        there are several (fanout.py), by their place in the batch; {} for one or none."""
        places = [i for i, r in enumerate(replies or ()) if r[0] == "fill"]
        if len(places) < 2:
            return {}
        self.fills.kick()  # the earlier fills get written while we wait on the source
        got = fanout.run_all([partial(self._fetch_source, unique[i]) for i in places],
                             parallel=self.source.concurrent)
        return dict(zip(places, got))

    def _resolve(self, piece: Piece, reply, fetched=None, asked: float = 0.0) -> bytes:
        client = self.client
        if reply is None:
            client.count("fallbacks")
            return self._direct(piece)
        kind, arg = reply[0], reply[1]
        if kind == "fill":
            return self._fill(piece, arg, reply[2], fetched, asked)
        if kind == "data":
            client.count("remote_reads")
            client.count("remote_bytes", len(arg))
            return arg if piece.lo == 0 and piece.hi == len(arg) else arg[piece.lo:piece.hi]
        if kind == "present":
            tier = self.tier(arg)
            started = time.perf_counter()
            try:
                data = tier.get(piece.key, piece.length, piece.lo, piece.hi) if tier else None
            except CorruptBlock:
                client.count("corrupt_repaired")
                data = None
            except OSError as exc:
                self._unreadable(piece, tier, exc)
                return self._direct(piece)
            if data is not None:
                self._hit_done(piece, arg, data, started)
                return data
            client.drop(piece.key, "missing")  # indexed but gone: let it be filled again
        client.count("fallbacks" if kind == "fallback" else "bypassed")
        return self._direct(piece)

    def _fill(self, piece: Piece, tier_name: str, lease: int, fetched=None,
              asked: float = 0.0) -> bytes:
        """Fill a leased block: fetch it (unless ``fetched`` with the batch's others: the
        block and its times, or the fetch's error), hand it to the fill writer, return the
        piece's bytes. The lease ends whatever failed, even Ctrl-C. ``asked``: the wall
        time before the fetch, after which a write through the cache keeps the pending
        bytes from being served by this process (fills.pending_fill)."""
        client = self.client
        meta = piece.meta
        try:
            if fetched is None:
                self.fills.kick()  # the earlier fills get written while we wait on the source
                fetched = self._fetch_source(piece)
            elif isinstance(fetched, BaseException):
                raise fetched
        except BaseException:
            client.abort(piece.key, "source-error")
            raise
        block, started, now = fetched
        client.count("misses")
        client.count("bytes_from_source", len(block))
        tier = self.tier(tier_name)
        if tier is None:  # a tier this process does not know (the daemon was reconfigured)
            client.abort(piece.key, "error")
        else:
            dropped_since = self.dropped_since
            written = None if dropped_since is None else partial(dropped_since, meta.path, asked)
            self.fills.submit(Fill(piece.key, tier, block, url_tag(meta.url), client.link(),
                                   lease, written), waited=now - started)
        return block if piece.lo == 0 and piece.hi == len(block) else block[piece.lo:piece.hi]
