"""Engine cost: wall time to simulate a 1M-access trace, per policy.

Target (issue 4): under 10 s on this machine. The trace is Zipf(1.0) over 100,000 keys with
a cache of 10% of them (many misses and evictions, the expensive path); Belady's time
includes its next-use precomputation. Run: python benchmarks/placement_cost.py
"""
from __future__ import annotations

import argparse
import time

from cachemw.placement import simulate, workloads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accesses", type=int, default=1_000_000)
    parser.add_argument("--policies", default="lru,history,pin,clairvoyant,belady")
    args = parser.parse_args()
    trace = workloads.zipf(n_keys=100_000, accesses=args.accesses, seed=0)
    cap = 10_000
    print(f"trace: Zipf s=1.0, 100,000 keys, {len(trace):,} accesses, capacity 10% of keys")
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        r = simulate(trace, policy, cap)
        dt = time.perf_counter() - t0
        verdict = "meets" if dt < 10 else "MISSES"
        print(f"{policy:12s} {dt:6.2f} s  ({r.accesses / dt / 1e6:.2f} M accesses/s, hit ratio {r.hit_ratio:.4f})"
              f"  {verdict} the 10 s target")


if __name__ == "__main__":
    main()
