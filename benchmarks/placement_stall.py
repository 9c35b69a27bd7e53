"""Stall-time targets of issue 4 (time model of cachemw.placement.timing).

Setup: a PFS source (500 MB/s, 5 ms per request, 32 in flight), a DRAM cache (5 GB/s,
50 us, 8 in flight) of 50% of the dataset, batches of 64, DataLoader prefetch depth 2;
compute per batch swept from I/O-bound to compute-bound. Workloads: resnet50-like
(10,000 x ~110 KB, 5 epochs, RandomSampler seed 0) and two jobs sharing a dataset
(2 x 5,000 x 110 KB).

Targets, with an announced order: clairvoyant stall <= 1.1x the lower bound (bytes that must
come from the source, minus what compute hides), and <= 0.2x LRU's stall on the same trace.
The second cannot hold where the bound itself exceeds 0.2x LRU's stall; the column
"bound/LRU" shows where that is. Run: python benchmarks/placement_stall.py
"""
from __future__ import annotations

import argparse

from cachemw.placement import TierSpec, TimeModel, simulate, workloads


def run(name, trace, computes):
    cap = workloads.dataset_bytes(trace) // 2
    print(f"{name} (capacity {cap / 1e9:.2f} GB)")
    print(f"  {'compute/batch':>13s} {'bound s':>8s} {'LRU s':>8s} {'history s':>9s} {'clairv. s':>9s}"
          f" {'cv/bound':>8s} {'cv/LRU':>7s} {'bound/LRU':>9s}  targets")
    for tc in computes:
        tm = TimeModel(
            source=TierSpec("pfs", 0, bandwidth=500e6, latency=5e-3, concurrency=32),
            cache=TierSpec("dram", cap, bandwidth=5e9, latency=50e-6, concurrency=8),
            compute_per_batch=tc, batch_size=64, prefetch_depth=2,
        )
        lru = simulate(trace, "lru", cap, time_model=tm)
        hist = simulate(trace, "history", cap, time_model=tm)
        cv = simulate(trace, "clairvoyant", cap, time_model=tm)
        bound = cv.stall_lower_bound_s
        a, b = cv.stall_s / bound, cv.stall_s / lru.stall_s
        verdict = f"{'1.1x bound: met' if a <= 1.1 else '1.1x bound: NOT met'}, " \
                  f"{'0.2x LRU: met' if b <= 0.2 else '0.2x LRU: NOT met'}"
        print(f"  {tc * 1e3:10.1f} ms {bound:8.3f} {lru.stall_s:8.3f} {hist.stall_s:9.3f} {cv.stall_s:9.3f}"
              f" {a:8.3f} {b:7.3f} {bound / lru.stall_s:9.3f}  {verdict}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--computes-ms", default="4,8,12,14,16")
    args = parser.parse_args()
    computes = [float(x) / 1e3 for x in args.computes_ms.split(",")]
    run("resnet50-like, 5 epochs", workloads.resnet50(n=10_000, epochs=5), computes)
    run("two jobs sharing a dataset, 5 epochs each", workloads.two_jobs(workloads.sample_sizes(5_000, 110_000, 0.3), 5, batch_size=64), computes)


if __name__ == "__main__":
    main()
