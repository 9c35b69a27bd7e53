"""Reading through a torch DataLoader, as users do (issue 17): cachemw against direct reads
and fsspec's ``simplecache`` in the same run, every figure a ratio taken in that run.

    python benchmarks/dataloader.py            # the targets' rows (a few minutes)
    python benchmarks/dataloader.py --quick    # a smoke run (smaller datasets, 1 run)
    python benchmarks/dataloader.py --full     # the whole matrix (long)
    python benchmarks/dataloader.py --sizes 128KiB --workers 0,2,4 --persistent no,yes \\
        --start fork,spawn --sources hot,latency --runs 5      # any part of it
    python benchmarks/dataloader.py --profile --sizes 128KiB  # cProfile of one cold worker

Each sample is one file. A ``Dataset`` holds the paths and a filesystem spec, and makes its
filesystem lazily in each worker (as datasets usually do, and as fsspec's instance cache
does not survive a fork), then returns ``np.frombuffer(fs.cat_file(path))``; batches of 32
(at most 64 MiB), shuffled. The main process does not import cachemw (pass
``--main-imports-cachemw`` to fork workers that have it already), so a worker starts as cold
as it can: imports, daemon link, metadata and block files all its own.

Variants, per row, in one run and interleaved epoch by epoch:

* ``direct``: the source read without a cache (hot source: ``open().read()`` of the files,
  which live in a /dev/shm directory; latency source: its ``cat_file``);
* ``copy`` (latency rows, epoch 1 only): direct reads, each sample's bytes also written to
  a new file in /dev/shm: the least any cache does on a miss (keep a copy in DRAM), so
  ``cachemw / copy`` is what cachemw's own work adds to epoch 1 beyond that copy;
* ``simplecache``: ``fsspec.filesystem("simplecache", target_protocol=..., cache_storage=D)``
  with D in /dev/shm (the same medium as cachemw's DRAM tier);
* ``cachemw``: ``fsspec.filesystem("cachemw", target_protocol=..., runtime_dir=R)``, default
  options otherwise (``validate="ttl"``), its daemon a process of its own as autostart makes it.

Sources: ``hot`` (files in /dev/shm) and ``latency``: the same files behind ``latencyfile``,
a local-file fsspec wrapper registered here that sleeps ``--latency-ms`` per data request
(each ``open`` and each ``get_file``: one per sample for a direct read, one per fetch for
either cache; metadata calls are not slowed, as on a store whose listing is cached).

Every run starts both caches empty: epoch 1 fills them, epochs 2.. are warm. A run's warm
figure is the median of its warm epochs; ratios are given as min / median / max over runs.
Also measured: a new process's first cached read after import (``--first-reads`` fresh
processes, against simplecache's), and the import itself.
"""
from __future__ import annotations

import argparse
import compileall
import cProfile
import importlib.util
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import fsspec
import numpy as np
import torch.utils.data
from fsspec.implementations.local import LocalFileSystem

KiB, MiB = 1 << 10, 1 << 20
COUNTS = {4 * KiB: 4096, 128 * KiB: 1500, MiB: 400, 16 * MiB: 32}
QUICK_COUNTS = {4 * KiB: 1024, 128 * KiB: 400, MiB: 100, 16 * MiB: 8}

# the samples are read-only buffers; the collate copies them into the batch either way
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class LatencyFileSystem(LocalFileSystem):
    """Local files with a fixed delay per data request: a stand-in for a remote store."""

    protocol = "latencyfile"

    def __init__(self, latency: float = 0.001, **kwargs):
        super().__init__(**kwargs)
        self.latency = latency

    def _open(self, path, *args, **kwargs):
        time.sleep(self.latency)
        return super()._open(path, *args, **kwargs)

    def get_file(self, path1, path2, *args, **kwargs):  # simplecache's fetch (no _open)
        time.sleep(self.latency)
        return super().get_file(path1, path2, *args, **kwargs)


fsspec.register_implementation("latencyfile", LatencyFileSystem, clobber=True)


def _plain_read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _copying_reader(options: dict):
    """The source's ``cat_file``, each sample's bytes also written to a new file in
    ``options["dir"]`` (on /dev/shm): the least a cache does on a miss, keep a copy in
    DRAM, without checksums, single flight or any index. The baseline that says what of
    epoch 1's time over direct reads is the copy itself and what is the cache's own."""
    fs = fsspec.filesystem(options["target_protocol"], **options["target_options"])
    keep = options["dir"]

    def read(path: str) -> bytes:
        data = fs.cat_file(path)
        fd = os.open(os.path.join(keep, os.path.basename(path)),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return data

    return read


class Samples(torch.utils.data.Dataset):
    """One file per sample, read through a filesystem made lazily in each process."""

    def __init__(self, paths: list[str], protocol: str | None, options: dict) -> None:
        self.paths = paths
        self.protocol = protocol  # None: plain open().read(); "floor": no read at all
        self.options = options
        self._read = None
        self._pid = None

    def __getstate__(self):
        return {"paths": self.paths, "protocol": self.protocol, "options": self.options}

    def __setstate__(self, state):
        self.__dict__.update(state, _read=None, _pid=None)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        if self._pid != os.getpid():
            self._pid = os.getpid()
            if self.protocol == "floor":  # the DataLoader's own cost: the same bytes each time
                same = bytes(self.options["size"])
                self._read = lambda path: same
            elif self.protocol == "copy":  # direct, each sample also written to a DRAM file
                self._read = _copying_reader(self.options)
            else:
                self._read = (_plain_read if self.protocol is None else
                              fsspec.filesystem(self.protocol, **self.options).cat_file)
        return np.frombuffer(self._read(self.paths[i]), dtype=np.uint8)


def _profile_worker(worker_id: int) -> None:
    """worker_init_fn of --profile: a cProfile of the worker's whole life, written at exit."""
    where = os.environ.get("CACHEMW_BENCH_PROFILE")
    if not where:  # not the epoch profiled
        return
    prof = cProfile.Profile()
    prof.enable()
    out = os.path.join(where, f"worker{worker_id}-{os.getpid()}")
    import multiprocessing.util

    def dump():
        prof.disable()
        prof.dump_stats(out)

    multiprocessing.util.Finalize(None, dump, exitpriority=100)


def make_files(d: str, n: int, size: int) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, f"s{i:06d}.bin") for i in range(n)]
    chunk = os.urandom(min(size, 4 * MiB))
    for i, p in enumerate(paths):
        with open(p, "wb") as f:
            head = i.to_bytes(8, "little")  # every file different
            left = size
            while left > 0:
                part = (head + chunk)[:min(left, len(chunk))]
                f.write(part)
                left -= len(part)
    return paths


def start_daemon(runtime_dir: str, capacity: int) -> subprocess.Popen:
    """The node daemon as autostart runs it: a process of its own, ending with ours."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "cachemw.node.service", "--runtime-dir", runtime_dir,
           "--options", json.dumps({"dram_capacity": capacity}), "--parent-pid",
           str(os.getpid()), "--ready-fd", str(w)]
    p = subprocess.Popen(cmd, pass_fds=(w,), stdout=subprocess.DEVNULL,
                         stderr=open(runtime_dir + ".log", "ab"))
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    if said != "ok":
        p.kill()
        raise RuntimeError(f"daemon did not start: {said}")
    return p


def stop_daemon(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def daemon_counters(runtime_dir: str) -> dict:
    """The daemon's counters, asked from a separate process (this one stays cachemw-free)."""
    code = ("import json, sys\nfrom cachemw.client.link import DaemonClient\n"
            f"c = DaemonClient({runtime_dir!r}, autostart=False)\n"
            "s = c.daemon_stats()\nprint(json.dumps(s['counters'] if s else {}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def epoch_seconds(loader) -> float:
    t = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch)
    if n != len(loader.dataset):
        raise RuntimeError(f"read {n} samples of {len(loader.dataset)}")
    return time.perf_counter() - t


def parse_size(text: str) -> int:
    """``4KiB``, ``1MiB``, ``4096`` (not cachemw's: this process stays cachemw-free)."""
    text = text.strip()
    for unit, mult in (("KiB", KiB), ("MiB", MiB)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * mult)
    return int(text)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return (f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}")


class Row:
    """One configuration: its per-run epoch times per variant."""

    def __init__(self, size, workers, persistent, start, source):
        self.size, self.workers, self.persistent = size, workers, persistent
        self.start, self.source = start, source
        self.first: dict[str, list[float]] = {}  # variant -> epoch-1 seconds per run
        self.warm: dict[str, list[float]] = {}   # variant -> median warm epoch per run

    @property
    def name(self) -> str:
        w = "main" if self.workers == 0 else (
            f"{self.workers}{' persistent' if self.persistent else ''} {self.start}")
        return f"{_size(self.size)} | {w} | {self.source}"

    def ratios(self, table: dict, num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(table.get(num, []), table.get(den, []))]

    def over_floor(self) -> list[float]:
        """What simplecache adds to the DataLoader's own time (the floor: the same loader
        returning the same bytes without reading) over what cachemw adds, from the medians
        over runs (per run, a difference of two noisy times is mostly noise)."""
        w = self.warm
        if not all(w.get(k) for k in ("floor", "simplecache", "cachemw")):
            return []
        f, s, c = (statistics.median(w[k]) for k in ("floor", "simplecache", "cachemw"))
        return [(s - f) / (c - f)] if c > f else []


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def run_row(row: Row, args, work: str) -> None:
    size = row.size
    n = (QUICK_COUNTS if args.quick else COUNTS)[size] if args.files is None else args.files
    src = os.path.join(work, "src")
    paths = make_files(src, n, size)
    batch = max(1, min(args.batch_size, (64 * MiB) // size))
    if row.source == "latency":
        target, target_options = "latencyfile", {"latency": args.latency_ms / 1000}
    else:
        target, target_options = "file", {}
    for run in range(args.runs):
        rt = tempfile.mkdtemp(prefix="rt", dir=work)
        os.rmdir(rt)  # the daemon makes it, private
        sc = os.path.join(work, f"simplecache{run}")
        copies = os.path.join(work, f"copies{run}")
        os.makedirs(copies)
        daemon = start_daemon(rt, max(4 * n * size, 256 * MiB))
        try:
            variants = {
                "floor": ("floor", {"size": size}),
                "direct": (None, {}) if row.source == "hot" else (target, target_options),
                "copy": ("copy", {"target_protocol": target, "target_options": target_options,
                                  "dir": copies}),
                "simplecache": ("simplecache", {"target_protocol": target,
                                                "target_options": target_options,
                                                "cache_storage": sc}),
                "cachemw": ("cachemw", {"target_protocol": target,
                                        "target_options": target_options, "runtime_dir": rt}),
            }
            kw = {}
            if row.workers:
                kw = {"persistent_workers": row.persistent,
                      "multiprocessing_context": row.start}
                if args.profile:
                    kw["worker_init_fn"] = _profile_worker
            loaders = {}
            for name, (protocol, options) in variants.items():
                if (args.profile and name != args.profile_variant) or \
                        (name == "floor" and args.no_floor) or \
                        (name == "copy" and (row.source != "latency" or args.no_copy)):
                    continue
                loaders[name] = torch.utils.data.DataLoader(
                    Samples(paths, protocol, options), batch_size=batch, shuffle=True,
                    num_workers=row.workers, **kw)
            times: dict[str, list[float]] = {v: [] for v in loaders}
            for epoch in range(1 + args.epochs):
                for name, loader in loaders.items():
                    if name == "copy" and epoch:  # a baseline of epoch 1 only
                        continue
                    if args.profile and epoch == args.profile_epoch:
                        os.environ["CACHEMW_BENCH_PROFILE"] = args.profile_dir
                    times[name].append(epoch_seconds(loader))
                    os.environ.pop("CACHEMW_BENCH_PROFILE", None)
            for name, t in times.items():
                row.first.setdefault(name, []).append(t[0])
                if t[1:]:
                    row.warm.setdefault(name, []).append(statistics.median(t[1:]))
            if args.verbose:
                print(f"    run {run + 1}: " + ", ".join(
                    f"{k} {t[0]:.3f} / " + " ".join(f"{x:.3f}" for x in t[1:])
                    for k, t in times.items()), flush=True)
            if args.check_hits and "cachemw" in loaders:
                c = daemon_counters(rt)
                print(f"    cachemw counters: hits {c.get('hits')} misses {c.get('misses')} "
                      f"fallbacks {c.get('fallbacks')} bypassed {c.get('bypassed')}",
                      flush=True)
            del loaders
        finally:
            stop_daemon(daemon)
            shutil.rmtree(rt, ignore_errors=True)
            shutil.rmtree(sc, ignore_errors=True)
            shutil.rmtree(copies, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)


FIRST_READ = r"""
import os, sys, time
t0 = time.perf_counter()
import fsspec
{imp}
t1 = time.perf_counter()
fs = fsspec.filesystem({args})
data = fs.cat_file({path!r})
t2 = time.perf_counter()
assert len(data) == {size}
print((t1 - t0) * 1e3, (t2 - t1) * 1e3)
"""


def first_reads(args, work: str) -> dict[str, list[tuple[float, float]]]:
    """A new process's first read of a cached 128 KiB file: (import ms, first read ms) of
    ``--first-reads`` fresh processes per variant, alternating."""
    paths = make_files(os.path.join(work, "first"), args.first_reads, 128 * KiB)
    rt = os.path.join(work, "rt-first")
    sc = os.path.join(work, "sc-first")
    daemon = start_daemon(rt, 256 * MiB)
    out: dict[str, list[tuple[float, float]]] = {"simplecache": [], "cachemw": []}
    try:
        specs = {
            "simplecache": ("import fsspec.implementations.cached",
                            f"'simplecache', target_protocol='file', cache_storage={sc!r}"),
            "cachemw": ("import cachemw.client.fs",
                        f"'cachemw', target_protocol='file', runtime_dir={rt!r}"),
        }
        warm = ("import fsspec\n" + "\n".join(
            f"fsspec.filesystem({a}).cat_file({p!r})" for _, a in specs.values() for p in paths))
        subprocess.run([sys.executable, "-c", warm], check=True)  # fill both caches
        for p in paths:  # each process reads a file no process of it has read yet
            for name, (imp, a) in specs.items():
                code = FIRST_READ.format(imp=imp, args=a, path=p, size=128 * KiB)
                res = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, check=True)
                out[name].append(tuple(float(x) for x in res.stdout.split()))
    finally:
        stop_daemon(daemon)
    return out


def print_profile(profile_dir: str, top: int) -> None:
    files = sorted(os.listdir(profile_dir))
    if not files:
        print("no worker profile written")
        return
    stats = pstats.Stats(*[os.path.join(profile_dir, f) for f in files])
    print(f"\ncProfile of {len(files)} worker(s), by cumulative and own time:")
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4KiB,128KiB,1MiB,16MiB")
    ap.add_argument("--workers", default="2", help="comma-separated num_workers")
    ap.add_argument("--persistent", default="no", help="no,yes")
    ap.add_argument("--start", default="fork", help="fork,spawn,forkserver")
    ap.add_argument("--sources", default="hot",
                    help="hot,latency (warm-epoch rows); the epoch-1 target always adds "
                         "128KiB and 1MiB against the latency source unless --no-epoch1")
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="warm epochs after the first")
    ap.add_argument("--files", type=int, default=None, help="samples per dataset")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--first-reads", type=int, default=10)
    ap.add_argument("--no-epoch1", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true", help="the whole matrix")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the cachemw workers of the first warm epoch (no baselines)")
    ap.add_argument("--profile-epoch", type=int, default=1,
                    help="which epoch --profile profiles: 0 is the first (cold) one")
    ap.add_argument("--profile-variant", default="cachemw",
                    help="which variant --profile profiles (direct, simplecache, cachemw)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--main-imports-cachemw", action="store_true")
    ap.add_argument("--no-floor", action="store_true",
                    help="do not time the DataLoader with no read at all (its own cost)")
    ap.add_argument("--no-copy", action="store_true",
                    help="latency rows: do not time direct reads that also write each sample "
                         "to a /dev/shm file (the least a cache does on a miss)")
    ap.add_argument("--check-hits", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.full:
        args.workers, args.persistent, args.start = "0,2,4", "no,yes", "fork,spawn"
        args.sources = "hot,latency"
    if args.quick:
        args.runs, args.epochs, args.first_reads = 1, 2, 3
    if args.main_imports_cachemw:
        import cachemw.client.fs  # noqa: F401  (forked workers inherit it)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    persistent = [p == "yes" for p in args.persistent.split(",")]
    starts = args.start.split(",")
    sources = args.sources.split(",")
    rows: list[Row] = []
    for source in sources:
        for size in sizes:
            for w in workers:
                for p in (persistent if w else [False]):
                    for s in (starts if w else ["fork"]):
                        rows.append(Row(size, w, p, s, source))
    if not args.no_epoch1 and not args.profile and "latency" not in sources:
        for size in (128 * KiB, MiB):  # the epoch-1 target's rows
            rows.append(Row(size, 2, False, "fork", "latency"))
    # as an install leaves it: an editable checkout under PYTHONDONTWRITEBYTECODE has no .pyc,
    # and every worker would compile cachemw's sources again (pycs are read under it)
    compileall.compile_dir(os.path.dirname(importlib.util.find_spec("cachemw").origin),
                           quiet=1)
    work = tempfile.mkdtemp(prefix="cachemw-dl-", dir="/dev/shm")
    if args.profile:
        args.runs, args.profile_dir = 1, os.path.join(work, "profiles")
        os.makedirs(args.profile_dir)
    print(f"DataLoader benchmark: batch <= {args.batch_size}, shuffled, {args.runs} run(s) of "
          f"1 + {args.epochs} epochs, latency source {args.latency_ms} ms/request; "
          f"figures: min / median / max over runs\n", flush=True)
    print("| samples | workers | source | epoch 1 s: direct / copy / simplecache / cachemw | "
          "warm s: floor / direct / simplecache / cachemw | warm: cachemw vs simplecache | "
          "warm, over the floor (medians): cachemw vs simplecache | warm: simplecache vs direct | "
          "warm: cachemw vs direct | epoch 1: cachemw / direct | epoch 1: cachemw / copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for row in rows:
            run_row(row, args, work)
            med = {k: statistics.median(v) for k, v in row.warm.items()}
            first = {k: statistics.median(v) for k, v in row.first.items()}
            names = ("direct", "simplecache", "cachemw")
            print(f"| {row.name} | "
                  + " / ".join(f"{first[k]:.3f}" if k in first else "-"
                               for k in ("direct", "copy", "simplecache", "cachemw")) + " | "
                  + " / ".join(f"{med[k]:.3f}" if k in med else "-"
                               for k in ("floor",) + names) + " | "
                  + spread(row.ratios(row.warm, "simplecache", "cachemw")) + "x | "
                  + spread(row.over_floor()) + "x | "
                  + spread(row.ratios(row.warm, "simplecache", "direct")) + "x | "
                  + spread(row.ratios(row.warm, "direct", "cachemw")) + "x | "
                  + spread(row.ratios(row.first, "cachemw", "direct")) + "x | "
                  + spread(row.ratios(row.first, "cachemw", "copy")) + "x |", flush=True)
        if args.profile:
            print_profile(args.profile_dir, args.top)
            return 0
        if args.first_reads:
            fr = first_reads(args, work)
            print(f"\nA new process's first read of a cached 128 KiB file, "
                  f"{args.first_reads} processes each (ms; min / median / max):")
            for name, values in fr.items():
                print(f"  {name:12s} import {spread([v[0] for v in values])}   "
                      f"first read after import {spread([v[1] for v in values])}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _targets(rows, fr if args.first_reads and not args.profile else None)
    return 0


def _targets(rows: list[Row], fr) -> None:
    print("\nTargets (issue 17):")
    for row in rows:
        if row.workers == 2 and not row.persistent and row.start == "fork":
            if row.source == "hot" and row.size < 16 * MiB:
                r = row.ratios(row.warm, "simplecache", "cachemw")
                bound = row.ratios(row.warm, "simplecache", "direct")
                print(f"  warm {_size(row.size)}, default workers: cachemw vs simplecache "
                      f"{spread(r)}x (>= 1.5x): {'met' if r and min(r) >= 1.5 else 'NOT met'}"
                      f"; simplecache vs plain reads {spread(bound)}x; over the floor, "
                      f"cachemw vs simplecache {spread(row.over_floor())}x")
            if row.source == "hot" and row.size == 16 * MiB:
                r = row.ratios(row.warm, "direct", "cachemw")
                print(f"  warm 16 MiB, default workers: cachemw vs plain /dev/shm reads "
                      f"{spread(r)}x (>= 0.9x): {'met' if r and min(r) >= 0.9 else 'NOT met'}")
            if row.source == "latency" and row.size in (128 * KiB, MiB):
                r = row.ratios(row.first, "cachemw", "direct")
                print(f"  epoch 1 {_size(row.size)}, latency source: cachemw / direct "
                      f"{spread(r)}x (<= 1.1x): {'met' if r and max(r) <= 1.1 else 'NOT met'}")
                c = row.ratios(row.first, "cachemw", "copy")
                if c:
                    print(f"    against direct reads that keep a copy in /dev/shm: "
                          f"{spread(c)}x (<= 1.1x): {'met' if max(c) <= 1.1 else 'NOT met'}; "
                          f"the copy alone: {spread(row.ratios(row.first, 'copy', 'direct'))}x "
                          f"direct")
    below = [row.name for row in rows if row.warm.get("simplecache") and
             min(row.ratios(row.warm, "simplecache", "cachemw")) < 1.0]
    print(f"  never below simplecache (warm): "
          f"{'met' if not below else 'NOT met: ' + '; '.join(below)}")
    if fr:
        after = [v[1] for v in fr["cachemw"]]
        print(f"  first cached read after import: {spread(after)} ms (<= 5 ms): "
              f"{'met' if max(after) <= 5 else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
