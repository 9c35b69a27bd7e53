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

import errno
import json
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from . import fanout
from .adopt import Adoptions, Adopted
from ..blockfile import CorruptBlock
from ..claims import Claims, claims_dir
from .link import DaemonClient
from .direct import DirectReads
from .fills import Fill, FillWriter
from ..keys import block_key, block_length, url_tag
from .metadata import FileMeta
from .openfile import clip
from .urls import env_endpoint
from .. import trace
from ..readtime import MISS_SUM, miss_bucket
from ..tiers.source import SourceTier

if TYPE_CHECKING:  # the filesystem passes its metadata cache: a type only
    from .metadata import MetadataCache

log = logging.getLogger(__name__)

# What a tier's block file may fail with that is the tier's fault (the disk, its permissions,
# its directories), not this process's (EMFILE, ENOMEM) nor a block that is not there.
TIER_FAULTS = frozenset({errno.EIO, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP,
                         errno.ENXIO, errno.ESTALE, errno.EROFS})

VIEW_MIN = 1 << 20  # blocks from this size are joined from their mappings (see _hit)


class Piece(NamedTuple):
    meta: FileMeta
    index: int
    lo: int
    hi: int
    key: str
    length: int


class BlockReader:
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
        # blocks fetched before their lease; set by the filesystem that owns the metadata
        self.dropped_since = None
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

    def read_many(self, requests: list[tuple[FileMeta, int, int]]) -> list[bytes]:
        """Many ranges at once: their misses go to the daemon (and on to owners) in one batch."""
        pieces: list[list[Piece]] = []
        data: dict[tuple[int, int], bytes] = {}
        missing: list[tuple[tuple[int, int], Piece]] = []
        for r, (meta, start, end) in enumerate(requests):
            ps = self._pieces(meta, start, end) if end > start else []
            pieces.append(ps)
            joined = len(ps) > 1  # whole blocks of a joined read: views, copied once
            for j, piece in enumerate(ps):
                got = self._hit(piece, joined and piece.lo == 0 and piece.hi == piece.length)
                if got is None:
                    missing.append(((r, j), piece))
                else:
                    data[(r, j)] = got
        if missing:
            for (where, _), got in zip(missing, self._misses([p for _, p in missing])):
                data[where] = got
        out = []
        for r, ps in enumerate(pieces):
            parts = [data.pop((r, j)) for j in range(len(ps))]
            out.append(parts[0] if len(parts) == 1 else b"".join(parts))
            for part in parts:  # unmap at once (a view holds its block file's mapping)
                if type(part) is memoryview:
                    part.release()
        return out

    def _hit(self, piece: Piece, view: bool = False) -> bytes | memoryview | None:
        """The piece from a tier (verified), or None. ``view``: a whole block may come as
        a view of its mapped file, for a read that joins blocks (see blockfile.map_block)."""
        client = self.client
        if piece.key in self.fills.pending:
            # filled by this process, its file not written yet: not served from memory, as
            # a write through the cache from elsewhere may have cancelled the fill since;
            # once it has landed (and been noted), the daemon says which way to read it
            self.fills.wait_landed(piece.key)
            return None
        started = time.perf_counter()
        failed = None  # the first tier whose file of the block could not be read, and why
        for tier in client.tiers():
            try:
                data = (tier.view(piece.key, piece.length) if view and piece.length >= VIEW_MIN
                        else tier.get(piece.key, piece.length, piece.lo, piece.hi))
            except CorruptBlock as exc:
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

    def _misses(self, pieces: list[Piece]) -> list[bytes]:
        with trace.span("miss", trace.READ, blocks=len(pieces)):
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
                    self._missed(started, now)
                    out[first[p.key]] = block if (p.lo, p.hi) == (0, len(block)) else block[p.lo:p.hi]
            unique = [p for p in unique if p.key not in direct]
        if unique and self.direct.alone():  # claimed: fetched now, leased behind the read
            claimed, found = self._claim(unique)
            for key, data in found.items():
                out[first[key]] = data
            if claimed:
                self._fetch_claimed(claimed, first, out, started)
            unique = [p for p in unique if p.key not in claimed and p.key not in found]
        replies = []
        if unique:
            asked = time.perf_counter()
            replies = self.client.lease_many([self.item(p) for p in unique])
            self.client.count("lease_requests")
            self.client.count("lease_waits", len(unique))
            self.took("lease_seconds", "lease_wait", asked, len(unique))
        done = -1  # the leases after it are aborted if this ends early
        try:
            fetched = self._prefetch_fills(unique, replies)
            for done, p in enumerate(unique):
                reply = None if replies is None else replies[done]
                out[first[p.key]] = self._resolve(p, reply, fetched.get(done))
                if reply is None or reply[0] != "present":  # filled meanwhile: a hit
                    self._missed(started, time.perf_counter())
            done = len(unique)
        finally:
            if replies is not None:
                for p, reply in zip(unique[done + 1:], replies[done + 1:]):
                    if reply[0] == "fill":
                        self.client.abort(p.key, "error")
        for i, p in enumerate(pieces):  # the repeats: from the block this call got, the tier,
            if i not in out:            # or the source
                block = direct.get(p.key) or self.fills.pending.get(p.key)
                data = block[p.lo:p.hi] if block is not None else self._hit(p)
                out[i] = data if data is not None else self._direct(p)
        self.client.maybe_flush()
        return [out[i] for i in range(len(pieces))]

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
            results = fanout.run_all([partial(self._fetch_source, p) for p in pending])
            while pending:
                p, result = pending[0], results[len(claimed) - len(pending)]
                if isinstance(result, BaseException):
                    error = error or result
                    self.claims.release(p.key)
                    pending.pop(0)
                    continue
                block, fetched, now = result
                pending.pop(0)
                self.client.count("source_seconds", now - fetched)
                self.client.count("source_reads")
                self.client.count("bytes_from_source", len(block))
                self._missed(started, now)
                self.fills.adopt(p.key, block,
                                 Adopted(p, block, partial(dropped, p.meta.path), True,
                                         "claimed_duplicates"),
                                 self.adoptions)
                out[first[p.key]] = block if (p.lo, p.hi) == (0, len(block)) else block[p.lo:p.hi]
        finally:
            for p in pending:  # not fetched, or not handed on (interrupted): nobody's claim
                self.claims.release(p.key)
        if error is not None:
            raise error

    def _fetch_source(self, piece: Piece) -> tuple[bytes, float, float]:
        """(the block from the source, pinned to its version; when the fetch began, ended),
        traced in the thread that fetched it (a thread's events nest)."""
        meta = piece.meta
        started = time.perf_counter()
        block = self.source.read_block(meta.path, piece.index, self.block_size, meta.size,
                                       meta.version)
        now = time.perf_counter()
        if trace.ENABLED:
            trace.block_event("source_fetch", started, now, "source", meta.path, piece.index,
                              len(block))
        return block, started, now

    def _prefetch_fills(self, unique: list[Piece], replies) -> dict[int, tuple | BaseException]:
        """The blocks of a batch this process was leased to fill, fetched side by side when
        there are several (fanout.py), by their place in the batch; {} for one or none."""
        places = [i for i, r in enumerate(replies or ()) if r[0] == "fill"]
        if len(places) < 2:
            return {}
        self.fills.kick()  # the earlier fills get written while we wait on the source
        got = fanout.run_all([partial(self._fetch_source, unique[i]) for i in places])
        return dict(zip(places, got))

    def _resolve(self, piece: Piece, reply, fetched=None) -> bytes:
        client = self.client
        if reply is None:
            client.count("fallbacks")
            return self._direct(piece)
        kind, arg = reply[0], reply[1]
        if kind == "fill":
            return self._fill(piece, arg, reply[2], fetched)
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

    def _fill(self, piece: Piece, tier_name: str, lease: int, fetched=None) -> bytes:
        """Fill a leased block: fetch it (unless ``fetched`` with the batch's others: the
        block and its times, or the fetch's error), hand it to the fill writer, return the
        piece's bytes. The lease ends whatever failed, even Ctrl-C."""
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
        client.count("source_seconds", now - started)
        client.count("source_reads")
        client.count("misses")
        client.count("bytes_from_source", len(block))
        tier = self.tier(tier_name)
        if tier is None:  # a tier this process does not know (the daemon was reconfigured)
            client.abort(piece.key, "error")
        else:
            self.fills.submit(Fill(piece.key, tier, block, url_tag(meta.url), client.link(),
                                   lease), waited=now - started)
        return block if piece.lo == 0 and piece.hi == len(block) else block[piece.lo:piece.hi]

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
            self.fills.adopt(piece.key, block, Adopted(
                piece, block, lambda: metadata.dropped_since(path, asked), claimed,
                "cold_get_duplicates"), self.adoptions)
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
        data = self.source.read_range(meta.path, base + piece.lo, base + piece.hi, meta.version)
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

    def _source_read(self, piece: Piece, started: float, nbytes: int) -> None:
        now = time.perf_counter()
        self.client.count("source_seconds", now - started)
        self.client.count("source_reads")
        if trace.ENABLED:
            trace.block_event("source_fetch", started, now, "source", piece.meta.path,
                              piece.index, nbytes)

    def _missed(self, started: float, now: float) -> None:
        """One block not in the node's tiers had its bytes ``now``: the miss latency."""
        self.client.count(miss_bucket(now - started))
        self.client.count(MISS_SUM, now - started)

    def read_unsized(self, meta: FileMeta) -> bytes:
        """The whole of a file whose size the source states as 0, read to its end from the
        source (still version-checked) and not cached: a ``/proc`` file's stat says 0 and
        its content is whatever the kernel has now. Counted as ``bypassed`` when it held
        bytes; a really empty file reads as ``b""`` and is no bypass of anything."""
        data = self.source.read_all(meta.path, meta.version)
        if data:
            self.client.count("bypassed")
            self.client.count("bytes_from_source", len(data))
        if data and not self._warned_unsized:
            self._warned_unsized = True
            log.info("%s: its size is stated as 0 but it holds %d bytes (a special file): "
                     "files like it are read from the source, uncached (counted as bypassed)",
                     meta.url, len(data))
        return data

    def tier(self, name: str | None):
        for tier in self.client.tiers():
            if tier.name == name:
                return tier
        return None
