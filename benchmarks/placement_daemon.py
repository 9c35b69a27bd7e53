"""Issue 4's real-daemon target: "On the real daemon, with an announced order, the epoch 2+
hit ratio is within 5% of the simulator's figure for the same trace."

    python benchmarks/placement_daemon.py                  # 1,000 x 64 KiB, 5 epochs, 50%
    python benchmarks/placement_daemon.py --files 300 --compute 0.05   # a quicker run

One trace, three ways: 5 epochs of a seeded torch RandomSampler over ``--files`` files of
64 KiB (one cache block each), read through a real node daemon in its own process with a
DRAM tier whose engine capacity (the tier's high watermark) is 50% of the dataset's stored
bytes (data + checksums), and replayed by ``cachemw.placement.simulate`` with the same keys,
sizes and capacity:

* announced: the reader wraps the sampler in ``cachemw.torch.AnnouncingSampler`` (each
  epoch's order is announced when the epoch starts), against ``simulate(trace,
  "clairvoyant", capacity, announced=True, horizon=<epoch>)`` (announced per epoch too);
* history (no announcement): the daemon's default policy, against ``simulate(trace,
  "history", capacity)``;
* lru: ``placement="lru"``, against ``simulate(trace, "lru", capacity)``.

Two hit ratios are printed for the daemon, because prefetch changes what a "hit" is:
``reader hits`` is what the reader saw (a block the daemon prefetched is a hit), and
``source-saved`` is 1 - (blocks fetched from the source: misses, bypasses, fallbacks and
prefetches) / reads -- the simulator's notion (its clairvoyant replay does not prefetch, so
every block it fetches is a miss). The target compares the source-saved figure.

The daemon prefetches in a background thread, planned from access reports that clients
send every 0.5 s and run at least once a second, so the reader emulates compute time with a
sleep of ``--compute`` seconds per batch of ``--batch`` reads; without it the reader outruns
the prefetcher and reads blocks before they arrive (they still hit in the next epochs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import fsspec
import torch
from torch.utils.data import RandomSampler

from cachemw.blockfile import stored_size
from cachemw.config import TierConfig
from cachemw.placement import simulate, workloads
from cachemw.torch import AnnouncingSampler

from cache_node import make_files  # benchmarks/ is on sys.path when run as a script

FILE_SIZE = 64 << 10
# What the reader's counters call a read served by a source fetch.
SOURCE_READS = ("misses", "bypassed", "fallbacks")


def start_daemon(runtime_dir: str, **config) -> subprocess.Popen:
    """A node daemon in its own process (as `cachemw start` runs one); returns once ready."""
    code = ("import json, sys\nfrom cachemw.config import DaemonConfig\n"
            "from cachemw.node.service import NodeService\n"
            "s = NodeService(DaemonConfig.build(**json.loads(sys.argv[1])))\n"
            "print('ready', flush=True)\nsys.stdin.read()\n")
    args = json.dumps(dict(runtime_dir=runtime_dir, **config))
    proc = subprocess.Popen([sys.executable, "-c", code, args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("daemon did not start")
    return proc


def run_daemon(work: str, label: str, paths: list[str], args, dram_capacity: int,
               announce: bool, placement: str | None) -> tuple[list[list[int]], list[dict]]:
    """Read the epochs through a fresh daemon; the order read and per-epoch counters."""
    rt = os.path.join(work, f"rt-{label}")
    config = dict(dram_capacity=dram_capacity)
    if placement:
        config["placement"] = placement
    daemon = start_daemon(rt, **config)
    try:
        fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=rt,
                               autostart=False, validate="immutable", skip_instance_cache=True)
        if not fs.client.connected():
            raise RuntimeError(f"no daemon answers at {rt}")
        sampler = RandomSampler(range(len(paths)),
                                generator=torch.Generator().manual_seed(args.seed))
        if announce:
            sampler = AnnouncingSampler(sampler, paths, fs=fs)
        orders, epochs = [], []
        for epoch in range(args.epochs):
            before = _snapshot(fs)
            t0 = time.perf_counter()
            order, batch = [], 0
            for index in sampler:
                fs.cat_file(paths[index])
                order.append(index)
                batch += 1
                if batch == args.batch:
                    time.sleep(args.compute)
                    batch = 0
            seconds = time.perf_counter() - t0
            time.sleep(0.6)  # the last access report lands before the next epoch starts
            after = _snapshot(fs)
            epochs.append({k: after[k] - before[k] for k in after} | {"seconds": seconds})
            orders.append(order)
        return orders, epochs
    finally:
        daemon.stdin.close()
        daemon.kill()
        daemon.wait()


def _snapshot(fs) -> dict:
    stats = fs.client.daemon_stats() or {"counters": {}}  # flushes this client's reports
    local = fs.client.counters
    out = {k: local.get(k, 0) for k in ("hits", *SOURCE_READS)}
    out["prefetched"] = stats["counters"].get("prefetched", 0)
    return out


def epoch2_ratios(epochs: list[dict]) -> tuple[float, float, int]:
    """(reader hit ratio, source-saved ratio, prefetched blocks) over epochs 2+."""
    later = epochs[1:]
    reads = sum(e["hits"] + sum(e[k] for k in SOURCE_READS) for e in later)
    hits = sum(e["hits"] for e in later)
    fetched = sum(sum(e[k] for k in SOURCE_READS) + e["prefetched"] for e in later)
    return hits / reads, 1 - fetched / reads, sum(e["prefetched"] for e in later)


def sim_epoch2(trace: list, policy: str, capacity: int, n: int, **kw) -> float:
    """Epoch 2+ hit ratio of a replay (epoch 1 reads every key once: all misses)."""
    result = simulate(trace, policy, capacity, **kw)
    return result.hits / (result.accesses - n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compute", type=float, default=0.1, help="seconds of sleep per batch")
    ap.add_argument("--fraction", type=float, default=0.5, help="capacity / dataset")
    ap.add_argument("--skip-lru", action="store_true")
    args = ap.parse_args()
    for name in ("files", "epochs", "batch"):
        if getattr(args, name) < 1 or (name == "epochs" and args.epochs < 2):
            raise ValueError(f"--{name}: too small ({getattr(args, name)})")
    if not 0 < args.fraction <= 1 or args.compute < 0:
        raise ValueError("--fraction must be in (0, 1] and --compute >= 0")

    n = args.files
    stored = stored_size(FILE_SIZE)  # what the engine charges per block
    # The engine fills the tier up to its high watermark: size the tier so that is the target.
    high = TierConfig("dram", "/unused", 1 << 30).high_watermark
    dram_capacity = math.ceil(n * stored * args.fraction / high) + 1
    engine_capacity = TierConfig("dram", "/unused", dram_capacity).high_bytes
    orders = workloads.epoch_orders(n, args.epochs, seed=args.seed)
    trace = [(i, stored) for epoch in orders for i in epoch[0]]
    print(f"{n} files x {FILE_SIZE >> 10} KiB, {args.epochs} epochs (RandomSampler seed "
          f"{args.seed}), engine capacity {engine_capacity / (n * stored):.3f} of the dataset "
          f"({engine_capacity // stored} blocks), batch {args.batch}, compute "
          f"{args.compute * 1e3:.0f} ms/batch\n", flush=True)

    sim = {
        "announced": sim_epoch2(trace, "clairvoyant", engine_capacity, n, announced=True,
                                horizon=n),
        "history": sim_epoch2(trace, "history", engine_capacity, n),
        "lru": sim_epoch2(trace, "lru", engine_capacity, n),
    }
    sim_all_known = sim_epoch2(trace, "clairvoyant", engine_capacity, n, announced=True)
    belady = sim_epoch2(trace, "belady", engine_capacity, n)

    work = tempfile.mkdtemp(prefix="cachemw-pd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    rows, met = [], True
    try:
        paths = make_files(os.path.join(work, "src"), n, FILE_SIZE)
        runs = [("announced", True, None), ("history", False, None)]
        if not args.skip_lru:
            runs.append(("lru", False, "lru"))
        for label, announce, placement in runs:
            got, epochs = run_daemon(work, label, paths, args, dram_capacity, announce, placement)
            if got != [o[0] for o in orders]:
                raise RuntimeError("the daemon run read another order than the simulated trace")
            reader, saved, prefetched = epoch2_ratios(epochs)
            for e, c in enumerate(epochs, 1):
                print(f"  {label:9s} epoch {e}: {c['hits']:5d} hits, "
                      + ", ".join(f"{c[k]} {k}" for k in SOURCE_READS)
                      + f", {c['prefetched']} prefetched, {c['seconds']:.1f} s", flush=True)
            rows.append((label, reader, saved, prefetched, sim[label]))
        print("\n| run | daemon reader hits (2+) | daemon source-saved (2+) | prefetched (2+) "
              "| simulator (2+) | daemon / simulator |\n|---|---:|---:|---:|---:|---:|")
        for label, reader, saved, prefetched, simulated in rows:
            ratio = saved / simulated if simulated else float("nan")
            print(f"| {label} | {reader:.4f} | {saved:.4f} | {prefetched} | {simulated:.4f} "
                  f"| {ratio:.3f} |")
            if label == "announced":
                met = abs(ratio - 1) <= 0.05
        print(f"\nsimulator, clairvoyant with the whole run announced at once: {sim_all_known:.4f}; "
              f"Belady: {belady:.4f} (epochs 2+)")
        print(f"target (announced: daemon source-saved within 5% of the simulator): "
              f"{'MET' if met else 'NOT MET'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
