"""What tracing costs on the hit path (issue 15): hits/s of ``cat_file`` on cached files
with tracing (cachemw.trace) off and on, and, with ``--baseline-rev``, with the code of that
revision (before the trace and read-time hooks), all in the same run.

    python benchmarks/trace_overhead.py                        # off vs on
    python benchmarks/trace_overhead.py --baseline-rev afcb71c # also off vs that revision
    python benchmarks/trace_overhead.py --quick                # fewer files and rounds
    python benchmarks/trace_overhead.py --instructions         # counted by callgrind

In each session two fresh reader processes, one of this code and one of the baseline's,
each with its own autostarted daemon and runtime dir in /dev/shm (the source files in
/dev/shm too), fill the cache, read every file once more, then make one timed pass over all
files each time they are told to: this code's reader with tracing off, then on
(its trace file opened once, the module's ENABLED flag switched between passes, a pass's
events all written within it; the trace file in /dev/shm), the baseline's plain, in
alternating order. On / off compares passes of the same process; off / baseline
passes of two processes, fresh ones per session, so one process's luck (its core, its memory
layout) does not bias a variant. A session's ratio is the median of its per-pass ratios;
printed: the min / median / max over sessions. Passes are timed in the reader's CPU time
(the hit path does no waiting: the daemon takes no part in a hit, so on a machine shared
with other work this is the steadier measure of what the code costs) and in wall time.
Targets: on / off >= 0.90; tracing off costs nothing measurable: the check a traced point
makes, timed at the end. Off / baseline holds every change to the hit path since that
revision, not only the trace checks.

With ``--instructions`` the same variants are counted instead of timed. For each, a fill
run (natively) starts a daemon that outlives it, fills its cache and reads every file once
more; then a reader runs under valgrind's callgrind (its daemon not), reads every file
once (hits) and makes no counted pass, and another makes ``--counted-passes``, failing if
any read missed; the difference over those passes' hits is the user-space instructions a
hit costs (``PYTHONHASHSEED=0``: the same layouts in every run). A count swings far less
than CPU time does here (+-10 % from pass to pass), about 1-2 % between runs; it leaves
out the kernel's share of a hit (its system calls, the trace file's writes) and the
hardware's (cache misses), so a share of the instructions estimates a share of the time.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from cachemw.launch import stop_local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

READER = r"""
import os, sys, time
import fsspec
try:
    from cachemw import trace
except ImportError:  # the baseline's code has no traces
    trace = None
src, runtime_dir, trace_dir = sys.argv[1:4]
fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True,
                       daemon_options={"dram_capacity": "2GiB"})
paths = sorted(os.path.join(src, p) for p in os.listdir(src))
for p in paths:  # misses: fill the cache
    fs.cat_file(p)
for p in paths:  # hits, once, before the clock
    fs.cat_file(p)
print("ready", flush=True)
if trace is not None:  # the file opened once, as in a traced job; passes switch the flag
    trace.start(trace_dir)
    trace.ENABLED = False
for line in sys.stdin:  # one timed pass per line: hits per second of wall and of CPU time
    if trace is not None:
        trace.ENABLED = line.strip() == "on"
    t, c = time.perf_counter(), time.process_time()
    for p in paths:
        fs.cat_file(p)
    if trace is not None and trace.ENABLED:
        trace.flush()  # the rest of the pass's events written (timed: every event's cost)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    print(len(paths) / wall, len(paths) / cpu, flush=True)
assert fs.stats()["hits"] >= 2 * len(paths)
"""

FILL = r"""
import os, sys
import fsspec
from cachemw.client.fills import drain_all
from cachemw.launch import spawn_detached
src, runtime_dir = sys.argv[1:3]
options = {"dram_capacity": "2GiB"}
spawn_detached(runtime_dir, options, idle_exit=3600)  # outlives this process: the counted
fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True,  # runs
                       daemon_options=options)                                   # hit its cache
paths = sorted(os.path.join(src, p) for p in os.listdir(src))
for p in paths:
    fs.cat_file(p)
drain_all()
for p in paths:
    fs.cat_file(p)
if fs.stats()["hits"] < len(paths):
    sys.exit("the fill run's second pass did not hit")
"""

COUNTED = r"""
import os, sys
import fsspec
try:
    from cachemw import trace
except ImportError:
    trace = None
src, runtime_dir, trace_dir, mode, passes = sys.argv[1:6]
fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True,
                       daemon_options={"dram_capacity": "2GiB"})
paths = sorted(os.path.join(src, p) for p in os.listdir(src))
for p in paths:  # filled by the fill run, in the daemon it left running: hits
    fs.cat_file(p)
if trace is not None:
    trace.start(trace_dir)
    trace.ENABLED = mode == "on"
for _ in range(int(passes)):
    for p in paths:
        fs.cat_file(p)
if trace is not None:
    trace.flush()
if fs.stats()["hits"] < (int(passes) + 1) * len(paths):
    sys.exit("a counted pass missed")
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


def code_of(variant: str, baseline: str | None) -> tuple[dict, str]:
    """(environment, working directory) that make a reader and the daemon it starts import
    the variant's cachemw. The directory matters: ``python -c`` and ``python -m`` (how a
    daemon starts) put it first on sys.path, ahead of PYTHONPATH and the installed package,
    so a baseline's reader started from this checkout would run this code."""
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEMW_TRACE", "PYTHONPATH")}
    if variant == "baseline":
        env["PYTHONPATH"] = baseline
        return env, baseline
    return env, REPO


def check_code(variant: str, baseline: str | None) -> None:
    """Fail unless the variant's reader imports the code it is meant to measure."""
    env, cwd = code_of(variant, baseline)
    where = subprocess.run([sys.executable, "-c", "import cachemw; print(cachemw.__file__)"],
                           env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout
    want = os.path.join(cwd, "cachemw", "__init__.py")
    if os.path.realpath(where.strip()) != os.path.realpath(want):
        raise RuntimeError(f"the {variant} reader imports {where.strip()}, not {want}")


def reader(variant: str, src: str, work: str, baseline: str | None) -> subprocess.Popen:
    """A reader process, its cache filled and warm, waiting for its first pass."""
    env, cwd = code_of(variant, baseline)
    trace_dir = tempfile.mkdtemp(prefix="trace-", dir=work)
    runtime_dir = tempfile.mkdtemp(prefix=f"rt-{variant}-", dir=work)
    proc = subprocess.Popen([sys.executable, "-c", READER, src, runtime_dir, trace_dir], env=env,
                            cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.runtime_dir = runtime_dir
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {variant} reader did not start")
    return proc


def one_pass(proc: subprocess.Popen, command: str) -> tuple[float, float]:
    """(hits per wall second, hits per CPU second of the reader) of one pass; ``command``:
    "on" traces the pass."""
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    wall, cpu = proc.stdout.readline().split()
    return float(wall), float(cpu)


def finish(proc: subprocess.Popen) -> None:
    """End a reader and its daemon (which would otherwise outlive it by up to a second,
    long enough to make its tier directory again under a removed work dir)."""
    proc.stdin.close()
    code = proc.wait(timeout=120)
    stop_local(proc.runtime_dir)
    if code != 0:
        raise RuntimeError("a reader failed")


def counted(variants: list[str], src: str, work: str, baseline: str | None,
            passes: int) -> dict[str, float]:
    """User-space instructions per hit of each variant, counted by callgrind (see the
    module docstring)."""
    n = len(os.listdir(src))
    out = {}
    for variant in variants:
        env, cwd = code_of(variant, baseline)
        env["PYTHONHASHSEED"] = "0"  # the same dict and set layouts in every run
        runtime_dir = tempfile.mkdtemp(prefix=f"rt-{variant}-", dir=work)
        trace_dir = tempfile.mkdtemp(prefix="trace-", dir=work)
        try:
            _run([sys.executable, "-c", FILL, src, runtime_dir], env, cwd, f"{variant} fill run")
            totals = []
            for k in (0, passes):
                out_file = os.path.join(work, f"callgrind.{variant}.{k}")
                _run(["valgrind", "--tool=callgrind", "--trace-children=no",
                      f"--callgrind-out-file={out_file}", sys.executable, "-c", COUNTED, src,
                      runtime_dir, trace_dir, variant, str(k)], env, cwd,
                     f"{variant} reader under callgrind")
                with open(out_file) as f:
                    found = [int(line.split()[1]) for line in f if line.startswith("totals:")]
                if not found:
                    raise RuntimeError(f"{out_file}: no totals line (callgrind's output changed?)")
                totals.append(found[0])
            out[variant] = (totals[1] - totals[0]) / (passes * n)
        finally:
            stop_local(runtime_dir)
    return out


def _run(command: list[str], env: dict, cwd: str, what: str) -> None:
    done = subprocess.run(command, env=env, cwd=cwd, timeout=1800, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {what} failed ({done.returncode}):\n{done.stderr[-3000:]}")


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
    p.add_argument("--sessions", type=int, default=5)
    p.add_argument("--passes", type=int, default=6, help="per variant and session")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions per hit under callgrind instead of timing")
    p.add_argument("--counted-passes", type=int, default=8)
    args = p.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        p.error("--instructions needs valgrind (apt-get install valgrind)")
    sessions, passes = (2, 3) if args.quick else (args.sessions, args.passes)
    cases = [("128 KiB", 128 << 10, 300 if args.quick else 1000),
             ("4 KiB", 4 << 10, 1000 if args.quick else 4000)]
    work = tempfile.mkdtemp(prefix="cachemw-trace-bench-", dir="/dev/shm")
    try:
        baseline = None
        if args.baseline_rev:
            baseline = checkout(args.baseline_rev, os.path.join(work, "baseline"))
        variants = ["off", "on"] + (["baseline"] if baseline else [])
        readers = {"off": "current", "on": "current", "baseline": "baseline"}
        for r in set(readers[v] for v in variants):
            check_code(r, baseline)
        print(f"variants {variants}; " + (
            f"{args.counted_passes} counted passes over the cached files" if args.instructions else
            f"{sessions} sessions x {passes} passes; hits/s of cat_file"))
        pairs = [("on", "off", ">= 0.90")] + ([("off", "baseline", "within noise")]
                                               if baseline else [])
        for label, size, n in cases:
            src = os.path.join(work, f"src-{size}")
            if args.instructions:
                make_files(src, min(n, 500), size)
                per_hit = counted(variants, src, work, baseline, args.counted_passes)
                print(f"{label} ({min(n, 500)} files): user-space instructions per hit, " + "; ".join(
                    f"{v} {x:,.0f}" for v, x in per_hit.items())
                    + f"; tracing adds {per_hit['on'] / per_hit['off'] - 1:.1%}", flush=True)
                shutil.rmtree(src)
                continue
            make_files(src, n, size)
            ratios = {(a, b, i): [] for a, b, _ in pairs for i in (0, 1)}
            for session in range(sessions):
                procs = {r: reader(r, src, work, baseline) for r in set(readers[v] for v in variants)}
                try:
                    rates = {v: [] for v in variants}
                    for r in range(passes):
                        order = variants[r % len(variants):] + variants[:r % len(variants)]
                        for v in order:
                            rates[v].append(one_pass(procs[readers[v]], v))
                finally:
                    for proc in procs.values():
                        finish(proc)
                for a, b, i in ratios:
                    ratios[(a, b, i)].append(statistics.median(
                        x[i] / y[i] for x, y in zip(rates[a], rates[b])))
                print(f"  {label} session {session + 1}: " + "; ".join(
                    f"{v} {statistics.median(c for _, c in x):,.0f}/CPU s, "
                    f"{statistics.median(w for w, _ in x):,.0f}/s" for v, x in rates.items()),
                    flush=True)
            for a, b, target in pairs:
                for i, clock in ((1, "CPU"), (0, "wall")):
                    print(f"{label}: {a} / {b} ({clock} time), sessions' medians "
                          f"{fmt(ratios[(a, b, i)])} (target {target})")
            shutil.rmtree(src)
        if args.instructions:
            return 0
        ns = off_check_cost()
        print(f"the off check at a traced point: {ns:.1f} ns")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
