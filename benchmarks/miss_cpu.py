"""What a cold miss costs in CPU (issue 17, epoch 1): one process reads files it has never
seen, one after another, from a source with a fixed delay per request, three ways in the
same run, and the CPU time each takes per file is compared.

    python benchmarks/miss_cpu.py                    # 128 KiB and 1 MiB, 3 rounds
    python benchmarks/miss_cpu.py --sizes 4KiB --files 2000 --rounds 5

* ``direct``: the source's ``cat_file``;
* ``copy``: the same, each file's bytes also written to a new file in /dev/shm: the least a
  cache does on a miss (keep the bytes in DRAM), without checksums, single flight or index;
* ``cachemw``: ``cat_file`` through cachemw (its daemon a process of its own, as autostart
  makes it; runtime dir in /dev/shm), its fills written behind by the fill writer thread
  and drained before the clock stops; the CPU of the reader process (every thread) and,
  separately, of the daemon over the same reads; and of the reading thread alone until
  its last read returned (``reader thread``: what a DataLoader worker pays at least before
  its next sample, the fill writer's work left out, as it runs while the worker waits on
  the source; CPU time, so the thread's waits for the GIL are not in it).

The source is ``slowfile`` (cachemw.bench.SlowLocalFileSystem: local files in /dev/shm, a
sleep per data request), so the source's own CPU is that of a local read: the smallest a
real store's client costs (an S3 or Lustre client spends more per MiB), so the
ratios here are the cache's overhead at its most visible. Each round uses new files and a
fresh daemon. Printed per size: CPU ms per file, min / median / max over rounds, and
``cachemw (reader + daemon) / copy``. No target of its own: it says where epoch 1's time
over direct reads goes in ``benchmarks/dataloader.py``'s latency rows.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import fsspec
import psutil

from cachemw.bench import SlowLocalFileSystem
from cachemw.client.fills import drain_all
from cachemw.config_values import parse_size
from cachemw.launch import stop_local

KiB, MiB = 1 << 10, 1 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _files(d: str, n: int, size: int) -> list[str]:
    os.makedirs(d)
    blob = os.urandom(size)
    paths = []
    for i in range(n):
        p = os.path.join(d, f"f{i:06d}")
        with open(p, "wb") as f:
            f.write(i.to_bytes(8, "little") + blob[8:])  # every file different
        paths.append(p)
    return paths


def _daemon_of(runtime_dir: str) -> psutil.Process:
    for p in psutil.process_iter(["cmdline"]):
        if runtime_dir in " ".join(p.info["cmdline"] or ()):
            return p
    raise RuntimeError(f"no daemon serves {runtime_dir}")


def one_round(work: str, size: int, n: int, latency: float) -> dict[str, float]:
    src = SlowLocalFileSystem(latency=latency)
    paths = _files(os.path.join(work, "src"), n + 1, size)
    out = {}
    c = _cpu()
    for p in paths[1:]:
        src.cat_file(p)
    out["direct"] = (_cpu() - c) / n
    copies = os.path.join(work, "copies")
    os.makedirs(copies)
    c = _cpu()
    for p in paths[1:]:
        data = src.cat_file(p)
        fd = os.open(os.path.join(copies, os.path.basename(p)),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    out["copy"] = (_cpu() - c) / n
    shutil.rmtree(copies)
    rt = os.path.join(work, "rt")
    fs = fsspec.filesystem("cachemw", fs=src, runtime_dir=rt, skip_instance_cache=True)
    try:
        fs.cat_file(paths[0])  # the daemon started, the process's first miss behind it
        drain_all()
        daemon = _daemon_of(rt)
        time.sleep(0.3)
        d0, c, t = sum(daemon.cpu_times()[:2]), _cpu(), time.thread_time()
        for p in paths[1:]:
            fs.cat_file(p)
        out["thread"] = (time.thread_time() - t) / n
        drain_all()
        out["cachemw"] = (_cpu() - c) / n
        out["daemon"] = (sum(daemon.cpu_times()[:2]) - d0) / n
        if fs.stats()["misses"] < n:
            raise RuntimeError("a read did not miss: the files were not new")
    finally:
        stop_local(rt)
        shutil.rmtree(os.path.join(work, "src"), ignore_errors=True)
        shutil.rmtree(rt, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128KiB,1MiB")
    ap.add_argument("--files", type=int, default=None,
                    help="files per round (default: 600 of 128 KiB and less, 300 larger)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=1.0)
    args = ap.parse_args()
    print(f"CPU per cold miss, source {args.latency_ms} ms per request, {args.rounds} rounds "
          f"(ms per file: min / median / max)\n")
    print("| size | direct | copy | cachemw reader | cachemw daemon | "
          "cachemw (reader + daemon) / copy | cachemw reader thread |")
    print("|---|---|---|---|---|---|---|")
    for size in (parse_size(s, name="--sizes") for s in args.sizes.split(",")):
        n = args.files or (600 if size <= 128 * KiB else 300)
        rounds: list[dict[str, float]] = []
        for _ in range(args.rounds):
            work = tempfile.mkdtemp(prefix="cachemw-miss-", dir="/dev/shm")
            try:
                rounds.append(one_round(work, size, n, args.latency_ms / 1000))
            finally:
                shutil.rmtree(work, ignore_errors=True)

        def spread(values: list[float], scale: float = 1e3, fmt: str = ".3f") -> str:
            return " / ".join(format(v * scale, fmt) for v in
                              (min(values), statistics.median(values), max(values)))
        total = [(r["cachemw"] + r["daemon"]) / r["copy"] for r in rounds]
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        print(f"| {label} | {spread([r['direct'] for r in rounds])} | "
              f"{spread([r['copy'] for r in rounds])} | "
              f"{spread([r['cachemw'] for r in rounds])} | "
              f"{spread([r['daemon'] for r in rounds])} | {spread(total, 1, '.2f')}x | "
              f"{spread([r['thread'] for r in rounds])} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
