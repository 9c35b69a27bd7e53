"""How a lease ends: its fill noted and published (or dropped, if cancelled meanwhile),
aborted, or ended with the connection that took it, and the block's claim released with
it (cachemw.claims). A mixin of NodeCache (cache.py): it works on the node's index, leases,
tiers and lock.
"""
from __future__ import annotations

import logging
import os
import time

from .. import blockfile
from .records import Inflight

log = logging.getLogger(__name__)


class LeaseEnds:
    def filled(self, key: str, tier: str, stored: int, conn: object, lease: int) -> bool:
        """A client staged the fill of lease ``lease`` (see land); True if it is now cached.
        A lease that has ended already (aborted on a disconnect, say) owns nothing: its
        staged file is deleted."""
        with self._lock:
            inflight = self._inflight.get(key)
            ours = inflight is not None and inflight.conn is conn and inflight.lease == lease
        if not ours:
            if tier in self._tiers:
                self._tiers[tier].tier.unstage(key, lease)
            return False
        return self.land(key, inflight, stored)

    def land(self, key: str, inflight: Inflight, stored: int, gone: bool = False) -> bool:
        """End a fill lease whose block is staged: publish and index it, or, if the lease
        was cancelled meanwhile (evicted, or the file written through the cache), drop the
        staged bytes: they may be stale, and hits read blocks by key without asking us.
        Publishing under the lock orders it with invalidate(). True if indexed; False also
        when the lease had ended already (its note, a waiter or release got here first).
        ``gone``: its client's connection is gone (see _release_claim)."""
        ts = self._tiers[inflight.tier]
        with self._lock:
            if self._inflight.get(key) is not inflight:
                return False
            del self._inflight[key]
            ts.reserved -= inflight.nbytes
            indexed = not inflight.cancelled and ts.tier.publish(key, inflight.lease)
            if indexed:
                self._add(key, inflight.tier, stored, inflight.tag)
            else:
                self.placer.drop(key)
            self._release_claim(key, inflight, gone)  # indexed first: a waiter finds it
        if not indexed:
            ts.tier.unstage(key, inflight.lease)
        inflight.done.set()
        return indexed

    def abort(self, key: str, reason: str, conn: object) -> None:
        with self._lock:
            inflight = self._inflight.get(key)
            if inflight is None or inflight.conn is not conn:
                return
        self.end_unfilled(key, inflight, reason)

    def end_unfilled(self, key: str, inflight: Inflight, reason: str,
                     keep_claim: bool = False, gone: bool = False) -> None:
        """End a fill lease that brought no block (an error, a disconnect, a failed
        prefetch): room and placement are given back; whatever was staged is deleted.
        Its claim is released, unless ``keep_claim`` (the caller holds it and releases it);
        ``gone``: its client's connection is gone (see _release_claim)."""
        with self._lock:
            if self._inflight.get(key) is not inflight:
                return
            del self._inflight[key]
            ts = self._tiers[inflight.tier]
            ts.reserved -= inflight.nbytes
            self.placer.drop(key)
            if not keep_claim:
                self._release_claim(key, inflight, gone)
            if reason == "nospace":
                ts.full_until = time.monotonic() + 5.0
                log.warning("%s tier %s is out of space; not admitting for 5 s", ts.config.name,
                            ts.tier.path)
        ts.tier.unstage(key, inflight.lease)  # whatever got written of it, if anything
        inflight.done.set()

    def release(self, conn: object) -> None:
        """A client went away: abort the leases it held so waiters can take them; a block
        whose file it wrote (and verifies) is kept, as if its 'filled' note had come (a
        process killed between writing a fill and noting it, or before its fill writer's
        note was read)."""
        with self._lock:
            held = [(k, f) for k, f in self._inflight.items() if f.conn is conn]
        for key, inflight in held:
            stored = self._verified_size(inflight, key)
            if stored is not None and self.land(key, inflight, stored, gone=True):
                self.count("adopted")
            else:  # nothing (sound) staged, or cancelled: ends it, deletes what is staged
                self.end_unfilled(key, inflight, "disconnected", gone=True)

    def _release_claim(self, key: str, inflight: Inflight, gone: bool) -> None:
        """Release the claim a lease ended with. A client whose lease request went
        unanswered (a timeout, a broken connection) released the claims it brought itself,
        and another process may have taken one since: once the connection is gone, a claim
        the client brought is removed only while it still names the client. Otherwise the
        client has left its claim to us, and this saves reading it on every fill."""
        self.claims.release(key, inflight.claimant if gone else None)

    def _verified_size(self, inflight: Inflight, key: str) -> int | None:
        """The size of the fill staged for ``inflight`` if it is whole and verifies."""
        nbytes = inflight.nbytes
        path = self._tiers[inflight.tier].tier.staged_path(key, inflight.lease)
        try:
            size = os.stat(path).st_size
            length = blockfile.data_length(size, path)
            if size != nbytes or blockfile.read_block(path, length) is None:
                return None
        except (OSError, blockfile.CorruptBlock):
            return None
        return size
