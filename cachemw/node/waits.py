"""How a lease waits for another process's fetch of the same block: on its claim (the holder
fetches before asking for its lease, claims.py) or on its lease in flight (the holder
writes the block file behind its read, and may note it late). A mixin of NodeCache
(cache.py): it works on the node's index, leases and lock.
"""
from __future__ import annotations

import logging
import os
import time

from .records import Inflight

log = logging.getLogger(__name__)


CLAIM_FAULT_LOG_EVERY = 60.0  # seconds between two logs of leases given without a claim


class LeaseWaits:
    _claimless = 0  # leases given without a claim since that was last logged
    _claimless_logged_at = float("-inf")

    def _claim(self, key: str) -> bool:
        """Take ``key``'s claim for a lease given here; False if another process holds it.
        Without a usable claims directory, leases alone decide (as before claims): the
        directory is made again if it is gone or a file is in its place, and where no
        claim can be made the lease goes without one, counted (``claim_errors``) and
        logged at most once a minute (a lease request never fails for it)."""
        try:
            return self.claims.take(key) or (not self.claims.held(key) and self.claims.take(key))
        except (FileNotFoundError, NotADirectoryError) as exc:  # removed, or a file in its place
            if self.claims.make():
                try:
                    return self.claims.take(key)
                except OSError as again:
                    exc = again
            self._lease_without_claim(key, exc)
        except OSError as exc:
            self._lease_without_claim(key, exc)
        return True

    def _lease_without_claim(self, key: str, exc: OSError) -> None:
        self.counters["claim_errors"] = self.counters.get("claim_errors", 0) + 1
        self._claimless += 1
        now = time.monotonic()
        if now - self._claimless_logged_at >= CLAIM_FAULT_LOG_EVERY:
            log.warning("cannot claim blocks in %s (%s, block %s): leasing %d block(s) without "
                        "a claim (counted as claim_errors; logged at most once a minute)",
                        self.claims.dir, exc.strerror or exc, key, self._claimless)
            self._claimless, self._claimless_logged_at = 0, now

    def _wait_for_claim(self, key: str, deadline: float) -> bool:
        """Wait while another process holds ``key``'s claim (it is fetching the block and
        will ask for the lease with it, or has it): True once the claim is gone or the block
        is cached or leased (look again); False when time is up."""
        step = 0.001
        while time.monotonic() < deadline:
            time.sleep(min(step, max(0.0, deadline - time.monotonic())))
            with self._lock:
                if key in self._index or key in self._inflight:
                    return True
            try:
                if not self.claims.held(key):
                    return True
            except OSError:  # a claim path no one can take: look again (leased without one)
                return True
            step = min(step * 2, 0.01)
        return False

    def _land_if_staged(self, key: str, inflight: Inflight) -> bool:
        """Publish ``inflight``'s fill now if its block file is staged whole (its note may
        still be on its way); True if it landed."""
        try:
            stored = os.stat(self._tiers[inflight.tier].tier.staged_path(key, inflight.lease)).st_size
        except FileNotFoundError:
            return False
        return stored == inflight.nbytes and self.land(key, inflight, stored)

    def _wait_for_fill(self, key: str, inflight: Inflight, deadline: float):
        """Wait for another client's fill: until its lease ends, or until its block is
        staged, then published here. The file can be staged well before the 'filled'
        note comes: a client writes fills behind its reads (fills.py), and the note then
        queues on its connection behind its next request, which may itself be waiting
        here on a fill of ours: without looking at the file, two such clients would hold
        each other up for lease_wait. ("present", tier) once published; None when the
        lease ended otherwise, was cancelled (nothing will be published), or time is up."""
        staged = self._tiers[inflight.tier].tier.staged_path(key, inflight.lease)
        step = 0.002
        while not inflight.cancelled:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or inflight.done.wait(min(step, remaining)):
                return None
            try:
                stored = os.stat(staged).st_size
            except FileNotFoundError:
                stored = None
            if stored == inflight.nbytes and self.land(key, inflight, stored):
                return ("present", inflight.tier)
            step = min(step * 2, 0.02)
        return None
