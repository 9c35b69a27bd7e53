"""The ``cachemw`` command: start/stop/status of daemons, stats, top, warm, job, bench."""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import sys

from . import bench, top, warm
from .client.link import DaemonClient
from .cluster import actor as daemon
from .config import WarmConfig, resolve_runtime_dir
from .config_values import check_runtime_dir, check_trace_dir, format_size, parse_size
from .job import command as job
from .placement.registry import ONLINE_POLICIES
from .protocol import check_private_dir, lock_holder, lookup
from .report import format_stats


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _runtime_dir(args) -> str:
    """The runtime dir a command means, checked as every component checks it (an absolute
    path, room for the socket): a relative one named another directory in each working
    directory, and ``status`` said "no daemon runs" where ``warm`` refused it."""
    return check_runtime_dir(resolve_runtime_dir(args.runtime_dir))


def _usable_runtime_dir(args) -> str:
    """The runtime dir of a command that looks into it (status, stats, top). One that is
    refused (a symlink, another user's: README, Security posture) is the command's error,
    said alone: the readers' log line about it and "no daemon runs" after it misled."""
    runtime_dir = _runtime_dir(args)
    if os.path.lexists(runtime_dir):
        check_private_dir(runtime_dir)  # UnsafeDirectory (an OSError): main says it
    return runtime_dir


def cmd_start(args) -> int:
    options = {k: v for k, v in {
        "dram_dir": args.dram_dir, "dram_capacity": args.dram_capacity,
        "nvme_dir": args.nvme_dir, "nvme_capacity": args.nvme_capacity,
        "peer_timeout": args.peer_timeout, "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host, "trace_dir": args.trace,
        "placement": args.placement}.items() if v is not None}
    if args.trace:
        _check_trace_dir(args.trace)
    addresses = daemon.start(args.address, runtime_dir=_runtime_dir(args), **options)
    for a in addresses:
        tiers = ", ".join(f"{t['name']}={t['path']} ({format_size(t['capacity'])})" for t in a["tiers"])
        print(f"daemon on node {a['node_id']}: {a['socket']}  tiers: {tiers}")
    return 0


def _seconds(text: str) -> float:
    """A positive number of seconds, a day at most (argparse's type: its error names the
    option)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (at most a "
                                         f"day), got {text!r}")
    return value


def _check_trace_dir(directory: str) -> None:
    """``--trace DIR`` must take trace files here: the daemons warned in their own logs
    and ran untraced while start said nothing (review ops5). (On other nodes, what their
    daemons meet is said in their logs.)"""
    import tempfile

    try:
        check_trace_dir(directory, "--trace")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".cachemw-probe-"):
            pass
    except (OSError, ValueError) as exc:
        raise ValueError(f"--trace {directory}: trace files cannot be written there "
                         f"({getattr(exc, 'strerror', None) or exc})") from None


def _metrics(stats: dict) -> str:
    return f", metrics {stats['metrics']}" if stats.get("metrics") else ""


def cmd_stop(args) -> int:
    notes: list[str] = []
    n = daemon.stop(args.address, runtime_dir=_runtime_dir(args), notes=notes)
    print(f"stopped {n} daemon(s)")
    for line in notes:
        print(line)
    holder = _ray_managed(_runtime_dir(args))
    if holder:  # Ray restarts its actors: only through its cluster can it be stopped
        print(f"the daemon of {_runtime_dir(args)} (pid {holder['pid']}) is a Ray actor of a cluster "
              "this command did not reach, and still runs: `cachemw stop --address ADDRESS` (or "
              "with RAY_ADDRESS set) stops it", file=sys.stderr)
        return 1
    return 0


def _ray_managed(runtime_dir: str) -> dict | None:
    """The lock holder of ``runtime_dir`` if it is a Ray-managed daemon, else None."""
    holder = lock_holder(runtime_dir)
    return holder if holder and holder.get("kind") == "ray" and holder.get("pid") else None


def _tiers(stats: dict) -> str:
    return ", ".join(f"{k} {format_size(t['used_bytes'])}/{format_size(t['capacity_bytes'])}"
                     for k, t in stats.get("tiers", {}).items())


def cmd_status(args) -> int:
    logging.getLogger("cachemw.client.link").setLevel(logging.ERROR)  # said below, once
    _usable_runtime_dir(args)
    try:
        nodes = daemon.status(args.address, runtime_dir=_runtime_dir(args))
    except daemon.UnreachableCluster:  # the address given is wrong: said, not passed over
        raise
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
            print(f"node {n['node_id']}: daemon pid {s['pid']}, {_tiers(s)}{_metrics(s)}")
    if not nodes:
        if local is None:
            silent = _silent_daemon(_runtime_dir(args))
            print(silent or "no cachemw daemon runs (start one with `cachemw start`)")
            return 1
        managed = ("Ray-managed: `cachemw status --address ADDRESS` lists every node"
                   if _ray_managed(_runtime_dir(args)) else "not Ray-managed")
        print(f"node {local['node_id']}: daemon pid {local['pid']} ({managed}), "
              f"{_tiers(local)}{_metrics(local)}")
    return 0


def _silent_daemon(runtime_dir: str) -> str:
    """What to say of a daemon that holds the runtime dir's lock (it lives) but did not
    answer (stopped with SIGSTOP, hung, busy past the timeout); "" if none holds it."""
    holder = lock_holder(runtime_dir)
    if not holder or not holder.get("pid"):
        return ""
    return (f"a cachemw daemon (pid {holder['pid']}) holds {runtime_dir} but does not answer "
            f"(starting, stopping, stopped or hung?); reads go to the source meanwhile; `cachemw stop` ends it")


def _local_stats(args) -> dict | None:
    client = DaemonClient(_runtime_dir(args), autostart=False, timeout=10)
    try:
        return client.daemon_stats()
    finally:
        client.close()


def cmd_stats(args) -> int:
    logging.getLogger("cachemw.client.link").setLevel(logging.ERROR)
    _usable_runtime_dir(args)
    stats = _local_stats(args)
    if stats is None:
        rt = _runtime_dir(args)
        address = lookup(rt)
        silent = _silent_daemon(rt)
        if silent:
            print(silent, file=sys.stderr)
        elif address is not None and lock_holder(rt) is None:
            then = ("Ray restarts it (`cachemw start` placed it: readers wait for the new one "
                    "a few seconds, then read from the source until it answers)"
                    if address.kind == "ray" else "the next process that reads through the "
                    "cache starts another, `cachemw stop` clears what it left")
            print(f"no cachemw daemon answers in {rt}: the daemon (pid {address.pid}) died; "
                  f"{then}", file=sys.stderr)
        else:
            print(f"no cachemw daemon answers in {rt}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def cmd_top(args) -> int:
    logging.getLogger("cachemw.client.link").setLevel(logging.ERROR)
    return top.main(args.address, _usable_runtime_dir(args), as_json=args.json,
                    interval=args.interval)


def cmd_warm(args) -> int:
    """Exit status: 0 every block of this node's share is cached; 1 some are not (each
    reason said); 2 nothing was read (bad arguments, no daemon, a cluster of other size)."""
    config = WarmConfig.build(nodes=args.nodes, ring_wait=args.ring_wait, threads=args.threads)
    node = socket.gethostname()
    progress = None if args.quiet or args.json else warm.progress_printer(node)
    try:
        report = warm.run(args.urls, config, progress=progress, runtime_dir=args.runtime_dir)
    except warm.WarmError as exc:
        print(f"cachemw warm: {node}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict()), flush=True)
    else:
        print(report.summary(), flush=True)
    for path, why in list(report.errors.items())[:10]:
        print(f"cachemw warm: {report.node}: not warmed: {path}: {why}", file=sys.stderr)
    if len(report.errors) > 10:
        print(f"cachemw warm: {report.node}: ... and {len(report.errors) - 10} more files "
              f"not warmed", file=sys.stderr)
    for note in report.notes:
        print(f"cachemw warm: {report.node}: {note}", file=sys.stderr)
    return 0 if report.ok else 1


def _own_runtime_dir(args) -> None:
    """``job`` and ``bench`` run a daemon of their own in a fresh runtime dir and remove that
    dir when they end: a ``--runtime-dir`` given them would be silently ignored (or, if
    used, removed), so it is refused."""
    if args.runtime_dir:
        raise ValueError(f"--runtime-dir: `cachemw {args.command}` runs its own daemon in a "
                         f"fresh runtime dir (removed when it ends) and reads no other; "
                         f"run it without --runtime-dir")


def cmd_bench(args) -> int:
    _own_runtime_dir(args)
    return bench.main(args)


def cmd_job(args) -> int:
    _own_runtime_dir(args)
    return job.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachemw", description=__doc__)
    p.add_argument("--runtime-dir", help="where the daemon publishes its socket "
                   "(default: $CACHEMW_RUNTIME_DIR or /dev/shm/cachemw-$UID)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("start", help="start one daemon per Ray node (a local Ray if no --address)",
                       description="Start one daemon per Ray node. An option left out is "
                       "taken from this command's CACHEMW_* variables (CACHEMW_DRAM_CAPACITY, "
                       "CACHEMW_PLACEMENT, ...), which every daemon gets, else each node's "
                       "default.")
    s.add_argument("--address", help="Ray cluster address (default: start a private local one)")
    s.add_argument("--dram-dir")
    s.add_argument("--dram-capacity", type=_size)
    s.add_argument("--nvme-dir")
    s.add_argument("--nvme-capacity", type=_size)
    s.add_argument("--peer-timeout", type=float, metavar="SECONDS",
                   help="how long a silent peer daemon may hold up a read before it is "
                        "read from the source instead (default 10)")
    s.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port on every node (0: any free "
                        "port, shown by `cachemw status`; default: none)")
    s.add_argument("--metrics-host", metavar="ADDRESS",
                   help="the address the metrics endpoint listens on (default 0.0.0.0)")
    s.add_argument("--trace", metavar="DIR",
                   help="the daemons write DFTracer traces (.pfw) into DIR")
    s.add_argument("--placement", choices=ONLINE_POLICIES,
                   help="the daemons' placement policy (default: clairvoyant once a sampler "
                        "announces its order, else history)")
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

    s = sub.add_parser("top", help="live view of every node: tiers, hit ratio, MB/s, checkpoints")
    s.add_argument("--address")
    s.add_argument("--json", action="store_true", help="print one sample as JSON and exit")
    s.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS",
                   help="refresh period, and the span of the rates (default 1)")
    s.set_defaults(func=cmd_top)

    s = sub.add_parser("warm", help="read files or directories into the cache (on every "
                       "node of a job at once: each node its own share)")
    s.add_argument("urls", nargs="+", help="cachemw::URL, any fsspec URL, or a local path")
    s.add_argument("--nodes", type=int, help="nodes warming together, one task each: each "
                   "reads only the blocks its node owns (default: the Slurm step's node "
                   "count under srun, else 1: this node reads everything)")
    s.add_argument("--ring-wait", type=float, metavar="SECONDS", help="how long to wait for "
                   "this node's daemon to see every node of its cluster (default 60)")
    s.add_argument("--threads", type=int, help="batches of block reads in flight (default 8)")
    s.add_argument("--json", action="store_true", help="print this node's report as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress display")
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
        code = args.func(args)
        sys.stdout.flush()  # a reader gone (`| head`) is found here, not at exit
        return code
    except KeyboardInterrupt:  # Ctrl-C, or a SIGTERM the job turns into one: cleaned up
        print(f"cachemw {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as exc:
        if not _reader_gone():  # another pipe (a daemon's socket): an error like any
            return _failed(args, exc)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush too
        return 141  # as a tool that SIGPIPE ended, and quietly
    except (ValueError, OSError, RuntimeError) as exc:
        return _failed(args, exc)
    except Exception as exc:
        if type(exc).__module__ in ("builtins",) or type(exc).__module__.startswith("cachemw"):
            raise  # a fault of ours: its traceback
        # a library's own error (botocore's missing credentials, aiohttp's): one line
        print(f"cachemw {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _failed(args, exc: Exception) -> int:
    print(f"cachemw {args.command}: {str(exc) or type(exc).__name__}", file=sys.stderr)
    return 2


def _reader_gone() -> bool:
    """Has stdout's reader closed it (``cachemw stats --json | head -1``)? The write end
    of a pipe with no reader polls as an error."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, ValueError, OSError):  # no stdout, or not a file
        return False
    return any(events & select.POLLERR for _, events in poll.poll(0))


if __name__ == "__main__":
    sys.exit(main())
