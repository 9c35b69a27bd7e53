"""Where a reader's time goes: counters every client process keeps and reports to its node
daemon with its other counters (plain numbers, added up by name), so a node's stats hold
the sum over all its processes (trainer, DataLoader workers) and a job diffs them per epoch.

Seconds: ``hit_seconds`` (reads of blocks in the node's tiers, through the reader: the
reads of the blocks an open file holds open are counted as hits but not timed, timing
them would cost a tenth of such a read), ``remote_hit_seconds`` (blocks sent by their
owner node's block server), ``lease_seconds`` (asking the daemon for blocks not here:
waits for another process's fill, for an owner node's fetch), ``source_seconds`` (reads
from the source store: fills and fallbacks). Counts: ``hits``, ``remote_hits`` (kept
elsewhere), ``lease_waits`` (blocks a reader waited on the daemon for), ``source_reads``;
and ``lease_requests``, every request for blocks not here (a fill writer's too, which
leases the blocks its reader fetched under their claims, many to a request).

Misses also land in a latency histogram (per block not in the node's tiers: from the
miss to its bytes in hand), as one counter per bucket (not cumulative; the Prometheus
collector adds them up).
"""
from __future__ import annotations

import bisect

READ_TIME_COUNTERS = (
    "hit_seconds", "remote_hit_seconds", "remote_bytes", "lease_seconds", "lease_requests",
    "lease_waits",
    "source_seconds", "source_reads",
)

MISS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)
MISS_BUCKET_COUNTERS = tuple(f"miss_le_{b:g}" for b in MISS_BUCKETS) + ("miss_le_inf",)
MISS_SUM = "miss_seconds"
MISS_COUNTERS = MISS_BUCKET_COUNTERS + (MISS_SUM,)


def miss_bucket(seconds: float) -> str:
    """The counter of the histogram bucket ``seconds`` falls in (``le``: at most)."""
    return MISS_BUCKET_COUNTERS[bisect.bisect_left(MISS_BUCKETS, seconds)]


class Histogram:
    """Fixed buckets as counts (not cumulative), a sum and a count: what a daemon keeps of
    the values its clients report (checkpoint stall and time to durable), as plain data
    for its stats."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": sum(self.counts)}
