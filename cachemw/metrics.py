"""Prometheus metrics of a node daemon, read from its stats when scraped.

A custom collector turns the daemon's stats (the counters it already keeps, the sums of its
clients' reports, its checkpoint notes) into metric families at scrape time, so a read
costs nothing more for being exported: nothing on the read path touches a Prometheus
object. ``METRICS`` is the list of what is exported (names, types, labels); the README's
table and the Grafana dashboard (deploy/grafana/cachemw.json) are checked against it.

Names follow Prometheus' conventions: prefix ``cachemw_``, base units (seconds, bytes),
counters exposed with ``_total`` (prometheus_client adds it), histograms as ``_bucket``,
``_sum``, ``_count``.
"""
from __future__ import annotations

import errno
import logging
import socket
from typing import Callable, NamedTuple

from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import start_http_server

from .readtime import MISS_BUCKETS, MISS_BUCKET_COUNTERS, MISS_SUM

log = logging.getLogger(__name__)


class Metric(NamedTuple):
    name: str  # as exposed, less the _total of a counter
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str


# fallback reasons: the stats counter behind each ``reason`` label value
FALLBACKS = {"unavailable": "fallbacks", "not_admitted": "bypassed", "peer": "peer_fallbacks",
             "direct_transfer": "direct_failures", "tier_read": "tier_read_errors"}
# how the blocks not in this node's tiers were read
MISSES = {"fill": "misses", "remote_hit": "remote_hits", "remote_read": "remote_reads",
          "fallback": "fallbacks", "bypassed": "bypassed"}
READ_BYTES = {"tier": "hit_bytes", "remote": "remote_bytes", "source": "bytes_from_source"}
READ_SECONDS = {"hit": "hit_seconds", "remote_hit": "remote_hit_seconds",
                "lease_wait": "lease_seconds", "source": "source_seconds"}

METRICS = (
    Metric("cachemw_node_info", "gauge", ("node",), "The node daemon (value 1)."),
    Metric("cachemw_hits", "counter", (), "Reads served from this node's tiers."),
    Metric("cachemw_misses", "counter", ("via",),
           "Block reads not in this node's tiers, by how they were served: fill (from the "
           "source, then cached), remote_hit, remote_read (fetched by the owner node), "
           "fallback, bypassed (both from the source, uncached)."),
    Metric("cachemw_tier_hits", "counter", ("tier",),
           "Block hits per tier (a read through the reader, or an open file's first read of "
           "a block it maps)."),
    Metric("cachemw_tier_misses", "counter", ("tier",),
           "Block lookups that reached this tier and did not find the block there."),
    Metric("cachemw_read_bytes", "counter", ("origin",),
           "Bytes read by this node's processes, by origin: tier, remote, source."),
    Metric("cachemw_read_seconds", "counter", ("kind",),
           "Seconds this node's readers spent on hit, remote_hit, lease_wait, source."),
    Metric("cachemw_lease_requests", "counter", (), "Requests to the daemon for missing blocks."),
    Metric("cachemw_source_reads", "counter", (), "Reads from the source store."),
    Metric("cachemw_miss_latency_seconds", "histogram", (),
           "Per block not in this node's tiers: time from the miss to its bytes in hand."),
    Metric("cachemw_tier_used_bytes", "gauge", ("tier",), "Bytes held in the tier."),
    Metric("cachemw_tier_capacity_bytes", "gauge", ("tier",), "The tier's capacity."),
    Metric("cachemw_tier_blocks", "gauge", ("tier",), "Blocks held in the tier."),
    Metric("cachemw_tier_admitting", "gauge", ("tier",),
           "1 if the tier takes new blocks, 0 if out of space or unusable."),
    Metric("cachemw_evictions", "counter", ("tier",), "Blocks evicted from the tier."),
    Metric("cachemw_demotions", "counter", ("tier",), "Blocks moved from the tier to a slower one."),
    Metric("cachemw_fills", "counter", (), "Blocks written into the tiers by readers."),
    Metric("cachemw_fills_in_flight", "gauge", (), "Fills leased and not ended yet."),
    Metric("cachemw_prefetched_blocks", "counter", (), "Blocks fetched ahead of the reader."),
    Metric("cachemw_prefetch_errors", "counter", (), "Prefetches the store failed (their readers "
           "fetch those blocks themselves; the daemon's log says why, once a minute a kind)."),
    Metric("cachemw_fallbacks", "counter", ("reason",),
           "Reads that fell back: unavailable (daemon or owner node could not serve), "
           "not_admitted, peer (an owner node failed this daemon), direct_transfer, "
           "tier_read (a cached block's file could not be read: EIO, EACCES)."),
    Metric("cachemw_corrupt_blocks_repaired", "counter", (),
           "Cached blocks that failed their checksum, dropped and refetched."),
    Metric("cachemw_fill_errors", "counter", (), "Fills that could not be written."),
    Metric("cachemw_peer_failures", "counter", (), "Calls to other nodes' daemons that failed."),
    Metric("cachemw_ring_nodes", "gauge", (), "Nodes in this daemon's ownership ring."),
    Metric("cachemw_served_blocks", "counter", ("via",),
           "Blocks this node sent to other nodes: ray (owner fetches), direct (block server)."),
    Metric("cachemw_checkpoint_saves", "counter", ("result",),
           "Checkpoint saves by this node's trainer processes (per rank): ok, failed."),
    Metric("cachemw_checkpoint_bytes", "counter", (), "Bytes those saves wrote."),
    Metric("cachemw_checkpoint_stall_seconds", "histogram", (),
           "Time a save blocked its training loop."),
    Metric("cachemw_checkpoint_durable_seconds", "histogram", (),
           "Time from a save to its checkpoint durable at the root."),
    Metric("cachemw_checkpoint_last_step", "gauge", (),
           "The newest step a trainer here saw durable (-1: none)."),
    Metric("cachemw_checkpoints_in_flight", "gauge", (), "Saves begun and not ended."),
)


def exposed_names(metric: Metric) -> tuple[str, ...]:
    """The sample names a metric appears under in the exposition."""
    if metric.type == "counter":
        return (metric.name + "_total",)
    if metric.type == "histogram":
        return tuple(metric.name + s for s in ("_bucket", "_sum", "_count"))
    return (metric.name,)


def _histogram(counts: list, buckets: list) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs of per-bucket counts (the last one: +Inf)."""
    out, running = [], 0
    for bound, n in zip(list(buckets) + [float("inf")], counts):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


def families(stats: dict) -> list:
    """The metric families of one daemon's stats (NodeCache.stats, plus ``peers`` from a
    Ray daemon); every metric of METRICS, zero where the daemon has nothing to count."""
    spec = {m.name: m for m in METRICS}
    made: dict[str, object] = {}

    def fam(name):
        m = spec[name]
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
               "histogram": HistogramMetricFamily}[m.type]
        made[name] = cls(name, m.help, labels=list(m.labels))
        return made[name]

    c = stats.get("counters", {})
    tiers = stats.get("tiers", {})
    peers = stats.get("peers", {})
    ck = stats.get("checkpoints") or {}

    fam("cachemw_node_info").add_metric([str(stats.get("node_id", ""))], 1)
    fam("cachemw_hits").add_metric([], c.get("hits", 0))
    f = fam("cachemw_misses")
    for label, key in MISSES.items():
        f.add_metric([label], c.get(key, 0))
    hits_f, miss_f = fam("cachemw_tier_hits"), fam("cachemw_tier_misses")
    lookups = sum(t.get("hits", 0) for t in tiers.values()) + sum(c.get(k, 0) for k in MISSES.values())
    for name, t in tiers.items():
        hits_f.add_metric([name], t.get("hits", 0))
        lookups -= t.get("hits", 0)
        miss_f.add_metric([name], max(lookups, 0))
    for metric, table in (("cachemw_read_bytes", READ_BYTES), ("cachemw_read_seconds", READ_SECONDS)):
        f = fam(metric)
        for label, key in table.items():
            f.add_metric([label], c.get(key, 0))
    fam("cachemw_lease_requests").add_metric([], c.get("lease_requests", 0))
    fam("cachemw_source_reads").add_metric([], c.get("source_reads", 0))
    counts = [c.get(k, 0) for k in MISS_BUCKET_COUNTERS]
    fam("cachemw_miss_latency_seconds").add_metric(
        [], _histogram(counts, MISS_BUCKETS), c.get(MISS_SUM, 0))
    for metric, key in (("cachemw_tier_used_bytes", "used_bytes"),
                        ("cachemw_tier_capacity_bytes", "capacity_bytes"),
                        ("cachemw_tier_blocks", "blocks"), ("cachemw_tier_admitting", "admitting"),
                        ("cachemw_evictions", "evictions"), ("cachemw_demotions", "demotions")):
        f = fam(metric)
        for name, t in tiers.items():
            f.add_metric([name], float(t.get(key, 0)))
    for metric, value in (("cachemw_fills", c.get("fills", 0)),
                          ("cachemw_fills_in_flight", stats.get("inflight", 0)),
                          ("cachemw_prefetched_blocks", c.get("prefetched", 0)),
                          ("cachemw_prefetch_errors", c.get("prefetch_errors", 0)),
                          ("cachemw_corrupt_blocks_repaired", c.get("corrupt_repaired", 0)),
                          ("cachemw_fill_errors", c.get("fill_errors", 0)),
                          ("cachemw_peer_failures", peers.get("peer_failures", 0)),
                          ("cachemw_ring_nodes", len(peers.get("ring", ())) or 1)):
        fam(metric).add_metric([], value)
    f = fam("cachemw_fallbacks")
    for label, key in FALLBACKS.items():
        f.add_metric([label], c.get(key, 0))
    f = fam("cachemw_served_blocks")
    f.add_metric(["ray"], c.get("served_remote", 0))
    f.add_metric(["direct"], c.get("served_direct", 0))
    f = fam("cachemw_checkpoint_saves")
    for result in ("ok", "failed"):
        f.add_metric([result], ck.get("saves", {}).get(result, 0))
    fam("cachemw_checkpoint_bytes").add_metric([], ck.get("bytes", 0))
    for metric, key in (("cachemw_checkpoint_stall_seconds", "stall_seconds"),
                        ("cachemw_checkpoint_durable_seconds", "durable_seconds")):
        h = ck.get(key) or {"buckets": [], "counts": [0], "sum": 0.0}
        fam(metric).add_metric([], _histogram(h["counts"], h["buckets"]), h["sum"])
    fam("cachemw_checkpoint_last_step").add_metric([], ck.get("last_step", -1))
    fam("cachemw_checkpoints_in_flight").add_metric([], len(ck.get("in_flight", ())))
    return [made[m.name] for m in METRICS]


class StatsCollector:
    """A prometheus_client collector over a callable returning a daemon's stats."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def describe(self):
        return []  # no describe at registration: collect() is called only on a scrape

    def collect(self):
        return families(self.stats())


class MetricsServer:
    """A daemon's endpoint: ``http://<host>:<port>/metrics`` (port 0: any free port; the
    one taken is in ``url``). Listening on every address, it is advertised under
    ``advertise`` (the node's IP in a Ray cluster) or the hostname. Binding fails with an
    OSError naming the address."""

    def __init__(self, stats: Callable[[], dict], host: str, port: int,
                 advertise: str | None = None) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatsCollector(stats))
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except socket.gaierror as exc:  # the host, not the port (review ops5)
            raise OSError(errno.EINVAL, f"metrics_host: {host!r} is no address of this "
                                        f"machine ({exc.strerror or exc})") from None
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise OSError(exc.errno, f"metrics_host: {host!r} is no address of this "
                                         f"machine ({exc.strerror or exc})") from None
            raise OSError(exc.errno, f"metrics_port: cannot listen on {host}:{port} "
                                     f"({exc.strerror or exc}); choose another port, or 0 "
                                     f"for any free one") from None
        self.port = self._httpd.server_address[1]
        if host not in ("", "0.0.0.0", "::"):  # one address: the one to reach it at
            advertise = host
        elif advertise is None:
            advertise = socket.gethostname()
        if ":" in advertise:  # an IPv6 address
            advertise = f"[{advertise}]"
        self.url = f"http://{advertise}:{self.port}/metrics"
        log.info("serving Prometheus metrics on %s", self.url)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
