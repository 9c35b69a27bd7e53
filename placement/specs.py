"""Configuration of tiers and of the time model, and the input checks shared by the package.

Why here: every public entry point (simulate, Engine, workload generators) validates its
arguments the same way -- a ValueError that names the bad argument -- so a daemon config
error or a typo in a benchmark says exactly what to fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def check_positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def check_positive_float(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float, or raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


# Nominal read bandwidths (bytes/s) of the cache's tier kinds, for the engine's time model
# where a tier's real speed is not measured (the node daemon's tiers, the GPU tier).
NOMINAL_BANDWIDTH = {"gpu": 50e9, "dram": 10e9, "nvme": 2e9}
DEFAULT_BANDWIDTH = 1e9


def nominal_bandwidth(tier_name: str) -> float:
    """The nominal read bandwidth of a tier named after its kind (1 GB/s if unknown)."""
    return NOMINAL_BANDWIDTH.get(tier_name, DEFAULT_BANDWIDTH)


@dataclass(frozen=True)
class TierSpec:
    """One storage tier: how much it holds and how fast it reads.

    ``bandwidth`` is bytes/s of the tier's read path; ``latency`` is seconds per request;
    ``concurrency`` is how many requests are in flight at once (loader workers, async I/O),
    so the throughput cost of one request is ``size / bandwidth + latency / concurrency``.
    The source store is a TierSpec too (its capacity is ignored).
    """

    name: str
    capacity: int
    bandwidth: float
    latency: float = 0.0
    concurrency: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        check_positive_int("capacity", self.capacity, allow_zero=True)
        check_positive_float("bandwidth", self.bandwidth)
        check_positive_float("latency", self.latency, allow_zero=True)
        check_positive_int("concurrency", self.concurrency)

    def service_time(self, size: int) -> float:
        """Seconds of this tier's read path that one request of ``size`` bytes occupies."""
        return size / self.bandwidth + self.latency / self.concurrency


@dataclass(frozen=True)
class TimeModel:
    """How the simulator turns hits and misses into time.

    The trainer consumes ``batch_size`` accesses per step and computes for
    ``compute_per_batch`` seconds. A DataLoader-like loader starts loading batch ``b`` when
    batch ``b - prefetch_depth`` is handed to the trainer. Misses are read from ``source``,
    hits from ``cache`` (each a FIFO channel, see TierSpec.service_time). Stall is the time
    the trainer waits for data. A clairvoyant policy additionally prefetches in announced
    order, holding at most ``prefetch_fraction`` of the cache in blocks fetched ahead and not
    yet read (the rest keeps the blocks worth retaining; prefetching further ahead evicts
    blocks that must then be fetched twice).
    """

    source: TierSpec
    cache: TierSpec
    compute_per_batch: float
    batch_size: int = 32
    prefetch_depth: int = 2
    prefetch_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.source, TierSpec):
            raise ValueError(f"source must be a TierSpec, got {self.source!r}")
        if not isinstance(self.cache, TierSpec):
            raise ValueError(f"cache must be a TierSpec, got {self.cache!r}")
        check_positive_float("compute_per_batch", self.compute_per_batch, allow_zero=True)
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("prefetch_depth", self.prefetch_depth)
        check_positive_float("prefetch_fraction", self.prefetch_fraction)
        if self.prefetch_fraction > 1:
            raise ValueError(f"prefetch_fraction must be <= 1, got {self.prefetch_fraction!r}")

    def prefetch_budget(self, capacity: int) -> int:
        """Bytes the clairvoyant prefetcher may hold fetched but not yet read."""
        return int(capacity * self.prefetch_fraction)
