"""The 3-node Slurm job and the warm-up on 1, 2 and 3 nodes, on a real Slurm with emulated
nodes (tests/slurm_cluster.py: network, UTS and mount namespaces per node, one slurmd
each; needs root and Slurm, else it says so and exits 0).

    flock /tmp/cachemw-bench.lock .venv/bin/python benchmarks/slurm_warm.py [--quick]

The source is the emulated PFS of the tests (``countfile://``: local files plus a delay per
request, ``--latency-ms``, and a log line per data read, so source reads are counted at the
source). Every job runs slurm/cachemw-job.sh (Ray on every node, one daemon per node).

1. A 3-node job reads each of ``--runs`` dataset copies for two epochs from its first node
   (torch DataLoader, shuffled): per epoch its time, the hit ratio (block reads served by a
   tier of any node / all block reads), the remote-hit share (reads served by another
   node's block server / all), and the reads the source saw.
2. Jobs of 1, 2 and 3 nodes run the same command on every node of the job, ``srun --overlap
   -N $SLURM_JOB_NUM_NODES --ntasks-per-node=1 cachemw warm URL``, on each copy (each job
   has fresh tiers: every warm starts cold); the step's wall time, and the 1-node time over
   it (the speed-up) per copy. The 3-node job then reads each warmed copy once (an epoch
   right after the warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the emulated cluster

from slurm_cluster import JOB_SCRIPT, counting_source, emulated_cluster, missing  # noqa: E402

DRIVER = textwrap.dedent('''\
    """Runs inside a job, on its first node: the warm-ups (``warm``) or the epochs (``train``)
    over each dataset copy; one JSON line per measurement to ``out``."""
    import json, os, random, subprocess, sys, time

    import fsspec

    mode, out, copies = sys.argv[1], sys.argv[2], sys.argv[3:]
    log = os.environ["CMW_COUNT_LOG"]
    nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    BLOCK_READS = ("hits", "remote_hits", "remote_reads", "misses", "fallbacks", "bypassed")


    def source_reads():
        with open(log) as f:
            return sum(1 for _ in f)


    def say(record):
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\\n")


    def epoch(fs, paths, shuffle):
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Files(Dataset):
            def __len__(self):
                return len(paths)

            def __getitem__(self, i):
                return len(fs.cat_file(paths[i]))

        before, reads = dict(fs.stats()), source_reads()
        t = time.monotonic()
        n = sum(int(b.sum()) for b in DataLoader(Files(), batch_size=16, shuffle=shuffle))
        seconds = time.monotonic() - t
        after = fs.stats()
        c = {k: after[k] - before.get(k, 0) for k in after}
        total = sum(c[k] for k in BLOCK_READS)
        return {"seconds": seconds, "bytes": n, "block_reads": total,
                "hit_ratio": (c["hits"] + c["remote_hits"]) / total,
                "remote_hit_share": c["remote_hits"] / total,
                "source_reads": source_reads() - reads, "counters": c}


    for k, data in enumerate(copies):
        paths = sorted(os.path.join(data, p) for p in os.listdir(data))
        fs = fsspec.filesystem("cachemw", target_protocol="countfile", autostart=False,
                               validate="immutable", skip_instance_cache=True)
        if mode == "train":
            for e in (1, 2):
                say(dict(epoch(fs, paths, shuffle=True), kind="epoch", epoch=e, copy=k))
            continue
        reads = source_reads()
        t = time.monotonic()
        run = subprocess.run(
            ["srun", "--overlap", f"-N{nodes}", f"-n{nodes}", "--ntasks-per-node=1",
             "cachemw", "warm", "--json", "--quiet", f"cachemw::countfile://{data}"],
            capture_output=True, text=True)
        seconds = time.monotonic() - t
        reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        say({"kind": "warm", "nodes": nodes, "copy": k, "seconds": seconds,
             "rc": run.returncode, "stderr": run.stderr[-2000:],
             "source_reads": source_reads() - reads,
             "per_node": {r["host"]: [r["blocks"], round(r["seconds"], 2)] for r in reports}})
        if nodes == 3:
            say(dict(epoch(fs, paths, shuffle=True), kind="epoch after warm", copy=k))
    ''')


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """min / median / max (all values when fewer than three)."""
    if len(values) < 3:
        return ", ".join(fmt.format(v) for v in values)
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def make_copies(root: str, runs: int, files: int, size: int) -> list[str]:
    copies = []
    for k in range(runs):
        d = os.path.join(root, f"data{k}")
        os.makedirs(d, mode=0o755)
        for i in range(files):
            with open(os.path.join(d, f"s{i:05d}"), "wb") as f:
                f.write(os.urandom(size))
        copies.append(d)
    return copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller copies")
    ap.add_argument("--runs", type=int, default=3, help="dataset copies (runs per figure)")
    ap.add_argument("--files", type=int, default=1200, help="files per copy")
    ap.add_argument("--file-size", type=int, default=64 * 1024)
    ap.add_argument("--train-files", type=int, default=240,
                    help="files per copy read by the training job (its epochs are serial)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="source delay per request")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.files, args.train_files = 2, 240, 96
    why = missing()
    if why:
        print(f"skipped: {why}")
        return 0
    # ended by a signal (a timeout): through the clean-up of the emulated cluster, not past it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    with emulated_cluster() as slurm:
        work = os.path.join(slurm.root, "bench")
        os.makedirs(work, mode=0o755)
        log = os.path.join(work, "source.log")
        open(log, "w").close()
        env = dict(slurm.env, **counting_source(os.path.join(work, "plugin"), log,
                                                args.latency_ms),
                   CACHEMW_DRAM_CAPACITY="512MiB")
        driver = os.path.join(work, "driver.py")
        with open(driver, "w") as f:
            f.write(DRIVER)
        warm_copies = make_copies(os.path.join(work, "warm"), args.runs, args.files,
                                  args.file_size)
        train_copies = make_copies(os.path.join(work, "train"), args.runs, args.train_files,
                                   args.file_size)
        out = os.path.join(work, "results.jsonl")
        jobs = [("train", 3, train_copies)] + [("warm", n, warm_copies) for n in (1, 2, 3)]
        for mode, n, copies in jobs:
            done = slurm.sbatch(f"-N{n}", f"--output={work}/{mode}{n}.out", JOB_SCRIPT,
                                sys.executable, driver, mode, out, *copies, env=env,
                                timeout=1800)
            if done.returncode != 0:
                with open(f"{work}/{mode}{n}.out") as f:
                    print(f"job {mode} on {n} nodes failed:\n{done.stderr}\n{f.read()[-4000:]}")
                return 1
        with open(out) as f:
            records = [json.loads(line) for line in f]
    print(f"# {args.runs} runs; copies of {args.files} (warm) and {args.train_files} (epochs) "
          f"files of {args.file_size} B; source {args.latency_ms} ms per request; "
          f"{time.monotonic() - started:.0f} s in all\n")
    print("| case | figures |\n|---|---|")
    for e in (1, 2):
        rows = [r for r in records if r["kind"] == "epoch" and r["epoch"] == e]
        print(f"| 3-node job, epoch {e}: seconds | {spread([r['seconds'] for r in rows])} |")
        print(f"| &nbsp;&nbsp;hit ratio | {spread([r['hit_ratio'] for r in rows], '{:.3f}')} |")
        print(f"| &nbsp;&nbsp;remote-hit share | "
              f"{spread([r['remote_hit_share'] for r in rows], '{:.3f}')} |")
        print(f"| &nbsp;&nbsp;reads at the source / files | "
              f"{spread([r['source_reads'] / args.train_files for r in rows], '{:.2f}')} |")
    warms = {n: sorted((r for r in records if r["kind"] == "warm" and r["nodes"] == n),
                       key=lambda r: r["copy"]) for n in (1, 2, 3)}
    bad = [r for n in warms for r in warms[n] if r["rc"] != 0]
    for r in bad:
        print(f"warm on {r['nodes']} nodes, copy {r['copy']}: exit {r['rc']}: {r['stderr']}")
    for n in (1, 2, 3):
        print(f"| warm-up on {n} node(s): seconds (the srun step) | "
              f"{spread([r['seconds'] for r in warms[n]])} |")
        print(f"| &nbsp;&nbsp;of which reading (slowest node) | "
              f"{spread([max(t for _, t in r['per_node'].values()) for r in warms[n]])} |")
        print(f"| &nbsp;&nbsp;reads at the source / files | "
              f"{spread([r['source_reads'] / args.files for r in warms[n]], '{:.2f}')} |")
        if n > 1:
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(warms[1], warms[n])]
            print(f"| &nbsp;&nbsp;1-node time / {n}-node time | {spread(ratios)} |")
            reading = [max(t for _, t in a["per_node"].values())
                       / max(t for _, t in b["per_node"].values())
                       for a, b in zip(warms[1], warms[n])]
            print(f"| &nbsp;&nbsp;same, reading only | {spread(reading)} |")
    after = [r for r in records if r["kind"] == "epoch after warm"]
    print(f"| epoch right after the 3-node warm-up: seconds | "
          f"{spread([r['seconds'] for r in after])} |")
    print(f"| &nbsp;&nbsp;hit ratio | {spread([r['hit_ratio'] for r in after], '{:.3f}')} |")
    print(f"| &nbsp;&nbsp;remote-hit share | "
          f"{spread([r['remote_hit_share'] for r in after], '{:.3f}')} |")
    print("\nper node (blocks, seconds reading), 3-node warm-ups:",
          [r["per_node"] for r in warms[3]])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
