"""``cachemw top``: the cluster at a glance, refreshed every second.

Per node: tier use, the hit ratio, MB/s read from its tiers, from other nodes and from
the source store, checkpoints in flight. Rates are the change of the daemons' counters
between two samples (the sums of every process's reports on that node: a process reports
twice a second, so a rate lags its reads by up to that). ``--json`` prints one sample pair
and exits. Into a pipe or a file, each refresh is a plain frame of its own (_frames).

The daemons are found as ``cachemw status`` finds them: every node's through Ray when a
cachemw-managed (or given) Ray cluster answers, else this node's own daemon.
"""
from __future__ import annotations

import io
import json
import signal
import sys
import threading
import time

from .client.link import DaemonClient
from .cluster import actor as daemon
from .config import resolve_runtime_dir
from .config_values import format_size
from .metrics import MISSES, READ_BYTES


def sample(address: str | None = None, runtime_dir: str | None = None) -> list[dict]:
    """Every daemon's stats: ``[{"node_id", "stats"}]`` (``stats`` with ``error`` for a
    daemon that does not answer); empty if none runs."""
    runtime_dir = resolve_runtime_dir(runtime_dir)
    try:
        nodes = daemon.status(address, runtime_dir=runtime_dir, timeout=10)
    except daemon.UnreachableCluster:  # the address given is wrong: said, not passed over
        raise
    except ConnectionError:
        nodes = []
    _sigterm_as_interrupt()
    if nodes:
        return nodes
    client = DaemonClient(runtime_dir, autostart=False, timeout=10)
    try:
        stats = client.daemon_stats()
    finally:
        client.close()
    return [] if stats is None else [{"node_id": stats["node_id"], "stats": stats}]


def _reads(c: dict) -> tuple[float, float]:
    return c.get("hits", 0), c.get("hits", 0) + sum(c.get(k, 0) for k in MISSES.values())


def summarize(before: list[dict], after: list[dict], seconds: float) -> list[dict]:
    """One row per node of ``after``: rates over ``seconds`` against ``before``."""
    old = {n["node_id"]: n["stats"] for n in before}
    rows = []
    for n in after:
        s = n["stats"]
        row = {"node_id": n["node_id"]}
        if "error" in s:
            rows.append(dict(row, error=s["error"]))
            continue
        c, p = s.get("counters", {}), old.get(n["node_id"], {}).get("counters", {})
        hits, reads = _reads(c)
        hits0, reads0 = _reads(p) if p else (hits, reads)
        ck = s.get("checkpoints") or {}
        rows.append(dict(
            row, pid=s.get("pid"), metrics=s.get("metrics"),
            tiers={name: {"used_bytes": t["used_bytes"], "capacity_bytes": t["capacity_bytes"],
                          "blocks": t["blocks"]} for name, t in s.get("tiers", {}).items()},
            hit_ratio=hits / reads if reads else None,
            hit_ratio_now=(hits - hits0) / (reads - reads0) if reads > reads0 else None,
            mb_per_s={origin: max(c.get(key, 0) - p.get(key, c.get(key, 0)), 0) / seconds / 1e6
                      for origin, key in READ_BYTES.items()},
            checkpoints_in_flight=[{"step": x["step"], "pid": x["pid"],
                                    "seconds": round(x["seconds"], 1)}
                                   for x in ck.get("in_flight", ())],
            last_checkpoint_step=ck.get("last_step", -1),
        ))
    return rows


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _sigterm_as_interrupt() -> None:
    """A SIGTERM (``timeout``, the end of a job step) ends top as Ctrl-C does. Set after
    each look into the cluster: connecting to Ray installs its C++ handler, which wrote a
    stack dump of ours to stderr for a SIGTERM (review ops5)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)


def measure(address=None, runtime_dir=None, interval: float = 1.0) -> list[dict]:
    before = sample(address, runtime_dir)
    t0 = time.monotonic()
    time.sleep(interval)
    after = sample(address, runtime_dir)
    return summarize(before, after, time.monotonic() - t0)


def render(rows: list[dict]):
    """A rich Table of the rows."""
    from rich.table import Table

    table = Table(title=f"cachemw  {time.strftime('%H:%M:%S')}  {len(rows)} node(s)",
                  title_justify="left")
    for col, just in (("node", "left"), ("tiers used / capacity", "left"), ("hit ratio", "right"),
                      ("MB/s tiers", "right"), ("remote", "right"), ("source", "right"),
                      ("checkpoints", "left")):
        table.add_column(col, justify=just)
    for r in rows:
        if "error" in r:
            table.add_row(r["node_id"][:12], f"[red]NOT ANSWERING[/red] {r['error'][:60]}")
            continue
        tiers = "\n".join(f"{k} {format_size(t['used_bytes'])}/{format_size(t['capacity_bytes'])}"
                          for k, t in r["tiers"].items())
        ratio = r["hit_ratio_now"] if r["hit_ratio_now"] is not None else r["hit_ratio"]
        rates = r["mb_per_s"]
        ck = ", ".join(f"step {x['step']} ({x['seconds']:.0f} s)" for x in r["checkpoints_in_flight"])
        if not ck and r["last_checkpoint_step"] >= 0:
            ck = f"last step {r['last_checkpoint_step']}"
        table.add_row(r["node_id"][:12], tiers, "-" if ratio is None else f"{ratio:.1%}",
                      f"{rates['tier']:.1f}", f"{rates['remote']:.1f}", f"{rates['source']:.1f}",
                      ck or "-")
    return table


def main(address=None, runtime_dir=None, *, as_json: bool = False, interval: float = 1.0,
         iterations: int | None = None) -> int:
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    try:
        return _top(address, runtime_dir, as_json, interval, iterations)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: how a live view ends (--json: cut short)
        if as_json:
            raise
        return 0
    finally:
        if in_main and previous is not None:  # (None: a handler not set from Python)
            signal.signal(signal.SIGTERM, previous)


def _top(address, runtime_dir, as_json: bool, interval: float, iterations: int | None) -> int:
    if as_json:
        rows = measure(address, runtime_dir, interval)
        print(json.dumps({"nodes": rows, "interval": interval}, indent=2))
        return 0 if rows else 1
    from rich.live import Live

    before, t0 = sample(address, runtime_dir), time.monotonic()
    if not before:
        print("no cachemw daemon runs (start one with `cachemw start`)")
        return 1
    if not sys.stdout.isatty():
        return _frames(address, runtime_dir, before, t0, interval, iterations)
    n = 0
    with Live(render(summarize(before, before, 1.0)), auto_refresh=False) as live:
        try:
            while iterations is None or n < iterations:
                time.sleep(max(0.0, interval - (time.monotonic() - t0)))
                after, t1 = sample(address, runtime_dir), time.monotonic()
                live.update(render(summarize(before, after, t1 - t0)), refresh=True)
                before, t0, n = after, t1, n + 1
        except KeyboardInterrupt:
            pass
    return 0


def _frames(address, runtime_dir, before: list[dict], t0: float, interval: float,
            iterations: int | None) -> int:
    """``top`` into a pipe or a file (``| head``, ``| tee``): rich's live display redraws
    only on a terminal, so nothing reached them until top ended. Here each refresh is a
    plain frame of its own (the table, no terminal control codes), flushed as it is made.
    Rendered to text first: written by rich, a reader gone (``| head``) would end the
    process with exit 1 instead of as SIGPIPE ends a tool (main's 141)."""
    sys.stdout.write(_plain(render(summarize(before, before, 1.0))))
    sys.stdout.flush()
    n = 0
    try:
        while iterations is None or n < iterations:
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
            after, t1 = sample(address, runtime_dir), time.monotonic()
            sys.stdout.write("\n" + _plain(render(summarize(before, after, t1 - t0))))
            sys.stdout.flush()
            before, t0, n = after, t1, n + 1
    except KeyboardInterrupt:
        pass
    return 0


def _plain(table) -> str:
    """The table as text, without colours or control codes; in ASCII boxes where stdout's
    encoding (a latin-1 pipe, say) cannot hold rich's box characters, as rich's own
    console then draws them."""
    from rich import box
    from rich.console import Console

    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        "\u2500".encode(encoding)
    except LookupError:  # an encoding Python does not know
        encoding, table.box = "ascii", box.ASCII
    except UnicodeEncodeError:
        table.box = box.ASCII
    out = io.StringIO()
    Console(file=out, force_terminal=False, no_color=True).print(table)
    return out.getvalue().encode(encoding, "replace").decode(encoding)
    if True:  # a latin-1 pipe, say: ASCII boxes, as rich's own
        from rich import box

        table.box = box.ASCII
        out = io.StringIO()
        Console(file=out, force_terminal=False, no_color=True).print(table)
        text = out.getvalue().encode(encoding, "replace").decode(encoding)
    return text
