"""Checkpoint benchmark: cachemw Checkpointer against clone / torch.save / dcp.async_save / torch.load.

Every baseline is measured in the same run, on the same state, and the targets of issue 5 are
printed as ratios against them:

  stall per save            <= 1.2 x bare clone time
  time to committed at root <= dcp.async_save (thread) completion time
  time to committed in fast tier <= 0.5 x that
  busiest rank's bytes      <= 1/N of total + 5%        (--ranks N real gloo processes)
  load                      <= 1.2 x torch.load (hot page cache)
  peak extra host memory    <= 1.1 x state size

Usage: python benchmarks/checkpoint_bench.py [--size-mib 1024] [--root DIR] [--fast-root DIR]
       [--ranks 2] [--dist-size-mib 256] [--rounds 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from cachemw.checkpoint import Checkpointer
from cachemw.checkpoint.file_pool import held_bytes

warnings.filterwarnings("ignore")
MiB = 1 << 20


def make_state(size_mib: int, seed: int = 0) -> dict:
    """~size_mib of float32: three quarters in large matrices, the rest in 4 MiB ones."""
    g = torch.Generator().manual_seed(seed)
    big_rows = 4096
    n_big = max(1, (size_mib * 3 // 4) // 128)
    n_small = max(1, (size_mib - n_big * 128) // 4)
    state = {f"layer{i}.weight": torch.randn(big_rows, 8192, generator=g) for i in range(n_big)}
    state.update({f"small{i}": torch.randn(1024, 1024, generator=g) for i in range(n_small)})
    state["meta"] = {"epoch": 1, "note": "bench"}
    return state


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def rss_parts() -> tuple[int, int]:
    """(RSS, the part of it that is shared memory) of this process, from /proc/self/status.

    Mapped tmpfs files (the fast tier's snapshot files) show in RSS as RssShmem; they are
    counted once, as tmpfs bytes, so the process side counts RSS minus RssShmem.
    """
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields.get("RssShmem", 0)


class PeakRSS:
    """Samples this process's memory (+ optionally a tmpfs dir's) every 20 ms.

    Tracks the peaks of: RSS excluding shared-memory mappings, tmpfs bytes, their sum at the
    same instant, and raw RSS (which counts mapped tmpfs pages a second time).
    """

    def __init__(self, shm_dir: str | None = None) -> None:
        self.shm_dir = shm_dir
        self.base = self._sample()
        self.peak = self.base
        self._stop = threading.Event()
        self.paused = False  # while a baseline clone is timed between saves
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[int, int, int, int]:
        shm = held_bytes(self.shm_dir) if self.shm_dir and os.path.isdir(self.shm_dir) else 0
        rss, rss_shmem = rss_parts()
        return rss - rss_shmem, shm, rss - rss_shmem + shm, rss

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused:
                time.sleep(0.005)
                continue
            sample = self._sample()
            self.peak = tuple(max(p, s) for p, s in zip(self.peak, sample))
            time.sleep(0.02)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def extra_rss(self) -> int:
        return self.peak[0] - self.base[0]

    @property
    def extra_shm(self) -> int:
        return self.peak[1] - self.base[1]

    @property
    def extra_total(self) -> int:
        """Peak of (RSS excl. shmem + tmpfs bytes) sampled at the same instant."""
        return self.peak[2] - self.base[2]

    @property
    def extra_raw_rss(self) -> int:
        return self.peak[3] - self.base[3]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_baselines(size_mib: int, work: str) -> dict:
    """clone, torch.save + fsync, torch.load (hot) of the same state."""
    state = make_state(size_mib)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    clones = []
    for _ in range(3):
        dt, c = timed(lambda: {k: v.clone() for k, v in tensors.items()})
        clones.append(dt)
        del c
        gc.collect()
    path = os.path.join(work, "torch_save.pt")

    def torch_save():
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    t_save, _ = timed(torch_save)
    torch.load(path, weights_only=True)  # warm the page cache
    loads = [timed(lambda: torch.load(path, weights_only=True))[0] for _ in range(3)]
    os.remove(path)
    return {"clone_s": min(clones), "clone_all_s": clones, "torch_save_fsync_s": t_save, "torch_load_s": min(loads)}


def clone_time(state: dict, mem: "PeakRSS", enabled: bool = True) -> float:
    """Bare clone of the state, timed right before a save so that both see the same machine load.

    The memory sampler is paused meanwhile; what the allocator keeps of the freed clone still
    counts against the save afterwards (so the memory figure errs on the high side).
    """
    if not enabled:
        return float("nan")
    mem.paused = True
    time.sleep(0.03)
    dt, c = timed(lambda: {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    del c
    gc.collect()
    mem.paused = False
    return dt


def bench_dcp_async(size_mib: int, work: str, saves: int, time_clones: bool = True) -> dict:
    """dcp.async_save (thread mode, default stager and FileSystemWriter), as shipped."""
    state = make_state(size_mib)
    gc.collect()
    runs = []
    with PeakRSS() as mem:
        for step in range(saves):
            out = os.path.join(work, f"dcp_async_{step}")
            clone_s = clone_time(state, mem, time_clones)
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=out, no_dist=True)
            block = time.perf_counter() - t0
            fut.result()
            runs.append({"stall_s": block, "durable_s": time.perf_counter() - t0, "clone_s": clone_s})
            if step >= 2:
                shutil.rmtree(os.path.join(work, f"dcp_async_{step - 2}"))
    return {"runs": runs, "peak_extra_rss_bytes": mem.extra_rss}


def bench_ours(size_mib: int, root: str, fast_root: str | None, saves: int, time_clones: bool = True) -> dict:
    state = make_state(size_mib)
    gc.collect()
    runs = []
    with PeakRSS(fast_root) as mem:
        ck = Checkpointer(root, keep_last=2, fast_root=fast_root)
        for step in range(saves):
            clone_s = clone_time(state, mem, time_clones)
            t0 = time.perf_counter()
            handle = ck.save(step, state)
            stall = time.perf_counter() - t0
            handle.wait_in_memory()
            fast = time.perf_counter() - t0
            handle.wait()
            runs.append({"stall_s": stall, "fast_s": fast, "durable_s": time.perf_counter() - t0, "clone_s": clone_s})
    load_state = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    load_state["meta"] = {"epoch": 0, "note": ""}
    ck.load(load_state)  # warm
    loads = [timed(lambda: ck.load(load_state))[0] for _ in range(3)]
    ok = all(torch.equal(load_state[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    ck.close()
    return {"runs": runs, "load_s": min(loads), "load_ok": ok, "peak_extra_rss_bytes": mem.extra_rss,
            "peak_extra_shm_bytes": mem.extra_shm, "peak_extra_total_bytes": mem.extra_total,
            "peak_extra_raw_rss_bytes": mem.extra_raw_rss}


def in_child(fn, *args):
    """Run ``fn`` in a fresh spawned process, so RSS baselines are not polluted by earlier runs."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def _dist_rank(rank, world, rdv, root, size_mib, out, fast_root):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    state = make_state(size_mib)
    ck = Checkpointer(root)
    t0 = time.perf_counter()
    handle = ck.save(1, state)
    handle.wait()
    result = {"path": handle.path, "durable_s": time.perf_counter() - t0}
    ck.close()
    # The same with a fast tier shared by the ranks of this node: each rank snapshots its own
    # share only, so the stall is ~1/N of a clone and the node's tmpfs holds one copy in all.
    ck = Checkpointer(root + "-fast", fast_root=fast_root)
    stalls, clones, node_tmpfs = [], [], 0
    for step in range(3):
        dist.barrier()
        c0 = time.perf_counter()
        copy = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        clones.append(time.perf_counter() - c0)
        del copy
        dist.barrier()
        s0 = time.perf_counter()
        handle = ck.save(step, state)
        stalls.append(time.perf_counter() - s0)
        handle.wait()
        node_tmpfs = max(node_tmpfs, held_bytes(fast_root))
    result.update({"fast_stalls_s": stalls, "clones_s": clones, "node_tmpfs_bytes": node_tmpfs})
    ck.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def bench_ranks(world: int, size_mib: int, work: str, fast: str) -> dict:
    import torch.multiprocessing as mp

    root, out = os.path.join(work, "dist_root"), os.path.join(work, "dist_out")
    os.makedirs(out, exist_ok=True)
    mp.start_processes(_dist_rank, args=(world, os.path.join(work, "rdv"), root, size_mib, out,
                                         os.path.join(fast, "dist")), nprocs=world, join=True, start_method="spawn")
    results = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    manifest = json.load(open(os.path.join(results[0]["path"], "cachemw-manifest.json")))
    per_rank = [0] * world
    for item in manifest["items"].values():
        per_rank[int(item["relative_path"].split("_")[2])] += item["length"]
    total = sum(per_rank)
    # Steady state (saves 2-3): each rank's stall against its own clone of the whole state.
    stall_ratio = max(median([s / c for s, c in zip(r["fast_stalls_s"][1:], r["clones_s"][1:])]) for r in results)
    return {"world": world, "bytes_per_rank": per_rank, "total_bytes": total,
            "max_over_fair": max(per_rank) / (total / world), "durable_s": max(r["durable_s"] for r in results),
            "fast_stall_over_clone_worst_rank": stall_ratio, "node_tmpfs_bytes": max(r["node_tmpfs_bytes"] for r in results),
            "state_bytes": state_bytes(make_state(size_mib)), "per_rank": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--root", default=None, help="checkpoint root (default: a temp dir under /tmp)")
    ap.add_argument("--fast-root", default=None, help="fast tier (default: a temp dir under /dev/shm)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks for the bytes-per-rank check (0: skip)")
    ap.add_argument("--dist-size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of each configuration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = args.root or tempfile.mkdtemp(prefix="cachemw-ckpt-bench-", dir="/tmp")
    fast = args.fast_root or tempfile.mkdtemp(prefix="cachemw-ckpt-bench-", dir="/dev/shm")
    os.makedirs(work, exist_ok=True)
    try:
        size = state_bytes(make_state(args.size_mib))
        print(f"state: {size / MiB:.0f} MiB float32; root={work} fast={fast}; rounds={args.rounds}")
        base = in_child(bench_baselines, args.size_mib, work)
        rounds = {"dcp_async": [], "plain": [], "tiered": []}
        for r in range(args.rounds):  # interleaved, so drifts of a shared machine hit all alike
            rounds["dcp_async"].append(in_child(bench_dcp_async, args.size_mib, os.path.join(work, f"d{r}"), 4))
            rounds["plain"].append(in_child(bench_ours, args.size_mib, os.path.join(work, f"p{r}"), None, 4))
            rounds["tiered"].append(in_child(bench_ours, args.size_mib, os.path.join(work, f"t{r}"),
                                             os.path.join(fast, f"t{r}"), 4))
        # Save 1 allocates buffers, save 2 fresh fast-tier files; steady state is saves 3 and 4.
        steady = {k: [run for res in v for run in res["runs"][2:]] for k, v in rounds.items()}
        first = {k: [res["runs"][0] for res in v] for k, v in rounds.items()}
        m = {k: {f: median([run[f] for run in runs]) for f in runs[0]} for k, runs in steady.items()}
        stall_ratio = {k: median([run["stall_s"] / run["clone_s"] for run in runs]) for k, runs in steady.items()}
        first_ratio = median([r["stall_s"] / r["clone_s"] for r in first["plain"]])
        first_fast = median([r["stall_s"] / r["clone_s"] for r in first["tiered"]])
        # Memory in separate children that time no clones (a freed clone the allocator keeps
        # would be counted against the save).
        mem_runs = {"dcp_async": in_child(bench_dcp_async, args.size_mib, os.path.join(work, "dm"), 3, False),
                    "plain": in_child(bench_ours, args.size_mib, os.path.join(work, "pm"), None, 3, False),
                    "tiered": in_child(bench_ours, args.size_mib, os.path.join(work, "tm"),
                                       os.path.join(fast, "tm"), 3, False)}
        peak = {k: v["peak_extra_rss_bytes"] for k, v in mem_runs.items()}
        shm_peak = mem_runs["tiered"]["peak_extra_shm_bytes"]
        total_peak = mem_runs["tiered"]["peak_extra_total_bytes"]
        load_plain = min(res["load_s"] for res in rounds["plain"])
        load_fast = min(res["load_s"] for res in rounds["tiered"])
        assert all(res["load_ok"] for k in ("plain", "tiered") for res in rounds[k])
        dist = bench_ranks(args.ranks, args.dist_size_mib, work, fast) if args.ranks > 1 else None
        report = {"state_bytes": size, "baselines": base, "median_steady": m, "stall_over_clone": stall_ratio, "first_saves": first,
                  "peak_extra_rss_bytes": peak, "peak_extra_shm_bytes": shm_peak,
                  "peak_extra_total_bytes_fast": total_peak,
                  "peak_extra_raw_rss_bytes_fast": mem_runs["tiered"]["peak_extra_raw_rss_bytes"],
                  "load_s": {"plain": load_plain, "fast": load_fast}, "ranks": dist}
        plain, tiered, dcp_m = m["plain"], m["tiered"], m["dcp_async"]
        rows = [
            ("stall / clone (no fast tier)", stall_ratio["plain"], 1.2),
            ("stall / clone (fast tier)", stall_ratio["tiered"], 1.2),
            ("first-save stall / clone (buffers allocated)", first_ratio, None),
            ("first-save stall / clone (fast tier: tmpfs files allocated)", first_fast, None),
            ("dcp.async_save stall / clone", stall_ratio["dcp_async"], None),
            ("committed at root / dcp.async_save (no fast tier)", plain["durable_s"] / dcp_m["durable_s"], 1.0),
            ("committed at root / dcp.async_save (fast tier)", tiered["durable_s"] / dcp_m["durable_s"], 1.0),
            ("committed in fast tier / dcp.async_save", tiered["fast_s"] / dcp_m["durable_s"], 0.5),
            ("load / torch.load", load_plain / base["torch_load_s"], 1.2),
            ("load from fast tier / torch.load", load_fast / base["torch_load_s"], 1.2),
            ("peak extra RSS / state (no fast tier)", peak["plain"] / size, 1.1),
            ("peak extra RSS excl. tmpfs maps / state (fast tier)", peak["tiered"] / size, None),
            ("peak extra tmpfs / state (fast tier)", shm_peak / size, None),
            ("peak extra RSS+tmpfs, same instant / state (fast tier)", total_peak / size, 1.1),
            ("peak extra RSS + peak extra tmpfs / state (fast tier)", (peak["tiered"] + shm_peak) / size, 1.1),
            ("dcp.async_save peak extra RSS / state", peak["dcp_async"] / size, None),
        ]
        if dist:
            rows.append((f"busiest rank bytes / fair share ({dist['world']} ranks)", dist["max_over_fair"], 1.05))
            rows.append((f"fast tier, {dist['world']} ranks: worst rank's stall / its clone of the state",
                         dist["fast_stall_over_clone_worst_rank"], 1.2))
            rows.append((f"fast tier, {dist['world']} ranks on one node: node tmpfs / state",
                         dist["node_tmpfs_bytes"] / dist["state_bytes"], 1.1))
        print(json.dumps({k: v for k, v in report.items() if k != "state_bytes"}, indent=1, default=str))
        print(f"\n{'measure':58s} {'ratio':>7s} {'target':>7s}  met")
        for name, ratio, target in rows:
            met = "-" if target is None else ("yes" if ratio <= target else "NO")
            print(f"{name:58s} {ratio:7.2f} {'' if target is None else f'{target:7.2f}':>7s}  {met}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"report": report, "rows": rows}, f, indent=1, default=str)
    finally:
        if args.root is None:
            shutil.rmtree(work, ignore_errors=True)
        if args.fast_root is None:
            shutil.rmtree(fast, ignore_errors=True)


if __name__ == "__main__":
    main()
