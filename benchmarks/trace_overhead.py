"""What tracing costs on the hit path (issue 15): hits/s of ``cat_file`` on cached files
with tracing off and on (``CACHEMW_TRACE``), and, with ``--baseline-rev``, with the code of
that revision (before the trace and read-time hooks), all in the same run.

    python benchmarks/trace_overhead.py                        # off vs on
    python benchmarks/trace_overhead.py --baseline-rev afcb71c # also off vs that revision
    python benchmarks/trace_overhead.py --quick                # fewer files and rounds

Each variant is a reader process of its own (its own autostarted daemon and runtime dir in
/dev/shm; the source files in /dev/shm too) that fills the cache, reads every file once
more, then makes one timed pass over all files each time it is told to. The variants' passes
alternate, so a noisy stretch of the (shared) machine falls on all of them; a round is one
pass of each, its ratios per round (min / median / max), and the ratio of the best passes.
Targets: off / baseline within noise, on / off >= 0.90.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import io

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

READER = r"""
import os, sys, time
import fsspec
src, runtime_dir = sys.argv[1:3]
fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True,
                       daemon_options={"dram_capacity": "2GiB"})
paths = sorted(os.path.join(src, p) for p in os.listdir(src))
for p in paths:  # misses: fill the cache
    fs.cat_file(p)
for p in paths:  # hits, once, before the clock
    fs.cat_file(p)
print("ready", flush=True)
for line in sys.stdin:  # one timed pass per line
    t = time.perf_counter()
    for p in paths:
        fs.cat_file(p)
    print(len(paths) / (time.perf_counter() - t), flush=True)
assert fs.stats()["hits"] >= 2 * len(paths)
"""


def make_files(d: str, n: int, size: int) -> None:
    os.makedirs(d)
    for i in range(n):
        with open(os.path.join(d, f"f{i:06d}"), "wb") as f:
            f.write(os.urandom(size))


def checkout(rev: str, into: str) -> str:
    """The package as it was at ``rev`` (git archive: no worktree left registered)."""
    data = subprocess.run(["git", "-C", REPO, "archive", rev], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="fully_trusted")
    return into


def reader(variant: str, src: str, work: str, baseline: str | None) -> subprocess.Popen:
    """A reader process, its cache filled and warm, waiting for its first pass."""
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEMW_TRACE", "PYTHONPATH")}
    if variant == "on":
        env["CACHEMW_TRACE"] = tempfile.mkdtemp(prefix="trace-", dir=work)
    if variant == "baseline":
        env["PYTHONPATH"] = baseline  # its cachemw first, for the reader and its daemon
    runtime_dir = tempfile.mkdtemp(prefix=f"rt-{variant}-", dir=work)
    proc = subprocess.Popen([sys.executable, "-c", READER, src, runtime_dir], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {variant} reader did not start")
    return proc


def one_pass(proc: subprocess.Popen) -> float:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def finish(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    if proc.wait(timeout=120) != 0:
        raise RuntimeError("a reader failed")


def off_check_cost(n: int = 2_000_000) -> float:
    """Nanoseconds of the check a traced point costs when tracing is off."""
    from cachemw import trace

    def checked():
        for _ in range(n):
            if trace.ENABLED:
                pass

    def bare():
        for _ in range(n):
            pass

    best = []
    for fn in (checked, bare):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        best.append(min(times))
    return max(best[0] - best[1], 0.0) / n * 1e9


def fmt(xs: list[float]) -> str:
    return (f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}" if len(xs) > 2
            else ", ".join(f"{x:.3f}" for x in xs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-rev", help="also measure the code of this git revision")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    rounds = 3 if args.quick else args.rounds
    cases = [("128 KiB", 128 << 10, 300 if args.quick else 1000),
             ("4 KiB", 4 << 10, 1000 if args.quick else 4000)]
    work = tempfile.mkdtemp(prefix="cachemw-trace-bench-", dir="/dev/shm")
    try:
        baseline = None
        if args.baseline_rev:
            baseline = checkout(args.baseline_rev, os.path.join(work, "baseline"))
        variants = ["off", "on"] + (["baseline"] if baseline else [])
        print(f"{rounds} rounds; variants {variants}; hits/s of cat_file per pass")
        for label, size, n in cases:
            src = os.path.join(work, f"src-{size}")
            make_files(src, n, size)
            procs = {v: reader(v, src, work, baseline) for v in variants}
            try:
                rates = {v: [] for v in variants}
                for r in range(rounds):
                    order = variants[r % len(variants):] + variants[:r % len(variants)]
                    for v in order:
                        rates[v].append(one_pass(procs[v]))
                print(f"  {label}: " + "; ".join(
                    f"{v} {min(x):,.0f}-{max(x):,.0f}/s" for v, x in rates.items()), flush=True)
            finally:
                for proc in procs.values():
                    finish(proc)
            pairs = [("on", "off", ">= 0.90")] + ([("off", "baseline", "within noise")]
                                                   if baseline else [])
            for a, b, target in pairs:
                per_round = [x / y for x, y in zip(rates[a], rates[b])]
                print(f"{label}: {a} / {b} per round {fmt(per_round)}, best / best "
                      f"{max(rates[a]) / max(rates[b]):.3f} (target {target})")
            shutil.rmtree(src)
        ns = off_check_cost()
        print(f"the off check at a traced point: {ns:.1f} ns")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
