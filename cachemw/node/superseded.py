"""A file's versions the source has moved on from: their blocks, dropped by the daemon.

A client that learns a file has another version (a revalidation finds another, a read
meets another or none: client/metadata.py ``_superseding``) names the old one once (ops
SUPERSEDED: url, version, size, block size), never its blocks one by one: a file of 16 GiB
in blocks of 1 MiB is 16,384 keys, and a message per key on the reader's path cost that
read 150 ms (diffrev-6). The daemon looks only if it holds blocks of that URL (most often
it holds none), and off the client's connection: the maintenance thread computes the old
version's keys and drops those it holds. Blocks cached under another block size are not
matched (their keys differ); eviction takes them.
"""
from __future__ import annotations

from ..keys import block_count, block_key, url_tag

# Keys computed per maintenance pass (~0.1 s): a version of a file of millions of blocks
# is gone through over several passes, between which the thread's other work (moves,
# prefetch, tier checks) runs; 64 GiB in 4 KiB blocks took one pass 10 s (diffrev-7).
PASS_KEYS = 1 << 16


class SupersededVersions:
    """The part of NodeCache (node/cache.py) that drops the blocks of versions the source
    no longer has: one superseded, or every version of a file written through the cache."""

    def invalidate(self, url: str) -> int:
        """Drop every block of ``url`` (the file was written through the cache)."""
        tag = url_tag(url)
        with self._lock:
            keys = list(self._by_tag.get(tag, ()))
            for fill in self._inflight.values():
                if fill.tag == tag:  # read before the write: must not land in the cache
                    fill.cancelled = True
        for key in keys:
            self.drop(key, "invalidated")
        return len(keys)

    def superseded(self, url: str, version: str, size: int, block_size: int) -> None:
        """A client's note that ``version`` of ``url`` is gone at the source."""
        if not isinstance(size, int) or not isinstance(block_size, int) or block_size <= 0:
            return  # (a note, never an error: nothing of it is dropped)
        with self._lock:
            if not self._by_tag.get(url_tag(url)):  # nothing of the file here
                return
            note = (url, version, size, block_size, 0)
            if note in self._superseded:  # (each process that learns it says it)
                return
            self._superseded.append(note)
        self._wake.set()

    def drop_superseded(self) -> int:
        """The maintenance thread's part: drop the held blocks of the versions noted, at
        most PASS_KEYS keys computed a pass (the rest of a version is left for the next,
        which comes at once). Returns how many were dropped."""
        with self._lock:
            todo, self._superseded = self._superseded, []
        dropped, budget, left = 0, PASS_KEYS, []
        for url, version, size, block_size, first in todo:
            with self._lock:
                held = set(self._by_tag.get(url_tag(url), ()))
            count = block_count(size, block_size)
            last = min(count, first + budget) if held else first
            for index in range(first, last):
                key = block_key(url, version, index, block_size)
                if key in held:
                    held.discard(key)
                    self.drop(key, "superseded")
                    dropped += 1
            budget -= last - first
            if held and last < count:
                left.append((url, version, size, block_size, last))
        if left:
            with self._lock:
                self._superseded[:0] = left
            self._wake.set()
        return dropped
