"""The ``cachemw`` command: start/stop/status of daemons, stats, warm, job, bench."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import bench
from .client.link import DaemonClient
from .cluster import actor as daemon
from .config import format_size, parse_size, resolve_runtime_dir
from .job import command as job
from .protocol import lock_holder, lookup
from .report import format_stats


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _runtime_dir(args) -> str:
    return resolve_runtime_dir(args.runtime_dir)


def cmd_start(args) -> int:
    options = {k: v for k, v in {
        "dram_dir": args.dram_dir, "dram_capacity": args.dram_capacity,
        "nvme_dir": args.nvme_dir, "nvme_capacity": args.nvme_capacity,
        "peer_timeout": args.peer_timeout}.items() if v is not None}
    addresses = daemon.start(args.address, runtime_dir=_runtime_dir(args), **options)
    for a in addresses:
        tiers = ", ".join(f"{t['name']}={t['path']} ({format_size(t['capacity'])})" for t in a["tiers"])
        print(f"daemon on node {a['node_id']}: {a['socket']}  tiers: {tiers}")
    return 0


def cmd_stop(args) -> int:
    notes: list[str] = []
    n = daemon.stop(args.address, runtime_dir=_runtime_dir(args), notes=notes)
    print(f"stopped {n} daemon(s)")
    for line in notes:
        print(line)
    return 0


def cmd_status(args) -> int:
    try:
        nodes = daemon.status(args.address, runtime_dir=_runtime_dir(args))
    except ConnectionError:
        nodes = []
    local = _local_stats(args)
    if args.json:
        print(json.dumps({"nodes": nodes, "local": local}, indent=2))
        return 0 if nodes or local else 1
    for n in nodes:
        s = n["stats"]
        if "error" in s:
            print(f"node {n['node_id']}: daemon NOT ANSWERING ({s['error']})")
        else:
            tiers = ", ".join(f"{k} {format_size(t['used_bytes'])}/{format_size(t['capacity_bytes'])}"
                              for k, t in s["tiers"].items())
            print(f"node {n['node_id']}: daemon pid {s['pid']}, {tiers}")
    if not nodes:
        if local is None:
            print("no cachemw daemon runs (start one with `cachemw start`)")
            return 1
        print(f"local {local['node_id']} daemon (not Ray-managed), pid {local['pid']}")
    return 0


def _local_stats(args) -> dict | None:
    client = DaemonClient(_runtime_dir(args), autostart=False, timeout=10)
    try:
        return client.daemon_stats()
    finally:
        client.close()


def cmd_stats(args) -> int:
    logging.getLogger("cachemw.client.link").setLevel(logging.ERROR)
    stats = _local_stats(args)
    if stats is None:
        rt = _runtime_dir(args)
        address = lookup(rt)
        if address is not None and lock_holder(rt) is None:
            print(f"no cachemw daemon answers in {rt}: the daemon (pid {address.pid}) died; "
                  f"the next process that reads through the cache starts another, "
                  f"`cachemw stop` clears what it left", file=sys.stderr)
        else:
            print(f"no cachemw daemon answers in {rt}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def cmd_warm(args) -> int:
    import fsspec
    from tqdm import tqdm

    total = 0
    for url in args.urls:
        local = "://" not in url and "::" not in url  # a path; cachemw:// URLs are absolute
        fs, path = fsspec.core.url_to_fs(f"cachemw://{os.path.abspath(url)}" if local else url)
        files = fs.find(path) if fs.isdir(path) else [path]
        for f in tqdm(files, desc=f"warming {url}", unit="file", disable=args.quiet):
            total += len(fs.cat_file(f))
    print(f"warmed {format_size(total)}")
    return 0


def cmd_bench(args) -> int:
    return bench.main(args)


def cmd_job(args) -> int:
    return job.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachemw", description=__doc__)
    p.add_argument("--runtime-dir", help="where the daemon publishes its socket "
                   "(default: $CACHEMW_RUNTIME_DIR or /dev/shm/cachemw-$UID)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("start", help="start one daemon per Ray node (a local Ray if no --address)")
    s.add_argument("--address", help="Ray cluster address (default: start a private local one)")
    s.add_argument("--dram-dir")
    s.add_argument("--dram-capacity", type=_size)
    s.add_argument("--nvme-dir")
    s.add_argument("--nvme-capacity", type=_size)
    s.add_argument("--peer-timeout", type=float, metavar="SECONDS",
                   help="how long a silent peer daemon may hold up a read before it is "
                        "read from the source instead (default 10)")
    s.set_defaults(func=cmd_start)

    s = sub.add_parser("stop", help="stop the daemons (and the local Ray cachemw started)")
    s.add_argument("--address")
    s.set_defaults(func=cmd_stop)

    s = sub.add_parser("status", help="list every node's daemon")
    s.add_argument("--address")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("stats", help="this node's cache statistics")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("warm", help="read files or directories through the cache")
    s.add_argument("urls", nargs="+", help="cachemw::URL, any fsspec URL, or a local path")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_warm)

    s = sub.add_parser("job", help="the main job: DLIO-style training on an emulated slow "
                       "shared store, read paths and checkpoint methods side by side")
    job.add_arguments(s)
    s.set_defaults(func=cmd_job)

    s = sub.add_parser("bench", help="read 2,000 local files directly and through the cache "
                       "(a quick node-cache check; the main job is `cachemw job`)")
    bench.add_arguments(s)
    s.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"cachemw {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
