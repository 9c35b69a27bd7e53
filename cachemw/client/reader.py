"""The read path: byte ranges of source files, served block by block through the tiers.

A hit is read straight from a tier file and verified. A miss on a node of its own takes the
block's claim (cachemw.claims: a file created with O_EXCL, the node's single flight), fetches
the block, and leaves its lease and its fill to the fill writer (``adopt``): no round trip
to the daemon before the source request. Misses whose claim another process holds, and
misses in a cluster of several nodes, go to the daemon in one request; for each block it
answers: fill it (fetch the whole block from the source and write the tier file), it is
present now (the claim's holder filled it), here are its bytes (fetched from the node that
owns it), or read the source yourself. Every outcome
but a fill or a hit (daemon unreachable, tiers full, filler stuck, owner down, block
evicted under us) reads the source directly and is counted, so losing the cache costs
speed and never a read.

Every source read names the version of the file it is for (the one in the block's key, the
one an open file pinned): the source tier returns that version's bytes or raises
ChangedSourceError (see tiers/source.py), so a read never joins blocks of two versions.

A cold read (``read_cold``: a file neither this process nor the node knows) of a store
whose GET names the version (HTTP, S3) fetches the block it starts in first, with a plain
GET, and takes the file's version from that response instead of asking for the file's
info (a HEAD) before it; the block is then leased and filled behind the read (by the fill
writer, fills.py ``adopt``), and the rest of the read is pinned to that version. The lease
comes after the fetch there (a block's key needs the version), so two processes reading
the same cold file at once both fetch its first block: counted (``cold_get_duplicates``),
both return that version's bytes, one fill is kept.
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from .adopt import Adoptions, Adopted
from ..blockfile import TIER_FAULTS, CorruptBlock, HeldBlock, join_blocks
from ..claims import Claims, claims_dir
from .link import DaemonClient
from .direct import DirectReads
from .fills import FillWriter
from ..keys import block_key, block_length
from .metadata import FileMeta
from .misses import Misses, Piece
from .openfile import clip
from .urls import env_endpoint
from .. import trace
from ..readtime import MISS_SUM, miss_bucket
from ..tiers.source import MOVED_ON, ChangedSourceError, SourceTier

if TYPE_CHECKING:  # the filesystem passes its metadata cache: a type only
    from .metadata import MetadataCache

log = logging.getLogger(__name__)

VIEW_MIN = 1 << 20  # blocks from this size are joined from their mappings (see _hit)


class BlockReader(Misses):
    """Byte ranges of source files through the node's tiers: hits here, misses in
    misses.py (Misses), the source pinned to each file's version."""

    def __init__(self, source: SourceTier, client: DaemonClient, block_size: int,
                 write_behind: int = 0) -> None:
        self.source = source
        self.client = client
        self.block_size = block_size
        self._source_json: str | None = None  # source_json(), made at its first use
        self.direct = DirectReads(client)
        self.fills = FillWriter(client, write_behind)
        self.claims = Claims(claims_dir(client.runtime_dir))
        # leases blocks fetched before them, on the fill writer
        self.adoptions = Adoptions(client, self.fills, self.claims, self.item, self.tier,
                                   self.took)
        # the node table's "written through the cache since" (metadata.dropped_since), for
        # blocks fetched before their lease; and what a source read that finds its version
        # gone (changed, or no file) calls with the file's FileMeta (metadata.moved_on), so
        # that the next read of it, a retry, a reopen, the path of a batch read again alone,
        # asks the source: set by the filesystem that owns the metadata
        self.dropped_since = None
        self.moved_on = None
        self._warned_unsized = False
        self._warned_unversioned = False
        self._warned_claims = False
        self._warned_unreadable: set = set()
        self._unreadable_keys: set = set()  # blocks already counted and dropped as unreadable
        self._warned_corrupt = False

    def _pieces(self, meta: FileMeta, start: int, end: int) -> list[Piece]:
        bs = self.block_size
        out = []
        for i in range(start // bs, (end - 1) // bs + 1):
            base = i * bs
            length = block_length(meta.size, i, bs)
            out.append(Piece(meta, i, max(start - base, 0), min(end - base, length),
                              block_key(meta.url, meta.version, i, bs), length))
        return out

    def read(self, meta: FileMeta, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the file (already clipped to its size)."""
        if end <= start:
            return b""
        bs = self.block_size
        index = start // bs
        if index == (end - 1) // bs:  # the common case: one block
            base = index * bs
            piece = Piece(meta, index, start - base, end - base,
                           block_key(meta.url, meta.version, index, bs),
                           block_length(meta.size, index, bs))
            data = self._hit(piece)
            return data if data is not None else self._misses([piece])[0]
        return self.read_many([(meta, start, end)])[0]

    def read_many(self, requests: list[tuple[FileMeta, int, int]], *,
                  join_held: bool = True) -> list[bytes]:
        """Many ranges at once: their misses go to the daemon (and on to owners) in one batch.
        ``join_held``: a range's whole large blocks are held and joined from their files."""
        pieces: list[list[Piece]] = []
        data: dict[tuple[int, int], bytes | HeldBlock] = {}
        missing: list[tuple[tuple[int, int], Piece]] = []
        try:
            for r, (meta, start, end) in enumerate(requests):
                ps = self._pieces(meta, start, end) if end > start else []
                pieces.append(ps)
                joined = join_held and len(ps) > 1  # whole blocks of a joined read: copied once
                for j, piece in enumerate(ps):
                    got = self._hit(piece, joined and piece.lo == 0 and piece.hi == piece.length)
                    if got is None:
                        missing.append(((r, j), piece))
                    else:
                        data[(r, j)] = got
            if missing:
                for (where, _), got in zip(missing, self._misses([p for _, p in missing])):
                    data[where] = got
            out, repaired = [], set()
            for r, ps in enumerate(pieces):
                parts = [data.pop((r, j)) for j in range(len(ps))]
                if len(parts) == 1:
                    out.append(parts[0])
                    continue
                whole, bad = join_blocks(parts)
                for j, exc in bad.items():  # damaged: dropped, and the range read anew
                    if ps[j].key not in repaired:  # (held by two ranges: the fresh copy stays)
                        repaired.add(ps[j].key)
                        self._corrupt(ps[j], parts[j].tier, exc)
                out.append(whole if not bad else
                           self.read_many([requests[r]], join_held=False)[0])
            return out
        finally:
            for part in data.values():  # held, and not joined (a failed read)
                if type(part) is HeldBlock:
                    part.close()

    def _hit(self, piece: Piece, view: bool = False) -> bytes | HeldBlock | None:
        """The piece from a tier (verified), or None. ``view``: a whole block may come held
        open, its data checked where the read joins it (see blockfile.join_blocks)."""
        client = self.client
        if piece.key in self.fills.pending:  # filled by this process, its file not landed
            pending = self.fills.pending_fill(piece.key)
            if pending is not None:
                return self._pending_hit(piece, *pending)
        started = time.perf_counter()
        failed = None  # the first tier whose file of the block could not be read, and why
        for tier in client.tiers():
            try:
                if view and piece.length >= VIEW_MIN:
                    data = tier.view(piece.key, piece.length)
                    if data is not None:
                        data.tier = tier
                else:
                    data = tier.get(piece.key, piece.length, piece.lo, piece.hi)
            except CorruptBlock as exc:
                self._corrupt(piece, tier, exc)
                continue
            except OSError as exc:
                if exc.errno not in TIER_FAULTS:  # this process's (EMFILE, ENOMEM): raised
                    raise
                failed = failed or (tier, exc)
                continue
            if data is not None:
                if failed is not None:  # a slower tier's copy served it
                    self._unreadable(piece, *failed, served=True)
                self._hit_done(piece, tier.name, data, started)
                return data
        if failed is not None:
            self._unreadable(piece, *failed)
        return None

    def _corrupt(self, piece: Piece, tier, exc: CorruptBlock) -> None:
        """A damaged block file of ``tier``: dropped (refetched by the read that found it)."""
        client = self.client
        if not self._warned_corrupt:  # a failing disk would log every block
            self._warned_corrupt = True
            log.warning("corrupt cached block of %s (block %d): %s; refetched (further "
                        "ones counted as corrupt_repaired; logged once)",
                        piece.meta.url, piece.index, exc)
        client.count("corrupt_repaired")
        tier.delete(piece.key)
        client.drop(piece.key, "corrupt")
        # answered before the refetch's lease, which may go on another connection
        # (the fill writer's: see _fetch_claimed), so it is never granted "present"
        client.ping()

    def _pending_hit(self, piece: Piece, block: bytes, servable: bool) -> bytes:
        """A block this process fetched and has not landed yet (fills.py): its bytes from
        memory, counted as a hit (of the first tier, where fills go). Never a wait for the
        fill to land: that is a wait on the fill writer thread, which runs whatever a
        garbage collection on it finalizes, and a finalizer may need a lock this reader
        holds (h5py's, around a read of a file object): each waited for the other. Where
        the file was written through the cache since the block was fetched (``servable``
        False), the daemon cancels the fill, and the piece is read from the source,
        pinned to its version (counted as bypassed): not from the pending bytes, which a
        rewrite keeping the version token would make stale, nor through a lease, which
        would wait on this process's own fill."""
        if not servable:
            self.client.count("bypassed")
            return self._direct(piece)
        started = time.perf_counter()
        data = block if (piece.lo, piece.hi) == (0, len(block)) else block[piece.lo:piece.hi]
        tiers = self.client.tiers()
        self._hit_done(piece, tiers[0].name if tiers else "memory", data, started)
        return data

    def _unreadable(self, piece: Piece, tier, exc: OSError, served: bool = False) -> None:
        """A tier's file of the block that cannot be read (EIO, EACCES, a tier directory
        made a file): the daemon forgets the block if that tier holds it (not a copy
        elsewhere), so that it sends no reader there again. Unless a slower tier's copy
        ``served`` the read, it goes on as a miss, from the source: counted (once per
        block: a miss probes the tiers twice) and logged once per tier and error. Errors
        of this process, not of the tier (EMFILE: too many open files; ENOMEM: no room
        for a mapping), are raised, not blamed on the block."""
        if exc.errno not in TIER_FAULTS:
            raise exc
        if piece.key in self._unreadable_keys:
            return
        if len(self._unreadable_keys) >= 4096:
            self._unreadable_keys.clear()
        self._unreadable_keys.add(piece.key)
        if not served:
            self.client.count("tier_read_errors")
        if (tier.name, exc.errno) not in self._warned_unreadable:
            self._warned_unreadable.add((tier.name, exc.errno))
            log.warning("cannot read cached blocks from the %s tier (%s, a block of %s): read "
                        "from another tier or the source (counted as tier_read_errors; "
                        "logged once)", tier.name, exc, piece.meta.url)
        if self.client.drop(piece.key, "unreadable", tier.name) and not served:
            self.client.ping()  # before the refetch's lease (see the corrupt case in _hit)

    def item(self, p: Piece) -> tuple:
        """What the daemon needs to fetch a block itself: key, length, url, source ref
        (with the version token, so an owner node never caches another version's bytes);
        no source ref for a target that cannot be described to another process."""
        described = self.source_json()
        return (p.key, p.length, p.meta.url,
                None if described is None else
                (described, p.meta.path, p.index, self.block_size, p.meta.size,
                 p.meta.version))

    def source_json(self) -> str | None:
        """The target in fsspec's JSON form, from which a daemon (this node's prefetch, a
        block's owner node) makes its own; None, said once, if an option of the target has
        no JSON form (an aiohttp ``ClientTimeout``, a botocore ``Config``): this process
        then reads those blocks itself, as it would with no daemon at all."""
        if self._source_json is None:
            try:
                self._source_json = self.source.fs.to_json()
                endpoint = env_endpoint(self.source.fs)
                if endpoint:  # from this process's environment: the daemon's may name another
                    described = json.loads(self._source_json)
                    described["endpoint_url"] = endpoint
                    self._source_json = json.dumps(described)
            except (TypeError, ValueError) as exc:
                self._source_json = ""
                log.info("the target's options have no JSON form (%s): its blocks are not "
                         "prefetched by the daemon nor fetched by other nodes for this "
                         "process; it reads them itself", exc)
        return self._source_json or None

    def announce_items(self, meta: FileMeta, start: int, end: int) -> list[tuple]:
        return [self.item(p) for p in self._pieces(meta, start, end)] if end > start else []

    def read_cold(self, path: str, start: int | None, end: int | None,
                  metadata: MetadataCache) -> bytes | None:
        """Bytes ``[start, end)`` (fsspec's meaning) of a file whose version no process of
        the node knows, with its version learned from the GET of the block ``start`` falls
        in (tiers/source.py read_first) and kept in ``metadata`` for the node. None, having
        fetched nothing, where that cannot be done (a store whose GET names no version, a
        range from the end, other nodes sharing blocks: a block's owner fetches it, and
        asking it needs the key, so the version, first); None also when the response named
        no version (counted as ``cold_get_fallbacks``): then ask for the info and read."""
        if not self.source.tells_versions or (start is not None and start < 0) \
                or not self.direct.alone():
            return None
        bs = self.block_size
        index = (start or 0) // bs
        self.fills.kick()  # the earlier fills get written while we wait on the source
        asked = time.time()  # before the request, as for metadata (see metadata._ask)
        started = time.perf_counter()
        first = self.source.read_first(path, index, bs)
        if first is None:
            self.client.count("cold_get_fallbacks")
            if not self._warned_unversioned:
                self._warned_unversioned = True
                log.info("%s: the store's answer to a cold GET did not name the file's "
                         "version (no ETag or size, an empty file, a range past its end, an "
                         "error); its info is asked for first (counted as "
                         "cold_get_fallbacks; logged once)", path)
            return None
        meta = metadata.learned(path, first.info, asked)
        self.client.count("cold_gets")
        block = first.data
        piece = Piece(meta, index, 0, len(block),
                       block_key(meta.url, meta.version, index, bs), len(block))
        self._source_read(piece, started, len(block))
        self.client.count("bytes_from_source", len(block))
        self._missed(started, time.perf_counter())
        if block:  # (an empty file is read to its end each time, uncached: see fs._read)
            # leased and filled behind the read, as fills are written (fills.py), before
            # the file's info is shared: a process that learns the version there finds the
            # fill in flight and waits for it, rather than fetching the block again
            # its claim first, so that a process learning the version misses into a wait
            claimed = self._take_claim(piece.key)
            written = lambda: metadata.dropped_since(path, asked)  # noqa: E731
            self.fills.adopt(piece.key, block, Adopted(
                piece, block, written, claimed, "cold_get_duplicates"), self.adoptions,
                written)
        metadata.share(path, first.info, asked)
        start, end = clip(start, end, meta.size)
        if end <= start:
            return b""
        base = index * bs
        stop = base + len(block)
        head = block if (start, end) == (base, stop) else block[start - base:min(end, stop) - base]
        if end <= stop:
            return head
        return b"".join((head, self.read_many([(meta, stop, end)])[0]))

    def _direct(self, piece: Piece) -> bytes:
        base = piece.index * self.block_size
        meta = piece.meta
        started = time.perf_counter()
        try:
            data = self.source.read_range(meta.path, base + piece.lo, base + piece.hi,
                                          meta.version)
        except MOVED_ON:
            self._moved_on(meta)
            raise
        self._source_read(piece, started, len(data))
        self.client.count("bytes_from_source", len(data))
        return data

    # -- where the time went (readtime.py) and traces (trace.py) ------------------------

    def _hit_done(self, piece: Piece, tier: str, data: bytes, started: float) -> None:
        now = time.perf_counter()
        self.client.hit(piece.key, tier, len(data), now - started)
        if trace.ENABLED:
            trace.block_event("hit", started, now, tier, piece.meta.path, piece.index, len(data))

    def took(self, counter: str, name: str, started: float, blocks: int) -> float:
        """Add the time since ``started`` to ``counter``; trace it as ``name``. Now."""
        now = time.perf_counter()
        if blocks:
            self.client.count(counter, now - started)
            if trace.ENABLED:
                trace.event(name, trace.READ, started, now, {"blocks": blocks})
        return now

    def _source_read(self, piece: Piece, started: float, nbytes: int) -> float:
        """Count and trace a read from the source that began at ``started``, in the thread
        that made it (a thread's trace events nest; the counters take a lock); now."""
        now = time.perf_counter()
        self.client.count("source_seconds", now - started)
        self.client.count("source_reads")
        if trace.ENABLED:
            trace.block_event("source_fetch", started, now, "source", piece.meta.path,
                              piece.index, nbytes)
        return now

    def _missed(self, started: float, now: float) -> None:
        """One block not in the node's tiers had its bytes ``now``: the miss latency."""
        self.client.count(miss_bucket(now - started))
        self.client.count(MISS_SUM, now - started)

    def read_unsized(self, meta: FileMeta) -> bytes:
        """The whole of a file whose size the source states as 0 or not at all, read to its
        end from the source (still version-checked) and not cached: a ``/proc`` file's stat
        says 0 and its content is whatever the kernel has now; an HTTP server that sends no
        Content-Length states none. Counted as ``bypassed`` when it held
        bytes; a really empty file reads as ``b""`` and is no bypass of anything. A file
        gone meanwhile is not dropped here: under immutable, one known as empty stays so
        (fs._read)."""
        try:
            data = self.source.read_all(meta.path, meta.version)
        except ChangedSourceError:
            self._moved_on(meta)
            raise
        if data:
            self.client.count("bypassed")
            self.client.count("bytes_from_source", len(data))
        if data and not self._warned_unsized:
            self._warned_unsized = True
            log.info("%s: its size is stated as %s but it holds %d bytes (a special file, or "
                     "a server that sends no Content-Length): files like it are read from the "
                     "source, uncached (counted as bypassed)",
                     meta.url, "none" if meta.size < 0 else 0, len(data))
        return data

    def _moved_on(self, meta: FileMeta) -> None:
        """A source read of ``meta``'s version found it gone: what is known of the file
        is dropped (see ``moved_on``), and the error is raised on by the caller."""
        if self.moved_on is not None:
            self.moved_on(meta)

    def tier(self, name: str | None):
        for tier in self.client.tiers():
            if tier.name == name:
                return tier
        return None
