"""Several DDP ranks on one node, each announcing its own shard of every epoch: the epoch
2+ source reads through a real daemon, against the simulator's clairvoyant replay of what
the node read.

    python benchmarks/placement_ranks.py                       # 4 ranks, 1,000 x 64 KiB, 3 runs
    python benchmarks/placement_ranks.py --ranks 2 --files 400 --epochs 3 --runs 1   # quicker

``--ranks`` reader processes (forked, as torchrun starts one per device), each with its
own filesystem (its own connection to the daemon) and ``AnnouncingSampler`` over a
``DistributedSampler`` shard of ``--files`` files of 64 KiB (one block each), read in step:
after each batch of ``--batch`` reads every rank waits for the others (DDP's gradient
all-reduce) and sleeps ``--compute`` seconds (the accelerator). One daemon in its own
process, a DRAM tier whose engine capacity is ``--fraction`` of the stored bytes. Three
runs, each with a fresh daemon:

* ``grouped``: each sampler given its ``rank`` and ``ranks`` (as torchrun's LOCAL_RANK and
  LOCAL_WORLD_SIZE give them): each epoch's orders form one group, laid interleaved;
* ``appended``: each sampler as one rank alone (``ranks=1``): the orders one after another;
* ``history``: no announcement (the daemon's default policy).

Two figures per run, over epochs 2+: ``reader hits`` (a prefetched block read is a hit)
and ``source-saved``, 1 - (blocks fetched from the source: the ranks' misses, bypasses and
fallbacks, and the daemon's prefetches) / reads, the simulator's notion (its replay does
not prefetch).
The reference is ``cachemw.placement.simulate(trace, "clairvoyant", capacity, announced=True,
horizon=<epoch>)`` of the node's reads (each step's batches, rank by rank). Target: grouped
within 5% of the simulator, as benchmarks/placement_daemon.py holds for one reader.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import fsspec
from torch.utils.data import DistributedSampler

from cachemw.blockfile import stored_size
from cachemw.config import TierConfig
from cachemw.placement import simulate
from cachemw.torch import AnnouncingSampler

from cache_node import make_files  # benchmarks/ is on sys.path when run as a script
from placement_daemon import FILE_SIZE, SOURCE_READS, start_daemon

RUNS = ("grouped", "appended", "history")


def shard(n: int, ranks: int, rank: int, seed: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=ranks, rank=rank, shuffle=True,
                                 seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def rank_main(rank: int, run: str, rt: str, paths: list[str], args, barrier, out) -> None:
    """One rank: its epochs in step with the others; its counters per epoch to ``out``."""
    fs = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=rt,
                           autostart=False, validate="immutable", skip_instance_cache=True)
    inner = DistributedSampler(range(len(paths)), num_replicas=args.ranks, rank=rank,
                               shuffle=True, seed=args.seed)
    sampler = inner
    if run != "history":
        ranks = args.ranks if run == "grouped" else 1
        sampler = AnnouncingSampler(inner, paths, fs=fs, rank=rank if ranks > 1 else 0,
                                    ranks=ranks)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        before = dict(fs.client.counters)
        barrier.wait()
        order = list(sampler)  # announces (its first window, or all of it) here
        prefetched = fs.client.daemon_stats()["counters"].get("prefetched", 0) if rank == 0 else 0
        for b in range(0, len(order), args.batch):
            for index in order[b:b + args.batch]:
                fs.cat_file(paths[index])
            barrier.wait()  # the all-reduce: every rank's batch is done
            time.sleep(args.compute)
        time.sleep(0.6)  # the last access report lands
        fs.client.daemon_stats()  # flushes this client's reports
        barrier.wait()
        counts = {k: fs.client.counters.get(k, 0) - before.get(k, 0) for k in ("hits", *SOURCE_READS)}
        if rank == 0:
            counts["prefetched"] = fs.client.daemon_stats()["counters"].get("prefetched", 0) - prefetched
        out.put((rank, epoch, order, counts))
        barrier.wait()


def run_ranks(work: str, run: str, paths: list[str], args, dram_capacity: int):
    rt = os.path.join(work, f"rt-{run}")
    daemon = start_daemon(rt, dram_capacity=dram_capacity)
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, run, rt, paths, args, barrier, out))
             for r in range(args.ranks)]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in range(args.ranks * args.epochs)]
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{run}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        daemon.stdin.close()
        daemon.kill()
        daemon.wait()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16, help="reads per rank per step")
    ap.add_argument("--compute", type=float, default=0.1, help="seconds of sleep per step")
    ap.add_argument("--fraction", type=float, default=0.5, help="capacity / dataset")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.ranks < 2 or args.epochs < 2 or args.files < args.ranks or args.batch < 1 \
            or args.runs < 1:
        raise ValueError("--ranks >= 2, --epochs >= 2, --files >= --ranks, --batch, --runs >= 1")
    if not 0 < args.fraction <= 1 or args.compute < 0:
        raise ValueError("--fraction must be in (0, 1] and --compute >= 0")

    n, stored = args.files, stored_size(FILE_SIZE)
    high = TierConfig("dram", "/unused", 1 << 30).high_watermark
    dram_capacity = math.ceil(n * stored * args.fraction / high) + 1
    capacity = TierConfig("dram", "/unused", dram_capacity).high_bytes
    shards = [[shard(n, args.ranks, r, args.seed, e) for r in range(args.ranks)]
              for e in range(args.epochs)]
    per_epoch = len(shards[0][0]) * args.ranks  # DistributedSampler pads to equal shards
    trace = [(i, stored) for epoch in shards for b in range(0, len(epoch[0]), args.batch)
             for ranked in epoch for i in ranked[b:b + args.batch]]
    sim = simulate(trace, "clairvoyant", capacity, announced=True, horizon=per_epoch)
    later = len(trace) - per_epoch
    sim_saved = sim.hits / later  # epoch 1 reads each block once: all misses
    print(f"{args.ranks} ranks, {n} files x {FILE_SIZE >> 10} KiB, {args.epochs} epochs, engine "
          f"capacity {capacity / (n * stored):.3f} of the dataset, batch {args.batch} per "
          f"rank, compute {args.compute * 1e3:.0f} ms/step\n", flush=True)

    work = tempfile.mkdtemp(prefix="cachemw-pr-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    figures: dict[str, list[tuple[float, float]]] = {run: [] for run in RUNS}
    try:
        paths = make_files(os.path.join(work, "src"), n, FILE_SIZE)
        for _ in range(args.runs):
            for run in RUNS:
                figures[run].append(one_run(work, run, paths, args, dram_capacity, shards))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def spread(values):
        return " / ".join(f"{v:.4f}" for v in (min(values), statistics.median(values), max(values)))
    print(f"\n{args.runs} run(s), min / median / max\n\n| run | reader hits (2+) | source-saved "
          f"(2+) | simulator (2+) | source-saved / simulator |\n|---|---:|---:|---:|---:|")
    for run in RUNS:
        hits, saved = zip(*figures[run])
        print(f"| {run} | {spread(hits)} | {spread(saved)} | {sim_saved:.4f} | "
              f"{spread([v / sim_saved for v in saved])} |")
    met = all(abs(saved / sim_saved - 1) <= 0.05 for _, saved in figures["grouped"])
    print(f"\ntarget (grouped: daemon source-saved within 5% of the simulator, every run): "
          f"{'MET' if met else 'NOT MET'}")
    return 0 if met else 1


def one_run(work: str, run: str, paths: list[str], args, dram_capacity: int,
            shards: list) -> tuple[float, float]:
    """(reader hit ratio, source-saved ratio) of epochs 2+ through a fresh daemon."""
    t0 = time.perf_counter()
    results = run_ranks(work, run, paths, args, dram_capacity)
    for rank, epoch, order, _ in results:
        if order != shards[epoch][rank]:
            raise RuntimeError(f"{run}: rank {rank} read another order than simulated")
    reads = fetched = hits = 0
    for _, epoch, _, counts in results:
        if epoch == 0:
            continue
        hits += counts["hits"]
        reads += counts["hits"] + sum(counts[k] for k in SOURCE_READS)
        fetched += sum(counts[k] for k in SOURCE_READS) + counts.get("prefetched", 0)
    for epoch in range(args.epochs):
        got = [c for _, e, _, c in results if e == epoch]
        print(f"  {run:9s} epoch {epoch + 1}: "
              + ", ".join(f"{sum(c.get(k, 0) for c in got)} {k}"
                          for k in ("hits", *SOURCE_READS, "prefetched")), flush=True)
    print(f"  {run:9s} epochs 2+: reader hits {hits / reads:.4f}, source-saved "
          f"{1 - fetched / reads:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return hits / reads, 1 - fetched / reads


if __name__ == "__main__":
    sys.exit(main())
