"""Node-cache benchmarks (issue 2): every figure is a ratio against a baseline measured in
the same run, because these machines are noisy.

    python benchmarks/cache_node.py            # all cases, default sizes
    python benchmarks/cache_node.py --quick    # smaller sizes (a smoke run)

The daemon runs in its own process, as in a deployment (``cachemw start``).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import fsspec
import psutil
from fsspec.implementations.local import LocalFileSystem


def start_daemon(runtime_dir: str, dram_capacity: str) -> subprocess.Popen:
    code = (
        "import time, sys\n"
        "from cachemw.node.service import NodeService\n"
        "from cachemw.config import DaemonConfig\n"
        f"s = NodeService(DaemonConfig.build(runtime_dir={runtime_dir!r}, dram_capacity={dram_capacity!r}))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError("daemon did not start")
    return p


def paired_best_rates(fa, fb, items, repeat=5) -> tuple[float, float]:
    """Best items/s of ``fa`` and of ``fb``, their passes alternating, so a noisy stretch
    of the machine falls on both rather than on one side of the ratio."""
    best_a = best_b = 0.0
    for _ in range(repeat):
        for fn, which in ((fa, 0), (fb, 1)):
            t = time.perf_counter()
            for it in items:
                fn(it)
            rate = len(items) / (time.perf_counter() - t)
            if which == 0:
                best_a = max(best_a, rate)
            else:
                best_b = max(best_b, rate)
    return best_a, best_b


def make_files(d: str, n: int, size: int) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, f"f{i:06d}") for i in range(n)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(os.urandom(size))
    return paths


def first_epoch(source, cached, paths, listed: bool = False) -> tuple[float, float]:
    """Seconds to read every file once directly from ``source``, then (all misses)
    through ``cached``, a cachemw filesystem over the same files' source. ``listed``: each
    side first lists the directory, as a loader building its dataset does (through cachemw
    the listing also gives every file's metadata), and the listing is timed too."""
    where = os.path.dirname(paths[0])
    t = time.perf_counter()
    if listed:
        source.find(where)
    for p in paths:
        source.cat_file(p)
    direct = time.perf_counter() - t
    t = time.perf_counter()
    if listed:
        cached.find(where)
    for p in paths:
        cached.cat_file(p)
    return direct, time.perf_counter() - t


def tmpfs_floor(paths, work) -> tuple[float, float]:
    """What caching the first epoch costs at the least here, against the read alone (same
    files, same run): read each file and write its bytes into a new tmpfs file; and read
    it and write the bytes in place into a tmpfs file whose pages are allocated already
    (no cache could do less than that copy)."""
    out = os.path.join(work, "floor")
    os.makedirs(out, exist_ok=True)
    t = time.perf_counter()
    for p in paths:
        plain_read(p)
    read = time.perf_counter() - t
    t = time.perf_counter()
    for i, p in enumerate(paths):
        data = plain_read(p)
        with open(os.path.join(out, str(i)), "wb") as f:
            f.write(data)
    new_files = time.perf_counter() - t
    shutil.rmtree(out, ignore_errors=True)
    slot = os.path.join(work, "floor-slot")
    fd = os.open(slot, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, plain_read(paths[0]), 0)  # the slot's pages, allocated once
        t = time.perf_counter()
        for p in paths:
            os.pwrite(fd, plain_read(p), 0)
        in_place = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(slot)
    return new_files / read, in_place / read


def plain_read(p):
    with open(p, "rb") as f:
        return f.read()


def row(name, value, baseline, target, higher_is_better=True):
    ratio = value / baseline
    ok = ratio >= target if higher_is_better else ratio <= target
    print(f"| {name} | {value:,.0f} | {baseline:,.0f} | {ratio:.2f}x | "
          f"{'>=' if higher_is_better else '<='} {target}x | {'PASS' if ok else 'FAIL'} |", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_files = 500 if args.quick else 2000
    big = (64 if args.quick else 1024) << 20
    work = tempfile.mkdtemp(prefix="cachemw-bench-", dir="/dev/shm")
    rt = os.path.join(work, "rt")
    daemon = start_daemon(rt, "4GiB")
    results = []
    try:
        print("| case | cachemw | baseline | ratio | target | |\n|---|---|---|---|---|---|")
        fs = fsspec.filesystem("cachemw", runtime_dir=rt, autostart=False, skip_instance_cache=True)
        if not fs.client.connected():
            raise RuntimeError("no daemon")

        # 1. hits, 128 KiB files, against plain open().read() of the same files in /dev/shm
        paths = make_files(os.path.join(work, "src128"), n_files, 128 << 10)
        for p in paths:
            fs.cat_file(p)
        plain, hits = paired_best_rates(plain_read, fs.cat_file, paths)
        results.append(row("hits 128 KiB cat_file vs open().read() (files/s)", hits, plain, 0.6))
        # ... and against fsspec simplecache on a warm cache
        sc = fsspec.filesystem("simplecache", target_protocol="file",
                               cache_storage=os.path.join(work, "simplecache"))
        for p in paths:
            sc.cat_file(p)
        simple, hits_sc = paired_best_rates(sc.cat_file, fs.cat_file, paths)
        results.append(row("hits 128 KiB cat_file vs simplecache warm (files/s)", hits_sc, simple, 1.5))

        # 2. hits, 4 KiB files: an absolute floor of 25k files/s (baseline: open().read())
        small = make_files(os.path.join(work, "src4k"), n_files * 2, 4096)
        for p in small:
            fs.cat_file(p)
        plain4, hits4 = paired_best_rates(plain_read, fs.cat_file, small)
        results.append(row("hits 4 KiB cat_file (files/s) vs 25k/s floor", hits4, 25000, 1.0))
        print(f"|   (plain open().read() of the same 4 KiB files: {plain4:,.0f}/s) | | | | | |")

        # 3. first epoch, all misses, against reading the target directly
        cold = make_files(os.path.join(work, "cold"), n_files, 128 << 10)
        direct, first = first_epoch(LocalFileSystem(), fs, cold)
        results.append(row("first epoch vs direct, source = hot local page cache (ms, lower is better)",
                           first * 1e3, direct * 1e3, 1.3, higher_is_better=False))
        cold_l = make_files(os.path.join(work, "cold_l"), n_files, 128 << 10)
        direct_l, first_l = first_epoch(LocalFileSystem(), fs, cold_l, listed=True)
        results.append(row("   same, listing the directory first as loaders do (ms)",
                           first_l * 1e3, direct_l * 1e3, 1.3, higher_is_better=False))
        new_files, in_place = tmpfs_floor(cold, work)
        print(f"|   (floor here: read + write the bytes into a new tmpfs file = {new_files:.2f}x "
              f"the read alone; into allocated tmpfs pages = {in_place:.2f}x) | | | | | |")
        # ... and with a source that answers in 1 ms per request, as a PFS or S3 does
        from cachemw.bench import SlowLocalFileSystem

        slow = SlowLocalFileSystem(latency=0.001)
        fs_slow = fsspec.filesystem("cachemw", fs=slow, runtime_dir=rt, autostart=False,
                                    skip_instance_cache=True)
        cold2 = make_files(os.path.join(work, "cold2"), n_files // 2, 128 << 10)
        direct2, first2 = first_epoch(slow, fs_slow, cold2)
        results.append(row("first epoch vs direct, source with 1 ms/request (ms, lower is better)",
                           first2 * 1e3, direct2 * 1e3, 1.3, higher_is_better=False))
        cold2_l = make_files(os.path.join(work, "cold2_l"), n_files // 2, 128 << 10)
        direct2_l, first2_l = first_epoch(slow, fs_slow, cold2_l, listed=True)
        results.append(row("   same, listing the directory first as loaders do (ms)",
                           first2_l * 1e3, direct2_l * 1e3, 1.3, higher_is_better=False))

        # 4. random 4 KiB range reads of a cached big file against os.pread
        bigfile = os.path.join(work, "big.bin")
        with open(bigfile, "wb") as f:
            for _ in range(big >> 20):
                f.write(os.urandom(1 << 20))
        fs.cat_file(bigfile)  # warm every block
        rng = random.Random(0)
        offsets = [rng.randrange(0, big - 4096) for _ in range(20000)]
        fd = os.open(bigfile, os.O_RDONLY)
        pread, ranged = paired_best_rates(lambda o: os.pread(fd, 4096, o),
                                          lambda o: fs.cat_file(bigfile, o, o + 4096), offsets)
        results.append(row(f"random 4 KiB cat_file of a cached {big >> 20} MiB file vs os.pread (reads/s)",
                           ranged, pread, 0.5))
        with fs.open(bigfile, "rb") as f:
            def seek_read(o):
                f.seek(o)
                return f.read(4096)
            pread2, opened = paired_best_rates(lambda o: os.pread(fd, 4096, o), seek_read, offsets)
        os.close(fd)
        results.append(row("   same through an open file's seek+read (reads/s)", opened, pread2, 0.5))

        # 5. daemon memory does not grow with cached bytes
        proc = psutil.Process(daemon.pid)
        rss_before = proc.memory_info().rss
        more = make_files(os.path.join(work, "mem"), 64 if args.quick else 256, 4 << 20)
        for p in more:
            fs.cat_file(p)
        fs.client.flush()
        time.sleep(0.5)
        rss_after = proc.memory_info().rss
        cached = sum(os.path.getsize(p) for p in more)
        growth = (rss_after - rss_before) / cached
        print(f"| daemon RSS growth per cached byte ({cached >> 20} MiB cached) | "
              f"{(rss_after - rss_before) / 1024:,.0f} KiB | | {growth:.4f} | <= 0.01 | "
              f"{'PASS' if growth <= 0.01 else 'FAIL'} |")
        results.append(growth <= 0.01)
    finally:
        daemon.stdin.close()
        daemon.kill()
        daemon.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{sum(results)} of {len(results)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
